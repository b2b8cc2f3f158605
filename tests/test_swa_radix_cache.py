"""SWARadixCache: SGLang-like sliding-window cases with exact slot ids, and a
hypothesis state machine against a brute-force oracle.

Both pools must conserve after every step:
``full_available + full_evictable + full_protected (+ private) == size`` and
``swa_available + swa_evictable + swa_protected (+ private) == size_swa``.
"""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mem_cache.allocator import TokenToKVPoolAllocator
from mem_cache.integrity import IntegrityError
from mem_cache.kv_events import BlockRemoved, BlockStored, WindowLost
from mem_cache.radix_key import RadixKey
from mem_cache.req_to_token_pool import ReqToTokenPool
from mem_cache.swa_allocator import SWATokenToKVPoolAllocator
from mem_cache.swa_radix_cache import SWARadixCache, SWAEvictResult
from tests.cache_helpers import FakeReq, IndexMirror, machine_case


def make(window=4, size=32, size_swa=16, events=False, disable=False):
    alloc = SWATokenToKVPoolAllocator(size, size_swa, debug=True)
    pool = ReqToTokenPool(4, 64)
    return SWARadixCache(pool, alloc, sliding_window_size=window, enable_kv_events=events, disable=disable), pool, alloc


def row(pool, req, start, end):
    return pool.req_to_token[req.req_pool_idx, start:end].to(torch.int64)


def _pages_between(start, end, ps):
    """Slots of the whole pages a request holds for positions ``[start, end)`` (``start`` a page boundary)."""
    return max(0, -(-end // ps) * ps - start)


def check(cache, pool, alloc, reqs=()):
    """Conservation of both pools (running requests' private slots counted, in whole pages) and both
    integrity checks."""
    ps = alloc.page_size
    private_full = sum(_pages_between(r.cache_protected_len, r.kv_committed_len, ps) for r in reqs)
    private_swa = sum(
        _pages_between(max(r.cache_protected_len, r.swa_evicted_seqlen), r.kv_committed_len, ps) for r in reqs
    )
    cache.check_accounting(private_full, private_swa)
    cache.check_integrity()
    private = [row(pool, r, r.cache_protected_len, r.kv_committed_len) for r in reqs]
    alloc.check_integrity(torch.cat([cache.all_values()] + private))


def swa_of(alloc, slots):
    return alloc.full_to_swa_index_mapping[torch.as_tensor(slots)].tolist()


def match(cache, tokens):
    return cache.match_prefix(RadixKey(list(tokens))).device_indices.tolist()


def put(cache, alloc, tokens, swa_evicted=0):
    """A request that computed ``tokens`` alone, slid ``[0, swa_evicted)`` out of its window, and is cached."""
    value = alloc.alloc(len(tokens))
    alloc.free_swa(value[:swa_evicted])
    return cache.insert(RadixKey(list(tokens)), value, swa_evicted_seqlen=swa_evicted), value


def extend(alloc, pool, req, end):
    """Slots for positions ``[kv_committed_len, end)`` of ``req``'s row, as a prefill or a decode step
    takes them (continuing its last page), or None."""
    done = req.kv_committed_len
    if end == done:  # (a prompt matched whole)
        return torch.empty(0, dtype=torch.int64)
    last_loc = torch.tensor([int(pool.req_to_token[req.req_pool_idx, done - 1]) if done else -1])
    prefix, seq = torch.tensor([done]), torch.tensor([end])
    if end == done + 1 and done:
        new = alloc.alloc_decode(seq, last_loc)
    else:
        new = alloc.alloc_extend(prefix, seq, last_loc, end - done)
    if new is not None:
        pool.req_to_token[req.req_pool_idx, done:end] = new.to(torch.int32)
        req.kv_committed_len = end
    return new


def start(cache, pool, alloc, tokens):
    """Match, lock, take a row and slots for the rest: a prefill's bookkeeping."""
    req = FakeReq(list(tokens), fill_ids=list(tokens))
    m = cache.match_prefix(RadixKey(req.origin_input_ids))
    req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
    req.cache_protected_len = len(m.device_indices)
    req.swa_uuid_for_lock = cache.inc_lock_ref(req.last_node)
    req.req_pool_idx = pool.alloc(1)[0]
    prefix = req.cache_protected_len
    pool.req_to_token[req.req_pool_idx, :prefix] = m.device_indices.to(torch.int32)
    req.kv_committed_len = prefix
    assert extend(alloc, pool, req, len(tokens)) is not None
    return req


def decode(cache, pool, alloc, req, token):
    assert extend(alloc, pool, req, req.kv_committed_len + 1) is not None
    req.output_ids.append(token)
    return cache.free_swa_out_of_window(req)


def build_fork(cache, alloc):
    """root → N0 [0,6) → {N1 [6,12) slots 7..12, N2 (50..55) slots 13..18}; N1 least recently used."""
    put(cache, alloc, range(12))
    value = torch.cat([torch.arange(1, 7), alloc.alloc(6)])
    assert cache.insert(RadixKey(list(range(6)) + list(range(50, 56))), value, prev_prefix_len=6) == 6
    n0 = cache.root_node.children[0]
    return n0, n0.children[6], n0.children[50]


def test_insert_and_match_within_window():
    cache, pool, alloc = make()
    assert put(cache, alloc, range(10))[0] == 0
    assert match(cache, range(10)) == list(range(1, 11))
    assert match(cache, [0, 1, 2, 99]) == [1, 2, 3]  # no tombstone above: shorter than the window is fine
    dup = alloc.alloc(5)  # fresh slots for cached tokens are duplicates: freed, full and SWA
    assert cache.insert(RadixKey(list(range(5))), dup) == 5
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (22, 6)
    assert (cache.full_evictable_size(), cache.swa_evictable_size()) == (10, 10)
    check(cache, pool, alloc)


def test_tokens_slid_out_of_the_window_become_a_tombstone():
    cache, pool, alloc = make()
    _, value = put(cache, alloc, range(10), swa_evicted=6)
    tomb = cache.root_node.children[0]
    assert tomb.swa_tombstone and len(tomb.key) == 6 and not tomb.children[6].swa_tombstone
    assert swa_of(alloc, value) == [0] * 6 + [7, 8, 9, 10]
    assert (cache.full_evictable_size(), cache.swa_evictable_size(), alloc.swa_available_size()) == (10, 4, 12)
    assert match(cache, range(10)) == list(range(1, 11))  # the last 4 tokens have SWA KV
    assert match(cache, range(9)) == []  # only 3 before the end: the window is incomplete
    assert match(cache, range(4)) == []  # inside the tombstone
    check(cache, pool, alloc)


def test_insert_with_every_swa_slot_freed_adds_no_tombstone_leaf():
    cache, pool, alloc = make()
    assert put(cache, alloc, range(5), swa_evicted=5)[0] == 0
    assert not cache.root_node.children and alloc.full_available_size() == 32
    check(cache, pool, alloc)


def test_match_stops_where_the_window_swa_is_missing_and_locks_keep_only_the_window():
    cache, pool, alloc = make(size_swa=24)
    n0, n1, n2 = build_fork(cache, alloc)
    locks = [(n, cache.inc_lock_ref(n)) for n in (n1, n2)]  # each leaf covers the window alone
    assert [u for _, u in locks] == [n1.swa_uuid, n2.swa_uuid] and n0.swa_lock_ref == 0
    assert (cache.full_protected_size(), cache.swa_protected_size(), cache.swa_evictable_size()) == (18, 12, 6)
    assert cache.evict(full_num_tokens=100, swa_num_tokens=100) == SWAEvictResult(0, 6)  # only N0's SWA is unlocked
    assert n0.swa_tombstone and swa_of(alloc, n0.value) == [0] * 6
    assert match(cache, range(12)) == list(range(1, 13))
    assert match(cache, range(10)) == list(range(1, 11))
    assert match(cache, range(9)) == []  # 3 tokens after the tombstone
    for node, uuid in locks:
        cache.dec_lock_ref(node, uuid)
    assert (cache.full_protected_size(), cache.swa_protected_size()) == (0, 0)
    check(cache, pool, alloc)


def test_swa_eviction_tombstones_internal_nodes_and_deletes_leaves():
    cache, pool, alloc = make(size_swa=24)
    n0, n1, n2 = build_fork(cache, alloc)
    assert cache.evict(swa_num_tokens=7) == SWAEvictResult(6, 12)  # leaf N1 whole, then N0 becomes a tombstone
    assert n0.swa_tombstone and list(n0.children.values()) == [n2]
    check(cache, pool, alloc)
    assert cache.evict(swa_num_tokens=1) == SWAEvictResult(12, 6)  # leaf N2, then the tombstone leaf N0
    assert not cache.root_node.children
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (32, 24)
    check(cache, pool, alloc)


def test_full_eviction_takes_lru_leaves_and_tombstone_parents():
    cache, pool, alloc = make(size_swa=24)
    n0, n1, n2 = build_fork(cache, alloc)
    match(cache, range(12))  # N1 is now more recent than N2
    assert cache.evict(full_num_tokens=1) == SWAEvictResult(6, 6)
    assert list(n0.children.values()) == [n1] and alloc.translate_loc_from_full_to_swa(n2.value).tolist() == [0] * 6
    cache.evict(swa_num_tokens=1)  # N0 is the LRU SWA node → tombstone
    assert n0.swa_tombstone
    assert cache.evict(full_num_tokens=1) == SWAEvictResult(12, 6)  # N1 and its tombstone parent
    assert not cache.root_node.children
    check(cache, pool, alloc)


def test_lock_covers_the_window_and_survives_a_split_of_its_boundary():
    cache, pool, alloc = make(window=5)
    for n, cached in ((3, 0), (6, 3), (10, 6)):  # a chain A [0,3) → B [3,6) → C [6,10), slots 1..10
        value = torch.cat([torch.arange(1, 1 + cached), alloc.alloc(n - cached)])
        assert cache.insert(RadixKey(list(range(n))), value, prev_prefix_len=cached) == cached
    a = cache.root_node.children[0]
    b, c = a.children[3], a.children[3].children[6]
    uuids = [cache.inc_lock_ref(c), cache.inc_lock_ref(c)]
    assert uuids == [b.swa_uuid] * 2 and (a.swa_lock_ref, b.swa_lock_ref, c.swa_lock_ref) == (0, 2, 2)
    assert (cache.full_protected_size(), cache.swa_protected_size(), cache.swa_evictable_size()) == (10, 7, 3)
    assert cache.evict(full_num_tokens=100, swa_num_tokens=100) == SWAEvictResult(0, 3)
    assert match(cache, [0, 1, 2, 3, 99]) == []  # splits B under the lock; 1 token after the tombstone
    b_upper = a.children[3]
    assert (len(b_upper.key), b_upper.swa_lock_ref, b_upper.swa_uuid, b.swa_uuid) == (1, 2, uuids[0], None)
    assert match(cache, range(10)) == list(range(1, 11))
    for uuid in uuids:
        cache.dec_lock_ref(c, uuid)
    assert (cache.full_protected_size(), cache.swa_protected_size(), cache.full_evictable_size()) == (0, 0, 10)
    check(cache, pool, alloc)
    assert cache.evict(swa_num_tokens=100) == SWAEvictResult(10, 7)
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (32, 16)


def test_insert_revives_a_locked_tombstone_with_the_callers_swa_slots():
    cache, pool, alloc = make()
    put(cache, alloc, range(10), swa_evicted=6)  # T [0,6) slots 1..6 → L [6,10) slots 7..10
    tomb = cache.root_node.children[0]
    leaf = tomb.children[6]
    uuid = cache.inc_lock_ref(leaf)  # full-locks T, swa-locks only L
    fresh = alloc.alloc(8)  # full 11..18, SWA 11..16 then the freed 1, 2
    assert swa_of(alloc, fresh) == [11, 12, 13, 14, 15, 16, 1, 2]
    assert cache.insert(RadixKey(list(range(8))), fresh) == 8
    assert not tomb.swa_tombstone and tomb.value.tolist() == [1, 2, 3, 4, 5, 6]  # keeps the locked full slots
    assert swa_of(alloc, range(1, 11)) == [11, 12, 13, 14, 15, 16, 7, 8, 9, 10]
    assert swa_of(alloc, fresh) == [0] * 8  # the caller's full slots were freed, its SWA 1, 2 too
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (22, 6)
    assert match(cache, range(5)) == [1, 2, 3, 4, 5]
    cache.dec_lock_ref(leaf, uuid)
    check(cache, pool, alloc)


def test_insert_revives_only_the_part_the_caller_still_has_swa_for():
    cache, pool, alloc = make()
    put(cache, alloc, range(10), swa_evicted=6)
    fresh = alloc.alloc(10)
    alloc.free_swa(fresh[:2])
    assert cache.insert(RadixKey(list(range(10))), fresh, swa_evicted_seqlen=2) == 10
    upper = cache.root_node.children[0]
    assert (len(upper.key), upper.swa_tombstone, upper.children[2].swa_tombstone) == (2, True, False)
    assert swa_of(alloc, range(1, 11)) == [0, 0, 13, 14, 15, 16, 7, 8, 9, 10]
    assert match(cache, range(5)) == []  # 3 tokens with SWA after the tombstone: short of the window
    assert match(cache, range(6)) == list(range(1, 7))
    check(cache, pool, alloc)


def test_finished_request_that_slid_out_of_its_window():
    cache, pool, alloc = make()
    req = start(cache, pool, alloc, range(6))
    freed = [decode(cache, pool, alloc, req, 100 + i) for i in range(6)]
    assert freed == [3, 1, 1, 1, 1, 1] and req.swa_evicted_seqlen == 8  # the last 4 tokens keep their SWA
    assert swa_of(alloc, row(pool, req, 0, 12)) == [0] * 8 + [9, 10, 11, 12]
    check(cache, pool, alloc, [req])
    cache.cache_finished_req(req)
    check(cache, pool, alloc)
    tomb = cache.root_node.children[0]
    assert tomb.swa_tombstone and len(tomb.key) == 8
    assert (cache.full_evictable_size(), cache.swa_evictable_size()) == (12, 4)
    again = start(cache, pool, alloc, list(range(6)) + [100 + i for i in range(6)] + [7])
    assert again.prefix_indices.tolist() == list(range(1, 13)) and again.cache_protected_len == 12
    assert (cache.full_protected_size(), cache.swa_protected_size()) == (12, 4)
    check(cache, pool, alloc, [again])
    cache.cache_finished_req(again)
    assert (cache.full_protected_size(), cache.swa_protected_size(), cache.full_evictable_size()) == (0, 0, 13)
    check(cache, pool, alloc)


def test_chunked_prefill_caches_progress_and_moves_the_lock():
    cache, pool, alloc = make()
    req = start(cache, pool, alloc, range(5))
    cache.cache_unfinished_req(req)
    first = cache.root_node.children[0]
    assert (req.cache_protected_len, req.last_node, req.swa_uuid_for_lock) == (5, first, first.swa_uuid)
    check(cache, pool, alloc, [req])
    pool.req_to_token[req.req_pool_idx, 5:10] = alloc.alloc(5).to(torch.int32)
    req.fill_ids, req.kv_committed_len = list(range(10)), 10
    assert cache.free_swa_out_of_window(req) == 1  # position 5 only: [0, 5) is the tree's
    check(cache, pool, alloc, [req])
    cache.cache_unfinished_req(req)
    tomb = first.children[5]
    assert tomb.swa_tombstone and len(tomb.key) == 1 and req.last_node is tomb.children[6]
    assert req.prefix_indices.tolist() == list(range(1, 11)) and first.swa_lock_ref == 0
    check(cache, pool, alloc, [req])
    cache.cache_finished_req(req)
    assert (cache.full_evictable_size(), cache.swa_evictable_size(), cache.full_protected_size()) == (10, 9, 0)
    check(cache, pool, alloc)


def test_chunk_cached_meanwhile_by_another_request_is_freed_and_the_row_rewritten():
    cache, pool, alloc = make()
    a, b = start(cache, pool, alloc, range(8)), start(cache, pool, alloc, range(8))
    cache.cache_unfinished_req(a)
    b_slots = row(pool, b, 0, 8).tolist()
    cache.cache_unfinished_req(b)
    assert row(pool, b, 0, 8).tolist() == list(range(1, 9)) and b.swa_uuid_for_lock == a.swa_uuid_for_lock
    assert set(b_slots) <= set(alloc.full_attn_allocator.free_page_ids().tolist())
    check(cache, pool, alloc, [a, b])
    for req in (a, b):
        cache.cache_finished_req(req)
    check(cache, pool, alloc)


def test_disabled_cache_frees_what_slid_out_between_chunks_and_everything_at_the_end():
    """disable_radix_cache (SGLang's SWAChunkCache): nothing is matched or cached; between two chunks the
    request frees the SWA KV before its window itself (no tree evicts it, so a long prompt would hold
    an SWA slot a token), and every slot of both pools when it ends."""
    cache, pool, alloc = make(disable=True)
    req = start(cache, pool, alloc, range(6))
    assert (req.cache_protected_len, req.last_node, req.swa_uuid_for_lock) == (0, cache.root_node, None)
    cache.cache_unfinished_req(req)  # a window of 4 before position 6 keeps [2, 6)
    assert swa_of(alloc, row(pool, req, 0, 6)) == [0, 0, 3, 4, 5, 6] and req.swa_evicted_seqlen == 2
    assert req.prefix_indices.tolist() == [1, 2, 3, 4, 5, 6] and not cache.root_node.children
    check(cache, pool, alloc, [req])
    req.origin_input_ids = req.fill_ids = list(range(10))  # (the prompt's second chunk)
    assert extend(alloc, pool, req, 10) is not None
    cache.cache_unfinished_req(req)
    assert [s > 0 for s in swa_of(alloc, row(pool, req, 0, 10))] == [False] * 6 + [True] * 4
    check(cache, pool, alloc, [req])
    assert [decode(cache, pool, alloc, req, t) for t in (100, 101)] == [1, 1] and req.swa_evicted_seqlen == 8
    assert match(cache, list(range(10)) + [100]) == [] and cache.evict(32, 16) == SWAEvictResult(0, 0)
    cache.cache_finished_req(req)
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (32, 16) and not cache.root_node.children
    check(cache, pool, alloc)


def test_kv_events_follow_nodes():
    cache, pool, alloc = make(events=True)
    put(cache, alloc, range(6), swa_evicted=2)
    stored = cache.take_events()
    assert [(type(e), len(e.block_hashes)) for e in stored[1:]] == [(BlockStored, 2), (WindowLost, 2), (BlockStored, 4)]
    assert stored[2].block_hashes == stored[1].block_hashes  # the tombstone: its SWA KV slid out of the window
    cache.evict(full_num_tokens=1)
    assert [type(e) for e in cache.take_events()] == [BlockRemoved, BlockRemoved]
    check(cache, pool, alloc)


def test_rejects_what_it_cannot_serve():
    pool = ReqToTokenPool(2, 8)
    with pytest.raises(ValueError, match="the allocator's is 4"):
        SWARadixCache(pool, SWATokenToKVPoolAllocator(16, 8, page_size=4), sliding_window_size=4)
    with pytest.raises(TypeError, match="SWATokenToKVPoolAllocator"):
        SWARadixCache(pool, TokenToKVPoolAllocator(16), sliding_window_size=4)
    with pytest.raises(NotImplementedError, match="full_evictable_size"):
        make()[0].evictable_size()


def test_check_accounting_counts_private_slots():
    cache, pool, alloc = make()
    put(cache, alloc, range(6), swa_evicted=2)
    mine = alloc.alloc(3)
    alloc.free_swa(mine[:1])
    cache.check_accounting(private_full=3, private_swa=2)
    with pytest.raises(IntegrityError, match="SWA pool"):
        cache.check_accounting(private_full=3, private_swa=3)


def test_check_integrity_catches_slots_lost_behind_the_trees_back():
    cache, pool, alloc = make()
    _, value = put(cache, alloc, range(6))
    alloc.full_attn_allocator.free(value[2:3])  # a cached full slot listed as free
    with pytest.raises(IntegrityError, match="lists as free"):
        cache.check_integrity()
    cache, pool, alloc = make()
    _, value = put(cache, alloc, range(6))
    alloc.full_to_swa_index_mapping[value[4]] = 0  # a live node lost one token's SWA slot
    with pytest.raises(IntegrityError, match="SWA mapping"):
        cache.check_integrity()
    cache, pool, alloc = make()
    _, value = put(cache, alloc, range(6))
    alloc.full_to_swa_index_mapping[value[5]] = alloc.full_to_swa_index_mapping[value[0]]  # two tokens, one slot
    with pytest.raises(IntegrityError, match="duplicate"):
        cache.check_integrity()


# ---- differential test ---------------------------------------------------------------


class SWAOracle:
    """Every cached token: ``(extra, prefix to the end of its page, offset in the page) → its full
    slot``, plus the slots whose SWA KV is cached."""

    def __init__(self, window, page_size=1):
        self.window, self.page_size = window, page_size
        self.slots = {}
        self.swa = set()

    def full_match(self, tokens, extra):
        """Cached tokens of ``tokens``, in whole pages."""
        out = []
        while len(out) < len(tokens) and self._key(tokens, extra, len(out)) in self.slots:
            out.append(self.slots[self._key(tokens, extra, len(out))])
        return out[: len(out) - len(out) % self.page_size]

    def _key(self, tokens, extra, p):
        ps = self.page_size
        return extra, tuple(tokens[: (p // ps + 1) * ps]), p % ps

    def match(self, tokens, extra):
        """Deepest k: no tombstone in [0, k), or the window [k - W, k) all with SWA."""
        full = self.full_match(tokens, extra)
        has = [s in self.swa for s in full]
        w = self.window
        best = max(k for k in range(len(full) + 1) if all(has[:k]) or (k >= w and all(has[k - w : k])))
        return full[:best]

    def insert(self, tokens, extra, value, prev, evicted):
        """Mirror of ``insert``: a tombstone revives where the caller still has SWA. Paged, the
        tokens' whole pages are cached, and a page with any token SWA-evicted has lost it all."""
        ps = self.page_size
        tokens, evicted = tokens[: len(tokens) - len(tokens) % ps], -(-evicted // ps) * ps
        full = self.full_match(tokens, extra)
        self.swa.update(s for p, s in enumerate(full) if p >= max(prev, evicted))
        if evicted < len(tokens):
            for p in range(len(full), len(tokens)):
                self.slots[self._key(tokens, extra, p)] = value[p]
                if p >= evicted:
                    self.swa.add(value[p])
        return len(full)

    def check_shape(self):
        ps = self.page_size

        def before(e, p, off):
            return (e, p, off - 1) if off else (e, p[:-ps], ps - 1)

        followed = {before(*key) for key in self.slots}
        for (e, p, off), slot in self.slots.items():
            assert len(p) == ps and not off or before(e, p, off) in self.slots, "cached tokens are not prefix-closed"
            assert (e, p, off) in followed or slot in self.swa, f"a cached sequence ends in a tombstone: {p}"


class SWAMachine(RuleBasedStateMachine):
    window = 3
    num_rows = 2
    page_size = 1
    pool_pages = (40, 24)  # full, SWA

    def __init__(self):
        super().__init__()
        ps = self.page_size
        self.alloc = SWATokenToKVPoolAllocator(self.pool_pages[0] * ps, self.pool_pages[1] * ps, ps, debug=True)
        self.pool = ReqToTokenPool(self.num_rows, 32 * ps)
        self.cache = SWARadixCache(
            self.pool, self.alloc, sliding_window_size=self.window, page_size=ps, enable_kv_events=True
        )
        self.oracle = SWAOracle(self.window, ps)
        self.mirror = IndexMirror(self.cache, ps)  # the router's view: WindowLost / WindowRestored mark tombstones
        self.locks = []  # (node, swa_uuid_for_lock, tokens, slots)

    def _free_slots(self):
        """Every free full slot (whole free pages)."""
        ps = self.page_size
        return {p * ps + o for p in self.alloc.full_attn_allocator.free_page_ids().tolist() for o in range(ps)}

    def _tokens(self, data):
        """Often a cut of a cached sequence plus a few tokens, so that walks split and revive shared nodes."""
        known = sorted(p for (e, p, _) in self.oracle.slots if e is None)
        base = list(data.draw(st.sampled_from(known))) if known and data.draw(st.booleans()) else []
        base = base[: data.draw(st.integers(0, len(base)))]
        longest = (8 - min(len(base), 4)) * self.page_size
        return base + data.draw(st.lists(st.integers(0, 2), min_size=0 if base else 1, max_size=longest))

    def _check_match(self, tokens, extra=None):
        m = self.cache.match_prefix(RadixKey(tokens, extra))
        assert m.device_indices.tolist() == self.oracle.match(tokens, extra)
        self.mirror.check(tokens, extra, m.device_indices.numel())
        return m

    def _evict(self, full_num, swa_num, live_locks):
        free_before = self._free_slots()
        result = self.cache.evict(full_num, swa_num)
        freed = self._free_slots() - free_before
        mapping = self.alloc.full_to_swa_index_mapping
        lost_swa = {s for s in self.oracle.swa if int(mapping[s]) == 0}
        assert result == (len(freed), len(lost_swa))
        self.oracle.slots = {k: s for k, s in self.oracle.slots.items() if s not in freed}
        self.oracle.swa -= lost_swa
        for _, _, tokens, slots in live_locks:  # a locked prefix stays whole and usable
            assert self.oracle.match(tokens, None) == slots
        if result.full_num_evicted < full_num:
            assert self.cache.full_evictable_size() == 0
        if result.swa_num_evicted < swa_num:
            assert self.cache.swa_evictable_size() == 0

    @rule(data=st.data(), extra=st.sampled_from([None, "x"]))
    def insert(self, data, extra):
        ps = self.page_size
        tokens = self._tokens(data)
        cached = self._check_match(tokens, extra).device_indices
        tokens = tokens[: len(tokens) - len(tokens) % ps]
        prev = data.draw(st.integers(0, len(cached) // ps)) * ps
        evicted = data.draw(st.integers(0, len(tokens)))  # paged: the caller frees a partial page's SWA whole
        new = self.alloc.alloc(len(tokens) - prev)
        if new is None:
            return
        self.alloc.free_swa(new[: max(0, -(-evicted // ps) * ps - prev)])
        value = torch.cat([cached[:prev], new])
        expected = self.oracle.insert(tokens, extra, value.tolist(), prev, evicted)
        assert self.cache.insert(RadixKey(tokens, extra), value, prev, evicted) == expected

    @rule(data=st.data(), extra=st.sampled_from([None, "x"]))
    def match(self, data, extra):
        self._check_match(self._tokens(data), extra)

    @rule(data=st.data())
    def lock(self, data):
        tokens = self._tokens(data)
        m = self._check_match(tokens)
        slots = m.device_indices.tolist()
        if slots:
            uuid = self.cache.inc_lock_ref(m.last_device_node)
            self.locks.append((m.last_device_node, uuid, tokens[: len(slots)], slots))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        node, uuid, _, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.dec_lock_ref(node, uuid)

    @rule(n=st.integers(1, 12))
    def evict_full(self, n):
        self._evict(n * self.page_size, 0, self._live_locks())

    @rule(n=st.integers(1, 12))
    def evict_swa(self, n):
        self._evict(0, n * self.page_size, self._live_locks())

    @rule(data=st.data(), num_decode=st.integers(0, 6), cache_at=st.integers(-1, 6), evict_swa=st.integers(0, 8))
    def serve(self, data, num_decode, cache_at, evict_swa):
        """A request from start to finish: prefill, decode sliding out of its window (its
        progress cached after ``cache_at`` steps), an SWA eviction while it runs, finish."""
        prompt = self._tokens(data)
        need = len(prompt) - len(self._check_match(prompt).device_indices) + self.page_size
        if min(self.alloc.full_available_size(), self.alloc.swa_available_size()) < need:
            return
        req = start(self.cache, self.pool, self.alloc, prompt)
        outputs = data.draw(st.lists(st.integers(0, 2), max_size=num_decode * self.page_size))
        for step in range(len(outputs) + 1):
            if step == cache_at:
                req.fill_ids = prompt + req.output_ids
                self._mirror_insert(req, len(req.fill_ids))
                self.cache.cache_unfinished_req(req)
            if step == len(outputs) or min(self.alloc.full_available_size(), self.alloc.swa_available_size()) == 0:
                break  # (paged: a decode in the last page's free slots needs no free page, but stops here too)
            decode(self.cache, self.pool, self.alloc, req, outputs[step])
        check(self.cache, self.pool, self.alloc, [req] + self._running())
        protected = req.cache_protected_len
        locked = (prompt + req.output_ids)[:protected]
        own_lock = (req.last_node, req.swa_uuid_for_lock, locked, row(self.pool, req, 0, protected).tolist())
        self._evict(0, evict_swa * self.page_size, self._live_locks() + [own_lock])
        check(self.cache, self.pool, self.alloc, [req] + self._running())
        self._mirror_insert(req, req.kv_committed_len)
        self.cache.cache_finished_req(req)

    def _live_locks(self):
        """(node, swa_uuid_for_lock, tokens, slots) of every lock held: the rules' (and running requests')."""
        return self.locks

    def _running(self):
        return []

    def _mirror_insert(self, req, seq_len):
        tokens = (req.origin_input_ids + req.output_ids)[:seq_len]
        value = row(self.pool, req, 0, seq_len).tolist()
        self.oracle.insert(tokens, None, value, req.cache_protected_len, req.swa_evicted_seqlen)

    @invariant()
    def accounting(self):
        self.oracle.check_shape()
        check(self.cache, self.pool, self.alloc, self._running())
        assert sorted(self.cache.all_values().tolist()) == sorted(self.oracle.slots.values())
        mapping = self.alloc.full_to_swa_index_mapping
        assert {s for s in self.oracle.slots.values() if int(mapping[s]) > 0} == self.oracle.swa
        assert self.cache.full_protected_size() == len({s for lock in self._live_locks() for s in lock[3]})
        self.mirror.check_snapshot()

    def teardown(self):
        """Unlocked and evicted, the tree gives every full and SWA slot back."""
        for node, uuid, _, _ in self.locks:
            self.cache.dec_lock_ref(node, uuid)
        self.cache.evict(10**6, 10**6)
        check(self.cache, self.pool, self.alloc)
        assert not self.cache.root_node.children
        alloc = self.alloc
        assert (alloc.full_available_size(), alloc.swa_available_size()) == (alloc.size, alloc.size_swa)


TestSWARadixCacheWindow3 = machine_case(SWAMachine, "w3", 60, 25, window=3)
TestSWARadixCacheWindow1 = machine_case(SWAMachine, "w1", 30, 25, window=1)
TestSWARadixCachePaged = machine_case(SWAMachine, "p4w6", 30, 25, window=6, page_size=4, pool_pages=(24, 12))
