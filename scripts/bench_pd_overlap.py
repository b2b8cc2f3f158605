"""Overlapping the KV push with prefill compute: TTFT and prefill throughput, on vs off.

An in-process prefill worker and decode worker (no Ray) serve ``--num-prompts``
random prompts of ``--prompt-len`` tokens, all submitted at once, prefilled in
``--chunk``-token chunks, one output token each (the decode side only lands
the KV and answers). The model is a Llama shape with random weights (built
here, no download) whose KV is large for its compute — 8 KV heads × 64 dims
in fp32 — so that the transfer is a real share of a prefill on a CPU.

For each backend (``shm``: writes into the decode rank's shared memory;
``torch_dist``: gloo messages over loopback, landed by the decode loop) it
runs twice: ``sync`` (``disaggregation_async_push=False``: every chunk is
pushed inside the engine loop, which waits) and ``async`` (pushed on the
prefill rank's transfer thread while the next chunk is computed). Reported:
prefill throughput (prompt tokens / time until the last completion notice),
mean and p90 TTFT (submission → the decode side's first token), the mean
push time a request still waited for after its last chunk ("exposed"), and
the bytes moved. Forward passes use ``--threads`` torch threads (default 1:
the transfer thread gets the other core of a 2-core machine).

``--link-gbps`` also runs each setting over an emulated slower link: after
every push the prefill rank's agent sleeps for the bytes' time on a link of
that many Gbit/s (a sleep releases the GIL, as a socket send does), standing
in for a cross-node network that a loopback on one machine cannot show.

    python scripts/bench_pd_overlap.py [--num-prompts 8] [--prompt-len 1024] [--chunk 256] [--backends shm torch_dist]
                                       [--link-gbps 0 1]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.workers import DecodeWorker, PrefillWorker  # noqa: E402

PARAMS = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}


def build_model(path: str, seed: int = 0) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=8, head_dim=64, num_hidden_layers=4,
                      intermediate_size=512, vocab_size=2048, max_position_embeddings=8192, dtype="float32")
    LlamaForCausalLM(cfg).save_pretrained(path)


async def _one(prefill, decode, rid: str, ids: List[int], start: float) -> Dict[str, float]:
    handoffs = await decode.reserve(rid, ids, PARAMS)
    notice = await prefill.prefill(rid, ids, PARAMS, handoffs)
    notice_at = time.perf_counter()
    async for _ in decode.stream(rid, notice):
        break
    return {"ttft": time.perf_counter() - start, "notice_at": notice_at, "exposed": notice["transfer_time"],
            "bytes": notice["transfer_bytes"]}


def emulate_link(agent, gbps: float) -> None:
    """After each push, wait for its bytes' time on a ``gbps`` Gbit/s link."""
    real = agent.push

    def push(*args, **kwargs):
        moved = real(*args, **kwargs)
        time.sleep(moved * 8 / (gbps * 1e9))
        return moved

    agent.push = push


def run(path: str, backend: str, asynchronous: bool, batch: List[List[int]], chunk: int,
        link_gbps: float = 0.0) -> Dict[str, float]:
    pool = sum(len(ids) for ids in batch) + 4096
    base = dict(max_total_tokens=pool, skip_tokenizer_init=True, context_length=8192)
    prefill = PrefillWorker(path, dict(base, chunked_prefill_size=chunk, disaggregation_async_push=asynchronous),
                            backend=backend)
    decode = DecodeWorker(path, base, backend=backend)
    if link_gbps:
        emulate_link(prefill.agents[backend], link_gbps)

    async def go():
        await _one(prefill, decode, "warm-up", batch[0][:chunk * 2], time.perf_counter())
        start = time.perf_counter()
        outs = await asyncio.gather(*(_one(prefill, decode, f"r{i}", ids, start) for i, ids in enumerate(batch)))
        return start, outs

    try:
        start, outs = asyncio.run(go())
    finally:
        prefill.shutdown()
        decode.shutdown()
    ttfts = sorted(o["ttft"] for o in outs)
    wall = max(o["notice_at"] for o in outs) - start
    return {
        "tok_s": sum(len(ids) for ids in batch) / wall,
        "ttft_mean": statistics.mean(ttfts) * 1e3,
        "ttft_p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] * 1e3,
        "exposed": statistics.mean(o["exposed"] for o in outs) * 1e3,
        "mib": sum(o["bytes"] for o in outs) / 2**20,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--backends", nargs="+", default=["shm", "torch_dist"])
    parser.add_argument("--repeat", type=int, default=2, help="runs per setting; the best throughput is kept")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--link-gbps", type=float, nargs="+", default=[0.0],
                        help="emulated link speeds to run over (0: the backend as it is)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    batch = [[rng.randrange(3, 2048) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp)
        for gbps in args.link_gbps:
            for backend in args.backends:
                for asynchronous in (False, True):
                    runs = [run(tmp, backend, asynchronous, batch, args.chunk, gbps) for _ in range(args.repeat)]
                    label = backend + (f" + {gbps:g} Gbit/s link" if gbps else "")
                    rows.append((label, "async" if asynchronous else "sync", max(runs, key=lambda r: r["tok_s"])))
    print(f"{args.num_prompts} prompts × {args.prompt_len} tokens, {args.chunk}-token chunks, 1 output token, "
          f"{args.threads} torch thread(s)")
    print("| backend | push | prefill tok/s | TTFT mean ms | TTFT p90 ms | exposed push ms | MiB moved |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for backend, mode, r in rows:
        print(f"| {backend} | {mode} | {r['tok_s']:.0f} | {r['ttft_mean']:.0f} | {r['ttft_p90']:.0f} | "
              f"{r['exposed']:.1f} | {r['mib']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
