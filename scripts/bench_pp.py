"""Pipeline micro-batches: decode throughput of ``pp_size`` stages with one batch in flight against
``pp_micro_batches`` of them (:mod:`actors.engine.micro_batch`).

A tiny Llama (``--hidden``, ``--layers``), or ``--model``, split into ``--pp`` stages of one rank each
(spawned processes: gloo on the CPU, NCCL on one GPU each), decodes ``--steps`` greedy tokens for each
of ``--batch`` requests (``ignore_eos``). A step's time is the run's wall time less a prefill-only
run's, over the steps (bench_decode.py's measure); "forwards" counts rank 0's launches a decode step
(one batch: 1; micro-batches: one per share). With micro-batches rank 0 schedules and samples while
the later stages run a batch, but the stages' forwards do not overlap yet: rank 0 broadcasts each
batch to every rank, a collective the last stage joins only once its forward of the batch before is
done (actors.engine.micro_batch). So today the smaller shares' extra forwards cost more than the
overlap wins back; the stages run at once when the batches go to them point to point.
"equal" says whether the tokens are one batch in flight's (they must be: greedy, the same batches' math).

    python scripts/bench_pp.py [--device cuda] [--pp 2] [--batch 16] [--steps 32] [--micro-batches 1 2]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine import Engine  # noqa: E402
from actors.engine.tiny import build_tiny_checkpoint  # noqa: E402
from bench_decode import decode_step, model_parser  # noqa: E402  (scripts/, beside this file)


def bench(model_path: str, args, micro_batches: int):
    """(ms a decode step, tokens/s, rank 0's forwards a decode step, the outputs)."""
    engine = Engine(model_path=model_path, device=args.device, skip_tokenizer_init=True, pp_size=args.pp,
                    pp_micro_batches=micro_batches, attention_backend="triton" if args.device == "cuda" else "torch",
                    max_running_requests=args.batch, max_total_tokens=args.batch * (args.steps + 64) * 2)
    try:
        prompts = [[5 + (i * 7 + j) % 250 for j in range(16)] for i in range(args.batch)]
        step, outputs = decode_step(engine, prompts, args.steps, args.repeats)
        before = engine.runner.num_forwards  # (a run of the batch: its prefill and steps)
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": args.steps + 1, "ignore_eos": True})
        forwards = (engine.runner.num_forwards - before - 1) / args.steps
        engine.check_integrity()
        return step * 1e3, args.batch / step, forwards, outputs
    finally:
        engine.shutdown()


def main() -> None:
    parser = model_parser(__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--micro-batches", nargs="+", type=int, default=None, help="default: 1 and --pp")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    settings = args.micro_batches or [1, args.pp]

    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model or str(build_tiny_checkpoint(
            "llama", Path(tmp) / "llama", seed=0, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32, num_key_value_heads=args.hidden // 64))
        results = {n: bench(model_path, args, n) for n in settings}
    model = args.model or f"tiny llama (hidden {args.hidden}, {args.layers} layers)"
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"{os.cpu_count()} CPU cores"
    print(f"{model}, pp {args.pp}, {args.device} ({device}), batch {args.batch}, {args.steps} steps, "
          f"best of {args.repeats}")
    print("| micro-batches | ms/step | tok/s | forwards/step | speed-up | equal |")
    print("|---:|---:|---:|---:|---:|---|")
    base = results[settings[0]]
    for n, (ms, tokens, forwards, outputs) in results.items():
        print(f"| {n} | {ms:.2f} | {tokens:,.0f} | {forwards:.2f} | {base[0] / ms:.2f}x | "
              f"{'yes' if outputs == base[3] else 'NO'} |")


if __name__ == "__main__":
    main()
