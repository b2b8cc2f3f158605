"""Random insert / match / copy-on-write / lock / KV-only lock / evict / evict_mamba
workloads on MambaRadixCache against a brute-force oracle of cached pages and
checkpoints (``test_mamba_radix_cache_requests`` adds running requests).

The router's prefix index, fed by the cache's KV events, predicts every match
(StateStored / StateRemoved mark where a reused prefix may end).

After every step: the match equals the oracle's (the deepest checkpoint within
the cached prefix; a KV-only match, the whole cached prefix), no checkpoint
outlives its KV, no cached sequence ends in a tombstone but where a KV-only lock
holds it, locks protect KV and states, every checkpoint holds the state after
exactly its prefix (``state_code``), and KV slots and Mamba slots are each exactly
free or held. At the end, unlocked and evicted, everything is free.
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


def state_code(extra, tokens) -> float:
    """What a state after ``tokens`` holds in these tests (exact in float32): a checkpoint
    cached for a prefix must hold that prefix's code, and a copy-on-write copy the same."""
    h = 7 if extra is None else 11
    for t in tokens:
        h = (h * 31 + t + 1) % 1_000_003
    return float(h)


class MambaMachine(RuleBasedStateMachine):
    page_size = 1
    strategy = "no_buffer"
    num_states, context_len, chunk = 6, 8, 64

    def __init__(self):
        super().__init__()
        ps = self.page_size
        self.mamba = MambaPool(self.num_states, [(2, 2)], (2,), 1, torch.float32, torch.float32)
        self.pool = HybridReqToTokenPool(
            2, self.context_len, "cpu", self.mamba, [0], enable_mamba_extra_buffer=self.strategy == "extra_buffer"
        )
        size = 40 * ps
        self.alloc = TokenToKVPoolAllocator(size) if ps == 1 else PagedTokenToKVPoolAllocator(size, ps)
        self.cache = MambaRadixCache(self.pool, self.alloc, page_size=ps, mamba_scheduler_strategy=self.strategy,
                                     enable_kv_events=True, chunk_size=self.chunk)
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

    def _write_state(self, slot, extra, tokens):
        for state in self.mamba.states():
            state[:, int(slot)] = state_code(extra, tokens)

    def _read_state(self, slot):
        return float(self.mamba.temporal[0, int(slot)].flatten()[0])

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
        self._write_state(state, extra, seq)
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
        m = self._cow_match(req)
        if m is not None and m.device_indices.numel():
            self.mamba.free(torch.tensor([req.mamba_pool_idx]))

    def _cow_match(self, req):
        """``match_prefix`` of the request's prompt with copy-on-write, checked; None when every
        state is held (by locks, running requests) and the copy has no slot: a logical OOM that
        takes nothing (it raised)."""
        tokens = req.origin_input_ids
        expected = self.oracle.match(tokens[: len(tokens) - 1], None)
        kv_before, states_before = self._free_kv(), self._free_states()
        m = self.cache.match_prefix(RadixKey(tokens), req=req, cow_mamba=True)
        if m.mamba_cow_failed:
            assert req.mamba_pool_idx is None and not self.mamba.available_size()
            m = None
        self._forget_freed(kv_before, states_before)  # a state may have been evicted to make room ...
        if req.mamba_pool_idx is not None:  # ... and its slot handed straight to the request
            self.oracle.drop_freed_states({req.mamba_pool_idx})
        if m is None:
            return None
        assert m.device_indices.tolist() == expected
        if m.device_indices.numel():
            src = int(m.last_device_node.mamba_value)
            assert torch.equal(self.mamba.temporal[:, req.mamba_pool_idx], self.mamba.temporal[:, src])
            assert self._read_state(req.mamba_pool_idx) == state_code(None, tokens[: len(expected)])
        return m

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

    def _state_locks(self):
        """(node, tokens) of every lock that holds a state: the rules' own (and running requests')."""
        return self.locks

    def _kv_only_locks(self):
        return self.kv_locks

    def _private_kv(self):
        """KV slots running requests hold as their own (none here)."""
        return torch.empty(0, dtype=torch.int64)

    def _locked_kv(self):
        slots = set()
        for _, tokens in self._state_locks() + self._kv_only_locks():
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
        for node, _ in self._state_locks():
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
        self.oracle.consistent({(None, tuple(tokens)) for _, tokens in self._kv_only_locks()})
        self.cache.check_integrity()
        c, a = self.cache, self.alloc
        private = self._private_kv()
        private_pages = len(set((private // a.page_size).tolist())) * a.page_size
        held = c.full_evictable_size() + c.full_protected_size() + private_pages
        assert a.available_size() + held == a.num_pages * a.page_size
        a.check_integrity(torch.cat([c.all_values(), private]))
        self.pool.check_integrity(tree_mamba_slots=c.all_mamba_values())
        assert c.mamba_protected_size() == len({id(n) for n, _ in self._state_locks()})
        self.mirror.check_snapshot()
        for node in c._iter_nodes():  # every checkpoint holds the state after exactly its prefix
            if node.mamba_value is not None:
                path, up = [], node
                while up is not c.root_node:
                    path[:0], up = up.key.token_ids, up.parent
                assert self._read_state(node.mamba_value) == state_code(node.key.extra_key, path)

    def teardown(self):
        """Unlocked and evicted, the tree gives every KV slot and Mamba state back."""
        for node, _ in self.locks:
            self.cache.dec_lock_ref(node)
        for node, _ in self.kv_locks:
            self.cache.dec_lock_ref(node, kv_only=True)
        self.cache.evict_mamba(10**6)
        self.cache.evict(10**6)
        self.cache.check_integrity()
        assert not self.cache.root_node.children
        assert self.alloc.available_size() == self.alloc.num_pages * self.alloc.page_size
        assert self.mamba.available_size() == self.mamba.size


def _machine(page_size, strategy, max_examples):
    cls = type(f"MambaMachine_ps{page_size}", (MambaMachine,), {"page_size": page_size, "strategy": strategy})
    cls.TestCase.settings = settings(max_examples=max_examples, stateful_step_count=30, deadline=None)
    return cls.TestCase


TestMambaRadixCacheNoBuffer = _machine(1, "no_buffer", 120)
TestMambaRadixCachePaged = _machine(4, "extra_buffer", 60)
