"""Prefill and decode forward times of a Gemma 3-shaped tiny model (random weights, fp32; five
sliding-window layers to one full one, as Gemma 3) over long prompts, per sliding window: what
the attention backend pays for the sliding-window layers' keys.

Each window gets its own checkpoint and engine; the same prompts (random tokens) are prefilled
(in forwards of up to 4,096 tokens), then decoded greedily. Reported: the mean time of a prefill
and of a decode forward (model only, no scheduling).

    python scripts/bench_swa_decode.py [--prompt-len 2048] [--batch 8] [--windows 16 128 8192]
    python scripts/bench_swa_decode.py --prompt-len 4096 --batch 1 --windows 128  # one long prefill
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine import Engine  # noqa: E402
from actors.engine.tiny import build_tiny_checkpoint  # noqa: E402


def forward_ms(root: Path, window: int, prompts, output_len: int, attention_backend: str) -> Tuple[float, float]:
    """Mean prefill and decode forward times, in ms."""
    path = build_tiny_checkpoint("gemma3", root / f"window{window}", sliding_window=window,
                                 num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                 max_position_embeddings=8192)
    total = sum(len(p) + output_len for p in prompts)
    engine = Engine(model_path=str(path), skip_tokenizer_init=True, device="cpu", attention_backend=attention_backend,
                    max_total_tokens=2 * total, chunked_prefill_size=4096)
    runner, times = engine.runner, {True: [], False: []}  # by is_decode
    forward = runner.forward

    def timed(forward_batch):
        start = time.perf_counter()
        logits = forward(forward_batch)
        times[forward_batch.forward_mode.is_decode].append(time.perf_counter() - start)
        return logits

    runner.forward = timed
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": output_len, "temperature": 0,
                                                        "ignore_eos": True})
    engine.check_integrity()
    engine.shutdown()
    return tuple(1e3 * sum(times[decode]) / len(times[decode]) for decode in (False, True))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--windows", type=int, nargs="+", default=[16, 128, 8192])
    parser.add_argument("--attention-backend", default="torch")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 261) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    print(f"{args.batch} prompts of {args.prompt_len} tokens, {args.output_len} decode steps, "
          f"{args.attention_backend} attention")
    print("| window | prefill ms/forward | decode ms/step |\n|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="raydix-bench-") as tmp:
        for window in args.windows:
            prefill_ms, decode_ms = forward_ms(Path(tmp), window, prompts, args.output_len, args.attention_backend)
            print(f"| {window:,} | {prefill_ms:.1f} | {decode_ms:.2f} |")


if __name__ == "__main__":
    main()
