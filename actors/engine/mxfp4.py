"""MXFP4 weights (OCP microscaling FP4), as released gpt-oss checkpoints store their experts, read
back into the model's dtype on load (HF's ``integrations/mxfp4.py`` ``convert_moe_packed_tensors``).

A tensor ``X`` [experts, in, out] is stored as ``X_blocks`` uint8 [experts, out, in / 32, 16] — each
row's values in groups of 32, two FP4 (E2M1) codes a byte, the low nibble first — and ``X_scales``
uint8 [experts, out, in / 32], a group's power of two biased by 127 (E8M0). The stored layout is
the transpose of HF's (and ours): ``out`` rows, ``in`` along a row.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

# the E2M1 value of each 4-bit code (sign bit, 2 exponent bits, 1 mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def packed_name(name: str) -> Optional[str]:
    """``X`` for a checkpoint tensor named ``X_blocks`` or ``X_scales``, else None."""
    for suffix in ("_blocks", "_scales"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def unpacked_shapes(shapes: Dict[str, List[int]], expected: Dict[str, List[int]]) -> Dict[str, List[int]]:
    """A checkpoint's tensor shapes (names → shapes, from its headers) with each ``X_blocks`` +
    ``X_scales`` pair of an ``expected`` tensor ``X`` read as ``X``'s dequantized shape; a pair whose
    shapes do not match each other stays as it is (the caller reports its names as unexpected)."""
    out = dict(shapes)
    for name in expected:
        blocks, scales = shapes.get(name + "_blocks"), shapes.get(name + "_scales")
        if name in shapes or blocks is None or scales is None or blocks[:-1] != scales or blocks[-1] != 16:
            continue
        *lead, rows, groups, _ = blocks
        out[name] = [*lead, groups * 32, rows]
        del out[name + "_blocks"], out[name + "_scales"]
    return out


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks`` [..., out, groups, 16], ``scales`` [..., out, groups] → ``[..., groups · 32, out]`` in
    ``dtype`` (every FP4 value times a power of two is exact in fp32 and bf16, so rounding never
    enters)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).int()  # [..., out, groups, 16, 2]: low nibble first
    values = torch.ldexp(lut[codes], scales.int()[..., None, None] - SCALE_BIAS)
    return values.flatten(-3).transpose(-1, -2).to(dtype)
