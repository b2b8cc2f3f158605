"""Packed int4 / int8 experts in the fused MoE (vLLM's ``moe_wna16``): GPTQ's and AWQ's (:mod:`.wna16`) and
compressed-tensors' ``pack-quantized`` ones (:mod:`.compressed_tensors`) run through :mod:`.fused_moe`'s
grouped GEMM, each weight tile unpacked from its int32 words and dequantized in registers
(:func:`.wna16_kernels.dequantize_tile`), the dense weights never in memory. compressed-tensors' unpacked
FP8 / int8 values (``-FP8-dynamic``, ``-quantized.w8a8``; per-tensor FP8's) take the block-FP8 path instead,
each scale the block of the weight it covers (:func:`scale_block`).

Each tensor a layer stores (words, zeros, scales) is stacked as it is stored, the experts' gate and up along
their output features (the dim holding them: GPTQ's and AWQ's last, compressed-tensors' first), the layers'
tensors then views of the stacks (a weight update copies into them). The kernel reads each layout by its
(output, input) strides; GPTQ's act-order ``g_idx`` (each input's group, every expert's gate, up and down
their own) one matrix's after another. What it does not take stays on the eager experts
(:func:`unfused_reason`): unpacked values with zero points, packed ones with per-tensor scales, experts
quantized in different ways.
"""

from __future__ import annotations

from typing import Hashable, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from actors.engine import wna16


class PackedLayout(NamedTuple):
    """How a packed layer's tensors are read: ``names`` (the words', the zeros' or None: symmetric, the
    scales', the ``g_idx``'s or None: groups in order), ``out_dim`` (the dim of the first three holding the
    output features), ``bits`` a value, ``group_size`` inputs a scale (one group: every input), ``awq``
    (words packed along the outputs in AutoAWQ's order, else down the inputs), ``zero_add`` (what a stored
    zero is short of: GPTQ v1's 1), ``zero_point`` (every zero, without zeros: compressed-tensors' values
    are stored plus it)."""

    names: Tuple[str, Optional[str], str, Optional[str]]
    out_dim: int
    bits: int
    group_size: int
    awq: bool = False
    zero_add: int = 0
    zero_point: int = 0

    @property
    def dims(self) -> Tuple[int, int, int, int]:
        """The dim each of :attr:`names` is stacked along: the output features', ``g_idx``'s only one."""
        return self.out_dim, self.out_dim, self.out_dim, 0


def unfused_reason(stacks: Sequence[Sequence[nn.Module]]) -> Optional[str]:
    """Why the layers of ``stacks`` (each list the layers of one stacked tensor: every expert's gate and up,
    every expert's down) cannot run fused, or None: one :func:`_layer_reason` gives, or some quantized and some
    not, quantized in different ways (GPTQModel's ``dynamic`` bits or groups; FP8 and int8)."""
    for linears in stacks:
        reason = next(filter(None, map(_layer_reason, linears)), None)
        if reason is not None:
            return reason
        layouts = {_layout(m) for m in linears}
        if len(layouts) > 1:
            return ("experts of which some are quantized and some not are not fused" if None in layouts else
                    "experts quantized in different ways (bits, groups, format) are not fused")
    return None


def is_packed(linear: nn.Module) -> bool:
    """Whether ``linear`` holds int32 words (GPTQ, AWQ, compressed-tensors' ``pack-quantized``)."""
    return linear.packed is not None or (linear.scheme is not None and linear.scheme.packed)


def _layout(linear: nn.Module) -> Hashable:
    """What the layers of one stacked tensor share: their :func:`packed_layout`, compressed-tensors' scheme of
    unpacked values, their FP8 blocks, or None (unquantized)."""
    return packed_layout(linear) if is_packed(linear) else linear.scheme or linear.weight_block_size


def _layer_reason(linear: nn.Module) -> Optional[str]:
    """Why quantized ``linear`` cannot be a fused expert's, or None."""
    quant, scheme = linear.packed, linear.scheme
    if not is_packed(linear):
        if scheme is not None and not scheme.symmetric:
            return "compressed-tensors experts of unpacked values with zero points are not fused"
        return None
    if scheme is not None and scheme.strategy == "tensor":
        return "packed compressed-tensors experts with per-tensor scales are not fused"
    pack = 32 // (quant.bits if quant is not None else scheme.num_bits)
    if linear.out_features % pack:  # (zeros packed along the outputs: gate's last word would hold up's first)
        return f"packed experts of {linear.out_features} output features (not whole words of {pack}) are not fused"
    return None


def scale_block(linear: nn.Module) -> Tuple[int, int]:
    """The (output, input) block of compressed ``linear``'s unpacked weight that one of its scales covers:
    the whole weight (``tensor``), a row (``channel``) or a row's group of inputs (``group``)."""
    scheme = linear.scheme
    rows = linear.out_features if scheme.strategy == "tensor" else 1
    return rows, scheme.group_size if scheme.strategy == "group" else linear.in_features


def packed_layout(linear: nn.Module) -> PackedLayout:
    """Fusable (:func:`unfused_reason`) packed ``linear``'s layout."""
    quant, scheme = linear.packed, linear.scheme
    if quant is not None:
        group_size = linear.in_features if quant.group_size == -1 else quant.group_size
        awq = quant.method == wna16.AWQ
        g_idx = "g_idx" if quant.desc_act else None
        return PackedLayout(("qweight", "qzeros", "scales", g_idx), 1, quant.bits, group_size, awq, 0 if awq else 1)
    group_size = scheme.group_size if scheme.strategy == "group" else linear.in_features
    zeros = None if scheme.symmetric else "weight_zero_point"
    return PackedLayout(("weight_packed", zeros, "weight_scale", None), 0, scheme.num_bits, group_size,
                        zero_point=0 if zeros else scheme.offset)


def strides(layout: PackedLayout, stacked: Optional[torch.Tensor]) -> Tuple[int, int, int]:
    """A stacked tensor's strides over (experts, output features or their words, inputs or groups); zeros
    where there is none."""
    if stacked is None:
        return 0, 0, 0
    expert, first, second = stacked.stride()
    return (expert, second, first) if layout.out_dim == 1 else (expert, first, second)

