"""Radix cache throughput and hit rate on a synthetic shared-prefix trace.

The trace: ``--num-prompts`` system prompts of ``--prompt-len`` tokens, each
request one of them (Zipf-ish popularity) followed by a unique suffix of
50–500 tokens. Every request is served the way the scheduler will serve it:
``match_prefix`` → allocate slots for the uncached rest (evicting when the
pool is short) → ``insert`` (freeing duplicates). The table gives operations
per second for match, insert and evict, and the token hit rate, for page
sizes 1 and 16, with a pool that holds everything ("large") and one that
holds about 1.5 system prompts' worth per prompt ("pressure").

``MambaRadixCache`` runs the same trace in ``extra_buffer`` mode: a request
saves one checkpoint per prefill at the position ``prefill_track_seqlen``
picks (the branching point when its prefix match ran past the deepest
checkpoint), and only that much is inserted.

``SWARadixCache`` runs it as a sliding-window model (``--sliding-window``,
Gemma 3's 1024 by default) whose SWA pool holds ``--swa-full-tokens-ratio`` of
the full pool: allocation evicts the (full, SWA) deficits, SWA eviction
turns internal nodes into tombstones, and a match is only usable where its
last window of tokens still has SWA KV. Its pool column is the full pool.

    python scripts/bench_radix_cache.py [--num-requests 50000] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: E402
from mem_cache.mamba_pool import HybridReqToTokenPool, MambaPool  # noqa: E402
from mem_cache.mamba_radix_cache import MambaRadixCache  # noqa: E402
from mem_cache.mamba_tracking import prefill_track_seqlen  # noqa: E402
from mem_cache.radix_cache import RadixCache  # noqa: E402
from mem_cache.radix_key import RadixKey  # noqa: E402
from mem_cache.req_to_token_pool import ReqToTokenPool  # noqa: E402
from mem_cache.swa_allocator import SWATokenToKVPoolAllocator  # noqa: E402
from mem_cache.swa_radix_cache import SWARadixCache  # noqa: E402


def make_trace(num_requests: int, num_prompts: int, prompt_len: int, seed: int = 0) -> List[List[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(32000) for _ in range(prompt_len)] for _ in range(num_prompts)]
    weights = [1.0 / (i + 1) for i in range(num_prompts)]
    trace = []
    for _ in range(num_requests):
        prompt = rng.choices(prompts, weights)[0]
        trace.append(prompt + [rng.randrange(32000) for _ in range(rng.randint(50, 500))])
    return trace


@dataclass
class Stats:
    ops: dict = field(default_factory=lambda: {"match": [0, 0.0], "insert": [0, 0.0], "evict": [0, 0.0]})
    hit_tokens: int = 0
    total_tokens: int = 0

    def timed(self, op: str, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.ops[op][0] += 1
        self.ops[op][1] += time.perf_counter() - start
        return out

    def match(self, cache, key: RadixKey):
        """Timed ``match_prefix`` counted into the hit rate; returns the match and its length."""
        m = self.timed("match", cache.match_prefix, key)
        self.hit_tokens += len(m.device_indices)
        self.total_tokens += len(key)
        return m, len(m.device_indices)

    def per_second(self, op: str) -> float:
        n, t = self.ops[op]
        return n / t if t else float("nan")


def alloc_or_evict(cache, alloc, need: int, stats: Stats, evict_extra=None):
    slots = alloc.alloc(need)
    if slots is None:
        stats.timed("evict", cache.evict, need)
        slots = alloc.alloc(need)
    if slots is None and evict_extra is not None:
        evict_extra()
        slots = alloc.alloc(need)
    return slots


def run_radix(trace, page_size: int, pool_tokens: int) -> Stats:
    alloc = TokenToKVPoolAllocator(pool_tokens) if page_size == 1 else PagedTokenToKVPoolAllocator(pool_tokens, page_size)
    cache = RadixCache(ReqToTokenPool(1, 8), alloc, page_size=page_size)
    stats = Stats()
    for tokens in trace:
        tokens = tokens[: len(tokens) // page_size * page_size]
        key = RadixKey(tokens)
        m, prefix = stats.match(cache, key)
        cache.inc_lock_ref(m.last_device_node)
        new = alloc_or_evict(cache, alloc, len(tokens) - prefix, stats)
        cache.dec_lock_ref(m.last_device_node)
        if new is None:
            continue
        value = torch.cat([m.device_indices, new])
        already = stats.timed("insert", cache.insert, key, value)
        if already > prefix:
            alloc.free(value[prefix:already])
    cache.check_integrity()
    return stats


def run_mamba(trace, pool_tokens: int, mamba_slots: int) -> Stats:
    mamba = MambaPool(mamba_slots, [(4, 4)], (4, 4), 1, torch.float32, torch.float32)
    pool = HybridReqToTokenPool(1, 8, "cpu", mamba, [0], enable_mamba_extra_buffer=False)
    alloc = TokenToKVPoolAllocator(pool_tokens)
    cache = MambaRadixCache(pool, alloc, mamba_scheduler_strategy="extra_buffer")
    stats = Stats()
    for tokens in trace:
        key = RadixKey(tokens)
        m, prefix = stats.match(cache, key)
        track = prefill_track_seqlen(prefix, len(tokens) - prefix, m.mamba_branching_seqlen)
        if track is None:
            continue
        cache.inc_lock_ref(m.last_device_node)
        new = alloc_or_evict(cache, alloc, track - prefix, stats)
        state = mamba.alloc(1)
        if state is None:
            stats.timed("evict", cache.evict_mamba, 1)
            state = mamba.alloc(1)
        cache.dec_lock_ref(m.last_device_node)
        if new is None or state is None:
            for x, owner in ((new, alloc), (state, mamba)):
                if x is not None:
                    owner.free(x)
            continue
        value = torch.cat([m.device_indices, new])
        already, mamba_exist = stats.timed("insert", cache.insert, RadixKey(tokens[:track]), value, state)
        if already > prefix:
            alloc.free(value[prefix:already])
        if mamba_exist:
            mamba.free(state)
    cache.check_integrity()
    return stats


def run_swa(trace, pool_tokens: int, sliding_window: int, swa_full_tokens_ratio: float) -> Stats:
    alloc = SWATokenToKVPoolAllocator(pool_tokens, int(pool_tokens * swa_full_tokens_ratio))
    cache = SWARadixCache(ReqToTokenPool(1, 8), alloc, sliding_window_size=sliding_window)
    stats = Stats()

    def alloc_or_evict_both(need: int):
        slots = alloc.alloc(need)
        if slots is None:
            deficits = (max(0, need - alloc.full_available_size()), max(0, need - alloc.swa_available_size()))
            stats.timed("evict", cache.evict, *deficits)
            slots = alloc.alloc(need)
        return slots

    for tokens in trace:
        key = RadixKey(tokens)
        m, prefix = stats.match(cache, key)
        swa_uuid_for_lock = cache.inc_lock_ref(m.last_device_node)
        new = alloc_or_evict_both(len(tokens) - prefix)
        if new is not None:  # the tree frees the duplicates itself
            stats.timed("insert", cache.insert, key, torch.cat([m.device_indices, new]), prefix)
        cache.dec_lock_ref(m.last_device_node, swa_uuid_for_lock)
    cache.check_integrity()
    return stats


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=50000)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--sliding-window", type=int, default=1024, help="SWARadixCache rows")
    parser.add_argument("--swa-full-tokens-ratio", type=float, default=0.8, help="SWARadixCache rows")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)

    trace = make_trace(args.num_requests, args.num_prompts, args.prompt_len)
    unique = args.num_prompts * args.prompt_len + sum(len(t) - args.prompt_len for t in trace)
    large = unique + 1024  # holds every distinct token: nothing is ever evicted
    pressure = int(args.num_prompts * args.prompt_len * 1.5)
    rows = []
    for cache_name, page_size, pool_name, pool_tokens in [
        ("RadixCache", 1, "large", large),
        ("RadixCache", 1, "pressure", pressure),
        ("RadixCache", 16, "large", large),
        ("RadixCache", 16, "pressure", pressure),
        ("MambaRadixCache", 1, "large", large),
        ("MambaRadixCache", 1, "pressure", pressure),
        ("SWARadixCache", 1, "large", large),
        ("SWARadixCache", 1, "pressure", pressure),
    ]:
        start = time.perf_counter()
        if cache_name == "RadixCache":
            stats = run_radix(trace, page_size, pool_tokens)
        elif cache_name == "SWARadixCache":
            stats = run_swa(trace, pool_tokens, args.sliding_window, args.swa_full_tokens_ratio)
        else:
            stats = run_mamba(trace, pool_tokens, mamba_slots=4 * args.num_prompts if pool_name == "pressure" else len(trace) + 16)
        wall = time.perf_counter() - start
        rows.append((cache_name, page_size, f"{pool_name} ({pool_tokens:,})", stats, wall))

    title = f"radix cache benchmark — {args.num_requests:,} requests, {args.num_prompts} prompts × {args.prompt_len} tokens + 50–500 unique"
    lines = [
        "| cache | page | pool (tokens) | match/s | insert/s | evict calls/s | evict calls | hit rate | wall s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, ps, pool, s, wall in rows:
        lines.append(
            f"| {name} | {ps} | {pool} | {s.per_second('match'):,.0f} | {s.per_second('insert'):,.0f} "
            f"| {s.per_second('evict'):,.0f} | {s.ops['evict'][0]:,} | {s.hit_tokens / s.total_tokens:.1%} | {wall:.1f} |"
        )
    table = "\n".join(lines)
    print(title)
    print(table)
    if args.markdown:
        args.markdown.write_text(f"{title}\n\n{table}\n")


if __name__ == "__main__":
    main()
