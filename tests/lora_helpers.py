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
from typing import Dict, Tuple

import torch

from actors.engine.tiny import tiny_adapters

# a checkpoint's expert projection: <layer>.<its MoE block>.experts.<expert>.<projection>
EXPERT = re.compile(r"^(model\.layers\.\d+)\.\w+\.experts\.(\d+)\.(\w+)$")
# a PEFT ParamWrapper over a layer's fused expert parameters
FUSED = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts(?:\.base_layer)*$")
# an expert's projection -> transformers 5's fused parameter and its half of it (None: all of it)
FUSED_PART = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
              "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None)}


def _merge(model, module: str, a: torch.Tensor, b: torch.Tensor, rank: int, scaling: float) -> None:
    """Add ``module``'s adapter delta to ``model``'s (HF's) weight it targets."""
    if match := EXPERT.match(module):
        name, half = FUSED_PART[match[3]]
        weight = model.get_submodule(f"{match[1]}.mlp.experts").get_parameter(name)[int(match[2])]
        (weight if half is None else weight.chunk(2)[half]).add_(scaling * b @ a)
    elif match := FUSED.match(module):
        experts = model.get_submodule(f"{match[1]}.mlp.experts")
        num_experts, d1, d2 = a.shape[0] // rank, a.shape[1], b.shape[0]
        param = experts.gate_up_proj if experts.gate_up_proj.shape[1:] == (d1, d2) else experts.down_proj
        param.add_(torch.einsum("o r e, e r i -> e i o", b.reshape(d2, rank, num_experts),
                                a.reshape(num_experts, rank, d1)) * scaling)
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
            _merge(model, module, ab["A"], ab["B"], rank, scaling)
    model.save_pretrained(out_dir)
    if vision:
        shutil.copy(Path(model_dir) / "preprocessor_config.json", out_dir)
    return str(out_dir)


def fused_expert_adapter(model_dir: str, out_dir: Path, rank: int, alpha: float, seed: int = 0) -> Path:
    """A random adapter as PEFT's ``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``
    writes it for transformers 5's fused experts: per MoE layer a ParamWrapper over each parameter, the first
    (gate_up_proj) innermost (``mlp.experts.base_layer.lora_*``), ``lora_A [experts·r, d1]`` and
    ``lora_B [d2, experts·r]`` of the parameter's ``[experts, d1, d2]``."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    gen, tensors = torch.Generator().manual_seed(seed), {}
    for name, module in hf.named_modules():
        if name.endswith("mlp.experts") and hasattr(module, "gate_up_proj"):
            for wrapper, param in ((f"{name}.base_layer", module.gate_up_proj), (name, module.down_proj)):
                num_experts, d1, d2 = param.shape
                key = f"base_model.model.{wrapper}.lora_"
                tensors[key + "A.weight"] = torch.randn(num_experts * rank, d1, generator=gen) / math.sqrt(d1)
                tensors[key + "B.weight"] = torch.randn(d2, num_experts * rank, generator=gen) / math.sqrt(rank)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": [], "bias": "none",
                "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    (out_dir / "adapter_config.json").write_text(json.dumps(settings))
    return out_dir


def adapters_and_oracles(model_dir: str, root: Path) -> Tuple[Dict[str, str], Dict[str, str]]:
    """:func:`~actors.engine.tiny.tiny_adapters` and their merged checkpoints."""
    adapters = tiny_adapters(model_dir, root)
    oracles = {name: merged_checkpoint(model_dir, path, root / f"{name}-merged") for name, path in adapters.items()}
    return {name: str(path) for name, path in adapters.items()}, oracles
