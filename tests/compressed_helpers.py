"""compressed-tensors and per-tensor FP8 checkpoints without llm-compressor: a round-to-nearest reference
quantizer into the tensors compressed-tensors' compressors save (float-, int-, pack-quantized; AutoFP8's
per-tensor FP8), and a brute-force dequantizer written from those layouts' definitions, value by value,
independent of ``actors.engine.compressed_tensors``: it gives the float weights the served model must compute
with (HF's oracle input)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch
from torch.nn import functional as F

from actors.engine.tiny import build_tiny_checkpoint
from tests.wna16_helpers import is_quantized, pack_words

FP8 = torch.float8_e4m3fn


def scheme(num_bits: int = 4, type: str = "int", strategy: str = "group", group_size: Optional[int] = 16,
           symmetric: bool = True, format: str = "pack-quantized", targets=("Linear",),
           input_activations: Optional[dict] = None) -> dict:
    """One config group, as llm-compressor writes it (its ``format`` its own, as newer versions do; W8A8's with
    its ``input_activations``)."""
    return {"targets": list(targets), "format": format, "input_activations": input_activations,
            "weights": {"num_bits": num_bits, "type": type, "strategy": strategy, "symmetric": symmetric,
                        "group_size": group_size if strategy == "group" else None, "dynamic": False,
                        "actorder": None, "observer": "minmax"}}


def _units(weight: torch.Tensor, strategy: str, group_size: Optional[int]) -> torch.Tensor:
    """[out, in] → [rows of units, units a row, values a unit]: one unit a scale."""
    out_features, in_features = weight.shape
    if strategy == "tensor":
        return weight.reshape(1, 1, -1)
    if strategy == "channel":
        return weight.reshape(out_features, 1, in_features)
    return weight.reshape(out_features, in_features // group_size, group_size)


def quantize_rtn(weight: torch.Tensor, weights: dict) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``weight`` [out, in] rounded per unit of ``weights``' strategy: (q [out, in] (FP8 or signed int64),
    bf16 scales [rows, units], signed zeros or None)."""
    units = _units(weight.double(), weights["strategy"], weights["group_size"])
    if weights["type"] == "float":
        scale = (units.abs().amax(-1) / torch.finfo(FP8).max).clamp(min=1e-8).bfloat16()
        q = (units / scale.double()[..., None]).clamp(-448, 448).to(FP8)
        return q.reshape(weight.shape), scale, None
    q_min, q_max = -(1 << weights["num_bits"] - 1), (1 << weights["num_bits"] - 1) - 1
    if weights["symmetric"]:
        scale, zero = (units.abs().amax(-1) / q_max).clamp(min=1e-8).bfloat16(), None
    else:
        lo, hi = units.amin(-1).clamp(max=0), units.amax(-1).clamp(min=0)
        scale = ((hi - lo) / (q_max - q_min)).clamp(min=1e-8).bfloat16()
        zero = torch.round(q_min - lo / scale.double()).long().clamp(q_min, q_max)
    q = torch.round(units / scale.double()[..., None]).long()
    if zero is not None:
        q = q + zero[..., None]
    return q.clamp(q_min, q_max).reshape(weight.shape), scale, zero


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Signed ``values`` [r, c] stored plus 2 ** (bits - 1), ``32 // bits`` to an int32 word along ``dim``,
    value k of a word at bits ``k · bits`` (compressed-tensors' pack_to_int32), the last word's spare places 0."""
    per_word = 32 // bits
    unsigned = values.long() + (1 << bits - 1)
    unsigned = unsigned.t() if dim == 0 else unsigned
    unsigned = F.pad(unsigned, (0, -unsigned.shape[1] % per_word))
    words = pack_words(unsigned.reshape(unsigned.shape[0], -1, per_word), bits, range(per_word))
    return words.t().contiguous() if dim == 0 else words


def quantize_layer(weight: torch.Tensor, group: dict) -> Dict[str, torch.Tensor]:
    """``weight`` [out, in] as the checkpoint tensors config ``group`` (its format) saves for a layer (by suffix)."""
    weights, fmt = group["weights"], group["format"]
    q, scale, zero = quantize_rtn(weight, weights)
    if weights["strategy"] == "tensor":
        scale, zero = scale.reshape(1), None if zero is None else zero.reshape(1)
    tensors = {"weight_scale": scale}
    if fmt == "pack-quantized":
        tensors["weight_packed"] = pack(q, weights["num_bits"], dim=1)
        tensors["weight_shape"] = torch.tensor(list(weight.shape))
        packed_zeros = weights["strategy"] != "tensor"
        if zero is not None:
            tensors["weight_zero_point"] = (pack(zero, weights["num_bits"], dim=0) if packed_zeros
                                            else zero.to(torch.int8))
    else:
        tensors["weight"] = q if q.dtype == FP8 else q.to(torch.int8)
        if zero is not None:
            tensors["weight_zero_point"] = zero.to(torch.int8)
    return tensors


def brute_force_dequantize(tensors: Dict[str, torch.Tensor], weights: dict,
                           shape: Tuple[int, int]) -> torch.Tensor:
    """The float32 [out, in] weight of a layer's stored tensors, value by value from the layout's definition
    (Python integers from the words as unsigned)."""
    bits, strategy = weights["num_bits"], weights["strategy"]
    offset, base = 1 << (bits - 1), 1 << bits
    per_word = 32 // bits
    scales = tensors["weight_scale"].float().reshape(-1, tensors["weight_scale"].shape[-1] if strategy != "tensor"
                                                     else 1).numpy()
    zeros = tensors.get("weight_zero_point")
    packed_zeros = zeros is not None and zeros.dtype == torch.int32  # (else int8, shaped as the scales)
    if zeros is not None:
        zeros = zeros.numpy().astype(np.int64) % (1 << 32) if packed_zeros else zeros.reshape(scales.shape).numpy()
    words = tensors["weight_packed"].numpy().astype(np.int64) % (1 << 32) if "weight_packed" in tensors else None
    stored = tensors["weight"].float().numpy() if words is None else None
    weight = np.zeros(shape, dtype=np.float32)
    for o in range(shape[0]):
        for i in range(shape[1]):
            row = 0 if strategy == "tensor" else o
            col = i // weights["group_size"] if strategy == "group" else 0
            if words is None:
                value = float(stored[o, i])
            else:
                value = int(words[o, i // per_word]) // base ** (i % per_word) % base - offset
            zero = 0
            if zeros is not None and packed_zeros:
                zero = int(zeros[o // per_word, col]) // base ** (o % per_word) % base - offset
            elif zeros is not None:
                zero = int(zeros[row, col])
            weight[o, i] = np.float32(np.float32(value - zero) * scales[row, col])
    return torch.from_numpy(weight)


def config_group(groups: Dict[str, dict], ignore, layer: str) -> Optional[dict]:
    """The config group a layer is quantized by, None when ignored or untargeted: compressed-tensors'
    ``apply_quantization_config`` (targets → groups, the last group naming a target wins) and ``match_targets``
    (the targets matching the layer sorted as strings, those without ``re:`` first, ``Linear``, its class,
    after them; a ``re:`` regex matched from the name's start)."""
    def name_matches(target):
        return re.match(target[3:], layer) is not None if target.startswith("re:") else target == layer
    if any(name_matches(t) or t == "Linear" for t in ignore):
        return None
    target_to_group = {t: g for g in groups.values() for t in g["targets"]}
    matched = sorted((t for t in target_to_group if name_matches(t)), key=lambda t: ("re:" in t, t))
    matched += [t for t in target_to_group if t == "Linear"]
    return target_to_group[matched[0]] if matched else None


def compressed_checkpoint(family: str, root: Path, groups: Dict[str, dict], ignore=("lm_head",), seed: int = 0,
                          per_tensor_fp8: bool = False, static: bool = False, kv_scales: bool = False,
                          build=build_tiny_checkpoint, **overrides) -> Tuple[str, str]:
    """(a tiny ``family`` checkpoint with its projections quantized by config ``groups``, the float checkpoint of
    the brute-force dequantization of those tensors: HF's input). ``per_tensor_fp8``: the single group is
    saved as ``quant_method: "fp8"`` (AutoFP8's: a scalar ``weight_scale``); ``static``: with each layer's
    ``input_scale`` (static activations, unread by a weight-only forward); ``kv_scales``: with an FP8 KV cache's
    scales, each attention's ``kv_scale`` (AutoFP8's) or ``k_scale`` and ``v_scale`` (a ``kv_cache_scheme``'s);
    ``build``: writes the float checkpoint (:func:`build_tiny_checkpoint`'s arguments; a variant's layout)."""
    from safetensors.torch import load_file, save_file

    dequantized = Path(build(family, root / "dequantized", seed=seed, **overrides))
    quantized = Path(shutil.copytree(dequantized, root / "compressed"))
    tensors = load_file(str(quantized / "model.safetensors"))
    plain = dict(tensors)
    for name in [n for n in tensors if is_quantized(n)]:
        prefix = name.removesuffix("weight")
        group = config_group(groups, ignore, prefix[:-1])
        if group is None:
            continue
        weight = tensors.pop(name)
        layer = quantize_layer(weight, group)
        if per_tensor_fp8:
            layer["weight_scale"] = layer["weight_scale"].float().reshape(())
        if static:
            layer["input_scale"] = torch.tensor(0.01 if per_tensor_fp8 else [0.01])
        tensors.update((prefix + k, v) for k, v in layer.items())
        plain[name] = brute_force_dequantize(layer, group["weights"], tuple(weight.shape))
    attention = {name[:name.index("self_attn.")] + "self_attn." for name in tensors if "self_attn." in name}
    for prefix in attention if kv_scales else ():
        tensors.update((prefix + scale, torch.tensor(0.02)) for scale in (("kv_scale",) if per_tensor_fp8
                                                                          else ("k_scale", "v_scale")))
    save_file(tensors, str(quantized / "model.safetensors"))
    save_file(plain, str(dequantized / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    if per_tensor_fp8:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
                                         **({"kv_cache_scheme": "static"} if kv_scales else {})}
    else:
        kv_scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
        config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mixed",
                                         "config_groups": groups, "ignore": list(ignore),
                                         "kv_cache_scheme": kv_scheme if kv_scales else None,
                                         "quantization_status": "compressed"}
    (quantized / "config.json").write_text(json.dumps(config))
    return str(quantized), str(dequantized)
