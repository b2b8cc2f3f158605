"""Block-wise FP8 weights (DeepSeek-V3/R1's and Qwen3-*-FP8's checkpoints), served weight-only (W8A16).

Such a checkpoint's ``config.json`` says ``quantization_config: {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [bo, bi]}`` and stores each quantized linear layer's
``weight`` [out, in] as ``float8_e4m3fn`` beside ``weight_scale_inv`` [ceil(out / bo), ceil(in / bi)] (fp32):
the weight is ``weight · weight_scale_inv[r // bo, c // bi]`` (HF's ``integrations/finegrained_fp8.py``).
Which layers are quantized is the checkpoint's: those with a ``weight_scale_inv`` (embeddings, ``lm_head``,
norms and routers never are).

A quantized layer keeps both tensors as they are stored (1 byte an element, half of bf16) and dequantizes
its weight to the activation's dtype in each forward (``parallel.LinearBase``), then multiplies: vLLM's
W8A16 path on GPUs without FP8 compute (its Marlin FP8), the activations never quantized. Under TP the
scales are sharded with the weight, a block's scale with its rows: every range of a shard must start on a
block boundary and end on one or at the tensor's end (SGLang's and vLLM's rule), else the layer is refused
by name. ``EngineConfig.quantization="fp8"`` also quantizes an unquantized checkpoint this way as it loads
(vLLM's ``--quantization fp8``), in blocks of :data:`DYNAMIC_BLOCK`.
"""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
DYNAMIC_BLOCK = (128, 128)  # DeepSeek-V3's and Qwen3-FP8's weight_block_size
SCALE = "weight_scale_inv"


class Fp8Config(NamedTuple):
    """The served quantization: ``block_size`` (rows, columns) of one scale; ``dynamic``: the checkpoint is
    unquantized and its weights are quantized as they load."""

    block_size: Tuple[int, int]
    dynamic: bool


def resolve(config, quantization: Optional[str]) -> Optional[Fp8Config]:
    """The quantization of the checkpoint of HF ``config`` served with ``EngineConfig.quantization``
    (None: the checkpoint's own; also None for per-tensor FP8, no ``weight_block_size``, which
    :mod:`.compressed_tensors` serves); ValueError naming the field when they disagree or the method is not served."""
    qc = quantization_config(config)
    if qc is None:
        return Fp8Config(DYNAMIC_BLOCK, dynamic=True) if quantization == "fp8" else None
    method = qc.get("quant_method")
    if method != "fp8":
        forced = f"quantization={quantization!r} but " if quantization else ""
        raise ValueError(f"{forced}the checkpoint's quantization_config.quant_method={method!r} is not supported "
                         "(served: 'fp8', 'gptq', 'awq', 'compressed-tensors')")
    block = qc.get("weight_block_size")
    if not block:
        return None
    if qc.get("fmt", "e4m3") != "e4m3" or qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"quantization_config fmt={qc.get('fmt')!r}, activation_scheme="
                         f"{qc.get('activation_scheme')!r}: only e4m3 with dynamic activations is served")
    if len(block) != 2:
        raise ValueError(f"quantization_config.weight_block_size={block!r}: block-wise FP8 is [rows, columns]")
    return Fp8Config((int(block[0]), int(block[1])), dynamic=False)


def quantization_config(config) -> Optional[dict]:
    """HF ``config``'s ``quantization_config`` as a dict (transformers may have made it an object), None
    when the checkpoint is not quantized: what each method's ``resolve`` reads."""
    qc = getattr(config, "quantization_config", None)
    return qc if qc is None or isinstance(qc, dict) else qc.to_dict()


def checkpoint_aliases(model: nn.Module, name: str) -> Tuple[str, ...]:
    """Layer ``name``'s other names (the served model's own: ``name``) that a ``quantization_config``'s layer
    names and regexes may use: the checkpoint's (a vision-language model's ``model.language_model.*`` and
    ``model.visual.*``: its ``checkpoint_renames`` reversed), as vLLM's ``hf_to_vllm_mapper`` maps a config's
    names to its own."""
    renames = getattr(model, "checkpoint_renames", ())
    return tuple(prefix + name[len(served):] for prefix, served in renames if name.startswith(served))


def refuse_forced(quantization: Optional[str], method: str) -> None:
    """ValueError when ``EngineConfig.quantization`` forces a method on a checkpoint quantized by ``method``."""
    if quantization is not None:
        raise ValueError(f"quantization={quantization!r} but the checkpoint's quantization_config.quant_method="
                         f"{method!r}: leave quantization unset to serve it as it is quantized")


def quantize_linears(model: nn.Module, quant: Fp8Config, shapes: Dict[str, List[int]]) -> Dict[str, nn.Module]:
    """Turn ``model``'s linear layers (on meta, before they are allocated) into block-FP8 ones: those whose
    ``weight_scale_inv`` the checkpoint holds, or every one when ``quant.dynamic``. ``shapes``: the
    checkpoint's tensor shapes (names → shapes, from its headers). Returns the quantized weights'
    names → their layers (to load into: :func:`copy_weight`)."""
    quantized = {}
    for name, module in model.named_modules():
        weight = f"{name}.weight"
        if not hasattr(module, "weight_block_size") or weight not in shapes:
            continue
        if quant.dynamic or f"{name}.{SCALE}" in shapes:
            quantize_linear(module, name, quant.block_size, shapes[weight])
            quantized[weight] = module
    return quantized


def quantize_linear(module: nn.Linear, name: str, block: Tuple[int, int], full_shape: Sequence[int]) -> None:
    """``module`` (``name`` in the model; its checkpoint weight ``full_shape``) holds its weight in FP8 and
    its scales, this rank's shard of both. ValueError when a shard range cuts a block."""
    out_features, in_features = module.weight.shape
    module.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=module.weight.device),
                                 requires_grad=False)
    shard = module.__dict__.get("param_shards", {}).get("weight")
    scale_shape = [-(-out_features // block[0]), -(-in_features // block[1])]
    if shard is not None:
        size, full = block[shard.dim], full_shape[shard.dim]
        shard = shard._replace(ranges=joined(shard.ranges))
        scale_ranges = cut(shard.ranges, size, full, lambda r: (
            f"{name}: this rank's slice [{r.start}, {r.stop}) of dim {shard.dim} of its weight {list(full_shape)} "
            f"cuts a block of weight_block_size {list(block)}: tp_size must split it on block boundaries"))
        scale_shape[shard.dim] = sum(len(r) for r in scale_ranges)
        module.param_shards[SCALE] = shard._replace(ranges=scale_ranges)
    module.weight_scale_inv = nn.Parameter(torch.empty(scale_shape, device=module.weight.device),
                                           requires_grad=False)
    module.weight_block_size = block


def joined(ranges: Sequence[range]) -> List[range]:
    """``ranges`` with each one that starts where the one before ends merged into it: a fused tensor's
    parts (Phi-3's q | k | v) at TP 1 are one range, whose blocks are the whole tensor's, cut nowhere."""
    out: List[range] = []
    for r in ranges:
        if out and out[-1].stop == r.start:
            out[-1] = range(out[-1].start, r.stop)
        else:
            out.append(r)
    return out


def cut(ranges: Sequence[range], unit: int, full: int, refusal: Callable[[range], str]) -> List[range]:
    """A shard's ``ranges`` of a dim's indices as ranges of its units of ``unit`` (a scale's block, a packed
    int32 word, a group): the shard of a tensor holding one entry a unit. ValueError ``refusal(r)`` for a
    range ``r`` that starts or ends inside a unit (but at the dim's end, ``full``)."""
    for r in ranges:
        if r.start % unit or (r.stop % unit and r.stop != full):
            raise ValueError(refusal(r))
    return [range(r.start // unit, -(-r.stop // unit)) for r in ranges]


def quantize_like(full: nn.Module, quantized: Dict[str, nn.Module]) -> None:
    """The layers of ``full`` (a whole model on meta) that are ``quantized`` (weight names → a served
    model's layers) quantized alike: the whole tensors' shapes a checkpoint replacing them must have."""
    for weight, served in quantized.items():
        name = weight.removesuffix(".weight")
        module = full.get_submodule(name)
        quantize_linear(module, name, served.weight_block_size, module.weight.shape)


def quantize(weight: torch.Tensor, block: Tuple[int, int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] → (FP8 weight, fp32 ``weight_scale_inv``): each block scaled so its largest
    magnitude is FP8's largest, every value rounded to the nearest FP8 one (a partial block at an edge
    is scaled by its own values)."""
    rows, cols = weight.shape
    pad_rows, pad_cols = -rows % block[0], -cols % block[1]
    padded = F.pad(weight.float(), (0, pad_cols, 0, pad_rows))
    blocks = padded.view(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(padded.shape)
    return q[:rows, :cols].contiguous(), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: Tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """FP8 ``weight`` [out, in] times its block's ``scale``, computed in fp32 and given in ``dtype``."""
    rows, cols = weight.shape
    scale = scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def copy_weight(module: nn.Module, tensor: torch.Tensor) -> List[str]:
    """A checkpoint's ``tensor`` (this rank's shard) into quantized ``module``'s weight: copied when FP8
    (its scales load by their own name), else quantized first, its scales written too. The parameter
    names written."""
    with torch.no_grad():
        if tensor.dtype == FP8:
            module.weight.copy_(tensor)
            return ["weight"]
        weight, scale = quantize(tensor, module.weight_block_size)
        module.weight.copy_(weight)
        module.weight_scale_inv.copy_(scale)
    return ["weight", SCALE]


def quantized_params(quantized: Dict[str, nn.Module]) -> List[nn.Parameter]:
    """The weights and scales of the ``quantized`` layers: the model's cast to its dtype leaves them
    as they are (FP8, fp32)."""
    return [p for module in quantized.values() for p in (module.weight, module.weight_scale_inv)]
