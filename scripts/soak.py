"""End-to-end soak: a PD cluster brought up in this process as ``raydix launch`` does, driven
over HTTP with the official async openai client by a seeded random mix of requests, then
drained and checked.

    python scripts/soak.py --config configs/local_cpu.yaml --duration 150
    python scripts/soak.py --config configs/cpu_2p2d_tp2.yaml --requests 400 --concurrency 12 --seed 1

The mix (scripts/soak_mix.py, scripts/soak_mix_extras.py): completions and chat, streamed or not,
n = 1..3, stop strings, greedy or seeded sampling, logprobs / top_logprobs, structured outputs
(response_format json_schema and json_object, guided_regex, guided_choice), priorities (priority
scheduling is switched on unless ``--no-priority``), shared system prompts (prefix caches, prefix
routing), prompts just under the context limit and past it (a 400 ``context_length_exceeded``),
streams whose client goes away mid-way, invalid requests (a 4xx with an OpenAI-style body), tool
calls (named, required, auto, none), reasoning split from the answer, vLLM's prompt_logprobs, and
/tokenize and /detokenize. The server's ``tool_call_parser`` (hermes) and ``reasoning_parser``
(qwen3) are switched on (``--set server.reasoning_parser=...`` picks another), so every chat
answer goes through them (the tiny model's own text, never closing a thinking, is all reasoning).
The newest routes (scripts/soak_mix_apis.py): /v1/responses (text against the chat answer,
streamed events, a json_schema format, a named function, previous_response_id and the stored
responses), /v1/embeddings (float and base64, dimensions, batches), and LoRA adapters by model name:
two random adapters of the built-in model are built into a temporary directory and served on both
sides (``--no-lora``: none). The decode workers draft by n-grams (speculative decoding, unless
``--no-speculative``), so every request's tokens go through its verification. vLLM's scoring
routes and sampling constraints (scripts/soak_mix_vllm.py): /score and the rerank routes against
/v1/embeddings' cosines, allowed_token_ids, bad_words and response_format structural_tag. The weights
are updated from disk every ``--weight-update-interval`` seconds (scripts/soak_weights.py;
``server.allow_weight_updates`` switched on, ``--no-weight-updates``: none), alternating between the
built-in model and another seed's, built into a temporary directory, while the mix keeps sending.
At the end the HTTP server's admission and every worker must drain within ``--drain-timeout``,
and every worker's ``check_integrity`` must pass (as ``raydix launch --prompt`` checks them);
the exit status is 1 if anything was unexpected. Latency is each request's end to end (a
``seeded`` one is two requests at once); tok/s is the kind's completion tokens over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List

import openai

from bench_serving import pct, text  # scripts/, beside this file
from soak_client import Ctx, Outcome
from soak_mix import KINDS, one
from soak_weights import WeightUpdates

PRIORITY_OVERRIDES = ["prefill.engine.enable_priority_scheduling=true", "decode.engine.enable_priority_scheduling=true"]
PARSER_OVERRIDES = ["server.tool_call_parser=hermes", "server.reasoning_parser=qwen3"]
SPECULATIVE_OVERRIDES = ["decode.engine.speculative_algorithm=ngram"]
WEIGHTS_OVERRIDES = ["server.allow_weight_updates=true"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/local_cpu.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (raydix launch's)")
    p.add_argument("--no-priority", action="store_true", help="leave the config's priority scheduling as it is")
    p.add_argument("--no-lora", action="store_true", help="serve no LoRA adapters (and leave out the lora kind)")
    p.add_argument("--no-speculative", action="store_true", help="leave the config's speculative decoding as it is")
    p.add_argument("--no-weight-updates", action="store_true", help="never update the weights during the run")
    p.add_argument("--weight-update-interval", type=float, default=20.0, help="seconds between weight updates")
    p.add_argument("--duration", type=float, default=150.0, help="seconds of requests (no new ones after)")
    p.add_argument("--requests", type=int, default=None, help="stop after this many requests instead")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(KINDS), help="the request kinds to mix (comma-separated)")
    p.add_argument("--num-systems", type=int, default=4, help="shared system prompts")
    p.add_argument("--drain-timeout", type=float, default=60.0)
    p.add_argument("--show-errors", type=int, default=20, help="unexpected outcomes printed")
    return p.parse_args(argv)


async def drive(ctx: Ctx, args) -> List[Outcome]:
    """``--concurrency`` senders, each drawing request ``i``'s kind and fields from a generator
    seeded by (seed, i), until the duration or the request count is reached; beside them the
    weight updates (``ctx.weights``), until the senders are done."""
    names = [k for k in args.kinds.split(",") if k != "lora" or ctx.adapters]
    weights = [KINDS[k][1] for k in names]
    deadline = time.monotonic() + args.duration
    counter, outcomes = iter(range(args.requests or sys.maxsize)), []

    async def sender():
        for i in counter:
            if args.requests is None and time.monotonic() > deadline:
                return
            rng = random.Random(f"{args.seed}-{i}")
            outcomes.append(await one(ctx, rng, rng.choices(names, weights)[0]))
            if len(outcomes) % 50 == 0:
                bad = sum(o.status == "unexpected" for o in outcomes)
                print(f"  {len(outcomes)} requests, {bad} unexpected", flush=True)

    async def senders():
        await asyncio.gather(*(sender() for _ in range(args.concurrency)))
        stop.set()

    stop = asyncio.Event()
    updates = [] if ctx.weights is None else [ctx.weights.run(ctx, stop)]
    for done in await asyncio.gather(senders(), *updates):
        outcomes += done or []
    return outcomes


def drain(cluster, app, timeout_s: float) -> float:
    """Seconds until the server admits nothing and every worker has nothing queued, running, in
    transfer or quarantined (the workers' own drain: what their integrity check needs); raises at
    the timeout naming the workers still busy and what they report."""
    import ray

    start = time.monotonic()
    while app.state.admission.running + app.state.admission.waiting:
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"the server still admits {app.state.admission.running} requests")
        time.sleep(0.05)
    for side in (cluster.prefill, cluster.decode):  # (decode after prefill: a push may still land)
        workers = [w for w in side if w.alive]
        left = max(0.0, timeout_s - (time.monotonic() - start))
        idle = ray.get([w.handle.drain.remote(left) for w in workers])
        busy = [w for w, done in zip(workers, idle) if not done]
        if busy:
            loads = ray.get([w.handle.load.remote() for w in busy])
            raise RuntimeError(f"not drained after {timeout_s:.0f}s: {loads}")
    return time.monotonic() - start


def report(outcomes: List[Outcome], wall: float, show_errors: int) -> int:
    """The table; returns the number of unexpected outcomes."""
    by_kind: Dict[str, List[Outcome]] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, []).append(o)
    head = f"{'kind':<11} {'requests':>8} {'ok':>6} {'expected':>8} {'unexpected':>10} {'p50 ms':>8} {'p99 ms':>8} {'tok/s':>7}"
    print(head + "\n" + "-" * len(head))
    for kind, rows in list(sorted(by_kind.items())) + [("all", outcomes)]:
        counts = Counter(o.status for o in rows)
        latency = [o.latency for o in rows]
        tokens = sum(o.completion_tokens for o in rows)
        print(f"{kind:<11} {len(rows):>8} {counts['ok']:>6} {counts['expected']:>8} {counts['unexpected']:>10} "
              f"{pct(latency, 50):>8.0f} {pct(latency, 99):>8.0f} {tokens / wall:>7.1f}")
    bad = [o for o in outcomes if o.status == "unexpected"]
    for o in bad[:show_errors]:
        print(f"UNEXPECTED {o.kind}: {o.detail[:400]}")
    return len(bad)


def worker_counts(base_url: str) -> Dict[str, float]:
    """The workers' counters, each summed over the workers, from the server's /metrics, by name less
    ``raydix_worker_`` and ``_total``: that the n-gram drafts were verified at all (drafts, draft
    tokens, accepted tokens), how many requests priority preemption retracted."""
    import httpx

    counts: Dict[str, float] = Counter()
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        name = line.partition("{")[0]
        if name.startswith("raydix_worker_") and name.endswith("_total"):
            counts[name.removeprefix("raydix_worker_").removesuffix("_total")] += float(line.split()[-1])
    return counts


def with_adapters(config, model_path: str, root: Path):
    """``config`` serving :func:`~actors.engine.tiny.tiny_adapters` of the model on both sides (the
    cluster refuses prefill and decode adapters that differ)."""
    from actors.engine.tiny import tiny_adapters

    paths = {name: str(path) for name, path in tiny_adapters(model_path, root).items()}
    return config.with_updates({f"{side}.engine.lora_paths": paths for side in ("prefill", "decode")})


def other_checkpoint(config, root: Path) -> str:
    """The built-in model's family at the next seed, in ``root``: the checkpoint the weight updates
    alternate with (the same config, other weights)."""
    from actors.engine.tiny import build_tiny_checkpoint

    if config.model.builtin is None:
        raise SystemExit("weight updates need a built-in model to build a second seed of (or --no-weight-updates)")
    return str(build_tiny_checkpoint(config.model.builtin, root, seed=config.model.seed + 1))


def main(argv=None) -> int:
    import ray

    from cluster.config import load_config
    from cluster.http_server import BackgroundServer
    from cluster.launch import init_ray, load_tokenizer, parse_overrides
    from cluster.pd import PDCluster
    from cluster.server import build_app

    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    config = load_config(args.config)
    overrides = (PARSER_OVERRIDES + ([] if args.no_priority else PRIORITY_OVERRIDES)
                 + ([] if args.no_speculative else SPECULATIVE_OVERRIDES)
                 + ([] if args.no_weight_updates else WEIGHTS_OVERRIDES) + args.set)
    config = config.with_updates(parse_overrides(overrides))
    model_path = config.model.resolve_model_path()
    scratch = tempfile.TemporaryDirectory(prefix="soak-")  # (the adapters, the second checkpoint)
    if not args.no_lora:
        config = with_adapters(config, model_path, Path(scratch.name))
    weights = None if args.no_weight_updates else WeightUpdates(
        (model_path, other_checkpoint(config, Path(scratch.name) / "weights")), args.weight_update_interval)
    init_ray()
    cluster = PDCluster(config, model_path).start()
    try:
        tokenizer = load_tokenizer(config, model_path)
        app = build_app(cluster, tokenizer, config)
        rng = random.Random(args.seed)
        with BackgroundServer(app, config.server.host, 0) as server:
            key = config.server.api_key.get_secret_value() if config.server.api_key is not None else "none"
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)
            ctx = Ctx(client, server.url, config.model.name, cluster.context_len(), cluster.max_prompt_len(),
                      getattr(config.decode.engine, "enable_priority_scheduling", False), tokenizer,
                      [f"system {g}: " + text(rng, 400) for g in range(args.num_systems)],
                      config.server.reasoning_parser, sorted(config.decode.engine.lora_paths or ()),
                      config.server.tool_call_parser, weights)
            print(f"soak of {args.config} ({len(cluster.prefill)} prefill + {len(cluster.decode)} decode workers), "
                  f"context {ctx.context_len}, priority {'on' if ctx.priority else 'off'}, reasoning parser "
                  f"{ctx.reasoning_parser}, tool call parser {config.server.tool_call_parser}, LoRA adapters "
                  f"{ctx.adapters}, speculative {config.decode.engine.speculative_algorithm}, weight updates every "
                  f"{'-' if weights is None else args.weight_update_interval}s", flush=True)
            started = time.perf_counter()
            outcomes = asyncio.run(drive(ctx, args))
            wall = time.perf_counter() - started
            print(f"{len(outcomes)} requests in {wall:.1f}s")
            unexpected = report(outcomes, wall, args.show_errors)
            if weights is not None:
                print(f"weights updated {len(weights.timeline) - 1} times (the weights row: the start's probe, then "
                      f"each update)")
            print(f"drained {drain(cluster, app, args.drain_timeout):.2f}s after the last answer")
            counts = worker_counts(server.url)
            print(f"speculative decoding: {counts['spec_decode_num_drafts']:.0f} drafts, "
                  f"{counts['spec_decode_num_accepted_tokens']:.0f} of {counts['spec_decode_num_draft_tokens']:.0f} "
                  f"draft tokens accepted; {counts['preemptions']:.0f} requests preempted for a higher priority")
        cluster.check_integrity()  # (after the app's own drain, as raydix launch --prompt checks)
        print("workers idle, integrity checks passed")
        return 1 if unexpected else 0
    finally:
        cluster.drain_and_shutdown()
        ray.shutdown()
        scratch.cleanup()


if __name__ == "__main__":
    sys.exit(main())
