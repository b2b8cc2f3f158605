"""Load an HF checkpoint directory into our model modules (no download, ever)."""

from __future__ import annotations

import glob
import os
from typing import Tuple

import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from actors.engine.models import get_model_class

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_config(model_path: str):
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(f"model_path={model_path!r} has no config.json (only local checkpoints are served)")
    return AutoConfig.from_pretrained(model_path, local_files_only=True)


def resolve_dtype(config, dtype: str) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return name if isinstance(name, torch.dtype) else DTYPES.get(str(name).removeprefix("torch."), torch.float32)


def load_model(model_path: str, dtype: str, device: str) -> Tuple[torch.nn.Module, object, torch.dtype]:
    """Model in eval mode on ``device`` with every checkpoint tensor loaded."""
    config = load_config(model_path)
    architecture = (getattr(config, "architectures", None) or ["?"])[0]
    model_cls = get_model_class(architecture)
    torch_dtype = resolve_dtype(config, dtype)
    with torch.device("meta"):
        model = model_cls(config)
    model = model.to_empty(device=device)
    state = {}
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path!r}")
    for path in files:
        state.update(load_file(path, device=str(device)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        missing = [m for m in missing if m != "lm_head.weight"]
        model.lm_head.weight = model.model.embed_tokens.weight
    if missing or unexpected:
        raise ValueError(f"checkpoint/model mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
    model = model.to(torch_dtype).eval()
    reinit_buffers(model)
    return model, config, torch_dtype


def reinit_buffers(model: torch.nn.Module) -> None:
    """Non-persistent buffers (rotary inv_freq) were created on meta: rebuild them."""
    for module in model.modules():
        if hasattr(module, "rebuild_buffers"):
            module.rebuild_buffers()
