"""Random workloads on a small HiRadixCache: requests (match → load back →
allocate → insert), device eviction and host eviction, under every write
policy, with backups copied at once or off the loop (``overlap_write``). After
every step the tree passes ``check_integrity``, device and host
slots are conserved, and every node on the device holds the KV of exactly its
tokens: token ``t`` at position ``p`` is written as ``1000 * t + p``, so a
slot mix-up anywhere (split, backup, load back, adoption) shows."""

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from mem_cache.hiradix_cache import WRITE_POLICIES
from tests.hicache_helpers import LAYERS, K, check, make

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
