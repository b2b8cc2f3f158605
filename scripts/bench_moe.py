"""One MoE layer's routed experts, eager (``moe_backend=torch``) and fused (``moe_backend=triton``).

"eager": :func:`~actors.engine.models.moe.run_experts` as HF runs its experts — the experts chosen read
to the host (``unique().tolist()``), then one gate/up/down matmul chain per chosen expert on its tokens.
"fused": the same layer's experts stacked (:meth:`~actors.engine.models.moe.ExpertList.fuse`) and run by
:mod:`actors.engine.fused_moe` — the pairs sorted by expert, two grouped-GEMM launches, the top-k sum. Each
row is a batch of ``tokens`` routed at random (softmax top-k over standard-normal logits: every expert
busy once the batch is large); times are the median of ``--iters`` calls after a warm-up, in ms, with the
largest difference between the two outputs relative to the largest output.

On CUDA the sizes are real models' (``qwen3-30b-a3b``: 128 experts of 768, top-8, hidden 2048;
``mixtral-8x7b``: 8 of 14336, top-2, hidden 4096; one TP rank's whole experts), in bf16. On the CPU the
kernels run under Triton's interpreter (set here), at tiny sizes: a correctness run, not a speed one.

``--quant gptq | awq | compressed``: the experts packed 4-bit in groups of 128, their words random (as
bench_wna16.py's layers); eager is then each expert's packed linear (on CUDA the dequant-GEMM kernel;
compressed-tensors' dequantize-then-matmul), fused the packed grouped GEMM (:mod:`actors.engine.moe_wna16`).
``--quant fp8 | fp8-tensor | int8``: the experts as compressed-tensors stores FP8 / int8 values (``-FP8-dynamic``'s
per-channel scales, per-tensor FP8's one a matrix, ``-quantized.w8a8``'s int8 channels), random values; eager
dequantizes each expert's weights then multiplies, fused scales each tile in the grouped GEMM.

    python scripts/bench_moe.py [--device cuda] [--shapes qwen3-30b-a3b mixtral-8x7b] [--tokens 1 64 2048]
                                [--quant gptq]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before Triton is imported)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine import compressed_tensors  # noqa: E402
from actors.engine.fused_moe import fuse_experts  # noqa: E402
from actors.engine.models.moe import ExpertList, qwen_expert, run_experts  # noqa: E402
from actors.engine.parallel import SINGLE, LinearBase  # noqa: E402
from bench_common import median_ms  # noqa: E402  (scripts/, beside this file)
from bench_wna16 import FORMATS, GROUP_SIZE, pack_randomly  # noqa: E402


class Shape(NamedTuple):
    hidden: int
    intermediate: int
    experts: int
    top_k: int


# compressed-tensors' unpacked values: -FP8-dynamic's, per-tensor FP8's, -quantized.w8a8's
UNPACKED = {"fp8": compressed_tensors.Scheme(8, "float", "channel", 0, True, False),
            "fp8-tensor": compressed_tensors.PER_TENSOR_FP8,
            "int8": compressed_tensors.Scheme(8, "int", "channel", 0, True, False)}

SHAPES = {
    "qwen3-30b-a3b": Shape(2048, 768, 128, 8),
    "mixtral-8x7b": Shape(4096, 14336, 8, 2),
    "tiny": Shape(64, 32, 8, 2),
    "tiny-top1": Shape(64, 32, 4, 1),
}


def make_experts(shape: Shape, dtype: torch.dtype, device: str, quant: str = "none") -> ExpertList:
    """``shape``'s experts in ``dtype``, their weights ~ N(0, 1/fan_in), or packed or stored by ``quant`` (fp32
    scales, as a loaded model keeps them)."""
    with torch.device(device):
        experts = ExpertList(range(shape.experts),
                             lambda: qwen_expert(shape.hidden, shape.intermediate, "silu", SINGLE, "i"))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, p.shape[1] ** -0.5)
    experts = experts.to(dtype).requires_grad_(False)
    if quant != "none":
        for linear in [m for m in experts.modules() if isinstance(m, LinearBase)]:
            if quant in UNPACKED:
                store_randomly(linear, UNPACKED[quant])
            else:
                pack_randomly(linear, quant)
    return experts


def store_randomly(linear: torch.nn.Module, scheme: compressed_tensors.Scheme) -> None:
    """``linear`` as compressed-tensors stores ``scheme``'s FP8 / int8 values, random ones (and scales) keeping
    each weight ~ 1/sqrt(fan_in)."""
    shape = (linear.out_features, linear.in_features)
    compressed_tensors.quantize_linear(linear, "expert", scheme, shape, [1])
    magnitude = 1 if scheme.type == "float" else 32  # (of a stored value)
    with torch.no_grad():
        values = torch.randn(shape, device=linear.weight.device) * magnitude
        linear.weight.copy_(values if scheme.type == "float" else values.round().clamp(-127, 127))
        linear.weight_scale.fill_(1 / magnitude / shape[1] ** 0.5)


def bench(shape: Shape, num_tokens: int, dtype: torch.dtype, device: str, iters: int, quant: str = "none") -> tuple:
    """(eager ms, fused ms, the outputs' largest difference over the largest output)."""
    torch.manual_seed(0)
    experts = make_experts(shape, dtype, device, quant)
    x = torch.randn(num_tokens, shape.hidden, device=device, dtype=dtype)
    weights, idx = torch.softmax(torch.randn(num_tokens, shape.experts, device=device), -1).topk(shape.top_k, -1)
    weights = weights.to(dtype)
    with torch.inference_mode():
        eager_out = run_experts(experts, x, idx, weights)
        eager = median_ms(lambda: run_experts(experts, x, idx, weights), iters, device)
        fuse_experts(torch.nn.Sequential(experts))
        fused_out = run_experts(experts, x, idx, weights)
        fused = median_ms(lambda: run_experts(experts, x, idx, weights), iters, device)
    error = ((fused_out - eager_out).abs().max() / eager_out.abs().max()).item()
    return eager, fused, error


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES),
                        default=["qwen3-30b-a3b", "mixtral-8x7b"] if cuda else ["tiny", "tiny-top1"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 512, 2048] if cuda else [1, 13, 64])
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    parser.add_argument("--iters", type=int, default=20 if cuda else 3)
    parser.add_argument("--quant", choices=["none", *FORMATS, *UNPACKED], default="none",
                        help=f"the experts packed 4-bit in groups of {GROUP_SIZE}, their words random; or FP8 / "
                             "int8 values (compressed-tensors'), random")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    weights = ("unquantized" if args.quant == "none" else f"{args.quant} 4-bit, group {GROUP_SIZE}"
               if args.quant in FORMATS else f"{args.quant}, {UNPACKED[args.quant].strategy} scales")
    print(f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'interpreted'}), "
          f"{args.dtype}, {weights}, median of {args.iters}")
    print(f"{'shape':<15}{'experts':>8}{'top_k':>6}{'tokens':>8}{'eager ms':>11}{'fused ms':>11}{'speed-up':>10}"
          f"{'rel err':>10}")
    for name in args.shapes:
        shape = SHAPES[name]
        for num_tokens in args.tokens:
            eager, fused, error = bench(shape, num_tokens, dtype, args.device, args.iters, args.quant)
            print(f"{name:<15}{shape.experts:>8}{shape.top_k:>6}{num_tokens:>8}{eager:>11.3f}{fused:>11.3f}"
                  f"{eager / fused:>9.3g}x{error:>10.1e}")


if __name__ == "__main__":
    main()
