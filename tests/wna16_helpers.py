"""GPTQ and AWQ checkpoints without a GPTQ library: a round-to-nearest reference quantizer into the packed
layouts released checkpoints store (AutoGPTQ's v1, AutoAWQ's GEMM), and a brute-force unpacker written from
those layouts' definitions, value by value, independent of ``actors.engine.wna16``: it gives the float
weights the served model must compute with (HF's oracle input)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from actors.engine.tiny import build_tiny_checkpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's from_linear: nibble i of a word holds column 8c + AWQ_ORDER[i]


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int, sym: bool, act_order: bool,
                 gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] rounded to ``bits``-bit ints per group of input features: (q [out, in],
    zeros [groups, out], fp16 scales [groups, out], g_idx [in]). ``act_order``: the groups are taken
    over a random order of the input features (GPTQ's desc_act: ``g_idx[perm[k]] = k // group_size``)."""
    out_features, in_features = weight.shape
    size = in_features if group_size == -1 else group_size
    order = torch.randperm(in_features, generator=gen) if act_order else torch.arange(in_features)
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // size).int()
    groups, maxq = -(-in_features // size), (1 << bits) - 1
    q = torch.empty(out_features, in_features, dtype=torch.int64)
    zeros, scales = torch.empty(groups, out_features, dtype=torch.int64), torch.empty(groups, out_features)
    for g in range(groups):
        cols = g_idx == g
        w = weight[:, cols].double()
        if sym:
            scale = w.abs().amax(1).clamp(min=1e-8) * 2 / maxq
            zero = torch.full((out_features,), (maxq + 1) // 2, dtype=torch.int64)
        else:
            lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
            scale = ((hi - lo) / maxq).clamp(min=1e-8)
            zero = torch.round(-lo / scale).long().clamp(1, maxq)  # (>= 1: v1 stores zero - 1)
        scale = scale.half()
        scales[g], zeros[g] = scale.float(), zero
        q[:, cols] = (torch.round(w / scale.double()[:, None]).long() + zero[:, None]).clamp(0, maxq)
    return q, zeros, scales.half(), g_idx


def pack_words(values: torch.Tensor, bits: int, places) -> torch.Tensor:
    """``values`` [..., pack] into one int32 word each, value j at place ``places[j]``."""
    word = torch.zeros(values.shape[:-1], dtype=torch.int64)
    for j, place in enumerate(places):
        word |= values[..., j] << (bits * place)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).int()


def pack_gptq(q, zeros, scales, g_idx, bits: int) -> Dict[str, torch.Tensor]:
    """AutoGPTQ's v1 tensors: qweight [in / pack, out] packed down the input dim, qzeros [groups, out / pack]
    holding zero - 1, scales, g_idx."""
    pack, (out_features, in_features) = 32 // bits, q.shape
    qweight = pack_words(q.t().reshape(in_features // pack, pack, out_features).transpose(1, 2), bits, range(pack))
    stored = (zeros - 1) & ((1 << bits) - 1)
    qzeros = pack_words(stored.reshape(stored.shape[0], -1, pack), bits, range(pack))
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}


def pack_awq(q, zeros, scales) -> Dict[str, torch.Tensor]:
    """AutoAWQ's GEMM tensors: qweight [in, out / 8] and qzeros [groups, out / 8], column 8c + AWQ_ORDER[i]
    in nibble i of word c; scales."""
    places = [AWQ_ORDER.index(j) for j in range(8)]  # (column 8c + j goes to nibble places[j])
    qweight = pack_words(q.t().reshape(q.shape[1], -1, 8), 4, places)
    qzeros = pack_words(zeros.reshape(zeros.shape[0], -1, 8), 4, places)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales}


def brute_force_dequantize(tensors: Dict[str, torch.Tensor], method: str, bits: int, group_size: int,
                           act_order: bool) -> torch.Tensor:
    """The float32 [out, in] weight of a layer's stored tensors, value by value from the layout's
    definition (Python integers, no shifts of signed words)."""
    qweight = tensors["qweight"].numpy().astype(np.int64) % (1 << 32)  # the words as unsigned
    qzeros = tensors["qzeros"].numpy().astype(np.int64) % (1 << 32)
    scales = tensors["scales"].float().numpy()
    base = 1 << bits
    if method == "gptq":
        pack = 32 // bits
        in_features, out_features = qweight.shape[0] * pack, qweight.shape[1]
    else:
        pack = 8
        in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    weight = np.zeros((out_features, in_features), dtype=np.float32)
    for i in range(in_features):
        if act_order:
            g = int(tensors["g_idx"][i])
        else:
            g = 0 if group_size == -1 else i // group_size
        for o in range(out_features):
            if method == "gptq":
                value = int(qweight[i // pack, o]) // base ** (i % pack) % base
                zero = int(qzeros[g, o // pack]) // base ** (o % pack) % base + 1
            else:
                nibble = AWQ_ORDER.index(o % 8)
                value = int(qweight[i, o // 8]) // 16 ** nibble % 16
                zero = int(qzeros[g, o // 8]) // 16 ** nibble % 16
            weight[o, i] = np.float32(value - zero) * scales[g, o]
    return torch.from_numpy(weight)


def quantize_layer(weight: torch.Tensor, method: str, bits: int, group_size: int, sym: bool, act_order: bool,
                   gen: torch.Generator) -> Dict[str, torch.Tensor]:
    """``weight`` [out, in] as the checkpoint tensors of ``method`` (a layer's, by suffix)."""
    q, zeros, scales, g_idx = quantize_rtn(weight, bits, group_size, sym, act_order, gen)
    return pack_gptq(q, zeros, scales, g_idx, bits) if method == "gptq" else pack_awq(q, zeros, scales)


def quantization_config(method: str, bits: int, group_size: int, sym: bool, act_order: bool) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": sym,
                "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True}
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}


def is_quantized(name: str) -> bool:
    """The linear layers GPTQ / AWQ checkpoints quantize, and llm-compressor's with ``targets: [Linear]``
    (lm_head ignored): attention and MLP projections, experts' too (Mixtral's w1..w3), DeepSeek's MLA ones,
    not embeddings, lm_head, norms, routers."""
    return name.endswith(("proj.weight", "proj_with_mqa.weight", ".w1.weight", ".w2.weight", ".w3.weight"))


def dynamic_scheme(dynamic: Dict[str, dict], layer: str, scheme: dict) -> Optional[dict]:
    """GPTQModel's ``dynamic`` rule for ``layer``: the first pattern matching it decides, ``-:`` leaves it
    unquantized (None), ``+:`` or none gives it those bits / group_size / desc_act; else ``scheme``."""
    for pattern, override in dynamic.items():
        if re.match(pattern.split(":", 1)[1] if pattern[:2] in ("-:", "+:") else pattern, layer):
            return None if pattern.startswith("-:") else {**scheme, **override}
    return scheme


def packed_checkpoint(family: str, root: Path, method: str = "gptq", bits: int = 4, group_size: int = 32,
                      sym: bool = True, act_order: bool = False, seed: int = 0, skip: Optional[str] = None,
                      dynamic: Optional[Dict[str, dict]] = None, build=build_tiny_checkpoint,
                      **overrides) -> Tuple[str, str]:
    """(a tiny ``family`` checkpoint with its projections quantized by ``method``, the float checkpoint of
    the brute-force dequantization of those tensors: HF's input). ``skip``: a layer-name substring whose
    layers stay unquantized (``modules_to_not_convert``); ``dynamic``: GPTQModel's per-layer entries;
    ``build``: writes the float checkpoint (:func:`build_tiny_checkpoint`'s arguments; a variant's layout)."""
    from safetensors.torch import load_file, save_file

    quantized, dequantized = root / method, root / "dequantized"
    for path in (quantized, dequantized):
        build(family, path, seed=seed, **overrides)
    tensors = load_file(str(quantized / "model.safetensors"))
    plain, gen = dict(tensors), torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if is_quantized(n) and not (skip and skip in n)]:
        prefix = name.removesuffix("weight")
        scheme = dynamic_scheme(dynamic or {}, prefix[:-1], dict(bits=bits, group_size=group_size, desc_act=act_order))
        if scheme is None:
            continue
        layer = quantize_layer(tensors.pop(name), method, scheme["bits"], scheme["group_size"], sym,
                               scheme["desc_act"], gen)
        tensors.update((prefix + k, v) for k, v in layer.items())
        plain[name] = brute_force_dequantize(layer, method, scheme["bits"], scheme["group_size"], scheme["desc_act"])
    save_file(tensors, str(quantized / "model.safetensors"))
    save_file(plain, str(dequantized / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, bits, group_size, sym, act_order)
    if skip:
        config["quantization_config"]["modules_to_not_convert"] = [skip]
    if dynamic:
        config["quantization_config"]["dynamic"] = dynamic
    (quantized / "config.json").write_text(json.dumps(config))
    return str(quantized), str(dequantized)
