"""Routing decision time against tokenisation time of the same prompts (reference §9.1).

A :class:`actors.router.Router` over 16 prefill and 4 decode workers (in-process
stand-ins: ``route`` never calls a worker) whose index is first filled through
its real event path with a large synthetic population: ``--index-seqs`` cached
sequences of ``--index-len`` tokens, each on 1–3 random workers, plus the
system prompts of the workload, each on 1–2 workers. The workload: chat
conversations rendered with the tiny model's ChatML template — one of
``--system-prompts`` system prompts (``--system-len`` characters; the tiny
tokenizer is byte-level, one token a byte) and a unique user turn of 50–500
characters. The prefix the router hashes is the whole rendered conversation.

Times per request, p50 / p99 over ``--requests``:

* tokenise: ``tokenizer.encode`` of the rendered text (HF fast tokenizer);
  render + tokenise adds ``apply_chat_template``;
* route: ``Router.route`` + ``release`` — hashing the pages with
  ``mem_cache.radix_key.hash_pages``, matching the index, the policy,
  recording the decision; its parts below it (hash, match) timed alone;
* route (round_robin): the same call with a blind policy — the index work is
  the same (every decision reports the tokens its worker holds), only the
  policy differs;
* with ``--ray``: the same router as a Ray actor with the same index, called
  from the driver (``route.remote`` then ``release.remote``, one request at a
  time): the decision plus the actor round trips.

With ``--reuse-rule state`` the prefill workers are hybrid (Mamba) ones: a state is cached after
each system prompt and halfway through and at the end of each cached sequence (StateStored), and
their matches take the ruled path; with ``--reuse-rule window`` they are sliding-window ones
(``--window`` pages) whose cached sequences lost the window KV of their first half (WindowLost).

    python scripts/bench_router.py [--requests 2000] [--index-seqs 4000] [--page-size 16] [--ray]
                                   [--reuse-rule prefix|state|window] [--window 4] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.prefix_index import page_keys  # noqa: E402
from actors.router import Router  # noqa: E402
from actors.routing_policies import RouterSettings, WorkerState  # noqa: E402
from mem_cache.kv_events import BlockStored, KVEventBatch, StateStored, WindowLost  # noqa: E402
from mem_cache.radix_key import hash_pages  # noqa: E402

NUM_PREFILL, NUM_DECODE = 16, 4
WORDS = "the of and to in is that for it as with was on be by at this are from or an which have".split()


class Stub:
    """A worker the router never needs to call during ``route``; idle to its heartbeats and pulls."""

    def __init__(self, role: str):
        self.role = role

    def load(self):
        return {}

    def kv_events(self, since_id: int, max_events: int):
        return KVEventBatch([], since_id)


def text(rng: random.Random, num_chars: int) -> str:
    out: List[str] = []
    size = 0
    while size < num_chars:
        word = rng.choice(WORDS) if rng.random() < 0.7 else "".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                                                                     for _ in range(rng.randint(3, 9)))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:num_chars]


def tokenizer_of_tiny_model(tmp: str):
    from transformers import AutoTokenizer

    from actors.engine.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint("llama", Path(tmp) / "tiny-llama")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def fill_index(router: Router, rng: random.Random, prompts: Sequence[List[int]], args) -> None:
    """Cached sequences on random workers, through ``PrefixIndex.apply`` (the event path)."""
    ids = [f"prefill-{i}" for i in range(NUM_PREFILL)]
    for worker in ids:
        router.index.set_rule(worker, args.reuse_rule, args.window, prompt_state=True)
    event_id = 0

    def store(worker, hashes, states, lost):
        nonlocal event_id
        event_id += 1
        router.index.apply(worker, BlockStored(event_id, hashes, None, [], args.page_size))
        if args.reuse_rule == "state":
            router.index.apply(worker, StateStored(event_id, states))
        elif args.reuse_rule == "window" and lost:
            router.index.apply(worker, WindowLost(event_id, lost))

    for _ in range(args.index_seqs):
        seq = [rng.randrange(5, 261) for _ in range(args.index_len)]
        hashes = hash_pages(seq, args.page_size)
        for worker in rng.sample(ids, rng.randint(1, 3)):
            store(worker, hashes, [hashes[len(hashes) // 2], hashes[-1]], hashes[: len(hashes) // 2])
    for system in prompts:
        hashes = hash_pages(system, args.page_size)
        for worker in rng.sample(ids, rng.randint(1, 2)):
            store(worker, hashes, hashes[-1:], [])


def make_router(policy: str, page_size: int) -> Router:
    router = Router(RouterSettings(page_size=page_size, prefill_policy=policy, decode_policy=policy))
    _register(router)
    return router


def _register(router: Router) -> None:
    """Stand-in workers, registered directly: they have no snapshot to give ``add_worker``."""
    for i in range(NUM_PREFILL):
        router.index.add_worker(f"prefill-{i}")
        router.workers[f"prefill-{i}"] = WorkerState(f"prefill-{i}", "prefill", Stub("prefill"))
    for i in range(NUM_DECODE):
        router.index.add_worker(f"decode-{i}")
        router.workers[f"decode-{i}"] = WorkerState(f"decode-{i}", "decode", Stub("decode"))


def timed(fn: Callable, items: Sequence) -> List[float]:
    gc.freeze()  # as Router.start() does: what exists so far leaves the collector's full passes
    out = []
    for item in items:
        start = time.perf_counter()
        fn(item)
        out.append(time.perf_counter() - start)
    return out


def route_times(router: Router, prompts: Sequence[List[int]]) -> List[float]:
    gc.freeze()

    async def go():
        times = []
        for i, ids in enumerate(prompts):
            start = time.perf_counter()
            await router.route(f"r{i}", ids)
            await router.release(f"r{i}")
            times.append(time.perf_counter() - start)
        return times

    return asyncio.run(go())


class BenchRouter(Router):
    """The router as an actor, its index filled in place (stand-in workers cannot give snapshots)."""

    async def setup(self, args: argparse.Namespace, system_ids: List[List[int]]) -> int:
        _register(self)
        fill_index(self, random.Random(args.seed), system_ids, args)
        return len(self.index)


def ray_route_times(args: argparse.Namespace, prompts: Sequence[List[int]], system_ids) -> List[float]:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(BenchRouter).options(num_cpus=0).remote(RouterSettings(page_size=args.page_size))
        ray.get(actor.setup.remote(args, system_ids))
        ray.get(actor.start.remote())  # its loops run (on idle stand-ins), as in a cluster
        times = []
        for i, ids in enumerate(prompts):
            start = time.perf_counter()
            ray.get(actor.route.remote(f"r{i}", ids))
            ray.get(actor.release.remote(f"r{i}"))
            times.append(time.perf_counter() - start)
        return times
    finally:
        ray.shutdown()


def pct(values: List[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--system-prompts", type=int, default=64)
    parser.add_argument("--system-len", type=int, default=2000)
    parser.add_argument("--index-seqs", type=int, default=4000)
    parser.add_argument("--index-len", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ray", action="store_true", help="also time the router as a Ray actor")
    parser.add_argument("--reuse-rule", choices=["prefix", "state", "window"], default="prefix",
                        help="the prefill workers' reuse rule (state: hybrid; window: sliding-window)")
    parser.add_argument("--window", type=int, default=4, help="the window rule's window, in pages")
    parser.add_argument("--markdown", type=str, default=None, help="append the table to this file")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = tokenizer_of_tiny_model(tmp)
    systems = [text(rng, args.system_len) for _ in range(args.system_prompts)]
    chats = [[{"role": "system", "content": rng.choice(systems)},
              {"role": "user", "content": text(rng, rng.randint(50, 500))}] for _ in range(args.requests)]
    render = lambda chat: tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)  # noqa
    rendered = [render(c) for c in chats]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in rendered]
    system_ids = [tokenizer.encode(render([{"role": "system", "content": s}])[:-len("<|im_start|>assistant\n")],
                                   add_special_tokens=False) for s in systems]

    t_tok = timed(lambda t: tokenizer.encode(t, add_special_tokens=False), rendered)
    t_render = timed(lambda c: tokenizer.encode(render(c), add_special_tokens=False), chats)
    aware = make_router("cache_aware", args.page_size)
    started = time.perf_counter()
    fill_index(aware, rng, system_ids, args)
    fill_s = time.perf_counter() - started
    t_hash = timed(lambda ids: page_keys(hash_pages(ids, args.page_size)), prompts)
    keys = [page_keys(hash_pages(ids, args.page_size)) for ids in prompts]
    t_match = timed(aware.index.match, keys)
    t_route = route_times(aware, prompts)
    t_rr = route_times(make_router("round_robin", args.page_size), prompts)
    stats = aware.stats()
    rows = [("tokenise (encode)", t_tok), ("render + tokenise", t_render),
            ("route + release (cache_aware)", t_route), ("  of which: hash pages + keys", t_hash),
            ("  of which: index match", t_match), ("route + release (round_robin)", t_rr)]
    if args.ray:
        rows.append(("route + release through a Ray actor (cache_aware)", ray_route_times(args, prompts, system_ids)))

    tokens = statistics.mean(len(p) for p in prompts)
    entries = sum(aware.index.num_pages(w) for w in aware.index.workers())
    lines = [
        f"{NUM_PREFILL} {args.reuse_rule}-rule prefill + {NUM_DECODE} decode workers; index: {len(aware.index):,} distinct pages, "
        f"{entries:,} (page, worker) entries, filled in {fill_s:.1f}s; page size {args.page_size}; "
        f"{args.requests} requests of {tokens:,.0f} tokens on average; predicted hit rate "
        f"{stats['predicted_hit_rate']:.1%}",
        "",
        "| step | p50 µs | p99 µs | per 1k tokens p50 µs |",
        "|---|---:|---:|---:|",
    ]
    for name, values in rows:
        p50, p99 = pct(values, 50) * 1e6, pct(values, 99) * 1e6
        lines.append(f"| {name} | {p50:,.1f} | {p99:,.1f} | {p50 / tokens * 1000:,.1f} |")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(table + "\n")
    gc.unfreeze()  # frozen objects escape the collection at exit: Triton's bindings would report them leaked
    return 0


if __name__ == "__main__":
    sys.exit(main())
