"""The LoRA oracle: a tiny checkpoint with an adapter (``actors.engine.tiny``'s random ones) merged
into its weights (``W' = W + scaling · B A``), which HF transformers runs. transformers 5 holds a MoE
layer's experts as fused 3-D parameters (``mlp.experts.gate_up_proj [experts, 2·inter, hidden]``,
``down_proj [experts, hidden, inter]``): an expert's per-expert adapter is merged into its slice of them,
and a PEFT ``target_parameters`` adapter by PEFT's own formula (``ParamWrapper.get_delta_weight``)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from actors.engine.tiny import tiny_adapters

# a checkpoint's expert projection: <layer>.<its MoE block>.experts.<expert>.<projection> (a vision-language
# model's layers under model.language_model)
EXPERT = re.compile(r"^(model\.(?:language_model\.)?layers\.\d+)\.\w+\.experts\.(\d+)\.(\w+)$")
# a PEFT ParamWrapper over a layer's fused expert parameters
FUSED = re.compile(r"^(model\.(?:language_model\.)?layers\.\d+)\.mlp\.experts(?:\.base_layer)*$")
# an expert's projection -> transformers 5's fused parameter and its half of it (None: all of it)
FUSED_PART = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
              "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None)}


def _part_rows(model, module: str) -> torch.Tensor:
    """The rows of Phi-3's fused weight that ``module``, a part it fuses, is: q | k | v of qkv_proj, gate | up
    of gate_up_proj."""
    parent, _, part = module.rpartition(".")
    block = model.get_submodule(parent)
    if part in ("gate_proj", "up_proj"):
        return block.gate_up_proj.weight.chunk(2)[part == "up_proj"]
    q_rows = block.o_proj.in_features
    kv_rows = (block.qkv_proj.weight.shape[0] - q_rows) // 2
    return block.qkv_proj.weight.split([q_rows, kv_rows, kv_rows])["qkv".index(part[0])]


def _merge(model, module: str, a: torch.Tensor, b: torch.Tensor, rank: int, scaling: float, swaps: bool) -> None:
    """Add ``module``'s adapter delta to ``model``'s (HF's) weight it targets (``swaps``: the PEFT that wrote it
    reads the 3-D parameters of experts not ``is_transposed`` as ``[experts, out, in]``, :func:`peft_swaps`)."""
    parent, _, leaf = module.rpartition(".")
    if match := EXPERT.match(module):
        name, half = FUSED_PART[match[3]]
        weight = model.get_submodule(f"{match[1]}.mlp.experts").get_parameter(name)[int(match[2])]
        (weight if half is None else weight.chunk(2)[half]).add_(scaling * b @ a)
    elif match := FUSED.match(module):
        experts = model.get_submodule(f"{match[1]}.mlp.experts")
        swapped = swaps and not getattr(experts, "is_transposed", False)  # (as PEFT reads it)
        num_experts, d_in, d_out = a.shape[0] // rank, a.shape[1], b.shape[0]
        dims = (d_out, d_in) if swapped else (d_in, d_out)  # (the parameter's [experts, d1, d2])
        param = experts.gate_up_proj if experts.gate_up_proj.shape[1:] == dims else experts.down_proj
        param.add_(torch.einsum(f"o r e, e r i -> {'e o i' if swapped else 'e i o'}",
                                b.reshape(d_out, rank, num_experts), a.reshape(num_experts, rank, d_in)) * scaling)
    elif not hasattr(model.get_submodule(parent), leaf):  # (a part of a fused projection)
        _part_rows(model, module).add_(scaling * b @ a)
    else:
        model.get_submodule(module).weight.add_(scaling * b @ a)


def merged_checkpoint(model_dir: str, adapter_dir: Path, out_dir: Path) -> str:
    """``model_dir`` with the adapter merged into its weights, saved to ``out_dir`` (HF's oracle; a vision-language
    model's with its image processor's config)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    settings = json.loads((adapter_dir / "adapter_config.json").read_text())
    rank = settings["r"]
    scaling = settings["lora_alpha"] / (math.sqrt(rank) if settings.get("use_rslora") else rank)
    pairs: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(adapter_dir / "adapter_model.safetensors")).items():
        module, half = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        pairs.setdefault(module, {})[half[0]] = tensor
    vision = hasattr(AutoConfig.from_pretrained(model_dir), "vision_config")
    model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(model_dir,
                                                                                               dtype=torch.float32)
    with torch.no_grad():
        for module, ab in pairs.items():
            _merge(model, module, ab["A"], ab["B"], rank, scaling, peft_swaps(settings.get("peft_version")))
    model.save_pretrained(out_dir)
    if vision:
        shutil.copy(Path(model_dir) / "preprocessor_config.json", out_dir)
    return str(out_dir)


def peft_swaps(peft_version: Optional[str]) -> bool:
    """Whether the PEFT of ``peft_version`` (an adapter_config.json's, huggingface/peft#2782) reads the 3-D
    parameters of experts not marked ``is_transposed`` as ``[experts, out, in]``: since 0.19 (huggingface/peft#3165,
    ``ParamWrapper.update_layer``'s ``_did_swap_in_out_features``); before, every one as ``[experts, in, out]``."""
    return peft_version is not None and tuple(int(n) for n in peft_version.split(".")[:2]) >= (0, 19)


def fused_expert_adapter(model_dir: str, out_dir: Path, rank: int, alpha: float, seed: int = 0,
                         peft_version: str = "0.18.1") -> Path:
    """A random adapter as PEFT ``peft_version``'s ``target_parameters=["mlp.experts.gate_up_proj",
    "mlp.experts.down_proj"]`` writes it for transformers 5's fused experts: per MoE layer a ParamWrapper over each
    parameter, the first (gate_up_proj) innermost (``mlp.experts.base_layer.lora_*``), ``lora_A [experts·r, in]``
    and ``lora_B [out, experts·r]`` of the parameter ``[experts, d1, d2]`` read as ``[experts, in, out]``, or as
    ``[experts, out, in]`` where PEFT swaps them (:func:`peft_swaps`, experts not ``is_transposed``); a
    vision-language model's (Qwen3-VL-MoE's) under ``model.language_model.layers``."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        hf = (AutoModelForImageTextToText if hasattr(config, "vision_config") else
              AutoModelForCausalLM).from_config(config)
    gen, tensors = torch.Generator().manual_seed(seed), {}
    for name, module in hf.named_modules():
        if name.endswith("mlp.experts") and hasattr(module, "gate_up_proj"):
            for wrapper, param in ((f"{name}.base_layer", module.gate_up_proj), (name, module.down_proj)):
                num_experts, d_in, d_out = param.shape
                if peft_swaps(peft_version) and not getattr(module, "is_transposed", False):
                    d_in, d_out = d_out, d_in
                key = f"base_model.model.{wrapper}.lora_"
                tensors[key + "A.weight"] = torch.randn(num_experts * rank, d_in, generator=gen) / math.sqrt(d_in)
                tensors[key + "B.weight"] = torch.randn(d_out, num_experts * rank, generator=gen) / math.sqrt(rank)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": [], "bias": "none",
                "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                "peft_version": peft_version}
    (out_dir / "adapter_config.json").write_text(json.dumps(settings))
    return out_dir


def packed_parts_adapter(model_dir: str, out_dir: Path, rank: int, alpha: float, parts, seed: int = 0) -> Path:
    """A random adapter of Phi-3 as PEFT writes one trained on a Llama-style model's ``parts`` (q_proj,
    k_proj, v_proj, gate_proj, up_proj), which Phi-3's checkpoint fuses into qkv_proj and gate_up_proj."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    rows = {"q_proj": config.num_attention_heads * head_dim, "k_proj": config.num_key_value_heads * head_dim,
            "v_proj": config.num_key_value_heads * head_dim, "gate_proj": config.intermediate_size,
            "up_proj": config.intermediate_size}
    gen, tensors = torch.Generator().manual_seed(seed), {}
    for layer in range(config.num_hidden_layers):
        for part in parts:
            block = "mlp" if part in ("gate_proj", "up_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{part}.lora_"
            tensors[key + "A.weight"] = torch.randn(rank, hidden, generator=gen) / math.sqrt(hidden)
            tensors[key + "B.weight"] = torch.randn(rows[part], rank, generator=gen) / math.sqrt(rank)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(parts), "bias": "none"}
    (out_dir / "adapter_config.json").write_text(json.dumps(settings))
    return out_dir


def adapters_and_oracles(model_dir: str, root: Path) -> Tuple[Dict[str, str], Dict[str, str]]:
    """:func:`~actors.engine.tiny.tiny_adapters` and their merged checkpoints."""
    adapters = tiny_adapters(model_dir, root)
    oracles = {name: merged_checkpoint(model_dir, path, root / f"{name}-merged") for name, path in adapters.items()}
    return {name: str(path) for name, path in adapters.items()}, oracles
