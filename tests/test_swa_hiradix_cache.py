"""SWAHiRadixCache: the host tier of a sliding-window model's cache. Both pools' KV goes
to the host and comes back byte for byte; a tombstone is one on the host too; a load
brings the SWA KV of the last window only; and random operations against a brute-force
oracle of each token's KV, with both tiers' integrity checked after every one."""

import random

import pytest
import torch

from mem_cache.radix_key import RadixKey
from mem_cache.req_to_token_pool import ReqToTokenPool
from mem_cache.swa_allocator import SWATokenToKVPoolAllocator
from mem_cache.radix_key import hash_pages
from mem_cache.swa_hiradix_cache import SWAHiRadixCache
from mem_cache.swa_hiradix_storage import swa_storage_backends
from mem_cache.swa_memory_pool import SWAKVPool
from tests.cache_helpers import IndexMirror
from tests.hicache_helpers import break_loads

SWA_LAYER, FULL_LAYER = 0, 1


def make(page_size=1, size=32, size_swa=16, window=4, policy="write_through", threshold=1, events=False,
         storage_dir=None):
    kv = SWAKVPool(size, size_swa, page_size, torch.float32, head_num=1, head_dim=1,
                   swa_attention_layer_ids=[SWA_LAYER], full_attention_layer_ids=[FULL_LAYER])
    alloc = SWATokenToKVPoolAllocator(size, size_swa, page_size, kvcache=kv, debug=True)
    storage = swa_storage_backends(storage_dir) if storage_dir else (None, None)
    cache = SWAHiRadixCache(ReqToTokenPool(4, 64), alloc, kv, window, page_size, write_policy=policy,
                            load_back_threshold=threshold, storage_backends=storage, enable_kv_events=events)
    return cache, alloc, kv


def truth(tokens, i):
    """The KV every token ``i`` of ``tokens`` must have: a function of its prefix."""
    return float(hash(tuple(tokens[: i + 1])) % 100003)


def cached(cache, alloc, kv, tokens, swa_evicted=0):
    """Insert ``tokens`` the way a finished request does: its match locked, fresh slots with their
    true KV for the rest, the SWA KV of ``[match, swa_evicted)`` freed first."""
    match = cache.match_prefix(RadixKey(tokens))
    prefix = match.device_indices
    if match.host_hit_length:
        loaded, node = cache.init_load_back(match.last_host_node, match.host_hit_length)
        if loaded.numel():
            prefix, match = torch.cat([prefix, loaded]), match._replace(last_device_node=node)
    uuid = cache.inc_lock_ref(match.last_device_node)
    new = alloc.alloc(len(tokens) - len(prefix))
    if new is None:
        cache.evict(len(tokens), len(tokens))
        new = alloc.alloc(len(tokens) - len(prefix))
    assert new is not None
    values = torch.tensor([truth(tokens, i) for i in range(len(prefix), len(tokens))]).view(-1, 1, 1)
    kv.set_kv_buffer(FULL_LAYER, new, values, values)
    kv.set_kv_buffer(SWA_LAYER, new, values, values)
    slots = torch.cat([prefix, new])
    ps = cache.page_size
    freed_to = max(len(prefix), swa_evicted // ps * ps)
    alloc.free_swa(slots[len(prefix):freed_to])
    cache.insert(RadixKey(tokens), slots, len(prefix), freed_to)
    cache.dec_lock_ref(match.last_device_node, uuid)
    return slots


def check_kv(cache, alloc, kv, tokens, slots):
    """``slots`` hold ``tokens``' true full KV, and the last window of them their true SWA KV."""
    want = [truth(tokens, i) for i in range(len(slots))]
    assert kv.get_key_buffer(FULL_LAYER)[slots].flatten().tolist() == want
    window = max(0, len(slots) - cache.sliding_window_size)
    swa = alloc.full_to_swa_index_mapping[slots[window:]]
    assert bool((swa > 0).all()), "a match ends without its window's SWA KV"
    assert kv.get_key_buffer(SWA_LAYER)[swa].flatten().tolist() == want[window:]


def check(cache, alloc):
    cache.check_integrity()
    cache.check_accounting()
    alloc.check_integrity(cache.all_values())


def load(cache, tokens):
    """Match ``tokens`` and load its host part; returns the device slots of the whole match."""
    match = cache.match_prefix(RadixKey(tokens))
    slots = match.device_indices
    if match.host_hit_length:
        loaded, _ = cache.init_load_back(match.last_host_node, match.host_hit_length)
        slots = torch.cat([slots, loaded])
    return slots


@pytest.mark.parametrize("page_size", [1, 2])
def test_both_pools_come_back_from_the_host_and_a_tombstone_stays_one(page_size):
    """A sequence whose first half slid out of the window is backed up: the tombstone half with
    its full KV only, the rest with both. Evicted from the device and matched again, its full KV
    comes back for all of it, its SWA KV for the last window only (the rest loads as tombstones)."""
    cache, alloc, kv = make(page_size, window=4)
    tokens = list(range(10, 26))
    cached(cache, alloc, kv, tokens, swa_evicted=8)
    tomb, live = cache._nodes_of(RadixKey(tokens))
    assert (tomb.swa_tombstone, tomb.swa_host_value, len(tomb.host_value)) == (True, None, 8)
    assert (live.swa_tombstone, len(live.swa_host_value), len(live.host_value)) == (False, 8, 8)
    check(cache, alloc)
    assert cache.evict(16).full_num_evicted == 16
    assert (tomb.value, live.value) == (None, None) and alloc.full_available_size() == 32
    check(cache, alloc)
    match = cache.match_prefix(RadixKey(tokens))
    assert (len(match.device_indices), match.host_hit_length, match.last_host_node) == (0, 16, live)
    slots = load(cache, tokens)
    check_kv(cache, alloc, kv, tokens, slots)
    # the window's node alone took SWA slots: 8 tokens, not 16
    assert (alloc.swa_available_size(), tomb.swa_tombstone, live.swa_tombstone) == (8, True, False)
    check(cache, alloc)


def test_the_file_tier_gives_a_cold_cache_the_full_kv_and_the_last_windows_swa_kv(tmp_path):
    """Backups write each page's full KV to files, and its SWA KV where the host copy has it (not
    the tombstones'). A cold cache fetches a prefix whose last window storage has SWA KV for: full
    KV of every page and SWA KV of the window's pages only (a tombstone node, then one with both),
    and loads it byte for byte; an SWA page of that window lost, the prefix ends a page earlier."""
    tokens = list(range(10, 26))  # 8 pages of 2; window 4 = 2 pages
    writer, writer_alloc, writer_kv = make(page_size=2, window=4, storage_dir=tmp_path)
    cached(writer, writer_alloc, writer_kv, tokens, swa_evicted=8)  # [0, 8) tombstones, [8, 16) with SWA KV
    keys = hash_pages(tokens, 2)
    assert {p.stem for p in tmp_path.glob("*.bin")} == set(keys)
    assert {p.stem for p in (tmp_path / "swa").glob("*.bin")} == set(keys[4:])
    check(writer, writer_alloc)

    cold, alloc, kv = make(page_size=2, window=4, storage_dir=tmp_path)
    assert cold.match_prefix(RadixKey(tokens)).host_hit_length == 0
    assert cold.prefetch_from_storage(RadixKey(tokens + [1])) == 16
    head, tail = cold._nodes_of(RadixKey(tokens))
    assert (len(head.key), head.swa_tombstone, len(tail.key), len(tail.swa_host_value)) == (12, True, 4, 4)
    check(cold, alloc)
    slots = load(cold, tokens)
    check_kv(cold, alloc, kv, tokens, slots)
    assert alloc.swa_available_size() == 16 - 4 and cold.swa_cache_controller.read_pages == 2
    check(cold, alloc)

    (tmp_path / "swa" / f"{keys[7]}.bin").unlink()
    cold, alloc, kv = make(page_size=2, window=4, storage_dir=tmp_path)
    assert cold.prefetch_from_storage(RadixKey(tokens)) == 14  # its window: pages 5 and 6
    slots = load(cold, tokens)
    assert len(slots) == 14
    check_kv(cold, alloc, kv, tokens, slots)
    check(cold, alloc)


def test_a_fetch_shorter_than_the_window_completes_the_one_the_tree_holds(tmp_path):
    """The tree holds a prefix whose end lacks a whole window ([0, 8) tombstones, then 2 tokens with
    SWA KV: no usable match). A one-page fetch from files under it, its SWA KV included, completes
    that window: the whole prefix is a hit, its last window's SWA KV half on the device, half loaded."""
    tokens = list(range(10, 26))
    writer, writer_alloc, writer_kv = make(page_size=2, window=4, storage_dir=tmp_path)
    cached(writer, writer_alloc, writer_kv, tokens)  # every page's SWA KV in files
    cache, alloc, kv = make(page_size=2, window=4, storage_dir=tmp_path)
    cached(cache, alloc, kv, tokens[:10], swa_evicted=8)
    assert len(cache.match_prefix(RadixKey(tokens[:12])).device_indices) == 0
    assert cache.prefetch_from_storage(RadixKey(tokens[:12])) == 2
    slots = load(cache, tokens[:12])
    assert len(slots) == 12
    check_kv(cache, alloc, kv, tokens, slots)
    check(cache, alloc)


def test_only_the_last_windows_swa_kv_is_loaded():
    """A host prefix whose SWA KV (all backed up) is twice the SWA pool comes back: the SWA
    KV of the window's node only, the nodes before it loaded as tombstones (their host copy
    of it kept)."""
    cache, alloc, kv = make(size=32, size_swa=8, window=4)
    tokens = list(range(40, 56))
    for n in (4, 8, 12, 16):  # one node of 4 tokens at a time, each backed up with its SWA KV
        cached(cache, alloc, kv, tokens[:n])
        cache.evict(32, 8)
        check(cache, alloc)
    nodes = cache._nodes_of(RadixKey(tokens))
    assert [len(n.swa_host_value) for n in nodes] == [4, 4, 4, 4] and all(n.value is None for n in nodes)
    slots = load(cache, tokens)
    assert len(slots) == 16
    check_kv(cache, alloc, kv, tokens, slots)
    assert [n.swa_tombstone for n in nodes] == [True, True, True, False] and alloc.swa_available_size() == 4
    assert all(n.swa_host_value is not None for n in nodes)
    check(cache, alloc)


def test_a_declined_load_leaves_a_device_prefix_with_its_window():
    """Device tombstones before the host part: when the load does not happen (under the
    threshold), the request keeps a device prefix that ends with its window's SWA KV, not the
    tombstones' end."""
    cache, alloc, kv = make(window=4, threshold=100)
    base = list(range(10, 18))
    cached(cache, alloc, kv, base)
    cached(cache, alloc, kv, base + list(range(30, 38)), swa_evicted=12)  # [8, 12) tombstones, [12, 16) SWA
    leaf = cache._nodes_of(RadixKey(base + list(range(30, 38))))[-1]
    cache._evict_device_node(leaf)  # (backed up at its insert: it goes to the host)
    match = cache.match_prefix(RadixKey(base + list(range(30, 38))))
    assert (len(match.device_indices), match.host_hit_length) == (8, 8)
    slots, node = cache.init_load_back(match.last_host_node, match.host_hit_length)
    assert slots.numel() == 0 and node is match.last_device_node
    check_kv(cache, alloc, kv, base, match.device_indices)
    check(cache, alloc)


def test_swa_backups_of_device_tombstones_give_way_to_new_backups():
    """A chain cached a node at a time, each backed up with its SWA KV, which the small SWA pool
    then evicts on the device (tombstones there): the full pool (32) holds more tombstones than
    the SWA host pool (16) has slots. Their SWA host copies give way, oldest first, so every node
    is backed up and the whole chain comes back from the host (before: the SWA host pool full of
    tombstones' copies, the last nodes had no host copy and the host hit ended at 16)."""
    cache, alloc, kv = make(size=32, size_swa=8, window=4)
    tokens = list(range(10, 34))
    for n in range(4, 25, 4):
        cached(cache, alloc, kv, tokens[:n])
        check(cache, alloc)
    nodes = cache._nodes_of(RadixKey(tokens))
    assert [n.swa_tombstone for n in nodes] == [True] * 4 + [False] * 2
    assert all(n.host_value is not None for n in nodes)
    assert [n.swa_host_value is not None for n in nodes] == [False, False, True, True, True, True]
    cache.evict(32, 8)
    check(cache, alloc)
    match = cache.match_prefix(RadixKey(tokens))
    assert (len(match.device_indices), match.host_hit_length) == (0, 24)
    check_kv(cache, alloc, kv, tokens, load(cache, tokens))
    check(cache, alloc)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_node_the_device_tombstoned_ends_a_host_match_with_either_policy(policy):
    """The SWA pool's eviction tombstones a stem on the device; the device then evicts all. A new
    turn after the stem matches it on the host: write_through backed its SWA KV up at its insert,
    write_back before the SWA eviction freed it (before: write_back tombstoned it unsaved, a
    tombstone on the host as well, and the new turn matched nothing)."""
    cache, alloc, kv = make(window=4, policy=policy)
    stem = list(range(10, 18))
    cached(cache, alloc, kv, stem)
    cached(cache, alloc, kv, stem + [40, 41, 42, 43])
    node = cache._nodes_of(RadixKey(stem))[0]
    assert cache.evict(0, 8).swa_num_evicted == 8 and node.swa_tombstone and node.value is not None
    cache.evict(32)
    check(cache, alloc)
    match = cache.match_prefix(RadixKey(stem + [60, 61, 62, 63]))
    assert (len(match.device_indices), match.host_hit_length, match.last_host_node) == (0, 8, node)
    check_kv(cache, alloc, kv, stem, load(cache, stem))
    check(cache, alloc)


def test_a_split_keeps_the_hits_write_through_selective_counts():
    """write_through_selective backs a node up at its second hit. A sequence cached twice, a match
    splitting its node in between: both parts are backed up, the upper one keeping the hit the node
    had (before: the split gave it none, and it stayed on the device alone)."""
    cache, alloc, kv = make(window=4, policy="write_through_selective")
    tokens = list(range(10, 22))
    cached(cache, alloc, kv, tokens)
    assert [n.host_value for n in cache._nodes_of(RadixKey(tokens))] == [None]
    cache.match_prefix(RadixKey(tokens[:8] + [90, 91, 92, 93]))  # splits the node at 8
    cached(cache, alloc, kv, tokens)
    nodes = cache._nodes_of(RadixKey(tokens))
    assert [(len(n.key), n.hit_count, len(n.host_value), len(n.swa_host_value)) for n in nodes] == [(8, 2, 8, 8),
                                                                                                  (4, 2, 4, 4)]
    check(cache, alloc)


@pytest.mark.parametrize("page_size, policy, seed", [(1, "write_through", 0), (2, "write_back", 1),
                                                     (1, "write_through_selective", 2)])
def test_random_operations_against_each_tokens_true_kv(page_size, policy, seed):
    """Inserts (tails slid out of the window at random), matches loaded back, device evictions of
    either pool and host evictions, at random: every match's slots hold its tokens' true KV (the
    window's SWA KV too), both tiers are sound after every operation, and the router's index fed
    by the KV events matches what the cache does (a host prefix counts, as it is loaded back)."""
    rng = random.Random(seed)
    cache, alloc, kv = make(page_size, size=48, size_swa=24, window=4, events=True)
    mirror = IndexMirror(cache, page_size)
    stems = [[rng.randrange(100) for _ in range(rng.choice([4, 8, 12]))] for _ in range(4)]
    loaded_any = False
    for _ in range(150):
        tokens = rng.choice(stems) + [rng.randrange(100) for _ in range(rng.choice([0, 2, 6, 10]))]
        tokens = tokens[: len(tokens) // page_size * page_size]
        op = rng.random()
        if op < 0.4 and len(tokens) >= 4:
            cached(cache, alloc, kv, tokens, swa_evicted=rng.randrange(len(tokens) - 3))
        elif op < 0.7:
            match = cache.match_prefix(RadixKey(tokens))
            loaded_any |= match.host_hit_length > 0
            mirror.check(tokens, None, len(match.device_indices) + match.host_hit_length)
            slots = load(cache, tokens)
            if len(slots):
                check_kv(cache, alloc, kv, tokens, slots)
        elif op < 0.9:
            cache.evict(rng.randrange(0, 24, page_size), rng.randrange(0, 12, page_size))
        else:
            cache.evict_host(rng.randrange(0, 24, page_size), rng.randrange(0, 12, page_size))
        check(cache, alloc)
        mirror.check_snapshot()
    assert loaded_any


def test_a_failed_load_raises_and_leaves_the_prefix_on_the_host():
    """An SWA copy failing after the full one landed: the load raises, the device slots it
    took (both halves) are free again, and the nodes are still on the host for the next hit."""
    cache, alloc, kv = make(window=4)
    tokens = list(range(10, 22))
    cached(cache, alloc, kv, tokens, swa_evicted=4)
    cache.evict(32, 16)
    free = (alloc.full_available_size(), alloc.swa_available_size())
    restore = break_loads(cache.swa_cache_controller)
    match = cache.match_prefix(RadixKey(tokens))
    with pytest.raises(OSError, match="unreadable"):
        cache.init_load_back(match.last_host_node, match.host_hit_length)
    assert (alloc.full_available_size(), alloc.swa_available_size()) == free
    assert all(n.value is None for n in cache._nodes_of(RadixKey(tokens)))
    check(cache, alloc)
    restore()
    check_kv(cache, alloc, kv, tokens, load(cache, tokens))
    check(cache, alloc)
