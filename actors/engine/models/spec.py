"""What KV memory a model needs: the model runner builds pools from this."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple


@dataclass(frozen=True)
class KVCacheSpec:
    """``kind``: "mha" (per-layer K and V), "mla" (one latent row per token),
    "swa" (full + sliding-window layers) or "hybrid_mamba" (attention layers'
    KV plus Mamba state slots).

    Every number is *this TP rank's*: the pools built from it need no TP
    knowledge. Where the rank's share sits in the whole model (what a KV
    transfer between workers of different TP sizes slices by):

    * ``num_kv_heads`` heads ``[kv_head_start, kv_head_start + num_kv_heads)``
      of ``total_kv_heads``; when ``tp_size > total_kv_heads`` several ranks
      hold a replica of the same head. MLA: ``total_kv_heads`` is 0, the latent
      row is replicated on every rank.
    * Mamba state: the rank holds linear-attention *key* heads
      ``[mamba_head_start, mamba_head_start + n)`` of ``total_mamba_heads``
      (``n = total_mamba_heads // tp_size``). The temporal state's axis 0 is
      their value heads (``value_heads // key_heads`` per key head, in key-head
      order); conv channels are three consecutive groups — q, k (``key_head_dim``
      per key head) and v (the value heads' ``value_head_dim``) — each cut the
      same way.
    """

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
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    start_layer: int = 0  # the first of the ``num_layers`` layers this rank caches (its pipeline stage's)
    kv_head_start: int = 0
    total_kv_heads: int = 0
    mamba_head_start: int = 0
    total_mamba_heads: int = 0
