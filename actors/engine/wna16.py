"""GPTQ and AWQ checkpoints (int4 / int8 weights, fp16 scales and integer zero points per group of input
features), served weight-only (W4A16, W8A16), as vLLM's and SGLang's ``gptq`` and ``awq`` methods.

A quantized linear layer stores no ``weight``; its ``[out, in]`` weight is ``(q - zero) · scale`` of the
group each input feature belongs to, kept in int32 words of ``pack = 32 // bits`` values, the lowest bits
first:

* GPTQ (``quant_method: "gptq"``, AutoGPTQ's / GPTQModel's v1 layout, ``checkpoint_format: "gptq"``):
  ``qweight`` int32 ``[in / pack, out]`` (packed along the input dim), ``qzeros`` int32 ``[groups, out / pack]``
  holding ``zero - 1`` (v1's convention, whether ``sym`` or not), ``scales`` ``[groups, out]``, ``g_idx``
  int32 ``[in]``: each input feature's group. With ``desc_act`` (act-order) the groups were taken in an
  order of their own, and ``g_idx`` is read; without it feature ``i`` is in group ``i // group_size``
  (``group_size: -1``: one group) and the stored ``g_idx`` says nothing more (left unread, as vLLM's).
* AWQ (``quant_method: "awq"``, ``version: "gemm"``, AutoAWQ's GEMM layout): ``qweight`` int32
  ``[in, out / 8]`` packed along the output dim in AutoAWQ's order (:data:`AWQ_ORDER`), ``qzeros`` int32
  ``[groups, out / 8]`` alike (the zero itself), ``scales`` ``[groups, out]``; 4 bits only.

Which layers are quantized is the checkpoint's: those with a ``qweight`` (embeddings, ``lm_head``, norms
and MoE routers never are; ``modules_to_not_convert`` and GPTQModel's ``dynamic`` ``-:`` skips are layers
stored unquantized; ``dynamic``'s other entries give their layers bits, group size, act-order of their
own). A quantized layer keeps its tensors as stored, the int32 words packed (an eighth of fp32's bytes at
4 bits; the scales in fp32, exact whatever the model's dtype), so the memory budget sees the packed size,
and dequantizes its weight to the activations' dtype in each forward (:func:`linear`, from
``parallel.LinearBase``), then multiplies: the block-FP8 path's structure (:mod:`.fp8`). On CUDA the two are
one Triton kernel (:mod:`.wna16_kernels`), each weight tile dequantized in registers.

Under TP every tensor is cut with the weight (:func:`quantize_linear`): a column-parallel layer's output
features are columns of each tensor, a packed dim's in whole int32 words, so a rank's ranges of output
features must be multiples of ``pack`` (of the ``qzeros`` words, and of AWQ's ``qweight``); a row-parallel
layer's input features are rows of ``qweight`` (GPTQ's: whole words again) and of ``g_idx``, and rows of
``scales`` and ``qzeros`` by group: a rank's cut must not split a group, but where ``g_idx`` is read
(act-order) or there is one group, every rank keeps them whole. A cut that would split a word or a group
is refused naming the layer and the factor tp_size must respect.
"""

from __future__ import annotations

import re
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from actors.engine import wna16_kernels
from actors.engine.fp8 import checkpoint_aliases, cut, joined, quantization_config, refuse_forced

GPTQ, AWQ = "gptq", "awq"
METHODS = (GPTQ, AWQ)
GPTQ_BITS = (4, 8)
# AutoAWQ's GEMM packing: nibble i of a qweight / qzeros word holds output feature 8c + AWQ_ORDER[i] ...
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# ... so feature 8c + j is in nibble AWQ_REVERSE_ORDER[j] (vLLM's AWQ_REVERSE_ORDER)
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(j) for j in range(8))


class PackedConfig(NamedTuple):
    """One layer's quantization: ``method`` (:data:`GPTQ`, :data:`AWQ`), ``bits`` a value, ``group_size``
    input features a scale and zero (-1: one group), ``desc_act``: GPTQ's act-order (``g_idx`` read);
    ``dynamic``: GPTQModel's per-layer entries, (regex, skip, overrides), in the checkpoint's order."""

    method: str
    bits: int
    group_size: int
    desc_act: bool = False
    dynamic: Tuple[Tuple[str, bool, Tuple[Tuple[str, object], ...]], ...] = ()

    @property
    def pack(self) -> int:
        """Values an int32 word holds."""
        return 32 // self.bits


def resolve(config, quantization: Optional[str]) -> Optional[PackedConfig]:
    """The quantization of the checkpoint of HF ``config`` when it is GPTQ or AWQ (else None); ValueError
    naming the field of a variant not served: another GPTQ ``checkpoint_format`` (marlin, gptq_v2), bits
    2 / 3, AWQ's GEMV kernels' layout or no zero point, words other than int32 (GPTQModel's ``pack_dtype``),
    a quantized ``lm_head``; or a forced ``quantization`` (fp8)."""
    qc = quantization_config(config)
    method = None if qc is None else qc.get("quant_method")
    if method not in METHODS:
        return None
    refuse_forced(quantization, method)
    # (older AutoAWQ configs name them w_bit and q_group_size; vLLM reads either)
    bits, group_size = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size", 128))
    if method == GPTQ:
        fmt = "marlin" if qc.get("is_marlin_format") else qc.get("checkpoint_format", "gptq")
        if fmt != "gptq":
            raise ValueError(f"quantization_config.checkpoint_format={fmt!r} is not served: only 'gptq' "
                             "(AutoGPTQ's v1 layout, zeros stored minus one)")
    else:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version={qc.get('version')!r} is not served: only AWQ's "
                             "'gemm' layout (qweight [in, out / 8])")
        if not qc.get("zero_point", True):
            raise ValueError("quantization_config.zero_point=False is not served: AWQ with zero points only")
    if qc.get("pack_dtype", "int32") != "int32":  # (GPTQModel packs in int8 / int16 / int64 words too)
        raise ValueError(f"quantization_config.pack_dtype={qc['pack_dtype']!r} is not served: int32 words only")
    _check_sizes("quantization_config", method, bits, group_size)
    if qc.get("lm_head"):
        raise ValueError("quantization_config.lm_head=True is not served: lm_head stays unquantized")
    quant = PackedConfig(method, bits, group_size, bool(qc.get("desc_act", False)) and method == GPTQ)
    return quant._replace(dynamic=tuple(_dynamic_entry(quant, pattern, overrides)
                                        for pattern, overrides in (qc.get("dynamic") or {}).items()))


def _check_sizes(field: str, method: str, bits, group_size) -> None:
    """ValueError naming ``field``'s ``bits`` or ``group_size`` when ``method`` is not served so."""
    served = GPTQ_BITS if method == GPTQ else (4,)
    if bits not in served:
        raise ValueError(f"{field}.bits={bits!r}: {method.upper()} is served with {' or '.join(map(str, served))} bits")
    if group_size != -1 and (not isinstance(group_size, int) or group_size <= 0):
        raise ValueError(f"{field}.group_size={group_size!r}: a positive number of input features, or -1 (one group)")


def _dynamic_entry(quant: PackedConfig, pattern: str,
                   overrides: dict) -> Tuple[str, bool, Tuple[Tuple[str, object], ...]]:
    """One of GPTQModel's ``dynamic`` entries (over ``quant``): ``-:regex`` skips the layers it matches,
    ``+:regex`` (or a bare one) gives them ``bits``, ``group_size``, ``desc_act`` of their own."""
    field = f"quantization_config.dynamic[{pattern!r}]"
    unknown = sorted(set(overrides) - {"bits", "group_size", "desc_act", "sym"})
    if unknown:
        raise ValueError(f"{field} overrides {unknown}: only bits, group_size, desc_act and sym are served")
    _check_sizes(field, quant.method, overrides.get("bits", quant.bits), overrides.get("group_size", quant.group_size))
    skip = pattern.startswith("-:")
    regex = pattern[2:] if pattern[:2] in ("-:", "+:") else pattern
    return regex, skip, tuple(sorted((k, v) for k, v in overrides.items() if k != "sym"))


def layer_config(quant: PackedConfig, name: str, aliases: Sequence[str] = ()) -> Optional[PackedConfig]:
    """Layer ``name``'s quantization: the first ``dynamic`` entry matching it, or one of its ``aliases``
    (:func:`~.fp8.checkpoint_aliases`; None: skipped), else ``quant``."""
    for regex, skip, overrides in quant.dynamic:
        if any(re.match(regex, n) for n in (name, *aliases)):
            return None if skip else quant._replace(**dict(overrides))
    return quant


def quantize_linears(model: nn.Module, quant: PackedConfig, shapes: Dict[str, List[int]]) -> Dict[str, nn.Module]:
    """Turn ``model``'s linear layers (on meta, before they are allocated) whose ``qweight`` the checkpoint
    holds (``shapes``: its tensor names → shapes) into packed ones. Returns their names → the layers."""
    packed = {}
    for name, module in model.named_modules():
        qweight = shapes.get(f"{name}.qweight")
        if qweight is None or not hasattr(module, "weight_block_size"):
            continue
        layer = layer_config(quant, name, checkpoint_aliases(model, name))
        if layer is None:
            raise ValueError(f"{name}: quantization_config.dynamic skips it but the checkpoint holds its qweight")
        rows, cols = qweight
        full_shape = (cols, rows * layer.pack) if layer.method == GPTQ else (cols * layer.pack, rows)
        quantize_linear(module, name, layer, full_shape)
        packed[name] = module
    return packed


def quantize_linear(module: nn.Linear, name: str, quant: PackedConfig, full_shape: Sequence[int]) -> None:
    """``module`` (``name`` in the model; its whole weight ``full_shape`` [out, in]) holds this rank's
    shard of ``qweight``, ``qzeros``, ``scales`` (and ``g_idx`` with act-order) in place of its weight.
    ValueError when a shard range would split an int32 word or a group."""
    device, (out_features, in_features) = module.weight.device, (module.out_features, module.in_features)
    full_out, full_in = full_shape
    pack, gptq = quant.pack, quant.method == GPTQ
    whole_groups = quant.desc_act or quant.group_size == -1  # (every rank keeps every group)
    groups = 1 if quant.group_size == -1 else -(-full_in // quant.group_size)
    shards = module.__dict__.get("param_shards", {})
    shard = shards.get("weight")  # (kept: a LoRA adapter on the layer is cut as its weight)
    if shard is not None:
        shard = shard._replace(ranges=joined(shard.ranges))
        if shard.dim == 0:  # output features: columns of every tensor, g_idx whole
            cols = {"qweight": 1 if gptq else pack, "qzeros": pack, "scales": 1}
            for param, factor in cols.items():
                why = f"{param} packs {pack} output features an int32"
                shards[param] = shard._replace(dim=1, ranges=_cut(shard.ranges, factor, full_out, name, "output", why))
        else:  # input features: rows of qweight and g_idx, groups of scales and qzeros (whole: act-order, one group)
            word = f"qweight packs {pack} input features an int32"
            shards["qweight"] = shard._replace(dim=0, ranges=_cut(shard.ranges, pack if gptq else 1, full_in,
                                                                  name, "input", word))
            if quant.desc_act:
                shards["g_idx"] = shard._replace(dim=0)
            if not whole_groups:
                group = _cut(shard.ranges, quant.group_size, full_in, name, "input",
                             f"group_size {quant.group_size} input features share a scale")
                shards["qzeros"] = shards["scales"] = shard._replace(dim=0, ranges=group)
                groups = sum(len(r) for r in group)
    shapes = {"qweight": [in_features // pack, out_features] if gptq else [in_features, out_features // pack],
              "qzeros": [groups, out_features // pack], "scales": [groups, out_features]}
    if quant.desc_act:
        shapes["g_idx"] = [in_features]
    module.register_parameter("weight", None)
    for param, shape in shapes.items():
        dtype = torch.float32 if param == "scales" else torch.int32
        setattr(module, param, nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False))
    module.packed = quant


def _cut(ranges: Sequence[range], factor: int, full: int, name: str, what: str, why: str) -> List[range]:
    """``ranges`` of features in units of ``factor`` features (an int32 word, a group: :func:`fp8.cut`);
    ValueError naming layer ``name`` when one starts or ends inside a unit."""
    return cut(ranges, factor, full, lambda r: (
        f"{name}: this rank's slice [{r.start}, {r.stop}) of its {full} {what} features cuts {factor} ({why}): "
        f"tp_size must split them on multiples of {factor}"))


def quantize_like(full: nn.Module, packed: Dict[str, nn.Module]) -> None:
    """The layers of ``full`` (a whole model on meta) that are ``packed`` in a served model packed alike:
    the whole tensors' shapes a checkpoint replacing them must have."""
    for name, served in packed.items():
        module = full.get_submodule(name)
        quantize_linear(module, name, served.packed, (module.out_features, module.in_features))


def unread(packed: Dict[str, nn.Module], name: str) -> bool:
    """Whether checkpoint tensor ``name`` is one a ``packed`` layer does not read: the ``g_idx`` of a layer
    without act-order (its groups are in order: nothing to read), or the ``bias`` of a layer without one
    (GPTQ-for-LLaMa's QuantLinear stored a zero bias for every layer; vLLM and SGLang skip it alike)."""
    prefix, _, param = name.rpartition(".")
    layer = packed.get(prefix)
    if layer is None:
        return False
    return (param == "g_idx" and not layer.packed.desc_act) or (param == "bias" and layer.bias is None)


def value_checked(name: str) -> bool:
    """Whether a named tensor's values are checked, not its shape alone (:func:`unread_problems`): a rank
    holding its layer needs them."""
    return name.rpartition(".")[2] in ("g_idx", "bias")


def unread_problems(packed: Dict[str, nn.Module], tensors: Dict[str, torch.Tensor]) -> List[str]:
    """Named tensors' (a weight update's) rule for those a ``packed`` layer does not read (:func:`unread`):
    they must say nothing it would miss. A ``g_idx`` holds the groups in order (``i // group_size``, as GPTQ
    writes it without ``desc_act``): one of an act-order quantization would be dropped and its tensors read
    with other groups' scales and zeros; a ``bias`` is zeros (GPTQ-for-LLaMa's). Tensors on meta (a TP
    follower's check: shapes alone) are left to rank 0's."""
    problems = []
    for name, tensor in tensors.items():
        if tensor.is_meta or not unread(packed, name):
            continue
        layer, _, param = name.rpartition(".")
        if param == "bias" and tensor.any():
            problems.append(f"{name} is not zero but its packed layer has no bias")
        elif param == "g_idx":
            size = len(tensor) if packed[layer].packed.group_size == -1 else packed[layer].packed.group_size
            if not torch.equal(tensor.cpu().long(), torch.arange(len(tensor)) // size):
                problems.append(f"{name} is not in group order (act-order) but its layer is served without desc_act")
    return problems


def packed_params(packed: Dict[str, nn.Module]) -> List[nn.Parameter]:
    """The tensors of the ``packed`` layers that the model's cast to its dtype leaves as they are (the
    fp32 scales; the int32 ones are no floats)."""
    return [module.scales for module in packed.values()]


def unpack(words: torch.Tensor, bits: int, dim: int, order: Optional[Sequence[int]] = None) -> torch.Tensor:
    """int32 ``words`` [r, c] unpacked along ``dim`` into their ``32 // bits`` values each (the lowest bits
    first; ``order[j]``: the place in its word of the ``j``-th value): [r · pack, c] or [r, c · pack]."""
    pack = 32 // bits
    places = torch.arange(pack, device=words.device) if order is None else torch.tensor(order, device=words.device)
    shifts = (places * bits).to(torch.int32)
    if dim == 0:
        values = words.unsqueeze(1) >> shifts[None, :, None]  # [r, pack, c]
    else:
        values = words.unsqueeze(-1) >> shifts  # [r, c, pack]
    shape = [words.shape[0] * pack, words.shape[1]] if dim == 0 else [words.shape[0], words.shape[1] * pack]
    return (values & ((1 << bits) - 1)).reshape(shape)


def dequantize(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """Packed ``module``'s weight [out, in] in ``dtype`` (computed in fp32: ``(q - zero) · scale``)."""
    quant = module.packed
    if quant.method == GPTQ:
        q = unpack(module.qweight, quant.bits, dim=0)  # [in, out]
        zeros = unpack(module.qzeros, quant.bits, dim=1) + 1  # (v1: stored minus one)
    else:
        q = unpack(module.qweight, quant.bits, dim=1, order=AWQ_REVERSE_ORDER)
        zeros = unpack(module.qzeros, quant.bits, dim=1, order=AWQ_REVERSE_ORDER)
    scales = module.scales
    if quant.desc_act:
        zeros, scales = zeros.index_select(0, module.g_idx), scales.index_select(0, module.g_idx)
    else:
        size = q.shape[0] if quant.group_size == -1 else quant.group_size
        zeros, scales = (t.repeat_interleave(size, dim=0)[: q.shape[0]] for t in (zeros, scales))
    return ((q - zeros).float() * scales).to(dtype).t()


def linear(module: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` times packed ``module``'s weight, plus ``bias``: the fused dequant-GEMM kernel on CUDA, else the
    weight dequantized whole, then multiplied."""
    if x.is_cuda:
        return wna16_kernels.packed_linear(x, module, module.packed.method == AWQ, bias)
    return F.linear(x, dequantize(module, x.dtype), bias)
