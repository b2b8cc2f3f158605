"""Random sequences of allocator operations against the plain-Python model.

Every step compares exact slot numbers with the model; after every step the
free lists must equal the model's and ``check_integrity`` must find the used
slots (all live requests and raw holders) and the free pages partitioning
the pool: no slot handed out twice, slot 0 / page 0 never handed out, nothing
leaked, ``None`` leaving everything untouched.
"""

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from tests.alloc_model import AllocatorModel

NUM_PAGES = 24
# the Triton machine runs compiled on CUDA, under the interpreter on the CPU
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class AllocatorMachine(RuleBasedStateMachine):
    page_size = 4
    need_sort = False
    backend = "torch"

    def __init__(self):
        super().__init__()
        ps = self.page_size
        if ps == 1:
            self.alloc = TokenToKVPoolAllocator(NUM_PAGES, need_sort=self.need_sort, debug=True)
        else:
            device = TRITON_DEVICE if self.backend == "triton" else "cpu"
            self.alloc = PagedTokenToKVPoolAllocator(
                NUM_PAGES * ps, ps, device=device, need_sort=self.need_sort, backend=self.backend, debug=True
            )
        self.model = AllocatorModel(NUM_PAGES, ps, paged=ps > 1, need_sort=self.need_sort)
        self.reqs: list[list[int]] = []  # token slots of each live request
        self.raw: list[list[int]] = []  # page-aligned blocks from alloc()

    # ---- helpers -----------------------------------------------------------
    def _t(self, xs):
        return torch.tensor(xs, dtype=torch.int64, device=self.alloc.device)

    def _snapshot(self):
        return self.alloc.free_page_list().tolist(), self.alloc.release_page_list().tolist()

    def _extend(self, items):
        """items: (request index or None for a new request, extend_len)."""
        reqs = []
        for idx, ext in items:
            slots = self.reqs[idx] if idx is not None else []
            reqs.append((len(slots), len(slots) + ext, slots[-1] if slots else -1))
        before = self._snapshot()
        expected = self.model.extend(reqs)
        got = self.alloc.alloc_extend(
            self._t([r[0] for r in reqs]),
            self._t([r[1] for r in reqs]),
            self._t([r[2] for r in reqs]),
            sum(ext for _, ext in items),
        )
        if expected is None:
            assert got is None
            assert self._snapshot() == before, "a failed alloc_extend consumed pages"
            return
        assert got is not None and got.tolist() == expected
        pos = 0
        for idx, ext in items:
            new = expected[pos : pos + ext]
            pos += ext
            if idx is None:
                self.reqs.append(new)
            else:
                self.reqs[idx].extend(new)

    # ---- rules -------------------------------------------------------------
    @rule(lens=st.lists(st.integers(1, 3 * 4 + 3), min_size=1, max_size=4))
    def new_requests(self, lens):
        self._extend([(None, n) for n in lens])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def extend_requests(self, data):
        idxs = data.draw(st.lists(st.integers(0, len(self.reqs) - 1), min_size=1, max_size=4, unique=True))
        lens = data.draw(st.lists(st.integers(1, 9), min_size=len(idxs), max_size=len(idxs)))
        extra = data.draw(st.lists(st.integers(1, 9), max_size=2))
        self._extend(list(zip(idxs, lens)) + [(None, n) for n in extra])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def decode(self, data):
        idxs = data.draw(st.lists(st.integers(0, len(self.reqs) - 1), min_size=1, unique=True))
        seq_lens = self._t([len(self.reqs[i]) + 1 for i in idxs])
        last_loc = self._t([self.reqs[i][-1] for i in idxs])
        before = self._snapshot()
        expected = self.model.extend([(len(self.reqs[i]), len(self.reqs[i]) + 1, self.reqs[i][-1]) for i in idxs])
        got = self.alloc.alloc_decode(seq_lens, last_loc)
        if expected is None:
            assert got is None and self._snapshot() == before
            return
        assert got.tolist() == expected
        for i, slot in zip(idxs, expected):
            self.reqs[i].append(slot)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), grouped=st.booleans())
    def finish_requests(self, data, grouped):
        idxs = data.draw(st.lists(st.integers(0, len(self.reqs) - 1), min_size=1, unique=True))
        if grouped:
            self.alloc.free_group_begin()
            self.model.group_begin()
        for i in idxs:
            self.alloc.free(self._t(self.reqs[i]))
            self.model.give(self.reqs[i])
        if grouped:
            self.alloc.check_integrity(self._in_use(exclude=idxs))
            self.alloc.free_group_end()
            self.model.group_end()
        self.reqs = [r for i, r in enumerate(self.reqs) if i not in idxs]

    @rule(num_pages=st.integers(1, 6))
    def raw_alloc(self, num_pages):
        ps = self.page_size
        before = self._snapshot()
        pages = self.model.take(num_pages)
        got = self.alloc.alloc(num_pages * ps)
        if pages is None:
            assert got is None and self._snapshot() == before
            return
        expected = [p * ps + o for p in pages for o in range(ps)]
        assert got.tolist() == expected
        self.raw.append(expected)

    @precondition(lambda self: self.raw)
    @rule(data=st.data())
    def raw_free(self, data):
        block = self.raw.pop(data.draw(st.integers(0, len(self.raw) - 1)))
        self.alloc.free(self._t(block))
        self.model.give(block)

    @rule(lens=st.lists(st.integers(1, 20), min_size=1, max_size=3))
    def backup_alloc_restore(self, lens):
        state = self.alloc.backup_state()
        before = self._snapshot()
        total = sum(lens)
        self.alloc.alloc_extend(self._t([0] * len(lens)), self._t(lens), self._t([-1] * len(lens)), total)
        self.alloc.restore_state(state)
        assert self._snapshot() == before

    # ---- invariants ----------------------------------------------------------
    def _in_use(self, exclude=()):
        held = [s for i, r in enumerate(self.reqs) if i not in exclude for s in r]
        held += [s for b in self.raw for s in b]
        return self._t(held)

    @invariant()
    def matches_model(self):
        assert self.alloc.free_page_list().tolist() == self.model.free
        assert self.alloc.release_page_list().tolist() == self.model.release
        assert self.alloc.available_size() == self.model.available_pages() * self.page_size

    @invariant()
    def integrity(self):
        self.alloc.check_integrity(self._in_use())


def _machine(page_size, need_sort, backend="torch", max_examples=150):
    cls = type(
        f"Machine_ps{page_size}_sort{int(need_sort)}_{backend}",
        (AllocatorMachine,),
        {"page_size": page_size, "need_sort": need_sort, "backend": backend},
    )
    cls.TestCase.settings = settings(max_examples=max_examples, stateful_step_count=25, deadline=None)
    return cls.TestCase


TestTokenAllocator = _machine(1, False)
TestTokenAllocatorNeedSort = _machine(1, True)
TestPagedAllocator4 = _machine(4, False)
TestPagedAllocator4NeedSort = _machine(4, True)
TestPagedAllocator16 = _machine(16, False, max_examples=60)
TestPagedAllocatorTriton = _machine(4, True, backend="triton", max_examples=15)
