"""MambaRadixCache: checkpoints, tombstones, copy-on-write and request flows.

A "forward" is simulated: the test writes, into a request's Mamba slot, a
state that encodes how many tokens it covers (``state_of(n)``), so what the
tree caches and what a request gets back can be checked exactly.
"""

import pytest
import torch

from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.mamba_pool import HybridReqToTokenPool, MambaPool
from mem_cache.mamba_radix_cache import MambaRadixCache
from mem_cache.mamba_tracking import (
    decode_should_track,
    mamba_branching_seqlen,
    max_prefix_match_len,
    prefill_track_seqlen,
)
from mem_cache.radix_key import RadixKey
from tests.cache_helpers import FakeReq

TOKENS = [(7 * i + 3) % 50 for i in range(400)]


def make(strategy="no_buffer", kv_size=1024, mamba_size=16, rows=6):
    mamba = MambaPool(mamba_size, [(3, 4)], (2, 2, 2), 2, torch.float32, torch.float32)
    pool = HybridReqToTokenPool(rows, 512, "cpu", mamba, [1, 3], enable_mamba_extra_buffer=strategy == "extra_buffer")
    alloc = TokenToKVPoolAllocator(kv_size)
    return MambaRadixCache(pool, alloc, mamba_scheduler_strategy=strategy), pool, alloc, mamba


def state_of(n: int) -> float:
    return float(n) + 0.5


def write_state(mamba, slot, n):
    for s in mamba.states():
        s[:, slot] = state_of(n)


def read_state(mamba, slot) -> float:
    return float(mamba.temporal[0, int(slot)].flatten()[0])


def insert_checkpoint(cache, alloc, mamba, tokens, kv_before):
    """Insert ``tokens`` with a fresh state slot; reuse ``kv_before`` slots for the cached part."""
    new_kv = alloc.alloc(len(tokens) - len(kv_before))
    slot = mamba.alloc(1)
    write_state(mamba, slot, len(tokens))
    value = torch.cat([kv_before, new_kv])
    cache.insert(RadixKey(tokens), value, slot)
    return value


def build_192_256_320(cache, alloc, mamba):
    kv = insert_checkpoint(cache, alloc, mamba, TOKENS[:192], torch.empty(0, dtype=torch.int64))
    kv = insert_checkpoint(cache, alloc, mamba, TOKENS[:256], kv)
    return insert_checkpoint(cache, alloc, mamba, TOKENS[:320], kv)


def conservation(cache, alloc, pool, private_kv=0):
    total = alloc.num_pages * alloc.page_size
    got = alloc.available_size() + cache.full_evictable_size() + cache.full_protected_size() + private_kv
    assert got == total
    cache.check_integrity()
    alloc.check_integrity()
    pool.check_integrity(tree_mamba_slots=cache.all_mamba_values())


def test_seed_scenarios_230_and_280():
    cache, pool, alloc, mamba = make("extra_buffer")
    build_192_256_320(cache, alloc, mamba)
    m = cache.match_prefix(RadixKey(TOKENS[:230]))
    assert len(m.device_indices) == 192 and m.mamba_branching_seqlen == 192  # 230 // 64 * 64
    m = cache.match_prefix(RadixKey(TOKENS[:280]))
    assert len(m.device_indices) == 256
    assert read_state(mamba, m.last_device_node.mamba_value) == state_of(256)
    # make the node ending at 256 the least recently used state, then drop it
    cache.match_prefix(RadixKey(TOKENS[:192]))
    cache.match_prefix(RadixKey(TOKENS[:320]))
    node_256 = cache.match_prefix(RadixKey(TOKENS[:256])).last_device_node
    cache.match_prefix(RadixKey(TOKENS[:320]))
    cache.match_prefix(RadixKey(TOKENS[:192]))
    assert cache.evict_mamba(1) == 1
    assert node_256.mamba_value is None and node_256.children  # an internal tombstone
    m = cache.match_prefix(RadixKey(TOKENS[:280]))
    assert len(m.device_indices) == 192 and m.mamba_branching_seqlen == 256
    conservation(cache, alloc, pool)


def test_tombstone_leaf_is_deleted_with_its_tombstone_ancestors():
    cache, pool, alloc, mamba = make()
    build_192_256_320(cache, alloc, mamba)
    node_256 = cache.match_prefix(RadixKey(TOKENS[:256])).last_device_node
    node_192 = node_256.parent
    cache._drop_mamba(node_256)
    cache._drop_mamba(node_192)  # [0,192) and [192,256) are tombstones now
    assert cache.full_evictable_size() == 320
    freed = cache.evict(1)  # the LRU leaf [256,320) goes, then both tombstones above it
    assert freed == 320 and cache.full_evictable_size() == 0 and not cache.root_node.children
    assert alloc.available_size() == 1024 and mamba.available_size() == 16
    conservation(cache, alloc, pool)


def test_split_upper_half_is_a_tombstone_and_keeps_locks():
    cache, pool, alloc, mamba = make()
    insert_checkpoint(cache, alloc, mamba, TOKENS[:100], torch.empty(0, dtype=torch.int64))
    leaf = cache.match_prefix(RadixKey(TOKENS[:100])).last_device_node
    cache.inc_lock_ref(leaf)
    m = cache.match_prefix(RadixKey(TOKENS[:40] + [999]))
    assert len(m.device_indices) == 0  # the split point holds no state
    upper = leaf.parent
    assert len(upper.key) == 40 and upper.mamba_value is None and upper.full_lock_ref == 1
    assert (cache.full_protected_size(), cache.mamba_protected_size()) == (100, 1)
    cache.dec_lock_ref(leaf)
    conservation(cache, alloc, pool)


def test_copy_on_write_leaves_tree_state_untouched():
    cache, pool, alloc, mamba = make(mamba_size=4)
    build_192_256_320(cache, alloc, mamba)
    req = FakeReq(TOKENS[:300])
    m = cache.match_prefix(RadixKey(req.origin_input_ids), req=req, cow_mamba=True)
    src = int(m.last_device_node.mamba_value)
    assert len(m.device_indices) == 256 and req.mamba_pool_idx not in (None, src)
    assert read_state(mamba, req.mamba_pool_idx) == state_of(256)
    write_state(mamba, req.mamba_pool_idx, 299)  # the request computes on in its own slot
    assert read_state(mamba, src) == state_of(256)
    mamba.free(torch.tensor([req.mamba_pool_idx]))


def test_copy_on_write_evicts_a_state_when_the_pool_is_full():
    cache, pool, alloc, mamba = make(mamba_size=3)
    build_192_256_320(cache, alloc, mamba)  # all three slots are in the tree
    req = FakeReq(TOKENS[:300])
    m = cache.match_prefix(RadixKey(req.origin_input_ids), req=req, cow_mamba=True)
    assert m.last_device_node.mamba_value is not None  # the source was locked meanwhile
    assert read_state(mamba, req.mamba_pool_idx) == state_of(256)
    assert len(cache.all_mamba_values()) == 2



def test_copy_on_write_with_every_state_held_is_a_logical_oom():
    """Every slot held — one by a running request, the rest by the tree under locks: the copy
    has no slot even after eviction. A logical OOM (it raised): the match comes back flagged,
    nothing copied or taken, no lock left; once a state is unlocked the copy is made."""
    cache, pool, alloc, mamba = make(mamba_size=3)
    build_192_256_320(cache, alloc, mamba)
    cache.evict_mamba(1)  # the LRU state (192's) makes room for a running request's own state
    running = mamba.alloc(1)
    leaf = cache.match_prefix(RadixKey(TOKENS[:321])).last_device_node
    cache.inc_lock_ref(leaf)  # the 320 state locked; the 256 one, the copy's source, is locked while it evicts
    req = FakeReq(TOKENS[:300])
    m = cache.match_prefix(RadixKey(req.origin_input_ids), req=req, cow_mamba=True)
    assert m.mamba_cow_failed and req.mamba_pool_idx is None and len(m.device_indices) == 256
    assert (mamba.available_size(), cache.mamba_protected_size(), cache.mamba_evictable_size()) == (0, 1, 1)
    mamba.free(running)
    m = cache.match_prefix(RadixKey(req.origin_input_ids), req=req, cow_mamba=True)
    assert not m.mamba_cow_failed and read_state(mamba, req.mamba_pool_idx) == state_of(256)
    cache.dec_lock_ref(leaf)
    mamba.free(torch.tensor([req.mamba_pool_idx]))
    conservation(cache, alloc, pool)

def test_match_stops_one_token_short_of_the_prompt():
    cache, pool, alloc, mamba = make()
    insert_checkpoint(cache, alloc, mamba, TOKENS[:64], torch.empty(0, dtype=torch.int64))
    req = FakeReq(TOKENS[:64])
    assert len(cache.match_prefix(RadixKey(TOKENS[:64]), req=req).device_indices) == 0
    assert len(cache.match_prefix(RadixKey(TOKENS[:65]), req=FakeReq(TOKENS[:65])).device_indices) == 64
    assert max_prefix_match_len(64) == 63 and max_prefix_match_len(0) == 0


# ---- KV-only matches and locks (a decode-side reservation: the state comes from prefill) ----------
def test_kv_only_match_reaches_past_the_deepest_state_and_locks_no_state():
    cache, pool, alloc, mamba = make()
    kv = insert_checkpoint(cache, alloc, mamba, TOKENS[:100], torch.empty(0, dtype=torch.int64))
    key = RadixKey(TOKENS[:60] + [999])
    assert len(cache.match_prefix(key).device_indices) == 0  # no state at 60
    m = cache.match_kv_prefix(key)
    node = m.last_device_node
    assert m.device_indices.tolist() == kv[:60].tolist() and node.is_tombstone and len(node.key) == 60
    assert len(cache.match_kv_prefix(RadixKey(TOKENS[:100]), req=FakeReq(TOKENS[:100])).device_indices) == 99
    cache.inc_lock_ref(node, kv_only=True)
    assert (cache.full_protected_size(), cache.mamba_protected_size()) == (60, 0)
    cache.check_integrity()
    cache.dec_lock_ref(node, kv_only=True)
    conservation(cache, alloc, pool)


def test_a_kv_only_lock_on_a_revived_tombstone_leaves_its_state_lock_alone():
    """The tombstone a KV-only lock holds gets a state (an insert ending there) and another
    request's state lock: dropping the KV-only lock must not drop that state lock."""
    cache, pool, alloc, mamba = make()
    kv = insert_checkpoint(cache, alloc, mamba, TOKENS[:100], torch.empty(0, dtype=torch.int64))
    node = cache.match_kv_prefix(RadixKey(TOKENS[:60] + [999])).last_device_node
    cache.inc_lock_ref(node, kv_only=True)
    insert_checkpoint(cache, alloc, mamba, TOKENS[:60], kv[:60])  # revives the tombstone
    assert cache.match_prefix(RadixKey(TOKENS[:61])).last_device_node is node and not node.is_tombstone
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node, kv_only=True)
    assert (node.full_lock_ref, node.mamba_lock_ref, cache.mamba_protected_size()) == (1, 1, 1)
    assert cache.evict_mamba(2) == 1 and not node.is_tombstone  # only the state at 100 could go
    cache.dec_lock_ref(node)
    conservation(cache, alloc, pool)


def test_evict_mamba_frees_the_state_of_a_kv_only_locked_leaf():
    """A KV-only lock holds KV, not the state at its node: a leaf's state it holds counts as
    evictable and ``evict_mamba`` frees it, leaving a locked tombstone leaf that goes with the
    lock (the state was pinned until the reservation finished, and the pool could run dry)."""
    cache, pool, alloc, mamba = make(mamba_size=4)
    insert_checkpoint(cache, alloc, mamba, TOKENS[:100], torch.empty(0, dtype=torch.int64))
    node = cache.match_kv_prefix(RadixKey(TOKENS[:100] + [999])).last_device_node
    assert not node.is_tombstone and not node.children
    cache.inc_lock_ref(node, kv_only=True)
    assert (cache.mamba_evictable_size(), cache.mamba_protected_size()) == (1, 0)
    assert cache.evict_mamba(1) == 1 and node.is_tombstone and mamba.available_size() == 4
    assert cache.mamba_evictable_size() == 0 and cache.full_protected_size() == 100
    cache.check_integrity()
    assert len(cache.match_prefix(RadixKey(TOKENS[:101])).device_indices) == 0
    cache.dec_lock_ref(node, kv_only=True)
    assert not cache.root_node.children and alloc.available_size() == 1024
    conservation(cache, alloc, pool)


def test_a_locked_tombstone_left_a_leaf_goes_with_its_lock():
    """Evicting everything takes the leaf below a KV-only locked tombstone, not the
    tombstone (a locked tombstone leaf is allowed); unlocking deletes it."""
    cache, pool, alloc, mamba = make()
    insert_checkpoint(cache, alloc, mamba, TOKENS[:100], torch.empty(0, dtype=torch.int64))
    node = cache.match_kv_prefix(RadixKey(TOKENS[:60] + [999])).last_device_node
    cache.inc_lock_ref(node, kv_only=True)
    assert cache.evict(1000) == 40
    assert node.is_tombstone and not node.children and cache.full_protected_size() == 60
    cache.check_integrity()
    assert alloc.available_size() == 1024 - 60 and mamba.available_size() == 16
    assert cache.dec_lock_ref(node, kv_only=True) == 0  # made evictable, then deleted
    assert not cache.root_node.children and alloc.available_size() == 1024
    conservation(cache, alloc, pool)


@pytest.mark.parametrize("is_insert", [True, False])
def test_decode_reservation_flow_with_a_kv_only_prefix(is_insert):
    """Match KV only, lock KV only, take a row and slots past the prefix, receive the
    prompt's final state into the request's own slot, decode, finish: the request inserts
    its state at its end (or, not inserting, frees its own slots); no lock is left."""
    cache, pool, alloc, mamba = make()
    kv = insert_checkpoint(cache, alloc, mamba, TOKENS[:100], torch.empty(0, dtype=torch.int64))
    req = FakeReq(TOKENS[:60] + TOKENS[200:230], fill_ids=TOKENS[:60] + TOKENS[200:230], kv_only_lock=True)
    m = cache.match_kv_prefix(RadixKey(req.fill_ids), req=req)
    req.prefix_indices, req.last_node, req.cache_protected_len = m.device_indices, m.last_device_node, 60
    cache.inc_lock_ref(req.last_node, kv_only=True)
    req.req_pool_idx = pool.alloc(1, [None])[0]
    req.mamba_pool_idx = int(pool.get_mamba_indices(req.req_pool_idx)[0])
    own = alloc.alloc(31)  # the prompt's 30 new tokens and one decoded
    pool.req_to_token[req.req_pool_idx, :91] = torch.cat([kv[:60], own]).to(torch.int32)
    write_state(mamba, req.mamba_pool_idx, 91)  # pushed at 90 tokens, one decode step on
    req.output_ids, req.kv_committed_len = [1, 2], 91
    cache.cache_finished_req(req, is_insert=is_insert)
    assert cache.full_protected_size() == 0 and cache.mamba_protected_size() == 0
    m = cache.match_prefix(RadixKey(req.origin_input_ids + req.output_ids))
    assert len(m.device_indices) == (91 if is_insert else 0)
    if is_insert:
        assert read_state(mamba, m.last_device_node.mamba_value) == state_of(91)
    conservation(cache, alloc, pool)


def start(cache, pool, alloc, mamba, req):
    """Match (with copy-on-write), take a row and KV for the rest, like prefill."""
    m = cache.match_prefix(RadixKey(req.origin_input_ids), req=req, cow_mamba=True)
    req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
    req.cache_protected_len = len(m.device_indices)
    req.mamba_branching_seqlen = m.mamba_branching_seqlen
    cache.inc_lock_ref(req.last_node)
    req.req_pool_idx = pool.alloc(1, [req.mamba_pool_idx])[0]
    req.mamba_pool_idx = int(pool.get_mamba_indices(req.req_pool_idx)[0])
    prefix = len(req.prefix_indices)
    new = alloc.alloc(len(req.origin_input_ids) - prefix)
    pool.req_to_token[req.req_pool_idx, : len(req.origin_input_ids)] = torch.cat([req.prefix_indices, new]).to(torch.int32)
    req.fill_ids = list(req.origin_input_ids)
    return prefix


def forward(mamba, pool, req, prefix, extend, extra_buffer):
    """Write the states a forward over [prefix, prefix+extend) leaves behind."""
    write_state(mamba, req.mamba_pool_idx, prefix + extend)
    if extra_buffer:
        pos = prefill_track_seqlen(prefix, extend, req.mamba_branching_seqlen)
        if pos is not None:
            slot = pool.get_mamba_ping_pong_track_buffer(req.req_pool_idx)[0, req.mamba_next_track_idx]
            write_state(mamba, slot, pos)
            req.mamba_next_track_idx = 1 - req.mamba_next_track_idx
            req.mamba_last_track_seqlen = pos


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer"])
def test_finished_request_flow_and_reuse(strategy):
    extra = strategy == "extra_buffer"
    cache, pool, alloc, mamba = make(strategy)
    a = FakeReq(TOKENS[:150])
    prefix = start(cache, pool, alloc, mamba, a)
    forward(mamba, pool, a, prefix, 150, extra)
    a.output_ids, a.kv_committed_len = [1], 150
    cache.cache_finished_req(a)
    cached = 128 if extra else 150  # extra_buffer keeps the checkpoint at the last chunk boundary
    assert cache.full_evictable_size() == cached and len(cache.all_mamba_values()) == 1
    conservation(cache, alloc, pool)
    b = FakeReq(TOKENS[:200])
    prefix = start(cache, pool, alloc, mamba, b)
    assert prefix == cached and read_state(mamba, b.mamba_pool_idx) == state_of(cached)
    forward(mamba, pool, b, prefix, 200 - prefix, extra)
    b.output_ids, b.kv_committed_len = [1, 2], 201
    pool.req_to_token[b.req_pool_idx, 200] = int(alloc.alloc(1)[0])  # one decoded token
    cache.cache_finished_req(b)
    conservation(cache, alloc, pool)
    assert cache.full_protected_size() == 0 and cache.mamba_protected_size() == 0


def test_a_checkpoint_that_ends_inside_a_page_is_not_cached():
    """extra_buffer, page 4: a checkpoint after 130 tokens cached at the page boundary 128 would
    give later requests a state that is not 128's. Nothing is cached; every slot goes back."""
    mamba = MambaPool(16, [(3, 4)], (2, 2, 2), 2, torch.float32, torch.float32)
    pool = HybridReqToTokenPool(6, 512, "cpu", mamba, [1, 3], enable_mamba_extra_buffer=True)
    alloc = PagedTokenToKVPoolAllocator(1024, 4)
    cache = MambaRadixCache(pool, alloc, page_size=4, mamba_scheduler_strategy="extra_buffer")
    req = FakeReq(TOKENS[:152])
    start(cache, pool, alloc, mamba, req)
    forward(mamba, pool, req, 0, 152, True)
    assert req.mamba_last_track_seqlen == 128
    req.mamba_last_track_seqlen = 130  # as a decode checkpoint at an interval that is not a page multiple
    req.output_ids, req.kv_committed_len = [1], 152
    cache.cache_finished_req(req)
    assert cache.full_evictable_size() == 0 and len(cache.all_mamba_values()) == 0
    conservation(cache, alloc, pool)


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer"])
def test_chunked_prefill_caches_a_copy_and_moves_the_lock(strategy):
    extra = strategy == "extra_buffer"
    cache, pool, alloc, mamba = make(strategy)
    req = FakeReq(TOKENS[:200])
    start(cache, pool, alloc, mamba, req)
    req.fill_ids = TOKENS[:130]  # first chunk
    forward(mamba, pool, req, 0, 130, extra)
    cache.cache_unfinished_req(req)
    cached = 128 if extra else 130
    assert req.cache_protected_len == cached and req.last_node.full_lock_ref == 1
    tree_state = cache.all_mamba_values()
    assert len(tree_state) == 1 and int(tree_state[0]) != req.mamba_pool_idx
    assert read_state(mamba, tree_state[0]) == state_of(cached)
    conservation(cache, alloc, pool, private_kv=200 - cached)
    req.fill_ids = TOKENS[:200]
    forward(mamba, pool, req, 130, 70, extra)
    req.output_ids, req.kv_committed_len = [5], 200
    cache.cache_finished_req(req)
    assert cache.full_protected_size() == 0
    conservation(cache, alloc, pool)


@pytest.mark.parametrize(
    "prefix, extend, branching, expected",
    [
        (0, 63, None, None),  # fewer than a chunk computed: nothing tracked
        (0, 64, None, 64),
        (0, 200, None, 192),
        (64, 150, None, 192),
        (10, 130, None, 138),  # prefix + floor(extend / 64) * 64
        (0, 300, 128, 128),  # branching point inside the extend, chunk-aligned from prefix
        (10, 300, 128, 266),  # (128 - 10) is not a multiple of 64
        (0, 100, 128, 64),  # branching beyond the extend
        (128, 100, 128, 192),  # branching not strictly after the prefix
    ],
)
def test_prefill_track_seqlen_table(prefix, extend, branching, expected):
    assert prefill_track_seqlen(prefix, extend, branching) == expected


def test_branching_and_decode_tracking():
    assert mamba_branching_seqlen(280, 192) == 256
    assert mamba_branching_seqlen(256, 256) is None
    assert mamba_branching_seqlen(60, 0) is None
    assert [n for n in range(1, 1025) if decode_should_track(n, 256)] == [256, 512, 768, 1024]


def test_unknown_strategy_and_paged_no_buffer_rejected():
    with pytest.raises(ValueError, match="no_buffer, extra_buffer"):
        make("lazy")
    mamba = MambaPool(4, [(3, 4)], (2, 2, 2), 2, torch.float32, torch.float32)
    pool = HybridReqToTokenPool(2, 64, "cpu", mamba, [1, 3])
    with pytest.raises(ValueError, match="page_size 1"):
        MambaRadixCache(pool, TokenToKVPoolAllocator(64), page_size=4)


def test_check_integrity_catches_kv_slots_and_states_freed_behind_the_trees_back():
    """A KV slot the tree holds listed free by the allocator, or a state it holds listed
    free by the Mamba pool, is corruption (a later alloc hands it out twice)."""
    from mem_cache.integrity import IntegrityError

    cache, _, alloc, mamba = make()
    kv = insert_checkpoint(cache, alloc, mamba, TOKENS[:8], torch.empty(0, dtype=torch.int64))
    cache.check_integrity()
    alloc.free(kv[3:4])
    with pytest.raises(IntegrityError, match="free"):
        cache.check_integrity()
    cache, _, alloc, mamba = make()
    insert_checkpoint(cache, alloc, mamba, TOKENS[:8], torch.empty(0, dtype=torch.int64))
    mamba.free(cache.all_mamba_values())
    with pytest.raises(IntegrityError, match="free"):
        cache.check_integrity()
    cache, _, alloc, mamba = make()
    cache.root_node.full_lock_ref = 0  # the root would be evictable
    with pytest.raises(IntegrityError, match="root"):
        cache.check_integrity()


def test_reinserting_an_existing_checkpoint_makes_it_the_most_recent_state():
    """An insert that reaches a node already holding a state uses that state: it must
    be refreshed in the Mamba LRU list too, or the state evicted next is the one just used."""
    cache, _, alloc, mamba = make()
    kv_a = insert_checkpoint(cache, alloc, mamba, TOKENS[:8], torch.empty(0, dtype=torch.int64))
    insert_checkpoint(cache, alloc, mamba, list(range(60, 68)), torch.empty(0, dtype=torch.int64))
    slot = mamba.alloc(1)
    assert cache.insert(RadixKey(TOKENS[:8]), kv_a.clone(), slot) == (8, True)
    mamba.free(slot)  # the caller keeps its state when one existed
    assert cache.evict_mamba(1) == 1
    assert cache.match_prefix(RadixKey(TOKENS[:8])).device_indices.tolist() == kv_a.tolist()
    assert len(cache.match_prefix(RadixKey(list(range(60, 68)))).device_indices) == 0
    cache.check_integrity()
