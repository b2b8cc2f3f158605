"""What the hierarchical cache saves on multi-turn conversations that outgrow the device pool.

``--conversations`` conversations of ``--turns`` turns run round by round: each round sends
every conversation's next turn (its history, the previous answer and ``--user-tokens`` new
tokens) as one batch, greedy, ``--output-tokens`` out. The device KV pool holds
``--device-tokens`` slots, too few for every history, so between a conversation's turns
its prefix is evicted from the device. Modes:

* ``radix only``: evicted means recomputed;
* ``host tier (write_through | write_back)``: the prefix is loaded back from host memory
  (``hicache_ratio`` × the device pool), layer by layer while the forward runs, and backups
  copy off the loop; ``copies in the loop`` turns both overlaps off
  (``hicache_overlap_load=False``, ``hicache_overlap_write=False``);
* ``file tier, fresh engine each round``: a new engine per round, its device and host tiers
  empty; the prefix comes from the files earlier rounds wrote (a restart, or another worker
  sharing the folder).

Reported per mode: prompt tokens, the share served from cache (``cached_tokens``), tokens
loaded from host memory and fetched from files, tokens prefilled, TTFT mean / p90 over the
turns after the first, and the wall time of the rounds after the first. Every mode's answers
must equal the radix-only mode's (checked). Prints a table; ``--markdown`` appends it to a file.

    python scripts/bench_hicache.py [--conversations 8] [--turns 4] [--device-tokens 4096] [--device cuda]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from actors.engine import Engine  # noqa: E402
from bench_offline import build_model  # noqa: E402


def count_tier_traffic(engine: Engine, totals: Dict[str, int]) -> None:
    """Add the tokens the engine's HiCacheController loaded from host memory and read from
    files (prefetches and synchronous reads) to ``totals``."""
    controller = getattr(engine.scheduler.tree_cache, "cache_controller", None)
    if controller is None:
        return
    ps = controller.host_pool.page_size
    totals["host"] += controller.loaded_tokens
    totals["files"] += (controller.prefetched_pages + controller.read_pages) * ps


def run_mode(model_dir: str, args, engine_args: Dict, fresh_each_round: bool) -> Dict:
    rng = random.Random(args.seed)
    histories: List[List[int]] = [[] for _ in range(args.conversations)]
    totals = {"host": 0, "files": 0}
    ttfts, answers, prompt_tokens, cached, wall = [], [], 0, 0, 0.0
    params = {"max_new_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True}
    engine = None
    for turn in range(args.turns):
        if engine is None or fresh_each_round:
            if engine is not None:
                count_tier_traffic(engine, totals)
                engine.shutdown()
            engine = Engine(model_path=model_dir, skip_tokenizer_init=True, device=args.device,
                            attention_backend=args.attention_backend, **engine_args)
        prompts = [h + [rng.randrange(3, 2048) for _ in range(args.user_tokens)] for h in histories]
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        if turn:  # the first round is the same cold prefill in every mode
            wall += time.perf_counter() - start
            ttfts += [o["meta_info"]["ttft"] for o in outs]
            prompt_tokens += sum(len(p) for p in prompts)
            cached += sum(o["meta_info"]["cached_tokens"] for o in outs)
        answers.append([o["output_ids"] for o in outs])
        histories = [p + o["output_ids"] for p, o in zip(prompts, outs)]
    engine.check_integrity()
    count_tier_traffic(engine, totals)
    engine.shutdown()
    ttfts.sort()
    return {
        "prompt": prompt_tokens, "cached": cached, "host": totals["host"], "files": totals["files"],
        "prefilled": prompt_tokens - cached, "ttft_mean": statistics.mean(ttfts) * 1e3,
        "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))] * 1e3, "wall": wall, "answers": answers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--device-tokens", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--attention-backend", default=None, help="default: triton on cuda, torch on cpu")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here (use --device cpu, or a GPU machine)")
    args.attention_backend = args.attention_backend or ("triton" if args.device == "cuda" else "torch")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        build_model(model_dir)
        base = {"max_total_tokens": args.device_tokens, "page_size": args.page_size}
        hicache = dict(base, enable_hierarchical_cache=True, hicache_ratio=8.0)
        modes = [
            ("radix only", base, False),
            ("host tier, write_through", dict(hicache, hicache_write_policy="write_through"), False),
            ("host tier, write_through, copies in the loop",
             dict(hicache, hicache_write_policy="write_through", hicache_overlap_load=False,
                  hicache_overlap_write=False), False),
            ("host tier, write_back", dict(hicache, hicache_write_policy="write_back"), False),
            ("file tier, fresh engine each round", dict(hicache, hicache_storage_dir=str(Path(tmp) / "kv")), True),
        ]
        results = []
        for name, engine_args, fresh in modes:
            result = run_mode(model_dir, args, engine_args, fresh)
            if results and result["answers"] != results[0][1]["answers"]:
                raise SystemExit(f"{name}: answers differ from the radix-only mode's")
            results.append((name, result))
            print(f"{name}: done in {result['wall']:.1f}s", file=sys.stderr)

    lines = [
        f"{args.conversations} conversations × {args.turns} turns of {args.user_tokens} new tokens + "
        f"{args.output_tokens} out, device pool {args.device_tokens} tokens, page {args.page_size}, "
        f"{args.device} ({args.attention_backend} attention); rounds after the first:",
        "",
        "| mode | prompt tok | cached | from host | from files | prefilled | TTFT mean ms | TTFT p90 ms | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results:
        lines.append(
            f"| {name} | {r['prompt']:,} | {r['cached'] / r['prompt']:.0%} | {r['host']:,} | {r['files']:,} | "
            f"{r['prefilled']:,} | {r['ttft_mean']:,.0f} | {r['ttft_p90']:,.0f} | {r['wall']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
