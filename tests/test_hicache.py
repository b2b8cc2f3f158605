"""Hierarchical cache: host pool, write policies, device/host eviction, load
back and the per-layer load counter — exact slots, real pools, bytes compared."""

import threading
import time

import pytest
import torch

from mem_cache.hicache_controller import LayerDoneCounter
from mem_cache.integrity import IntegrityError
from mem_cache.kv_events import BlockRemoved
from mem_cache.memory_pool import MHATokenToKVPool
from mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost
from tests.cache_helpers import FakeReq, extend, start_req
from tests.hicache_helpers import (
    LAYERS, K, cached, check, device_pool, make, node_of, read_kv, same, scramble, write_random,
)


# ---- host pool ----------------------------------------------------------------
def test_host_pool_sizes_and_layouts():
    kv = device_pool(32, 4)  # one token: 3 layers × (K + V) × 2 heads × 3 dims × 4 bytes = 144 B
    host = MHATokenToKVPoolHost(kv, page_size=4)
    assert (host.size, host.size_per_token, host.page_nbytes) == (64, 144, 576)
    assert tuple(host.kv_buffer.shape) == (2, 3, 64, 2, 3)
    assert host.kv_buffer.is_pinned() == torch.cuda.is_available()  # pinned wherever CUDA could copy from it
    assert tuple(MHATokenToKVPoolHost(kv, layout="page_first").kv_buffer.shape) == (2, 64, 3, 2, 3)
    assert MHATokenToKVPoolHost(kv, host_size_gb=10_000 / 1e9).size == 72  # 69 tokens, rounded up to pages
    mla = device_pool(32, 4, mla=True)  # 3 layers × 6 dims × 2 bytes
    assert tuple(MLATokenToKVPoolHost(mla).kv_buffer.shape) == (3, 64, 1, 6)
    assert tuple(MLATokenToKVPoolHost(mla, layout="page_first").kv_buffer.shape) == (64, 3, 1, 6)
    assert MLATokenToKVPoolHost(mla).size_per_token == 36
    with pytest.raises(ValueError, match="must be larger than the device pool"):
        MHATokenToKVPoolHost(kv, host_to_device_ratio=1.0)
    with pytest.raises(ValueError, match="known: layer_first, page_first"):
        MHATokenToKVPoolHost(kv, layout="page_head")
    with pytest.raises(ValueError, match="v_head_dim == head_dim"):
        MHATokenToKVPoolHost(MHATokenToKVPool(32, 4, torch.float32, 2, 3, LAYERS, v_head_dim=5))


def test_host_pool_alloc_free_and_integrity():
    host = MHATokenToKVPoolHost(device_pool(32, 4))
    first = host.alloc(8)
    assert first.tolist() == list(range(8)) and host.available_size() == 56
    assert host.alloc(60) is None and host.available_size() == 56
    with pytest.raises(ValueError, match="multiple of page_size=4"):
        host.alloc(3)
    second = host.alloc(4)
    host.free(first)
    assert host.alloc(52).tolist() == list(range(12, 64)) and host.available_size() == 8
    host.check_integrity(in_use=torch.cat([second, torch.arange(12, 64)]))
    with pytest.raises(IntegrityError, match="leak"):
        host.check_integrity(in_use=second)
    host.free(second)
    host.free(second)
    with pytest.raises(IntegrityError, match="duplicate"):
        host.check_integrity()


@pytest.mark.parametrize("mla", [False, True])
def test_host_copies_and_page_bytes_are_bit_exact_across_layouts(mla):
    kv = device_pool(32, 4, mla)
    a = (MLATokenToKVPoolHost if mla else MHATokenToKVPoolHost)(kv, layout="layer_first")
    b = (MLATokenToKVPoolHost if mla else MHATokenToKVPoolHost)(kv, layout="page_first")
    src, dst = torch.arange(4, 12), torch.arange(20, 28)
    write_random(kv, src, seed=3)
    want = read_kv(kv, src)
    ha, hb = a.alloc(8), b.alloc(8).roll(4)  # b holds the pages in the other order: [4, 8) then [0, 4)
    a.backup_from_device_all_layer(kv, ha, src)
    for page in range(2):
        # [4 * page, 4 * page + 4): one page's slots in each pool
        data = a.get_page_bytes(ha[4 * page : 4 * page + 4])
        assert len(data) == a.page_nbytes
        b.set_page_bytes(hb[4 * page : 4 * page + 4], data)
    with pytest.raises(ValueError, match="expected"):
        b.set_page_bytes(hb[:4], data[:-1])
    for layer in range(LAYERS):
        b.load_to_device_per_layer(kv, hb, dst, layer)
    assert same(read_kv(kv, dst), want)


# ---- round trip through the cache ----------------------------------------------
@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_evict_to_host_then_load_back_is_byte_identical(page_size, layout, mla):
    cache, alloc, kv = make(page_size, mla=mla, layout=layout)
    tokens = list(range(100, 116))
    slots, want = cached(cache, alloc, tokens)
    node = node_of(cache, tokens)
    assert node.host_value.tolist() == list(range(16))  # write_through: backed up on insert
    assert cache.evict(16) == 16
    assert node.value is None and cache.evictable_size() == 0 and alloc.available_size() == 32
    check(cache, alloc)
    scramble(kv)
    m = cache.match_prefix(K(tokens))
    assert m.device_indices.numel() == 0 and m.last_device_node is cache.root_node
    assert (m.last_host_node, m.host_hit_length) == (node, 16)
    loaded, last = cache.init_load_back(m.last_host_node, m.host_hit_length)
    expected = list(range(17, 33)) if page_size == 1 else list(range(4, 20))  # FIFO slots / LIFO pages
    assert loaded.tolist() == expected and last is node and node.value.tolist() == expected
    assert same(read_kv(kv, loaded), want)
    assert cache.match_prefix(K(tokens)).device_indices.tolist() == expected
    check(cache, alloc)


# ---- write policies ---------------------------------------------------------------
@pytest.mark.parametrize(
    "policy, after_inserts, after_hit, after_evict",
    [
        # host slots of (A, B); None: no host copy; "gone": deleted from the tree
        ("write_through", ([0, 12], [12, 24]), ([0, 12], [12, 24]), ([0, 12], [12, 24])),
        ("write_through_selective", (None, None), ([0, 12], None), ([0, 12], "gone")),
        ("write_back", (None, None), (None, None), ([12, 24], [0, 12])),  # B is older: evicted first
    ],
)
def test_write_policies_decide_when_nodes_reach_the_host(policy, after_inserts, after_hit, after_evict):
    cache, alloc, _ = make(size=40, write_policy=policy)
    a, b = list(range(1, 13)), list(range(50, 62))
    cached(cache, alloc, a)
    cached(cache, alloc, b)
    na, nb = cache.root_node.children[1], cache.root_node.children[50]  # one hit each so far

    def hosts():
        return tuple(
            "gone" if n.parent is None or n.parent.children.get(n.key[0]) is not n
            else None if n.host_value is None
            else [int(n.host_value[0]), int(n.host_value[-1]) + 1]
            for n in (na, nb)
        )

    assert hosts() == after_inserts
    cache.match_prefix(K(a))  # second hit on A: a request reuses it; the backup waits for its insert
    assert hosts() == after_inserts
    dup = alloc.alloc(12)
    assert cache.insert(K(a), dup) == 12  # that request finishes: A is backed up (selective, 3 hits)
    alloc.free(dup)
    assert hosts() == after_hit
    check(cache, alloc)
    assert cache.evict(24) == 24
    assert hosts() == after_evict
    assert all(n.value is None for n in cache._iter_nodes())
    check(cache, alloc)


def test_unknown_write_policy_lists_known_ones():
    with pytest.raises(ValueError, match="known: write_back, write_through, write_through_selective"):
        make(write_policy="write_around")


@pytest.mark.parametrize("policy, backed_after_first", [("write_through", True), ("write_through_selective", False)])
def test_a_chunked_request_is_one_hit(policy, backed_after_first):
    cache, alloc, _ = make(write_policy=policy)
    pool = cache.req_to_token_pool
    prompt = list(range(1, 13))
    req = start_req(cache, pool, alloc, FakeReq(prompt), upto=6)
    cache.cache_unfinished_req(req)
    extend(cache, pool, alloc, req, 6, prompt)
    cache.cache_unfinished_req(req)
    assert all(not n.backuped for n in cache._iter_nodes())  # chunks count no hits
    req.output_ids = [99]
    cache.cache_finished_req(req)
    assert all(n.backuped == backed_after_first for n in cache._iter_nodes())
    again = start_req(cache, pool, alloc, FakeReq(prompt))
    again.output_ids = [98]
    cache.cache_finished_req(again)
    assert all(n.backuped for n in cache._iter_nodes())
    check(cache, alloc)


# ---- host eviction ------------------------------------------------------------------
def test_evict_host_frees_only_device_evicted_unreferenced_nodes_leaves_first():
    cache, alloc, _ = make(enable_kv_events=True)
    a, b = list(range(1, 9)), list(range(1, 13))  # B = A + 4 tokens: nodes A(8) → tail(4)
    cached(cache, alloc, a)
    dup = alloc.alloc(12)
    cache.insert(K(b), dup)
    alloc.free(dup[:8])
    c = list(range(40, 46))
    cached(cache, alloc, c)
    na, tail, nc = node_of(cache, a), node_of(cache, b), node_of(cache, c)
    cache.take_events()
    assert cache.evict(12) == 12  # LRU: tail, then A; C stays on the device
    assert (na.value, tail.value) == (None, None) and nc.value is not None
    tail.host_ref_counter = 1  # a load in flight uses it
    assert cache.evict_host(100) == 0  # A is not a leaf; tail is in use; C is on the device
    tail.host_ref_counter = 0
    assert cache.evict_host(100) == 12
    assert cache.match_prefix(K(b)).host_hit_length == 0 and list(cache.root_node.children.values()) == [nc]
    assert cache.take_events() == [BlockRemoved(5, tail.hash_value), BlockRemoved(6, na.hash_value)]
    assert nc.host_value.tolist() == list(range(12, 18)) and cache.host_pool.available_size() == 64 - 6
    check(cache, alloc)


# ---- match and load back ---------------------------------------------------------
def test_match_reports_host_hit_length_and_last_host_node_paged():
    cache, alloc, _ = make(page_size=4)
    a, b = list(range(1, 17)), list(range(1, 25))
    slots_a, _ = cached(cache, alloc, a)
    tail_slots = alloc.alloc(8)
    cache.insert(K(b), torch.cat([slots_a, tail_slots]))
    na, tail = node_of(cache, a), node_of(cache, b)
    assert cache.evict(8) == 8 and tail.value is None and na.value is not None
    m = cache.match_prefix(K(b + [99] * 4))
    assert m.device_indices.tolist() == slots_a.tolist() and m.last_device_node is na
    assert (m.last_host_node, m.host_hit_length) == (tail, 8)
    m = cache.match_prefix(K(a + [17, 18, 19, 20, 77, 78, 79, 80]))  # splits the host-only tail
    upper = m.last_host_node
    assert m.host_hit_length == 4 and upper.parent is na and upper.children == {(21, 22, 23, 24): tail}
    assert upper.host_value.tolist() == list(range(16, 20))
    assert tail.host_value.tolist() == list(range(20, 24))
    check(cache, alloc)
    assert cache.evict(16) == 16
    m = cache.match_prefix(K(b))
    assert (m.device_indices.numel(), m.last_device_node, m.host_hit_length) == (0, cache.root_node, 24)
    assert m.last_host_node is tail
    check(cache, alloc)


def test_match_without_host_copies_reports_root():
    cache, alloc, _ = make(write_policy="write_through_selective")
    cached(cache, alloc, list(range(1, 13)))
    m = cache.match_prefix(K(range(1, 13)))
    assert (m.last_host_node, m.host_hit_length, m.device_indices.numel()) == (cache.root_node, 0, 12)


def test_load_back_is_all_or_nothing_under_quota_and_threshold():
    cache, alloc, kv = make()
    big, small = list(range(1, 17)), list(range(60, 68))
    _, want = cached(cache, alloc, big)
    cached(cache, alloc, small)
    assert cache.evict(24) == 24
    for tokens, quota in [(big, 15), (small, None)]:  # over the quota / under the threshold of 10
        m = cache.match_prefix(K(tokens))
        loaded, last = cache.init_load_back(m.last_host_node, m.host_hit_length, mem_quota=quota)
        assert loaded.numel() == 0 and last is cache.root_node and m.last_host_node.value is None
        assert alloc.available_size() == 32
    with pytest.raises(ValueError, match="stale match: 15 host tokens reported, the tree has 16"):
        cache.init_load_back(node_of(cache, big), 15)
    m = cache.match_prefix(K(big))
    loaded, _ = cache.init_load_back(m.last_host_node, m.host_hit_length, mem_quota=16)
    assert loaded.numel() == 16 and same(read_kv(kv, loaded), want)
    check(cache, alloc)


def test_load_back_evicts_for_room_and_loads_nothing_when_it_cannot():
    cache, alloc, kv = make()
    a, b = list(range(1, 17)), list(range(40, 64))
    _, want = cached(cache, alloc, a)
    assert cache.evict(16) == 16
    cached(cache, alloc, b)  # 24 of 32 device slots
    nb = node_of(cache, b)
    cache.inc_lock_ref(nb)
    m = cache.match_prefix(K(a))
    assert cache.init_load_back(m.last_host_node, m.host_hit_length)[0].numel() == 0  # B is locked
    assert m.last_host_node.value is None and nb.value is not None and alloc.available_size() == 8
    check(cache, alloc)
    cache.dec_lock_ref(nb)
    loaded, _ = cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert loaded.numel() == 16 and nb.value is None and nb.backuped  # B went to the host for room
    assert same(read_kv(kv, loaded), want)
    check(cache, alloc)


def test_recomputed_request_adopts_host_only_nodes():
    cache, alloc, _ = make()
    prompt = list(range(1, 13))
    cached(cache, alloc, prompt)
    node = node_of(cache, prompt)
    host_slots = node.host_value.tolist()
    cache.evict(12)
    pool = cache.req_to_token_pool
    req = start_req(cache, pool, alloc, FakeReq(prompt))  # no load back: computes all 12 again
    own = pool.req_to_token[req.req_pool_idx, :12].tolist()
    req.output_ids = [99]
    cache.cache_finished_req(req)
    assert node.value.tolist() == own and node.host_value.tolist() == host_slots
    check(cache, alloc)


def test_reset_empties_both_tiers():
    cache, alloc, _ = make()
    cached(cache, alloc, list(range(1, 13)))
    cache.evict(12)
    cache.reset()
    alloc.clear()
    assert cache.root_node.children == {} and cache.host_pool.available_size() == 64
    check(cache, alloc)


# ---- per-layer load ------------------------------------------------------------------
def test_layer_done_counter_orders_layers():
    counter = LayerDoneCounter(start_layer=4, num_layers=3)
    counter.wait_until(6, timeout=0)  # idle: everything is loaded
    counter.begin()
    with pytest.raises(TimeoutError):
        counter.wait_until(4, timeout=0.01)
    counter.complete(4)
    counter.wait_until(4, timeout=0)
    with pytest.raises(IntegrityError, match="out of order"):
        counter.complete(6)
    assert counter.num_done == 1


def test_device_pool_reads_layer_0_while_later_layers_are_loading():
    cache, alloc, kv = make()
    tokens = list(range(1, 13))
    _, want = cached(cache, alloc, tokens)
    host_slots = node_of(cache, tokens).host_value
    dst = alloc.alloc(12)
    counter = cache.cache_controller.layer_done_counter
    assert kv.layer_transfer_counter is counter
    counter.begin()
    cache.host_pool.load_to_device_per_layer(kv, host_slots, dst, 0)
    counter.complete(0)
    assert torch.equal(kv.get_key_buffer(0)[dst].view(torch.uint8), want[0])  # layer 0 is readable now
    got, done = [], threading.Event()
    reader = threading.Thread(target=lambda: (got.append(kv.get_value_buffer(2)[dst].clone()), done.set()), daemon=True)
    reader.start()
    assert not done.wait(0.05)  # layer 2 has not arrived: the reader waits
    for layer in (1, 2):
        cache.host_pool.load_to_device_per_layer(kv, host_slots, dst, layer)
        counter.complete(layer)
    assert done.wait(5)
    reader.join()
    assert torch.equal(got[0].view(torch.uint8), want[5])
    alloc.free(dst)
    check(cache, alloc)


def break_loads(cache, times=None):
    """The next ``times`` per-layer loads from the host pool raise (every one if None); after
    them the real load is back."""
    load_layer, calls = cache.host_pool.load_to_device_per_layer, []

    def broken(*args, **kwargs):
        calls.append(1)
        if times is not None and len(calls) == times:
            cache.host_pool.load_to_device_per_layer = load_layer
        raise OSError("host memory unreadable")

    cache.host_pool.load_to_device_per_layer = broken


# ---- overlapped loads ----------------------------------------------------------------
def gated_loads(cache, first_free_layers=1):
    """Make the host pool's per-layer load wait at layers >= ``first_free_layers`` until the
    returned event is set; returns (gate, layers copied so far)."""
    gate, copied = threading.Event(), []
    load_layer = cache.host_pool.load_to_device_per_layer

    def slow(device_pool, host, device, layer_id):
        if layer_id >= first_free_layers:
            assert gate.wait(10), "the gate was never opened"
        load_layer(device_pool, host, device, layer_id)
        copied.append(layer_id)

    cache.host_pool.load_to_device_per_layer = slow
    return gate, copied


def evicted_prefix(cache, alloc, tokens):
    _, want = cached(cache, alloc, tokens)
    assert cache.evict(len(tokens)) == len(tokens)
    scramble(cache.cache_controller.device_pool)
    m = cache.match_prefix(K(tokens))
    return m, want


def test_overlapped_load_waits_for_the_forward_and_reads_each_layer_as_it_lands():
    """With ``overlap_load`` a load back is queued (nothing copied), starts with
    ``ready_to_load_host_cache`` and is read layer by layer: layer 0 while the later layers are
    still held back; a reader of the last layer waits for it. The host copies stay held until
    ``loading_check``."""
    cache, alloc, kv = make(overlap_load=True)
    tokens = list(range(1, 17))
    m, want = evicted_prefix(cache, alloc, tokens)
    loaded, node = cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert loaded.numel() == 16 and node.host_ref_counter == 1
    cache.check_integrity()  # a load in flight holds exactly one host ref per node
    gate, copied = gated_loads(cache)
    assert copied == [] and cache.cache_controller.load_pending
    cache.ready_to_load_host_cache()
    key0 = kv.get_key_buffer(0)[loaded].view(torch.uint8)  # layer 0 landed; 1 and 2 wait at the gate
    assert torch.equal(key0, want[0]) and copied == [0]
    got, done = [], threading.Event()
    reader = threading.Thread(target=lambda: (got.append(kv.get_value_buffer(2)[loaded].clone()), done.set()),
                              daemon=True)
    reader.start()
    assert not done.wait(0.05)
    gate.set()
    assert done.wait(10)
    assert torch.equal(got[0].view(torch.uint8), want[5])
    cache.loading_check()
    assert copied == [0, 1, 2] and node.host_ref_counter == 0 and not cache.cache_controller.load_pending
    assert same(read_kv(kv, loaded), want) and cache.cache_controller.loaded_tokens == 16
    check(cache, alloc)


def test_evicting_a_loaded_node_nobody_locked_ends_its_load_first():
    """A node loaded back for a request that was then not taken (its lock given back) may be
    evicted: its queued copy must land before the slots go back to the allocator, or it would
    write into slots handed to someone else."""
    cache, alloc, kv = make(overlap_load=True)
    tokens = list(range(1, 17))
    m, want = evicted_prefix(cache, alloc, tokens)
    loaded, node = cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert cache.cache_controller.load_pending
    assert cache.evict(16) == 16  # ended the load, then evicted (the node has its host copy: it stays)
    assert not cache.cache_controller.load_pending and node.evicted and node.host_ref_counter == 0
    again = cache.match_prefix(K(tokens))
    loaded, _ = cache.init_load_back(again.last_host_node, again.host_hit_length)
    cache.inc_lock_ref(node)  # taken this time: its load stays in flight across an eviction
    cached(cache, alloc, list(range(40, 56)))
    assert cache.evict(16) == 16 and cache.cache_controller.load_pending
    cache.ready_to_load_host_cache()
    cache.loading_check()
    assert same(read_kv(kv, loaded), want)
    cache.dec_lock_ref(node)
    check(cache, alloc)


def test_check_integrity_sees_a_load_whose_slots_no_node_holds():
    """A load still to land whose node left the device (its slots freed, to be reused) or
    that no loading node holds any more: both are reported, not taken for a quiet tree."""
    cache, alloc, _ = make(overlap_load=True)
    m, _ = evicted_prefix(cache, alloc, list(range(1, 17)))
    _, node = cache.init_load_back(m.last_host_node, m.host_hit_length)
    cache.check_integrity()
    cache.evictable_size_ -= len(node.value)  # evicted behind the load's back
    cache._free(node.value)
    node.value = None
    with pytest.raises(IntegrityError, match="being loaded back but is off the device"):
        cache.check_integrity()
    cache._loading_nodes, node.host_ref_counter = [], 0  # or let go of while its copy is pending
    with pytest.raises(IntegrityError, match="loads pending that no loading node holds"):
        cache.check_integrity()


def test_a_failed_layer_copy_fails_its_readers_then_the_tree_copies_it_again():
    """A layer copy that fails on the loader fails the forward reading it (no hang); ending the
    load re-raises after copying the nodes again in the caller's thread, so the tree never keeps
    device slots that hold what did not land, and the next reader goes straight through."""
    cache, alloc, kv = make(overlap_load=True)
    m, want = evicted_prefix(cache, alloc, list(range(1, 17)))
    loaded, _ = cache.init_load_back(m.last_host_node, m.host_hit_length)
    break_loads(cache, times=1)
    cache.ready_to_load_host_cache()
    with pytest.raises(RuntimeError, match="loading layer 0 from the host tier failed"):
        kv.get_key_buffer(0)
    with pytest.raises(OSError, match="unreadable"):
        cache.loading_check()
    assert same(read_kv(kv, loaded), want) and not cache.cache_controller.load_pending
    check(cache, alloc)


def cuda_backed_up(size, n):
    """A CUDA device pool of ``size`` slots whose slots [0, n) hold random KV, backed up to
    host slots by an overlapping controller: (pool, controller, host slots, their KV)."""
    from mem_cache.hicache_controller import HiCacheController

    kv = MHATokenToKVPool(size, 1, torch.float32, head_num=2, head_dim=3, layer_num=LAYERS, device="cuda")
    controller = HiCacheController(kv, MHATokenToKVPoolHost(kv, host_to_device_ratio=2.0), overlap_load=True)
    src = torch.arange(n, device="cuda")
    write_random(kv, src)
    host_slots = controller.host_pool.alloc(n)
    controller.write(host_slots, src)
    return kv, controller, host_slots, read_kv(kv, src)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_overlapped_load_orders_the_reading_stream_after_each_layer():
    """On CUDA the copies go on the controller's load stream, one event per layer, and a
    reader's stream waits on the event of the layer it reads: the bytes it sees are the host
    copy's, with no host-side wait in between."""
    kv, controller, host_slots, want = cuda_backed_up(64, 16)
    dst = torch.arange(32, 48, device="cuda")
    controller.queue_load(host_slots, dst)
    controller.start_loading()
    got = read_kv(kv, dst)  # queued behind each layer's event on this thread's stream
    controller.wait_loading()
    assert same(got, want) and not controller.load_pending
    controller.close()


def test_a_failed_load_copied_again_covers_a_node_split_meanwhile():
    """The copy again after a failure covers the transfer's slots, not the loading nodes: a
    later request of the same batch that split a loading node leaves no part behind."""
    cache, alloc, kv = make(overlap_load=True)
    tokens = list(range(1, 17))
    m, want = evicted_prefix(cache, alloc, tokens)
    loaded, node = cache.init_load_back(m.last_host_node, m.host_hit_length)
    cache.match_prefix(K(tokens[:12] + [99, 98]))  # splits the loading node at 12
    assert len(node.key) == 4
    break_loads(cache, times=1)
    cache.ready_to_load_host_cache()
    with pytest.raises(OSError):
        cache.loading_check()
    assert same(read_kv(kv, loaded), want)
    check(cache, alloc)


def test_a_failed_copy_made_at_once_gives_the_device_slots_back_and_keeps_the_host_copy():
    """Without ``overlap_load`` the load back copies at once: failing, it takes no device slot
    (they went back) and the chain stays host-only, to be loaded by the next hit."""
    cache, alloc, kv = make(overlap_load=False)
    m, want = evicted_prefix(cache, alloc, list(range(1, 17)))
    break_loads(cache, times=1)
    with pytest.raises(OSError):
        cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert m.last_host_node.evicted and alloc.available_size() == 32
    check(cache, alloc)
    loaded, _ = cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert same(read_kv(kv, loaded), want)
    check(cache, alloc)


def test_a_load_that_fails_again_raises_and_leaves_no_reader_waiting():
    cache, alloc, kv = make(overlap_load=True)
    m, _ = evicted_prefix(cache, alloc, list(range(1, 17)))
    cache.init_load_back(m.last_host_node, m.host_hit_length)
    break_loads(cache)
    cache.ready_to_load_host_cache()
    with pytest.raises(OSError):
        cache.loading_check()
    counter = cache.cache_controller.layer_done_counter
    assert counter.num_done == LAYERS  # idle: the next forward reads straight through
    kv.get_key_buffer(LAYERS - 1)


def test_a_tp_follower_ends_a_load_rank_0_ended_outside_a_forward_before_its_next_forward():
    """Rank 0 loaded slots for a request it then did not take, ended the load, freed the slots
    and gave them to the next forward's new tokens. The follower must end that load where rank 0
    did in the op sequence (``load_sync``); run alongside the next forward, its copy (slow here)
    would land after the new KV and overwrite it."""
    from mem_cache.hicache_controller import HiCacheController

    pools = []
    for _ in range(2):  # rank 0 and a follower: same slots, each its own pools
        kv = device_pool(size=32)
        pools.append((kv, HiCacheController(kv, MHATokenToKVPoolHost(kv, 2.0, page_size=1), overlap_load=True)))
    (kv0, rank0), (kv1, follower) = pools
    rank0.op_log = []
    host, dst = torch.arange(8), torch.arange(16, 24)
    for kv, controller in pools:
        write_random(kv, torch.arange(8), seed=1)
        controller.host_pool.backup_from_device_all_layer(kv, host, torch.arange(8))
    load_layer = follower.host_pool.load_to_device_per_layer

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return load_layer(*args, **kwargs)

    follower.host_pool.load_to_device_per_layer = slow
    rank0.queue_load(host, dst)  # the request's prefix...
    rank0.start_loading()
    rank0.wait_loading()  # ...loaded, the request not taken: ended outside a forward
    rank0.log_load_sync()
    ops, rank0.op_log = list(rank0.op_log), []
    assert [op for op, _, _ in ops] == ["load", "load_sync"]
    new_kv = []
    for kv, controller in pools:  # the next forward's new tokens get the freed slots
        if controller is follower:
            controller.replay(ops)
            controller.start_loading()
        write_random(kv, dst, seed=2)
        new_kv.append(read_kv(kv, dst))
        controller.wait_loading()
    assert same(read_kv(kv1, dst), new_kv[0]) and same(read_kv(kv0, dst), new_kv[0])
    for _, controller in pools:
        controller.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_start_loading_returns_before_the_copies_run():
    """The host only gathers into pinned buffers and enqueues: with the load stream held busy,
    ``start_loading`` still returns at once (a copy from pageable memory would wait for it)."""
    kv, controller, host_slots, want = cuda_backed_up(4096, 1024)
    controller._load_stream = torch.cuda.Stream()
    with torch.cuda.stream(controller._load_stream):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time
    start = time.perf_counter()
    dst = torch.arange(2048, 3072, device="cuda")
    controller.queue_load(host_slots, dst)
    controller.start_loading()
    assert time.perf_counter() - start < 0.3
    got = read_kv(kv, dst)
    controller.wait_loading()
    assert same(got, want)
    controller.close()


@pytest.mark.parametrize("taken", [True, False])
def test_a_load_that_fails_twice_leaves_the_device_and_the_next_hit_loads_it_again(taken):
    """The copy fails and so does the copy again: the slots hold no KV. No match finds them
    while the request that needed them (``taken``) still locks the node; they go back once it
    lets go (at once when nobody locks it), and the node keeps its host copy: the next hit
    loads it again."""
    cache, alloc, kv = make(overlap_load=True)
    tokens = list(range(1, 17))
    m, want = evicted_prefix(cache, alloc, tokens)
    _, node = cache.init_load_back(m.last_host_node, m.host_hit_length)
    if taken:
        cache.inc_lock_ref(node)
    load_layer = cache.host_pool.load_to_device_per_layer
    break_loads(cache)
    cache.ready_to_load_host_cache()
    with pytest.raises(OSError):
        cache.loading_check()
    cache.host_pool.load_to_device_per_layer = load_layer
    if taken:
        again = cache.match_prefix(K(tokens))
        assert again.device_indices.numel() == 0 and again.host_hit_length == 0
        cache.dec_lock_ref(node)
    assert node.evicted and node.backuped and alloc.available_size() == 32
    check(cache, alloc)
    again = cache.match_prefix(K(tokens))
    assert again.host_hit_length == 16
    loaded, _ = cache.init_load_back(again.last_host_node, again.host_hit_length)
    cache.ready_to_load_host_cache()
    cache.loading_check()
    assert same(read_kv(kv, loaded), want)
    check(cache, alloc)


def test_a_failed_transfer_in_flight_still_ends_the_loads_queued_behind_it():
    """A load queued while an earlier transfer is in flight: that transfer failing while
    ``loading_check`` ends it must not leave the queued load pending once its nodes' host
    copies are given back (they could be evicted, and its slots freed, before it copies)."""
    cache, alloc, kv = make(overlap_load=True, size=64)
    first, second = list(range(1, 17)), list(range(101, 117))
    _, want_first = cached(cache, alloc, first)
    _, want = cached(cache, alloc, second, seed=1)
    assert cache.evict(32) == 32
    scramble(kv)
    m, m2 = cache.match_prefix(K(first)), cache.match_prefix(K(second))
    loaded, _ = cache.init_load_back(m.last_host_node, m.host_hit_length)
    break_loads(cache, times=1)
    cache.ready_to_load_host_cache()
    loaded2, node2 = cache.init_load_back(m2.last_host_node, m2.host_hit_length)
    with pytest.raises(OSError):
        cache.loading_check()
    assert not cache.cache_controller.load_pending and node2.host_ref_counter == 0
    assert same(read_kv(kv, loaded), want_first) and same(read_kv(kv, loaded2), want)
    check(cache, alloc)


def test_a_lost_load_takes_what_was_loaded_under_it_off_the_device_too():
    """A transfer in flight that fails twice, with a load queued behind it of the prefix's
    continuation: that one lands, but its node sits under lost ones, so it leaves the device
    with them (no device node under a host-only one); both keep their host copies."""
    cache, alloc, kv = make(overlap_load=True, size=64)
    tokens = list(range(1, 33))
    _, want = cached(cache, alloc, tokens)
    assert cache.evict(32) == 32
    scramble(kv)
    m = cache.match_prefix(K(tokens[:16]))  # (splits the node)
    cache.init_load_back(m.last_host_node, m.host_hit_length)
    break_loads(cache, times=2)  # the transfer, then the copy again
    cache.ready_to_load_host_cache()
    m = cache.match_prefix(K(tokens))
    assert len(m.device_indices) == 16 and m.host_hit_length == 16
    _, below = cache.init_load_back(m.last_host_node, m.host_hit_length)
    with pytest.raises(OSError):
        cache.loading_check()
    assert below.evicted and alloc.available_size() == 64
    check(cache, alloc)
    m = cache.match_prefix(K(tokens))
    assert m.host_hit_length == 32
    loaded, _ = cache.init_load_back(m.last_host_node, m.host_hit_length)
    cache.loading_check()
    assert same(read_kv(kv, loaded), want)
    check(cache, alloc)
