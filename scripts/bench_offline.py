"""Offline throughput of the engine against HF transformers ``generate``.

A small Llama-shaped model with random weights (built here, no download) serves
two workloads, each also run through HF ``generate`` in the same process on
the same prompts:

* random: prompts of 64–512 random tokens;
* shared prefix: a 1,024-token system prompt shared by all, + 32–128 tokens.

Reported: input and output tokens per second, the engine's cached-token
share, and the wall time spent outside model forwards (scheduler, sampling,
allocation, the radix cache: the overhead), as a share and per engine step. A
table is printed and a bar chart is written (``--plot``, needs matplotlib).
``--layers 1 --hidden 64`` makes forwards cheap, so that the overhead shows
on a CPU too.

    python scripts/bench_offline.py [--num-prompts 32] [--output-len 32] [--device cpu|cuda] [--layers 4] [--hidden 256]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine import Engine  # noqa: E402


def build_model(path: str, seed: int = 0, layers: int = 4, hidden: int = 256) -> None:
    """Heads of 32 dims (two query heads per KV head), an MLP 3 × ``hidden`` wide."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    heads = max(2, hidden // 32)
    cfg = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads // 2,
                      num_hidden_layers=layers, intermediate_size=3 * hidden, vocab_size=2048,
                      max_position_embeddings=4096, dtype="float32")
    LlamaForCausalLM(cfg).save_pretrained(path)


def workloads(num_prompts: int, seed: int = 0):
    rng = random.Random(seed)
    rand = [[rng.randrange(3, 2048) for _ in range(rng.randint(64, 512))] for _ in range(num_prompts)]
    system = [rng.randrange(3, 2048) for _ in range(1024)]
    shared = [system + [rng.randrange(3, 2048) for _ in range(rng.randint(32, 128))] for _ in range(num_prompts)]
    return {"random": rand, "shared prefix": shared}


def run_engine(engine: Engine, prompts, output_len: int):
    """Wall seconds, cached tokens, the overhead's share of the wall time and ms per step."""
    runner = engine.runner
    runner.forward_time, runner.num_forwards, start = 0.0, 0, time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True})
    wall = time.perf_counter() - start
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    overhead = wall - runner.forward_time
    return wall, cached, overhead / wall, 1e3 * overhead / max(runner.num_forwards, 1)


def run_hf(model, prompts, output_len: int, device: str) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for p in prompts:  # HF generate without padding: one request at a time
            model.generate(torch.tensor([p], device=device), max_new_tokens=output_len, min_new_tokens=output_len,
                           do_sample=False, pad_token_id=0)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--attention-backend", default=None, help="default: triton on cuda, torch on cpu")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the model")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the model")
    parser.add_argument("--plot", type=Path, default=Path("bench_offline.png"), help="bar chart (PNG) path")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here (use --device cpu, or a GPU machine)")
    backend = args.attention_backend or ("triton" if args.device == "cuda" else "torch")

    from transformers import AutoModelForCausalLM

    path = tempfile.mkdtemp(prefix="raydix-bench-")
    build_model(path, layers=args.layers, hidden=args.hidden)
    engine = Engine(model_path=path, skip_tokenizer_init=True, device=args.device, attention_backend=backend,
                    max_total_tokens=200_000, max_running_requests=64, chunked_prefill_size=4096)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
    rows = []
    for name, prompts in workloads(args.num_prompts).items():
        engine.flush_cache()
        wall, cached, overhead, step_ms = run_engine(engine, prompts, args.output_len)
        hf_wall = run_hf(hf, prompts, args.output_len, args.device)
        n_in, n_out = sum(len(p) for p in prompts), len(prompts) * args.output_len
        rows.append((name, n_in, n_out, n_in / wall, n_out / wall, cached / n_in, overhead, n_in / hf_wall,
                     n_out / hf_wall, step_ms))
    engine.check_integrity()
    engine.shutdown()

    title = (f"offline throughput — {args.num_prompts} prompts, {args.output_len} output tokens, {args.device}, "
             f"{backend} attention, {args.layers} layers × {args.hidden}")
    lines = ["| workload | in tok | out tok | raydix in tok/s | raydix out tok/s | cached | overhead | overhead ms/step "
             "| HF in tok/s | HF out tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]:,} | {r[2]:,} | {r[3]:,.0f} | {r[4]:,.0f} | {r[5]:.0%} | {r[6]:.0%} | {r[9]:.2f} "
                     f"| {r[7]:,.0f} | {r[8]:,.0f} |")
    table = "\n".join(lines)
    print(title)
    print(table)
    if args.markdown:
        args.markdown.write_text(f"{title}\n\n{table}\n")
    write_plot(rows, args.plot, title)


def write_plot(rows, path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot written)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r[0] for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r[4] for r in rows], width=0.4, label="raydix")
    ax.bar([x + 0.2 for x in xs], [r[8] for r in rows], width=0.4, label="HF generate")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
