"""Differential test: RadixCache against a brute-force oracle.

The oracle keeps every cached page-aligned prefix of every inserted sequence
(per ``extra_key``) with the slots of its last page. Random workloads insert
sequences (sometimes with fresh slots for an already-cached prefix, which
must be reported as duplicates), match, lock, unlock and evict. After every
step: matched lengths and slot ids equal the oracle's, locked prefixes
survive eviction, what remains is prefix-closed, and every slot is free or
cached — never both, never neither.
"""

import hypothesis.strategies as st
import torch
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.radix_cache import RadixCache
from mem_cache.radix_key import RadixKey
from mem_cache.req_to_token_pool import ReqToTokenPool
from tests.cache_helpers import conservation, machine_case

EXTRA_KEYS = [None, "lora-a", "tenant-b"]


class Oracle:
    def __init__(self, page_size):
        self.ps = page_size
        self.pages = {}  # (extra_key, prefix tuple) -> slots of the prefix's last page

    def match(self, tokens, extra):
        slots, k = [], self.ps
        while k <= len(tokens) and (extra, tuple(tokens[:k])) in self.pages:
            slots.extend(self.pages[(extra, tuple(tokens[:k]))])
            k += self.ps
        return slots

    def insert(self, tokens, extra, slots):
        for k in range(self.ps, len(tokens) + 1, self.ps):
            self.pages.setdefault((extra, tuple(tokens[:k])), tuple(slots[k - self.ps : k]))

    def drop_freed(self, freed):
        self.pages = {p: s for p, s in self.pages.items() if not (set(s) & freed)}

    def prefix_closed(self):
        return all(len(p) == self.ps or (e, p[: -self.ps]) in self.pages for (e, p) in self.pages)


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    num_pages = 48

    def __init__(self):
        super().__init__()
        ps = self.page_size
        size = self.num_pages * ps
        self.alloc = TokenToKVPoolAllocator(size) if ps == 1 else PagedTokenToKVPoolAllocator(size, ps)
        self.cache = RadixCache(ReqToTokenPool(2, 8), self.alloc, page_size=ps, enable_kv_events=True)
        self.oracle = Oracle(ps)
        self.locks = []  # (node, tokens, extra_key) held

    def _free_set(self):
        return {int(p) * self.page_size + o for p in self.alloc.free_page_ids() for o in range(self.page_size)}

    def _check_match(self, tokens, extra):
        m = self.cache.match_prefix(RadixKey(tokens, extra))
        assert m.device_indices.tolist() == self.oracle.match(tokens, extra)
        return m

    def _tokens(self, data, max_pages=8, ragged=True):
        """Whole pages from a tiny alphabet (so prefixes are shared and pages
        differ only in their last token sometimes), plus an unaligned tail."""
        ps = self.page_size
        pages = data.draw(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1)), min_size=1, max_size=max_pages))
        tokens = [t for a, b in pages for t in ([a] * (ps - 1) + [b] if ps > 1 else [a])]
        if ragged and ps > 1:
            tokens += data.draw(st.lists(st.integers(0, 2), max_size=ps - 1))
        return tokens

    @rule(data=st.data(), extra=st.sampled_from(EXTRA_KEYS), fresh=st.booleans())
    def insert(self, data, extra, fresh):
        seq = self._tokens(data, ragged=False)
        cached = self._check_match(seq, extra).device_indices
        start = 0 if fresh else len(cached)
        new = self.alloc.alloc(len(seq) - start)
        if new is None:
            return
        value = torch.cat([cached[:start], new])
        already = self.cache.insert(RadixKey(seq, extra), value)
        assert already == len(self.oracle.match(seq, extra))
        if fresh:
            self.alloc.free(new[:already])  # duplicates the caller owns
        self.oracle.insert(seq, extra, value.tolist())

    @rule(data=st.data(), extra=st.sampled_from(EXTRA_KEYS))
    def match(self, data, extra):
        self._check_match(self._tokens(data), extra)

    @rule(data=st.data(), extra=st.sampled_from(EXTRA_KEYS))
    def lock(self, data, extra):
        tokens = self._tokens(data)
        m = self._check_match(tokens, extra)
        if m.device_indices.numel():
            self.cache.inc_lock_ref(m.last_device_node)
            self.locks.append((m.last_device_node, tokens[: m.device_indices.numel()], extra))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        node, _, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.dec_lock_ref(node)

    @rule(num_tokens=st.integers(1, 30))
    def evict(self, num_tokens):
        before = self._free_set()
        evictable = self.cache.evictable_size()
        evicted = self.cache.evict(num_tokens)
        freed = self._free_set() - before
        assert len(freed) == evicted >= min(num_tokens, evictable)
        for _, tokens, extra in self.locks:
            assert not set(self.oracle.match(tokens, extra)) & freed, "a locked prefix was evicted"
        self.oracle.drop_freed(freed)
        assert self.oracle.prefix_closed()

    @invariant()
    def accounting(self):
        self.cache.check_integrity()
        conservation(self.alloc, self.cache)
        self.alloc.check_integrity(self.cache.all_values())
        locked = {(e, tuple(t[:k])) for _, t, e in self.locks for k in range(self.page_size, len(t) + 1, self.page_size)}
        assert self.cache.protected_size() == len(locked) * self.page_size


TestRadixCachePage1 = machine_case(RadixMachine, "ps1", 120, 30, page_size=1)
TestRadixCachePage16 = machine_case(RadixMachine, "ps16", 60, 30, page_size=16)
