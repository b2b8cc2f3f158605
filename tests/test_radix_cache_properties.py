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
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.radix_cache import RadixCache
from mem_cache.radix_key import RadixKey
from mem_cache.req_to_token_pool import ReqToTokenPool
from tests.cache_helpers import FakeReq, conservation, extend, machine_case, start_req

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


def rematch_cache_unfinished_req(cache, req):
    """``cache_unfinished_req`` as it was before its insert gave the path: insert, then
    ``match_prefix`` again for the node and the tree's slots. The oracle of the test below."""
    cache._counting_hits = False
    try:
        token_ids, protected = req.fill_ids, req.cache_protected_len
        kv_indices = cache._row(req, len(token_ids))
        aligned = len(token_ids) - len(token_ids) % cache.page_size
        key = RadixKey(token_ids[:aligned], req.extra_key)
        new_prefix_len = cache.insert(key, kv_indices[:aligned].clone(), req.priority)
        cache._free(kv_indices[protected:new_prefix_len])
        match = cache.match_prefix(key)
        cache.req_to_token_pool.write((req.req_pool_idx, slice(protected, aligned)), match.device_indices[protected:])
        cache.inc_lock_ref(match.last_device_node)
        cache.dec_lock_ref(req.last_node)
        req.prefix_indices = torch.cat([match.device_indices, kv_indices[aligned:]])
        req.cache_protected_len, req.last_node = aligned, match.last_device_node
    finally:
        cache._counting_hits = True


def _path(node):
    keys = []
    while node.parent is not None:
        keys.append(tuple(node.key.token_ids))
        node = node.parent
    return tuple(reversed(keys))


def _snapshot(cache):
    """The tree as comparable data: per node its path, slots, locks, hits, priority, and its
    access and creation times as ranks (the re-match ticked the clock once more: same order)."""
    nodes = [cache.root_node, *cache._iter_nodes()]
    ranks = {name: {t: i for i, t in enumerate(sorted({getattr(n, name) for n in nodes}))}
             for name in ("last_access_time", "creation_time")}
    return sorted((_path(n), n.value.tolist(), n.lock_ref, n.hit_count, n.priority, ranks["last_access_time"][n.last_access_time],
                   ranks["creation_time"][n.creation_time]) for n in nodes), cache.evictable_size(), cache.protected_size()


class _Twin:
    def __init__(self, page_size, policy):
        size = 64 * page_size
        self.alloc = TokenToKVPoolAllocator(size) if page_size == 1 else PagedTokenToKVPoolAllocator(size, page_size)
        self.pool = ReqToTokenPool(5, 48)
        self.cache = RadixCache(self.pool, self.alloc, page_size=page_size, eviction_policy=policy)
        self.reqs = {}

    def state(self):
        reqs = {i: (r.prefix_indices.tolist(), _path(r.last_node), r.cache_protected_len,
                    self.pool.req_to_token[r.req_pool_idx, : len(r.fill_ids)].tolist()) for i, r in self.reqs.items()}
        return _snapshot(self.cache), reqs, self.alloc.free_page_list().tolist()


@settings(max_examples=80, deadline=None)
@given(page_size=st.sampled_from([1, 4]), policy=st.sampled_from(["lru", "lfu", "mru"]), data=st.data())
def test_cache_unfinished_req_leaves_what_insert_then_rematch_left(page_size, policy, data):
    """Twin caches run the same requests chunk by chunk, one caching progress with the path its
    insert gave, the other with insert and a re-match: after every step the trees (splits,
    slots, locks, hits, eviction order), the requests' prefixes, nodes and rows, and the free
    lists are the same."""
    new, old = _Twin(page_size, policy), _Twin(page_size, policy)
    stems = [data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=12)) for _ in range(2)]
    for _ in range(data.draw(st.integers(1, 30))):
        slot, chunk = data.draw(st.integers(0, 4)), data.draw(st.integers(1, 12))
        live = new.reqs.get(slot)
        if slot == 4:
            num_tokens = data.draw(st.integers(1, 40))
            assert new.cache.evict(num_tokens) == old.cache.evict(num_tokens)
        elif live is None:
            prompt = data.draw(st.sampled_from(stems)) + data.draw(st.lists(st.integers(1, 3), max_size=20))
            for twin in (new, old):
                twin.reqs[slot] = start_req(twin.cache, twin.pool, twin.alloc, FakeReq(list(prompt)), upto=chunk)
        elif len(live.fill_ids) == len(live.origin_input_ids) and data.draw(st.booleans()):
            for twin in (new, old):
                req = twin.reqs.pop(slot)
                req.kv_committed_len = len(req.fill_ids)
                twin.cache.cache_finished_req(req)
            continue
        else:
            for twin in (new, old):
                req = twin.reqs[slot]
                extend(twin.cache, twin.pool, twin.alloc, req, len(req.fill_ids), req.origin_input_ids[: len(req.fill_ids) + chunk])
        if slot != 4:
            new.cache.cache_unfinished_req(new.reqs[slot])
            rematch_cache_unfinished_req(old.cache, old.reqs[slot])
        assert new.state() == old.state()
        new.cache.check_integrity()
        new.alloc.check_integrity(torch.cat([new.cache.all_values(), *(
            r.prefix_indices[r.cache_protected_len :] for r in new.reqs.values())]))
