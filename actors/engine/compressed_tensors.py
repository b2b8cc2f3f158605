"""compressed-tensors checkpoints (llm-compressor's: RedHatAI's ``-FP8-dynamic``, ``-FP8``, ``-quantized.w8a8``,
``-quantized.w4a16``) and per-tensor FP8 ones (``quant_method: "fp8"`` without ``weight_block_size``: AutoFP8's,
vLLM's ``--quantization fp8`` saved), served weight-only as SGLang's and vLLM's ``compressed_tensors`` schemes.

``quantization_config: {"quant_method": "compressed-tensors", "format", "config_groups": {name: {"targets",
"weights": {"num_bits", "type", "strategy", "group_size", "symmetric", "dynamic", "actorder"},
"input_activations"}}, "ignore"}``. A quantized layer stores, beside what its format names:

* ``float-quantized`` / ``int-quantized`` / ``naive-quantized``: ``weight`` [out, in] as the values themselves
  (``float8_e4m3fn``; ``int8``);
* ``pack-quantized``: ``weight_packed`` int32 [out, in / pack], ``pack = 32 // num_bits`` signed values a word
  packed along the input dim, the lowest bits first, each stored plus ``2 ** (num_bits - 1)``; ``weight_shape``
  ([out, in], left unread: the model's shape is known);

and ``weight_scale``: one (``strategy: tensor``, shape [] or [1]), one an output feature (``channel``:
[out, 1]) or one a group of ``group_size`` input features (``group``: [out, in / group_size]);
``weight_zero_point`` when not ``symmetric``, shaped as the scales but for ``pack-quantized`` group or
channel zeros: packed along the output dim ([out / pack, groups]). The weight is ``(q - zero) · scale``
(compressed-tensors' ``dequantize``). Per-tensor FP8 is the ``float-quantized`` tensor case (its
``weight_scale`` a scalar). Which layers are quantized is the checkpoint's (those with a ``weight_scale``);
the config group whose ``targets`` match a layer (``Linear``, its name, or ``re:`` a regex) gives its
scheme (the most specific one's: :func:`layer_scheme`), ``ignore`` (names, ``re:`` regexes; ``lm_head``
usually) none.

A quantized layer keeps its tensors as stored (1 byte a weight at 8 bits, an eighth of fp32's at 4 packed;
the scales in fp32) and dequantizes its weight to the activations' dtype in each forward (``parallel.LinearBase``),
then multiplies: weight-only (W8A16, W4A16) where the checkpoint may quantize the activations too
(``input_activations``: dynamic, or static with an ``input_scale``, read nowhere; the load warns naming them:
:func:`quantized_activations`). The activations stay in the model's dtype, so a W8A8 checkpoint computes its
own math but for its activations' rounding.

Under TP a column-parallel layer's output features are rows of its weight, of per-channel or group scales and
zeros (packed zeros in whole words: a rank's range a multiple of ``pack``); a row-parallel layer's input
features are columns of its weight (packed: whole words) and, per group, of its group scales and zeros (a
cut inside a group refused naming the layer). Per-tensor scales, and a row-parallel layer's per-channel
ones, are whole on every rank; a fused tensor (Phi-3's ``qkv_proj``) has one scale, as stored, and its parts
are cut each.
"""

from __future__ import annotations

import re
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from actors.engine import wna16
from actors.engine.fp8 import FP8, checkpoint_aliases, joined, quantization_config, refuse_forced

PACKED_FORMAT = "pack-quantized"
# format → value type → bits served (the first three store each value in a byte of its own: FP8 or int8)
SERVED = {"float-quantized": {"float": (8,)}, "int-quantized": {"int": (4, 8)},
          "naive-quantized": {"float": (8,), "int": (4, 8)}, PACKED_FORMAT: {"int": (4, 8)}}
STRATEGIES = ("tensor", "channel", "group")
# actorder values whose groups are in input order, no weight_g_idx stored ('static': compressed-tensors'
# alias of 'weight'; 'group', its alias 'dynamic' and true have a g_idx)
ACTORDER_IN_GROUP_ORDER = (None, False, "weight", "static")
# a quantized layer's weight, as stored
STORED = ("weight", "weight_packed")
# what a checkpoint stores for a quantized layer that a weight-only forward never reads
UNREAD = ("weight_shape", "input_scale", "input_zero_point")


class Scheme(NamedTuple):
    """One layer's weights: ``num_bits`` a value of ``type`` (``int``, ``float``), one scale for
    ``strategy``'s unit (``group``: ``group_size`` input features), zeros unless ``symmetric``; ``packed``:
    ``pack-quantized`` int32 words."""

    num_bits: int
    type: str
    strategy: str
    group_size: int
    symmetric: bool
    packed: bool

    @property
    def pack(self) -> int:
        """Values an int32 word holds."""
        return 32 // self.num_bits

    @property
    def offset(self) -> int:
        """What a packed value is stored plus (the signed range made unsigned)."""
        return 1 << (self.num_bits - 1)


PER_TENSOR_FP8 = Scheme(8, "float", "tensor", 0, True, False)


class CompressedConfig(NamedTuple):
    """The checkpoint's ``config_groups`` as each target's scheme (a target of several groups the last
    one's, as compressed-tensors' ``target_to_scheme``), and its ``ignore``d layers."""

    schemes: Dict[str, Scheme]
    ignore: Tuple[str, ...] = ()


def resolve(config, quantization: Optional[str]) -> Optional[CompressedConfig]:
    """The quantization of the checkpoint of HF ``config`` when it is compressed-tensors or per-tensor FP8
    (else None); ValueError naming the field of what is not served: sparsity, formats
    other than float / int / naive / pack-quantized (``marlin-24``, ``nvfp4-pack-quantized``, ...), block
    or token strategies, act-order groups, dynamic weights; or a forced ``quantization``."""
    qc = quantization_config(config)
    method = None if qc is None else qc.get("quant_method")
    if method == "fp8" and not qc.get("weight_block_size"):
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config.fmt={qc.get('fmt')!r}: only e4m3 FP8 is served")
        return CompressedConfig({"Linear": PER_TENSOR_FP8}, tuple(qc.get("ignored_layers") or ()))
    if method != "compressed-tensors":
        return None
    refuse_forced(quantization, method)
    sparsity = (qc.get("sparsity_config") or {}).get("format", "dense")
    if sparsity != "dense":
        raise ValueError(f"quantization_config.sparsity_config.format={sparsity!r} is not served (dense only)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config.config_groups is empty: nothing says how the weights are stored")
    schemes = {}
    for name, group in groups.items():
        scheme = _scheme(f"config_groups[{name!r}]", group, group.get("format") or qc.get("format"))
        schemes.update(dict.fromkeys(group.get("targets") or (), scheme))
    return CompressedConfig(schemes, tuple(qc.get("ignore") or ()))


def quantized_activations(config) -> List[str]:
    """The fields of HF ``config``'s compressed-tensors or per-tensor FP8 quantization that quantize the activations
    too (a config group's ``input_activations``: -FP8-dynamic's, -quantized.w8a8's; AutoFP8's ``activation_scheme``,
    static or dynamic): vLLM and SGLang run such layers as W8A8 GEMMs, a weight-only forward leaves the activations
    in the model's dtype, so its speed and its activations' rounding differ from theirs."""
    qc = quantization_config(config) or {}
    if qc.get("quant_method") == "fp8":
        return [f"activation_scheme={qc.get('activation_scheme', 'dynamic')!r}"]
    return [f"config_groups[{name!r}].input_activations" for name, group in (qc.get("config_groups") or {}).items()
            if group.get("input_activations")]


def _scheme(field: str, group: dict, fmt: Optional[str]) -> Scheme:
    """Config group ``field``'s weights stored in format ``fmt``; ValueError naming what is not served."""
    weights = group.get("weights")
    if fmt not in SERVED:
        raise ValueError(f"quantization_config format={fmt!r} ({field}) is not served: only {', '.join(SERVED)}")
    if not weights:
        raise ValueError(f"quantization_config.{field} quantizes no weights: activation-only schemes are not served")
    bits, kind, strategy = weights.get("num_bits"), weights.get("type", "int"), weights.get("strategy", "tensor")
    weights_field = f"quantization_config.{field}.weights"
    served_bits = SERVED[fmt].get(kind)
    if served_bits is None:
        raise ValueError(f"{weights_field}.type={kind!r} is not served in format {fmt!r}: float-quantized floats, "
                         "int-quantized and pack-quantized ints")
    if bits not in served_bits:
        raise ValueError(f"{weights_field}.num_bits={bits!r}: {fmt} {kind} weights are served with "
                         f"{' or '.join(map(str, served_bits))} bits")
    if strategy not in STRATEGIES:
        raise ValueError(f"{weights_field}.strategy={strategy!r} is not served: only {', '.join(STRATEGIES)}")
    group_size = weights.get("group_size")
    if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
        raise ValueError(f"{weights_field}.group_size={group_size!r}: a positive number of input features")
    if weights.get("actorder") not in ACTORDER_IN_GROUP_ORDER:
        raise ValueError(f"{weights_field}.actorder={weights.get('actorder')!r} is not served (its weight_g_idx "
                         "unread): only groups in order ('weight', its alias 'static', or none)")
    if weights.get("dynamic"):
        raise ValueError(f"{weights_field}.dynamic={weights.get('dynamic')!r}: weights must be stored quantized")
    return Scheme(bits, kind, strategy, group_size if strategy == "group" else 0,
                  bool(weights.get("symmetric", True)), fmt == PACKED_FORMAT)


def _matches(target: str, name: str) -> bool:
    """Whether config ``target`` (``Linear``, a layer's name, ``re:`` a regex) names linear layer ``name``."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in ("Linear", name)


def layer_scheme(quant: CompressedConfig, name: str, aliases: Sequence[str] = ()) -> Optional[Scheme]:
    """Linear layer ``name``'s scheme; None when it is ignored or no target matches it (it, or one of its
    ``aliases``: :func:`~.fp8.checkpoint_aliases`). Several may: the most specific one's, as compressed-tensors'
    ``match_targets`` orders them (whatever the groups' order): its name, then a ``re:`` regex (each kind in sorted
    order), then ``Linear`` (llm-compressor's mixed recipes give ``Linear`` a default scheme and a few layers their
    own)."""
    def matches(target: str) -> bool:
        return any(_matches(target, n) for n in (name, *aliases))
    if any(matches(target) for target in quant.ignore):
        return None
    named = sorted((t for t in quant.schemes if t != "Linear" and matches(t)), key=lambda t: (t.startswith("re:"), t))
    return next((quant.schemes[t] for t in [*named, "Linear"] if t in quant.schemes), None)


def quantize_linears(model: nn.Module, quant: CompressedConfig, shapes: Dict[str, List[int]]) -> Dict[str, nn.Module]:
    """Turn ``model``'s linear layers (on meta, before they are allocated) whose ``weight_scale`` the
    checkpoint holds (``shapes``: its tensor names → shapes) into compressed ones. Returns their names →
    the layers. ValueError naming a module stored quantized that is no such layer (``lm_head`` where
    ``ignore`` leaves it out)."""
    compressed = {name: module for name, module in model.named_modules() if f"{name}.weight_scale" in shapes}
    unserved = sorted(name for name, module in compressed.items() if not hasattr(module, "weight_block_size"))
    if unserved:
        raise ValueError(f"{', '.join(unserved[:4])}: the checkpoint stores it quantized (its weight_scale), but only "
                         "projections are served quantized, not lm_head, embeddings, routers or a vision tower")
    for name, module in compressed.items():
        scheme = layer_scheme(quant, name, checkpoint_aliases(model, name))
        if scheme is None:
            raise ValueError(f"{name}: the checkpoint holds its weight_scale but quantization_config ignores it "
                             "or targets it with no config group")
        full_out = shapes.get(f"{name}.weight", shapes.get(f"{name}.weight_packed"))[0]
        tp = getattr(module, "tp", None)  # (a row-parallel layer's: its input features split evenly over it)
        quantize_linear(module, name, scheme, (full_out, module.in_features * (1 if tp is None else tp.size)),
                        shapes[f"{name}.weight_scale"])
    return compressed


def quantize_linear(module: nn.Linear, name: str, scheme: Scheme, full_shape: Sequence[int],
                    tensor_scale_shape: Sequence[int]) -> None:
    """``module`` (``name`` in the model; its whole weight ``full_shape`` [out, in]; a per-tensor scale
    stored in ``tensor_scale_shape``) holds this rank's shard of its stored weight, ``weight_scale`` (and
    ``weight_zero_point``) in ``scheme``. ValueError when a shard range would split a packed word or a group."""
    device, (out_features, in_features) = module.weight.device, (module.out_features, module.in_features)
    groups = {"tensor": 0, "channel": 1, "group": -(-in_features // max(scheme.group_size, 1))}[scheme.strategy]
    scale_shape = list(tensor_scale_shape) if scheme.strategy == "tensor" else [out_features, groups]
    packed_zeros = scheme.packed and scheme.strategy != "tensor"
    shapes = {"weight_scale": scale_shape}
    if not scheme.symmetric:
        shapes["weight_zero_point"] = [-(-out_features // scheme.pack), groups] if packed_zeros else scale_shape
    shards = module.__dict__.get("param_shards", {})
    shard = shards.get("weight")  # (kept: a LoRA adapter on the layer is cut as its weight)
    if shard is not None:
        _shard(shards, shard._replace(ranges=joined(shard.ranges)), scheme, full_shape, name)
    if scheme.packed:
        shapes["weight_packed"] = [out_features, -(-in_features // scheme.pack)]
        module.register_parameter("weight", None)
    else:
        module.weight = nn.Parameter(torch.empty(out_features, in_features, device=device,
                                                 dtype=FP8 if scheme.type == "float" else torch.int8),
                                     requires_grad=False)
    for param, shape in shapes.items():
        dtype = torch.float32 if param == "weight_scale" else torch.int32
        setattr(module, param, nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False))
    module.scheme = scheme


def _shard(shards: dict, shard, scheme: Scheme, full_shape: Sequence[int], name: str) -> None:
    """(:func:`quantize_linear`) the shards of the stored tensors of a layer whose weight is cut by ``shard``."""
    full_out, full_in = full_shape
    per_output = scheme.strategy != "tensor"  # (a scale, a zero an output feature or a group of one)
    zero = None if scheme.symmetric else "weight_zero_point"
    if shard.dim == 0:  # output features: rows of every tensor, packed zeros in words
        if scheme.packed:
            shards["weight_packed"] = shard
        if per_output:
            shards["weight_scale"] = shard
            if zero and scheme.packed:
                why = f"weight_zero_point packs {scheme.pack} output features an int32"
                shards[zero] = shard._replace(ranges=wna16._cut(shard.ranges, scheme.pack, full_out, name,
                                                                "output", why))
            elif zero:
                shards[zero] = shard
        return
    if scheme.packed:  # input features: words of weight_packed, groups of the scales and zeros
        why = f"weight_packed packs {scheme.pack} input features an int32"
        shards["weight_packed"] = shard._replace(ranges=wna16._cut(shard.ranges, scheme.pack, full_in, name,
                                                                   "input", why))
    if scheme.strategy == "group":
        why = f"group_size {scheme.group_size} input features share a scale"
        groups = shard._replace(ranges=wna16._cut(shard.ranges, scheme.group_size, full_in, name, "input", why))
        shards["weight_scale"] = groups
        if zero:
            shards[zero] = groups


def quantize_like(full: nn.Module, compressed: Dict[str, nn.Module]) -> None:
    """The layers of ``full`` (a whole model on meta) that are ``compressed`` in a served model quantized
    alike: the whole tensors' shapes a checkpoint replacing them must have."""
    for name, served in compressed.items():
        module = full.get_submodule(name)
        quantize_linear(module, name, served.scheme, (module.out_features, module.in_features),
                        served.weight_scale.shape)


def unread(compressed: Dict[str, nn.Module], name: str) -> bool:
    """Whether checkpoint tensor ``name`` is what a ``compressed`` layer stores for no weight-only forward:
    its ``weight_shape``, its activations' static ``input_scale`` (and zero point)."""
    layer, _, param = name.rpartition(".")
    return param in UNREAD and layer in compressed


def stored_problems(compressed: Dict[str, nn.Module], tensors: Dict[str, torch.Tensor]) -> List[str]:
    """Named tensors' rule for the ``compressed`` layers: a weight comes as its layer stores it (FP8, int8,
    int32 words), never in another dtype: a trainer's dense weight would be cast into it unscaled."""
    problems = []
    for name, tensor in tensors.items():
        layer, _, param = name.rpartition(".")
        stored = getattr(compressed[layer], param, None) if layer in compressed and param in STORED else None
        if stored is not None and tensor.dtype != stored.dtype:
            problems.append(f"{name} is {tensor.dtype} but its layer stores {stored.dtype} (compressed-tensors "
                            "layers take their weights quantized)")
    return problems


def compressed_params(compressed: Dict[str, nn.Module]) -> List[nn.Parameter]:
    """The tensors of the ``compressed`` layers that the model's cast to its dtype leaves as they are
    (FP8 weights, fp32 scales; the int ones are no floats)."""
    return [p for module in compressed.values() for p in (module.weight, module.weight_scale)
            if p is not None and p.is_floating_point()]


def dequantize(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """Compressed ``module``'s weight [out, in] in ``dtype`` (computed in fp32: ``(q - zero) · scale``)."""
    scheme, (out_features, in_features) = module.scheme, (module.out_features, module.in_features)
    if scheme.packed:
        q = wna16.unpack(module.weight_packed, scheme.num_bits, dim=1)[:, :in_features] - scheme.offset
    else:
        q = module.weight.float()
    zero = getattr(module, "weight_zero_point", None)
    if zero is not None:
        if scheme.packed and scheme.strategy != "tensor":
            zero = wna16.unpack(zero, scheme.num_bits, dim=0)[:out_features] - scheme.offset
        q = q - _by_input(zero, scheme, in_features)
    return (q.float() * _by_input(module.weight_scale, scheme, in_features)).to(dtype)


def _by_input(t: torch.Tensor, scheme: Scheme, in_features: int) -> torch.Tensor:
    """Scales or zeros ``t`` broadcastable over a weight [out, in]: a group's repeated over its inputs."""
    if scheme.strategy != "group":
        return t
    return t.repeat_interleave(scheme.group_size, dim=1)[:, :in_features]
