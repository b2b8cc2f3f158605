"""What KV memory a model needs: the model runner builds pools from this."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple


@dataclass(frozen=True)
class KVCacheSpec:
    """``kind``: "mha" (per-layer K and V), "mla" (one latent row per token),
    "swa" (full + sliding-window layers) or "hybrid_mamba" (attention layers'
    KV plus Mamba state slots)."""

    kind: str
    num_layers: int
    num_kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: Optional[int] = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    full_attention_layer_ids: List[int] = field(default_factory=list)
    swa_attention_layer_ids: List[int] = field(default_factory=list)
    sliding_window: Optional[int] = None
    mamba_layer_ids: List[int] = field(default_factory=list)
    conv_state_shapes: List[Tuple[int, ...]] = field(default_factory=list)
    temporal_state_shape: Tuple[int, ...] = ()
