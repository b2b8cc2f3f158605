"""Random workloads on a small HiRadixCache: requests (match → load back →
allocate → insert), device eviction and host eviction, under every write
policy, with backups copied at once or off the loop (``overlap_write``). After
every step the tree passes ``check_integrity``, device and host
slots are conserved, and every node on the device holds the KV of exactly its
tokens: token ``t`` at position ``p`` is written as ``1000 * t + p``, so a
slot mix-up anywhere (split, backup, load back, adoption) shows.

The second workload adds what the scheduler does around the tree — chunked
requests holding locks across steps, loads overlapping the forward, plans
dropped with their loads queued, storage prefetches — and checks the host
copies too, on rank 0 and on a TP follower that only replays rank 0's log."""

import hypothesis.strategies as st
import torch
from hypothesis import example, given, settings

from mem_cache.hicache_controller import HiCacheController
from mem_cache.hicache_storage import HiCacheStorage
from mem_cache.hiradix_cache import WRITE_POLICIES
from mem_cache.memory_pool_host import MHATokenToKVPoolHost
from tests.cache_helpers import FakeReq, conservation, extend
from tests.hicache_helpers import LAYERS, K, check, device_pool, make

PROMPTS = st.lists(st.lists(st.integers(1, 3), min_size=2, max_size=12), min_size=1, max_size=4)
OPS = st.one_of(
    st.tuples(st.just("request"), st.integers(0, 3)),  # a prompt, by index: prompts repeat
    st.tuples(st.just("evict"), st.integers(1, 16)),
    st.tuples(st.just("evict_host"), st.integers(1, 16)),
    st.tuples(st.just("writing_check"), st.booleans()),  # (with overlap_write) end the backups done, or all
)


def write_tokens(kv, slots, tokens, start):
    """KV of ``tokens`` at positions ``start, start + 1, ...`` into ``slots``."""
    marks = torch.tensor([1000.0 * t + start + i for i, t in enumerate(tokens)])
    rows = marks[:, None, None].expand(len(tokens), 2, 3)
    for layer in range(LAYERS):
        kv.set_kv_buffer(layer, slots, rows, -rows)


def run_request(cache, alloc, kv, tokens):
    """A prefill's bookkeeping: reuse the device prefix and what loads back from
    the host, compute the rest into fresh slots, insert, unlock."""
    key = K(tokens[: len(tokens) - len(tokens) % cache.page_size])
    if len(key) == 0:
        return
    m = cache.match_prefix(key)
    prefix, last = m.device_indices, m.last_device_node
    if m.host_hit_length:
        loaded, last = cache.init_load_back(m.last_host_node, m.host_hit_length)
        prefix = torch.cat([prefix, loaded])
    cache.inc_lock_ref(last)
    # [0, len(prefix)) reused from the tree; [len(prefix), len(key)) computed now
    num_new = len(key) - len(prefix)
    new = alloc.alloc(num_new)
    if new is None:
        cache.evict(num_new - alloc.available_size())
        new = alloc.alloc(num_new)
    if new is not None:
        write_tokens(kv, new, key.token_ids[len(prefix) :], len(prefix))
        assert cache.insert(key, torch.cat([prefix, new])) == len(prefix)
    cache.dec_lock_ref(last)


def check_device_kv(cache, kv):
    for node in cache._iter_nodes():
        if node.value is None:
            continue
        start, up = 0, node.parent
        while up is not cache.root_node:
            start += len(up.key)
            up = up.parent
        want = torch.tensor([1000.0 * t + start + i for i, t in enumerate(node.key.token_ids)])
        for layer in range(LAYERS):
            assert torch.equal(kv.get_key_buffer(layer)[node.value][:, 1, 2], want)
            assert torch.equal(kv.get_value_buffer(layer)[node.value][:, 0, 0], -want)


@settings(max_examples=100, deadline=None)
@given(
    page_size=st.sampled_from([1, 2]),
    policy=st.sampled_from(sorted(WRITE_POLICIES)),
    host_ratio=st.sampled_from([1.25, 2.0]),  # a 20-slot host runs full, a 32-slot one rarely
    overlap_write=st.booleans(),
    prompts=PROMPTS,
    ops=st.lists(OPS, max_size=25),
)
def test_random_workload_keeps_kv_and_accounting(page_size, policy, host_ratio, overlap_write, prompts, ops):
    cache, alloc, kv = make(
        page_size, size=16, write_policy=policy, host_to_device_ratio=host_ratio, load_back_threshold=2,
        overlap_write=overlap_write,
    )
    for op, arg in ops:
        if op == "request":
            run_request(cache, alloc, kv, prompts[arg % len(prompts)])
        elif op == "evict":
            cache.evict(arg)
        elif op == "evict_host":
            cache.evict_host(arg)
        else:
            cache.writing_check(wait=arg)
        check(cache, alloc)
        check_device_kv(cache, kv)


# ---- requests in flight, overlapped loads, the file tier and a TP follower -----------------
class DictStore(HiCacheStorage):
    """Storage in a dict (content-addressed: a key set once keeps its bytes)."""

    def __init__(self):
        self.pages = {}

    def batch_get(self, keys):
        return [self.pages.get(k) for k in keys]

    def batch_set(self, keys, values):
        for key, value in zip(keys, values):
            self.pages.setdefault(key, value)
        return [True] * len(keys)

    def batch_exists(self, keys):
        return next((i for i, k in enumerate(keys) if k not in self.pages), len(keys))


class Workload:
    """Rank 0's HiRadixCache driven the way the scheduler drives it — prefills that load their
    host prefix back while the forward runs, chunked requests that stay locked across steps,
    plans dropped with their loads still queued, storage prefetches — and a TP follower: a
    controller of its own pools and storage replaying rank 0's op log at each forward (and
    at each call to it), its forward writing the same new KV."""

    def __init__(self, page_size, policy, overlap, storage):
        args = dict(write_policy=policy, host_to_device_ratio=1.25, load_back_threshold=2, overlap_load=overlap,
                    overlap_write=overlap, storage_backend=DictStore() if storage else None)
        self.cache, self.alloc, self.kv = make(page_size, size=24, **args)
        self.kv1 = device_pool(24, page_size)
        host1 = MHATokenToKVPoolHost(self.kv1, 1.25, page_size=page_size)
        self.follower = HiCacheController(self.kv1, host1, DictStore() if storage else None, overlap_load=overlap,
                                          overlap_write=overlap)
        controller = self.cache.cache_controller
        controller.op_log = self.log = []
        controller.peers_read = lambda keys, host: self.send() or [self.follower.read_storage(keys, host)]
        controller.peers_prefetch = lambda name, payload: self.send() or [
            getattr(self.follower, "peer_" + name)(payload)]
        self.live, self.prefetches = [], []

    def send(self, new_kv=None):
        """The follower's side of a message: replay, start the loads, run the forward, end them."""
        self.follower.replay(list(self.log))
        self.log.clear()
        self.follower.start_loading()
        if new_kv is not None:
            write_tokens(self.kv1, *new_kv)
        self.follower.wait_loading()

    def admit(self, tokens, upto):
        """Match ``tokens[:upto]`` (from storage first), lock it, load its host part back."""
        cache = self.cache
        if cache.cache_controller.storage is not None:
            cache.prefetch_from_storage(K(tokens[:upto]))
        req = FakeReq(list(tokens))
        m = cache.match_prefix(K(tokens[: upto - upto % cache.page_size]))
        req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
        cache.inc_lock_ref(req.last_node)
        if m.host_hit_length:
            loaded, node = cache.init_load_back(m.last_host_node, m.host_hit_length)
            if loaded.numel():
                cache.inc_lock_ref(node)
                cache.dec_lock_ref(req.last_node)
                req.prefix_indices, req.last_node = torch.cat([req.prefix_indices, loaded]), node
        req.cache_protected_len = len(req.prefix_indices)
        return req

    def prefill(self, req, upto) -> bool:
        """Row and slots for ``[committed, upto)``, then the forward (loads start, new KV written,
        loads end); False, with the request released, when the pool is out of rows or slots."""
        cache, pool = self.cache, self.cache.req_to_token_pool
        if req.req_pool_idx == -1:
            rows = pool.alloc(1)
            if rows is None:  # (every row held by a live request: a scheduler would wait; released as a drop)
                cache.dec_lock_ref(req.last_node)
                return False
            req.req_pool_idx = rows[0]
            pool.req_to_token[req.req_pool_idx, : len(req.prefix_indices)] = req.prefix_indices.to(torch.int32)
        start = req.kv_committed_len or len(req.prefix_indices)
        try:
            extend(cache, pool, self.alloc, req, start, req.origin_input_ids[:upto])
        except AssertionError:  # (extend's "pool too small")
            req.kv_committed_len = start
            cache.cache_finished_req(req, is_insert=False)
            return False
        slots = pool.req_to_token[req.req_pool_idx, start:upto].to(torch.int64)
        new_kv = (slots, req.origin_input_ids[start:upto], start)
        cache.ready_to_load_host_cache()
        write_tokens(self.kv, *new_kv)
        self.send(new_kv)
        cache.loading_check()
        return True

    def step(self, op, prompt, n):
        cache = self.cache
        if op in ("finish", "chunk"):
            upto = len(prompt) if op == "finish" else min(len(prompt), n)
            req = self.admit(prompt, upto)
            if self.prefill(req, upto):
                (cache.cache_finished_req if op == "finish" else cache.cache_unfinished_req)(req)
                if op == "chunk":
                    self.live.append(req)
        elif op == "drop":  # planned (its host prefix queued to load), not taken: the allocation that failed evicts
            cache.dec_lock_ref(self.admit(prompt, len(prompt)).last_node)
            cache.evict(n)
        elif op in ("finish_live", "abort_live") and self.live:
            req = self.live.pop(n % len(self.live))
            full = len(req.origin_input_ids)
            if op == "finish_live" and self.prefill(req, full):
                cache.cache_finished_req(req)
            elif op == "abort_live":
                cache.cache_finished_req(req, is_insert=False)
        elif op == "evict":
            cache.evict(n)
        elif op == "evict_host":
            cache.evict_host(n)
        elif op == "writing_check":
            cache.writing_check(wait=n % 2 == 0)
        elif op == "prefetch" and cache.cache_controller.storage is not None:
            started = cache.start_prefetch(K(prompt))
            self.prefetches += [started] if started is not None else []
        elif op == "end_prefetch" and self.prefetches:
            cache.finish_prefetch(self.prefetches.pop(n % len(self.prefetches)), wait=True)

    def check(self):
        cache, ps = self.cache, self.cache.page_size
        cache.check_integrity()
        private = sum(-(-r.kv_committed_len // ps) * ps - r.cache_protected_len for r in self.live)
        conservation(self.alloc, cache, private)
        held = cache.all_host_values().numel() + sum(len(op.host_indices) for op in cache.prefetch_ops)
        assert cache.host_pool.available_size() + held == cache.host_pool.size
        if cache.cache_controller.load_pending:  # (the next forward lands them)
            return
        self.send()
        writing = {id(n) for w in cache._writing for n in self._path(w.node)}
        for kv, host in ((self.kv, cache.host_pool), (self.kv1, self.follower.host_pool)):
            check_device_kv(cache, kv)
            for node in cache._iter_nodes():
                if node.host_value is not None and id(node) not in writing:
                    start = sum(len(n.key) for n in self._path(node.parent))
                    want = torch.tensor([1000.0 * t + start + i for i, t in enumerate(node.key.token_ids)])
                    for layer in range(LAYERS):
                        k, v = host._host_views(layer)
                        assert torch.equal(k[node.host_value][:, 1, 2], want)
                        assert torch.equal(v[node.host_value][:, 0, 0], -want)

    def _path(self, node):
        path = []
        while node is not self.cache.root_node:
            path.append(node)
            node = node.parent
        return path


WORKLOAD_OPS = st.tuples(
    st.sampled_from(["finish"] * 3 + ["chunk", "drop", "finish_live", "abort_live"] + ["evict", "evict_host"] * 2
                    + ["writing_check", "prefetch", "end_prefetch"]),
    st.integers(0, 3), st.integers(1, 16),
)


@settings(max_examples=50, deadline=None)
@given(
    page_size=st.sampled_from([1, 2]),
    policy=st.sampled_from(sorted(WRITE_POLICIES)),
    overlap=st.booleans(),  # loads layer by layer alongside the forward, backups on the writer thread
    storage=st.booleans(),
    prompts=PROMPTS,
    ops=st.lists(WORKLOAD_OPS, min_size=8, max_size=24),
)
@example(page_size=1, policy="write_back", overlap=False, storage=False, prompts=[[1, 1]],
         ops=[("chunk", 0, 1)] * 9)  # (more requests in flight than the 8 rows: the ninth waits)
def test_requests_in_flight_keep_both_tiers_and_a_tp_follower_right(page_size, policy, overlap, storage, prompts, ops):
    """Every slot accounted for on both tiers after each step, every node's device and host KV
    that of its tokens — on rank 0 and on a follower that only replays rank 0's log."""
    work = Workload(page_size, policy, overlap, storage)
    try:
        for op, prompt, n in ops:
            work.step(op, prompts[prompt % len(prompts)], n)
            work.check()
    finally:
        work.cache.cache_controller.close()
        work.follower.close()
