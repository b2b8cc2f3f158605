"""Random insert / match / copy-on-write / lock / KV-only lock / evict / evict_mamba
workloads on MambaRadixCache against a brute-force oracle of cached pages and
checkpoints.

The router's prefix index, fed by the cache's KV events, predicts every match
(StateStored / StateRemoved mark where a reused prefix may end).

After every step: the match equals the oracle's (the deepest checkpoint within
the cached prefix; a KV-only match, the whole cached prefix), no checkpoint
outlives its KV, no cached sequence ends in a tombstone but where a KV-only lock
holds it, locks protect KV and states, and KV slots and Mamba slots are each
exactly free or held.
"""

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.mamba_pool import HybridReqToTokenPool, MambaPool
from mem_cache.mamba_radix_cache import MambaRadixCache
from mem_cache.radix_key import RadixKey
from tests.cache_helpers import FakeReq, IndexMirror
from tests.test_radix_cache_properties import Oracle


class MambaOracle(Oracle):
    def __init__(self, page_size):
        super().__init__(page_size)
        self.states = {}  # (extra, prefix) -> state slot

    def kv_match(self, tokens, extra):
        """Slots of the cached page-prefix of ``tokens``, ignoring checkpoints."""
        return super().match(tokens, extra)

    def match(self, tokens, extra):
        kv = self.kv_match(tokens, extra)
        best = max((k for k in range(0, len(kv) + 1, self.ps) if (extra, tuple(tokens[:k])) in self.states), default=0)
        return kv[:best]

    def drop_freed_states(self, freed):
        self.states = {p: s for p, s in self.states.items() if s not in freed}

    def consistent(self, kv_locked=()):
        """``kv_locked``: the keys KV-only locks end at (a tombstone may end there)."""
        for (extra, prefix) in self.states:
            assert (extra, prefix) in self.pages, "a checkpoint outlived its KV"
        extended = {(e, p[: -self.ps]) for (e, p) in self.pages}
        for key in self.pages:
            ok = key in extended or key in self.states or key in kv_locked
            assert ok, f"cached sequence ending in an unlocked tombstone: {key}"


class MambaMachine(RuleBasedStateMachine):
    page_size = 1
    strategy = "no_buffer"

    def __init__(self):
        super().__init__()
        ps = self.page_size
        self.mamba = MambaPool(6, [(2, 2)], (2,), 1, torch.float32, torch.float32)
        self.pool = HybridReqToTokenPool(2, 8, "cpu", self.mamba, [0])
        size = 40 * ps
        self.alloc = TokenToKVPoolAllocator(size) if ps == 1 else PagedTokenToKVPoolAllocator(size, ps)
        self.cache = MambaRadixCache(self.pool, self.alloc, page_size=ps, mamba_scheduler_strategy=self.strategy,
                                     enable_kv_events=True)
        self.mirror = IndexMirror(self.cache, ps)  # the router's view of this prefill worker
        self.oracle = MambaOracle(ps)
        self.locks = []  # (node, matched tokens)
        self.kv_locks = []  # (node, matched tokens): KV-only locks, as a decode reservation takes

    def _tokens(self, data, max_pages=6):
        ps = self.page_size
        pages = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=max_pages))
        tokens = [t for a in pages for t in [a] * ps]
        return tokens + data.draw(st.lists(st.integers(0, 2), max_size=ps - 1)) if ps > 1 else tokens

    def _free_kv(self):
        return {int(p) * self.page_size + o for p in self.alloc.free_page_ids() for o in range(self.page_size)}

    def _free_states(self):
        return set(self.mamba.free_slots.tolist())

    def _check_match(self, tokens, extra=None, req=None):
        m = self.cache.match_prefix(RadixKey(tokens, extra), req=req, cow_mamba=req is not None)
        considered = tokens[: len(tokens) - 1] if req is not None else tokens  # one token is always computed
        assert m.device_indices.tolist() == self.oracle.match(considered, extra)
        if req is None:
            self.mirror.check(tokens, extra, m.device_indices.numel())
        return m

    def _forget_freed(self, kv_before, states_before):
        """Drop what an eviction freed from the oracle; returns (kv, states) freed."""
        freed_kv, freed_states = self._free_kv() - kv_before, self._free_states() - states_before
        self.oracle.drop_freed(freed_kv)
        self.oracle.drop_freed_states(freed_states)
        return freed_kv, freed_states

    @rule(data=st.data(), extra=st.sampled_from([None, "x"]))
    def insert(self, data, extra):
        seq = self._tokens(data)
        self._insert(seq[: len(seq) // self.page_size * self.page_size], extra)

    @precondition(lambda self: self.kv_locks)
    @rule(data=st.data())
    def insert_and_lock_where_a_kv_lock_ends(self, data):
        """Revive the tombstone a KV-only lock may hold, and take a state lock there."""
        tokens = data.draw(st.sampled_from(self.kv_locks))[1]
        self._insert(tokens, None)
        self._lock(tokens)

    def _insert(self, seq, extra):
        self._check_match(seq, extra)
        cached = torch.tensor(self.oracle.kv_match(seq, extra), dtype=torch.int64)
        new = self.alloc.alloc(len(seq) - len(cached))
        state = self.mamba.alloc(1)
        if new is None or state is None:
            for x in (new, state):
                if x is not None:
                    (self.alloc if x is new else self.mamba).free(x)
            return
        value = torch.cat([cached, new])
        had_state = (extra, tuple(seq)) in self.oracle.states
        prefix_len, mamba_exist = self.cache.insert(RadixKey(seq, extra), value, state)
        assert prefix_len == len(cached) and mamba_exist == had_state
        if mamba_exist:
            self.mamba.free(state)
        else:
            self.oracle.states[(extra, tuple(seq))] = int(state)
        self.oracle.insert(seq, extra, value.tolist())

    @rule(data=st.data(), extra=st.sampled_from([None, "x"]))
    def match(self, data, extra):
        self._check_match(self._tokens(data), extra)

    @rule(data=st.data())
    def copy_on_write(self, data):
        tokens = self._tokens(data) + [0]
        req = FakeReq(tokens)
        expected = self.oracle.match(tokens[:-1], None)
        kv_before, states_before = self._free_kv(), self._free_states()
        m = self.cache.match_prefix(RadixKey(tokens), req=req, cow_mamba=True)
        self._forget_freed(kv_before, states_before)  # a state may have been evicted to make room ...
        if req.mamba_pool_idx is not None:  # ... and its slot handed straight to the request
            self.oracle.drop_freed_states({req.mamba_pool_idx})
        assert m.device_indices.tolist() == expected
        if m.device_indices.numel():
            src = int(m.last_device_node.mamba_value)
            assert torch.equal(self.mamba.temporal[:, req.mamba_pool_idx], self.mamba.temporal[:, src])
            self.mamba.free(torch.tensor([req.mamba_pool_idx]))

    @rule(data=st.data())
    def lock(self, data):
        self._lock(self._tokens(data))

    def _lock(self, tokens):
        m = self._check_match(tokens)
        if m.device_indices.numel():
            self.cache.inc_lock_ref(m.last_device_node)
            self.locks.append((m.last_device_node, tokens[: m.device_indices.numel()]))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.dec_lock_ref(node)

    @rule(data=st.data())
    def kv_lock(self, data):
        tokens = self._tokens(data)
        m = self.cache.match_kv_prefix(RadixKey(tokens))
        assert m.device_indices.tolist() == self.oracle.kv_match(tokens, None)
        if m.device_indices.numel():
            self.cache.inc_lock_ref(m.last_device_node, kv_only=True)
            self.kv_locks.append((m.last_device_node, tokens[: m.device_indices.numel()]))

    @precondition(lambda self: self.kv_locks)
    @rule(data=st.data())
    def kv_unlock(self, data):
        """A tombstone left a leaf under the lock goes with it: its KV only, no state."""
        node, _ = self.kv_locks.pop(data.draw(st.integers(0, len(self.kv_locks) - 1)))
        kv_before, states_before = self._free_kv(), self._free_states()
        self.cache.dec_lock_ref(node, kv_only=True)
        held = self._locked_kv()
        freed_kv, freed_states = self._forget_freed(kv_before, states_before)
        assert not freed_states and not freed_kv & held, "an unlock freed a state or locked KV"

    def _locked_kv(self):
        slots = set()
        for _, tokens in self.locks + self.kv_locks:
            slots |= set(self.oracle.kv_match(tokens, None))
        return slots

    @rule(n=st.integers(1, 12), mamba_only=st.booleans())
    def evict(self, n, mamba_only):
        kv_before, states_before = self._free_kv(), self._free_states()
        if mamba_only:
            self.cache.evict_mamba(n)
        else:
            self.cache.evict(n)
        held = self._locked_kv()
        freed_kv, freed_states = self._forget_freed(kv_before, states_before)
        assert not held & freed_kv, "locked KV evicted"
        for node, _ in self.locks:
            assert int(node.mamba_value) not in freed_states, "locked state evicted"

    @rule()
    def evict_one_leaf(self):
        """``evict(1)`` takes exactly one leaf and the tombstones above it: one state at most."""
        kv_before, states_before = self._free_kv(), self._free_states()
        self.cache.evict(1)
        _, freed_states = self._forget_freed(kv_before, states_before)
        assert len(freed_states) <= 1

    @invariant()
    def accounting(self):
        self.oracle.consistent({(None, tuple(tokens)) for _, tokens in self.kv_locks})
        self.cache.check_integrity()
        c, a = self.cache, self.alloc
        assert a.available_size() + c.full_evictable_size() + c.full_protected_size() == a.num_pages * a.page_size
        a.check_integrity(c.all_values())
        self.pool.check_integrity(tree_mamba_slots=c.all_mamba_values())
        assert c.mamba_protected_size() == len({id(n) for n, _ in self.locks})
        self.mirror.check_snapshot()


def _machine(page_size, strategy, max_examples):
    cls = type(f"MambaMachine_ps{page_size}", (MambaMachine,), {"page_size": page_size, "strategy": strategy})
    cls.TestCase.settings = settings(max_examples=max_examples, stateful_step_count=30, deadline=None)
    return cls.TestCase


TestMambaRadixCacheNoBuffer = _machine(1, "no_buffer", 120)
TestMambaRadixCachePaged = _machine(4, "extra_buffer", 60)
