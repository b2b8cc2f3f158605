"""A GPTQ / AWQ packed linear layer (:mod:`actors.engine.wna16`) against its weight dequantized, then
multiplied, and against a dense layer of the same size; compressed-tensors' packed int4 alongside.

For each layer (``K×N``: input × output features) and batch of ``M`` rows: "linear" is
:func:`~actors.engine.wna16.linear` as a served layer calls it (on CUDA the fused dequant-GEMM,
:mod:`~actors.engine.wna16_kernels`, each weight tile dequantized in registers; on the CPU the torch path),
"dequant" the weight dequantized whole (:func:`~actors.engine.wna16.dequantize`,
:func:`~actors.engine.compressed_tensors.dequantize`), then ``F.linear`` (compressed-tensors' served path),
"dense" ``F.linear`` with a dense weight in the activations' dtype. GB/s is the weight's bytes as stored
(int32 words, zeros and fp32 scales; the dense weight's) over the time: the bandwidth a decode batch, which
reads the weight once, is bound by. The layers are 4-bit, groups of 128, their words random; "rel err" is
the largest difference between linear's and dequant's outputs relative to the largest output. Times are
the median of ``--iters`` calls after a warm-up.

On CUDA the layers are Llama-2-7B's (``4096x4096``: attention; ``4096x11008``: gate / up), in bf16. On the
CPU they are small and fp32, Triton's interpreter off: linear is the torch path (the dequant path again),
so the run checks the script, not the kernel.

    python scripts/bench_wna16.py [--device cuda] [--layers 4096x4096 4096x11008] [--rows 1 16 128 1024]
                                  [--plot wna16.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, Tuple

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine import compressed_tensors, wna16  # noqa: E402
from bench_common import median_ms, write_plot  # noqa: E402  (scripts/, beside this file)

GROUP_SIZE = 128
FORMATS = {"gptq": wna16.PackedConfig(wna16.GPTQ, 4, GROUP_SIZE), "awq": wna16.PackedConfig(wna16.AWQ, 4, GROUP_SIZE),
           "compressed": compressed_tensors.Scheme(4, "int", "group", GROUP_SIZE, symmetric=True, packed=True)}


def random_words(shape, device: str) -> torch.Tensor:
    return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=device)


def quantized_layer(fmt: str, in_features: int, out_features: int, device: str) -> nn.Module:
    """A 4-bit ``fmt`` layer [out, in] with random words and scales of a trained layer's size."""
    return pack_randomly(nn.Linear(in_features, out_features, bias=False, device=device), fmt)


def pack_randomly(module: nn.Linear, fmt: str) -> nn.Module:
    """``module`` (one rank's whole layer) packed 4-bit by ``fmt``, its words random, its scales of a trained
    layer's size (bench_moe.py's experts too)."""
    device, full_shape = module.weight.device, (module.out_features, module.in_features)
    if fmt == "compressed":
        compressed_tensors.quantize_linear(module, fmt, FORMATS[fmt], full_shape, [1])
    else:
        wna16.quantize_linear(module, fmt, FORMATS[fmt], full_shape)
    with torch.no_grad():
        for param in module.parameters():
            if param.dtype == torch.int32:
                param.copy_(random_words(param.shape, device))
            else:
                param.uniform_(1e-3, 2e-3)
    return module


def weight_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def bench(fmt: str, layer: Tuple[int, int], rows: int, dtype: torch.dtype, device: str, iters: int) -> Dict[str, float]:
    """ms of linear (not for compressed: its served path is dequant), dequant and dense, each one's GB/s,
    and linear's output against dequant's."""
    torch.manual_seed(0)
    in_features, out_features = layer
    module = quantized_layer(fmt, in_features, out_features, device)
    dense = torch.randn(out_features, in_features, device=device, dtype=dtype) * in_features ** -0.5
    x = torch.randn(rows, in_features, device=device, dtype=dtype)
    lib = compressed_tensors if fmt == "compressed" else wna16
    calls = {"dequant": lambda: F.linear(x, lib.dequantize(module, dtype)), "dense": lambda: F.linear(x, dense)}
    if fmt != "compressed":
        calls["linear"] = lambda: wna16.linear(module, x)
    packed = weight_bytes(module)
    stored = {"dequant": packed, "linear": packed, "dense": dense.numel() * dense.element_size()}
    result = {}
    with torch.inference_mode():
        for name, call in calls.items():
            result[name] = median_ms(call, iters, device)
            result[f"{name} GB/s"] = stored[name] / result[name] / 1e6
        if "linear" in calls:
            reference = calls["dequant"]().float()
            result["rel err"] = ((calls["linear"]().float() - reference).abs().max() / reference.abs().max()).item()
    return result


def layer_size(text: str) -> Tuple[int, int]:
    in_features, out_features = text.split("x")
    return int(in_features), int(out_features)


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--layers", nargs="+", default=["4096x4096", "4096x11008"] if cuda else ["256x256", "256x688"],
                        help="input x output features")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 128, 1024] if cuda else [1, 16, 128])
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    parser.add_argument("--iters", type=int, default=50 if cuda else 5)
    parser.add_argument("--plot", type=Path, help="PNG path: GB/s by rows, a panel a layer")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    path = "fused Triton kernel" if args.device == "cuda" else "torch path, no Triton"
    title = (f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else path}), "
             f"{args.dtype}, 4-bit, group {GROUP_SIZE}, median of {args.iters}")
    print(title)
    print("| layer | rows | format | linear ms | dequant ms | dense ms | linear GB/s | dequant GB/s | dense GB/s "
          "| linear vs dense | rel err |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    panels = []
    for text in args.layers:
        series = {}
        for fmt in args.formats:
            results = [bench(fmt, layer_size(text), rows, dtype, args.device, args.iters) for rows in args.rows]
            for rows, r in zip(args.rows, results):
                ms = " | ".join(f"{r[k]:.3f}" if k in r else "—" for k in ("linear", "dequant", "dense"))
                bw = " | ".join(f"{r[f'{k} GB/s']:.3g}" if k in r else "—" for k in ("linear", "dequant", "dense"))
                speed = f"{r['dense'] / r['linear']:.2f}x" if "linear" in r else "—"
                err = f"{r['rel err']:.1e}" if "rel err" in r else "—"
                print(f"| {text} | {rows} | {fmt} | {ms} | {bw} | {speed} | {err} |")
            for name in ("linear", "dequant") if fmt != "compressed" else ("dequant",):
                series[f"{fmt} {name}"] = (args.rows, [r[f"{name} GB/s"] for r in results])
            series["dense"] = (args.rows, [r["dense GB/s"] for r in results])
        panels.append((f"{text}: weight GB/s", series))
    if args.plot:
        write_plot(args.plot, title, "rows (M)", panels)


if __name__ == "__main__":
    main()
