"""Decode step latency with CUDA graphs on and off (``disable_cuda_graph``).

The built-in tiny Llama (:mod:`actors.engine.tiny`), or ``--model``, decodes ``--steps`` greedy tokens
for each of ``--batches`` concurrent requests (``ignore_eos``: every request runs the full length). A
step's time is the run's wall time less a prefill-only run's (``max_new_tokens=1``), over the steps:
the decode forwards alone, best of ``--repeats``; tokens/s is the batch's tokens a step over it.
"graphs" replays the captured decode graph of the batch's padded size, "eager" launches every kernel
(``disable_cuda_graph=True``); both use ``--attention-backend`` (triton: the one graphs capture), and
"equal" says whether the two settings' tokens are the same (they should be: greedy, the same kernels).

On the CPU graphs cannot run (no CUDA), so only "eager" runs, with the torch attention backend (Triton's
would run interpreted) and small settings: a smoke run of the script, not a speed one. Each setting's
line above the table says whether its graphs were captured, or why not.

    python scripts/bench_decode.py [--device cuda] [--model PATH] [--batches 1 8 32 64] [--steps 64]
                                   [--plot decode.png]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine import Engine  # noqa: E402
from actors.engine.cuda_graph_runner import graphs_off_reason  # noqa: E402
from actors.engine.tiny import build_tiny_checkpoint  # noqa: E402
from bench_common import write_plot  # noqa: E402  (scripts/, beside this file)

SETTINGS = {"eager": True, "graphs": False}  # name → disable_cuda_graph


def timed_generate(engine: Engine, prompts: List[List[int]], new_tokens: int, repeats: int):
    """Best wall seconds of ``repeats`` greedy runs of ``new_tokens`` tokens each, and the last run's tokens."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        best = min(best, time.perf_counter() - start)
    return best, [o["output_ids"] for o in outs]


def decode_step(engine: Engine, prompts: List[List[int]], steps: int, repeats: int):
    """Seconds a decode step of ``prompts`` (``steps + 1`` tokens' run less a prefill-only run's, over the
    steps, after a warm-up run: Triton's compiles, the allocator), and the outputs."""
    timed_generate(engine, prompts, steps + 1, 1)
    prefill, _ = timed_generate(engine, prompts, 1, repeats)
    whole, outputs = timed_generate(engine, prompts, steps + 1, repeats)
    return max(whole - prefill, 1e-9) / steps, outputs


def bench_setting(model_path: str, args, disable_cuda_graph: bool) -> Tuple[str, Dict[int, tuple]]:
    """(whether graphs run, and if not why; batch size → (ms a decode step, tokens/s, the outputs))."""
    engine = Engine(model_path=model_path, device=args.device, attention_backend=args.attention_backend,
                    disable_cuda_graph=disable_cuda_graph, cuda_graph_max_bs=max(args.batches),
                    max_running_requests=max(args.batches),
                    max_total_tokens=max(args.batches) * (args.steps + 64) * 2)
    try:
        reason = graphs_off_reason(engine.runner)
        reason = "captured" if reason is None else f"off: {reason}"
        rows = {}
        for batch in args.batches:
            prompts = [engine.tokenizer.encode(f"request {i}: write") for i in range(batch)]
            step, outputs = decode_step(engine, prompts, args.steps, args.repeats)
            rows[batch] = (step * 1e3, batch / step, outputs)
        engine.check_integrity()
        return reason, rows
    finally:
        engine.shutdown()


def model_parser(description: str) -> argparse.ArgumentParser:
    """A decode benchmark's command line: ``--device`` and ``--model`` (bench_pp.py's too)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", help="a checkpoint's path (default: the tiny Llama, built here)")
    return parser


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = model_parser(__doc__.split("\n")[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64] if cuda else [1, 8])
    parser.add_argument("--steps", type=int, default=64 if cuda else 8)
    parser.add_argument("--repeats", type=int, default=3 if cuda else 1)
    parser.add_argument("--attention-backend", choices=("triton", "torch"), default="triton" if cuda else "torch")
    parser.add_argument("--plot", type=Path, help="PNG path: ms a step and tokens/s by batch size")
    args = parser.parse_args()
    settings = SETTINGS if args.device == "cuda" else {"eager": True}

    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model or str(build_tiny_checkpoint("llama", Path(tmp) / "llama", seed=0))
        results = {name: bench_setting(model_path, args, off) for name, off in settings.items()}
    model = args.model or "tiny llama"
    title = (f"{model}, {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'no GPU'}), "
             f"{args.attention_backend} attention, {args.steps} steps, greedy, best of {args.repeats}")
    print(title)
    for name, (reason, _) in results.items():
        print(f"  {name}: graphs {reason}")
    if "graphs" not in results:
        print("  graphs: not run (no CUDA: the CPU runs every forward eagerly)")
    names = list(results)
    print("| batch | " + " | ".join(f"{n} ms/step" for n in names) + " | " + " | ".join(f"{n} tok/s" for n in names)
          + (" | speed-up | equal |" if len(names) > 1 else " |"))
    print("|---:|" + "---:|" * 2 * len(names) + ("---:|---|" if len(names) > 1 else ""))
    for batch in args.batches:
        row = [results[n][1][batch] for n in names]
        line = (f"| {batch} | " + " | ".join(f"{r[0]:.3f}" for r in row) + " | "
                + " | ".join(f"{r[1]:,.0f}" for r in row))
        if len(row) > 1:
            line += f" | {row[0][0] / row[1][0]:.2f}x | {'yes' if row[0][2] == row[1][2] else 'NO'}"
        print(line + " |")
    if args.plot:
        write_plot(args.plot, title, "batch size",
                   [(measure, {n: (args.batches, [results[n][1][b][i] for b in args.batches]) for n in names})
                    for i, measure in enumerate(("ms per decode step", "tokens / s"))])


if __name__ == "__main__":
    main()
