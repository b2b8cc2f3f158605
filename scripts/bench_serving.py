"""Online serving benchmark against any OpenAI-compatible server (in the spirit of
SGLang's bench_serving): throughput, TTFT / TPOT / ITL p50 and p99, the share of
prompt tokens served from a prefix cache, and per-worker load.

    # a running server (raydix, SGLang, vLLM, ...)
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --workload shared-prefix --max-concurrency 16

    # launch raydix once per routing policy and compare them in one run
    python scripts/bench_serving.py --launch configs/local_cpu.yaml --set prefill.num_workers=2 \\
        --policies cache_aware,round_robin,random --workload shared-prefix --plot bench.png

Workloads: ``random`` (completions, random text and lengths), ``shared-prefix``
(chat: ``--num-groups`` system prompts × ``--questions-per-group`` questions,
shuffled), ``multi-turn`` (chat: ``--num-conversations`` conversations of
``--num-turns`` turns, each turn sent after the previous answer with the whole
history). Arrivals are Poisson at ``--request-rate`` (inf: all at once),
capped at ``--max-concurrency`` in flight. Per-worker load, the prefill hit ratio
(prompt tokens the prefill worker had cached, which is what prefix-aware routing wins)
and the decode hit ratio (prompt tokens the decode worker already held: their KV did not
move) come from raydix's /metrics; other servers skip them.
Each ``--launch`` run sets ``router.prefill_policy`` and ``router.decode_policy`` (``--policies``); the
policies run is recorded from the server's metrics labels, so a policy the
server does not use shows up as such.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import httpx
import numpy as np
import openai
from tqdm import tqdm

from bench_serving_launch import LaunchedServer, plot  # scripts/, beside this file

WORDS = ("radix tree page slot prefix cache decode prefill worker router token batch kernel memory pool "
         "transfer stream latency request schedule evict lock node hash chain budget").split()


@dataclass
class Turn:
    """One request: chat ``messages`` (the conversation so far is prepended at send time) or a ``prompt``."""

    max_tokens: int
    prompt: Optional[str] = None
    user: Optional[str] = None
    system: Optional[str] = None


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: List[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


def text(rng: random.Random, num_chars: int) -> str:
    out = []
    while sum(len(w) + 1 for w in out) < num_chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)[:num_chars]


def make_workload(args, rng: random.Random) -> List[List[Turn]]:
    """Conversations (lists of turns); a single-turn workload has one turn per conversation."""
    if args.workload == "random":
        return [[Turn(rng.randint(max(1, int(args.output_len * (1 - args.range_ratio))), args.output_len),
                      prompt=text(rng, rng.randint(max(1, int(args.input_len * (1 - args.range_ratio))),
                                                   args.input_len)))]
                for _ in range(args.num_prompts)]
    if args.workload == "shared-prefix":
        systems = [f"group {g}: " + text(rng, args.system_prompt_len) for g in range(args.num_groups)]
        convs = [[Turn(args.output_len, user=text(rng, args.question_len), system=s)]
                 for s in systems for _ in range(args.questions_per_group)]
        rng.shuffle(convs)
        return convs
    system = text(rng, args.system_prompt_len)
    return [[Turn(args.output_len, user=f"turn {t}: " + text(rng, args.question_len), system=system)
             for t in range(args.num_turns)] for _ in range(args.num_conversations)]


async def send(client: openai.AsyncOpenAI, model: str, turn: Turn, history: List[dict]) -> Result:
    start = time.perf_counter()
    common = dict(model=model, max_tokens=turn.max_tokens, temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    try:
        if turn.prompt is not None:
            stream = await client.completions.create(prompt=turn.prompt, **common)
        else:
            stream = await client.chat.completions.create(messages=history, **common)
        res, last, answer = Result(ok=True), None, []
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                piece = chunk.choices[0].text if turn.prompt is not None else chunk.choices[0].delta.content
                if last is None:
                    res.ttft = now - start
                elif piece:
                    res.itl.append(now - last)
                last = now if (last is None or piece) else last
                answer.append(piece or "")
            if chunk.usage:
                res.prompt_tokens, res.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                res.cached_tokens = (details.cached_tokens or 0) if details else 0
        res.e2e = time.perf_counter() - start
        history.append({"role": "assistant", "content": "".join(answer)})
        return res
    except openai.APIError as exc:
        return Result(ok=False, e2e=time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}")


async def run_workload(args, base_url: str, convs: List[List[Turn]]) -> Dict:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=args.api_key or "none", max_retries=0,
                                timeout=args.timeout)
    model = args.model or (await client.models.list()).data[0].id
    limit = asyncio.Semaphore(args.max_concurrency or 1 << 30)
    results: List[Result] = []
    bar = tqdm(total=sum(len(c) for c in convs), desc=args.label, unit="req", disable=args.no_progress)
    rng = np.random.default_rng(args.seed)

    async def conversation(turns: List[Turn]):
        history: List[dict] = []
        for turn in turns:
            if turn.system is not None and not history:
                history.append({"role": "system", "content": turn.system})
            if turn.user is not None:
                history.append({"role": "user", "content": turn.user})
            async with limit:
                results.append(await send(client, model, turn, history))
            bar.update(1)

    before = scrape_metrics(base_url, args.api_key)
    start = time.perf_counter()
    tasks = []
    for conv in convs:
        tasks.append(asyncio.ensure_future(conversation(conv)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    await client.close()
    after = scrape_metrics(base_url, args.api_key)
    return summarize(results, duration, diff_metrics(before, after))


def scrape_metrics(base_url: str, api_key: Optional[str]) -> Dict:
    """From raydix's /metrics: ``{(role, policy, worker): requests}`` routed, and the prompt and
    prefill-cached token counters; {} from other servers."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        body = httpx.get(base_url + "/metrics", timeout=10,
                         headers={"Authorization": f"Bearer {api_key}"} if api_key else None).text
        samples = [s for fam in text_string_to_metric_families(body) for s in fam.samples]
    except Exception:  # not raydix, or no metrics: no per-worker load
        return {}
    out = {(s.labels["role"], s.labels["policy"], s.labels["worker"]): s.value
           for s in samples if s.name == "raydix_routing_decisions_total"}
    for name in ("raydix_prompt_tokens_total", "raydix_prefill_cached_tokens_total",
                 "raydix_decode_cached_tokens_total"):
        out[name] = sum(s.value for s in samples if s.name == name)
    return out


def diff_metrics(before: Dict, after: Dict) -> Dict:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0) > 0}


def pct(values: List[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def summarize(results: List[Result], duration: float, server: Dict) -> Dict:
    good = [r for r in results if r.ok]
    ttft, e2e = [r.ttft for r in good], [r.e2e for r in good]
    tpot = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in good if r.completion_tokens > 1]
    itl = [x for r in good for x in r.itl]
    prompt = sum(r.prompt_tokens for r in good)
    routing = {k: n for k, n in server.items() if isinstance(k, tuple)}
    load: Dict[str, Dict[str, float]] = {}
    for (role, policy, worker), n in routing.items():
        load.setdefault(role, {})[worker] = n
    policies = sorted({f"{role}={policy}" for role, policy, _ in routing})
    server_prompt = server.get("raydix_prompt_tokens_total", 0.0)
    out = {
        "requests": len(results), "failed": len(results) - len(good), "duration_s": duration,
        "request_throughput": len(good) / duration,
        "output_throughput": sum(r.completion_tokens for r in good) / duration,
        "total_throughput": (prompt + sum(r.completion_tokens for r in good)) / duration,
        "cached_token_ratio": sum(r.cached_tokens for r in good) / prompt if prompt else 0.0,
        "prefill_hit_ratio": (server.get("raydix_prefill_cached_tokens_total", 0.0) / server_prompt
                              if server_prompt else None),
        "decode_hit_ratio": (server.get("raydix_decode_cached_tokens_total", 0.0) / server_prompt
                             if server_prompt else None),
        "policies_seen": policies, "worker_load": load,
        "load_skew": {role: max(w.values()) / max(1.0, min(w.values())) if len(w) > 1 else 1.0
                      for role, w in load.items()},
        "ttft_ms_all": [x * 1000 for x in ttft],
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        out[f"{name}_ms"] = {"mean": float(np.mean(values)) * 1000 if values else float("nan"),
                             "p50": pct(values, 50), "p99": pct(values, 99)}
    return out


def report(label: str, s: Dict) -> None:
    print(f"\n==== {label} ====")
    print(f"requests {s['requests']} (failed {s['failed']}) in {s['duration_s']:.1f}s; routing: "
          f"{', '.join(s['policies_seen']) or 'n/a'}")
    print(f"throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
          f"{s['total_throughput']:.1f} total tok/s")
    for name in ("ttft", "tpot", "itl", "e2e"):
        m = s[f"{name}_ms"]
        print(f"{name.upper():>5} ms: mean {m['mean']:8.1f}  p50 {m['p50']:8.1f}  p99 {m['p99']:8.1f}")
    hit, dhit = s["prefill_hit_ratio"], s["decode_hit_ratio"]
    print(f"cached-token ratio: {s['cached_token_ratio']:.3f} (usage); prefill hit ratio: "
          f"{'n/a' if hit is None else f'{hit:.3f}'}, decode hit ratio: {'n/a' if dhit is None else f'{dhit:.3f}'} "
          "(server metrics)")
    for role, workers in sorted(s["worker_load"].items()):
        loads = ", ".join(f"{w}: {int(n)}" for w, n in sorted(workers.items()))
        print(f"{role} load (requests): {loads}  (max/min {s['load_skew'][role]:.2f})")
    for error in s["errors"]:
        print(f"error: {error}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_argument_group("target")
    target.add_argument("--base-url", help="a running OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    target.add_argument("--launch", metavar="CONFIG", help="launch raydix with this config (once per policy)")
    target.add_argument("--policies", default="", help="comma-separated routing policies, each run with it as "
                        "router.prefill_policy and router.decode_policy (--launch)")
    target.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (--launch)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    target.add_argument("--model", help="default: the first of /v1/models")
    target.add_argument("--launch-timeout", type=float, default=600.0)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=("random", "shared-prefix", "multi-turn"), default="shared-prefix")
    w.add_argument("--num-prompts", type=int, default=64, help="random: requests")
    w.add_argument("--input-len", type=int, default=256, help="random: most prompt characters")
    w.add_argument("--range-ratio", type=float, default=0.5, help="random: lengths drawn from [len*(1-r), len]")
    w.add_argument("--output-len", type=int, default=16, help="tokens per answer (ignore_eos)")
    w.add_argument("--num-groups", type=int, default=4, help="shared-prefix: system prompts")
    w.add_argument("--questions-per-group", type=int, default=16)
    w.add_argument("--system-prompt-len", type=int, default=512, help="characters")
    w.add_argument("--question-len", type=int, default=48, help="characters")
    w.add_argument("--num-conversations", type=int, default=8, help="multi-turn")
    w.add_argument("--num-turns", type=int, default=4, help="multi-turn")
    w.add_argument("--seed", type=int, default=0)
    r = p.add_argument_group("load")
    r.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    r.add_argument("--max-concurrency", type=int, default=16)
    r.add_argument("--timeout", type=float, default=600.0, help="per request")
    o = p.add_argument_group("output")
    o.add_argument("--plot", help="PNG path for TTFT CDF, TTFT p50/p99, throughput and cached ratio")
    o.add_argument("--output-file", help="append one JSON line per run")
    o.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if bool(args.base_url) == bool(args.launch):
        p.error("give exactly one of --base-url and --launch")
    return args


def run_one(args, base_url: str, label: str) -> Dict:
    args.label = label
    convs = make_workload(args, random.Random(args.seed))  # the same requests for every policy
    summary = asyncio.run(run_workload(args, base_url, convs))
    report(label, summary)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps({"label": label, "workload": args.workload, **{
                k: v for k, v in summary.items() if k != "ttft_ms_all"}}) + "\n")
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    summaries: Dict[str, Dict] = {}
    if args.base_url:
        summaries["server"] = run_one(args, args.base_url.rstrip("/"), "server")
    else:
        for policy in [p for p in args.policies.split(",") if p] or [None]:
            label = policy or "default"
            server = LaunchedServer(args.launch, policy, args.set, f"bench_serving_{label}.log", args.launch_timeout)
            try:
                summaries[label] = run_one(args, server.url, label)
            finally:
                server.stop()
    if len(summaries) > 1:
        print("\n" + " | ".join(f"{lb}: TTFT p50 {s['ttft_ms']['p50']:.0f} ms, {s['output_throughput']:.0f} tok/s, "
                                f"cached {s['cached_token_ratio']:.2f}, prefill hit {s['prefill_hit_ratio'] or 0:.2f}, "
                                f"decode hit {s['decode_hit_ratio'] or 0:.2f}"
                                for lb, s in summaries.items()))
    if args.plot:
        plot(summaries, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
