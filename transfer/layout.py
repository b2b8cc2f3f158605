"""A rank's transferable buffers, read off its pools.

Every row-addressed tensor of the KV pool (and of the Mamba pool for hybrid
models) becomes one :class:`~transfer.base.BufferLayout` plus the tensor
itself, named the same on every rank and worker so that prefill and decode
agree by name:

* MHA: ``k.{layer}`` and ``v.{layer}``, rows ``[num_kv_heads, head_dim]``,
  head axis 0, heads ``[kv_head_start, kv_head_start + num_kv_heads)`` of
  ``total_kv_heads``;
* MLA: ``kv.{layer}``, rows ``[1, kv_lora_rank + qk_rope_head_dim]``, replicated;
* sliding-window models (``SWAKVPool``): the full-attention layers as MHA
  ``k.{layer}``/``v.{layer}``, the sliding-window layers as ``swa_k.{layer}`` and
  ``swa_v.{layer}``, index ``"swa"`` (rows are SWA slots), head-sharded the same way;
* hybrid models: the full-attention layers as MHA ``k.{layer}``/``v.{layer}``, and the
  Mamba states as ``state.{s}.{layer}`` (conv states, then the temporal state), rows
  are one state slot of one Mamba layer, addressed by state slot.

Every buffer is named by its global model layer id and carries it (``BufferLayout.layer``;
a pipeline stage's pools hold its layers only: an MHA or MLA pool ``start_layer ..``, the
sliding-window and hybrid pools their stage's layer-id lists), so the ranks of two stages
agree by name on the layers both hold; the layout carries the model's number of decoder layers.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from mem_cache.buffer_allocator import BufferAllocator, dtype_to_str
from mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from mem_cache.swa_memory_pool import SWAKVPool
from transfer.base import BufferLayout, KVLayout


def _add(entries, tensors, name, tensor, index, head_axis=None, head_start=0, total_heads=0, layer=None):
    entries.append(BufferLayout(name, index, tuple(tensor.shape[1:]), dtype_to_str(tensor.dtype), head_axis, head_start,
                                total_heads, layer))
    tensors[name] = tensor


def _add_mha(entries, tensors, pool: MHATokenToKVPool, prefix: str, index: str, head_start: int, total_heads: int,
             layers: Sequence[int]):
    """``layers``: the global id of each of the pool's layers."""
    for k, v, layer in zip(pool.k_buffer, pool.v_buffer, layers):
        _add(entries, tensors, f"{prefix}k.{layer}", k, index, 0, head_start, total_heads, layer)
        _add(entries, tensors, f"{prefix}v.{layer}", v, index, 0, head_start, total_heads, layer)


def _by_position(mapping: Dict[int, int]) -> List[int]:
    """The global layer ids of a ``{global id: position}`` map, in position order."""
    return sorted(mapping, key=mapping.__getitem__)


def pool_layout(
    token_to_kv_pool, kv_head_start: int = 0, total_kv_heads: Optional[int] = None, num_layers: Optional[int] = None,
) -> Tuple[KVLayout, Dict[str, torch.Tensor]]:
    """The layout and ``{name: tensor}`` of every transferable buffer of a KV pool.
    ``num_layers``: the model's decoder layers (default: one past the pool's last)."""
    entries, tensors = [], {}
    mamba_pool = getattr(token_to_kv_pool, "mamba_pool", None)
    kv_pool = getattr(token_to_kv_pool, "full_kv_pool", token_to_kv_pool)
    if isinstance(token_to_kv_pool, SWAKVPool):
        total = total_kv_heads if total_kv_heads is not None else kv_pool.head_num
        mapping = token_to_kv_pool.layers_mapping
        for prefix, index, pool, swa in (("", "token", kv_pool, False),
                                         ("swa_", "swa", token_to_kv_pool.swa_kv_pool, True)):
            layers = _by_position({layer: i for layer, (i, is_swa) in mapping.items() if is_swa == swa})
            _add_mha(entries, tensors, pool, prefix, index, kv_head_start, total, layers)
    elif isinstance(kv_pool, MHATokenToKVPool):
        total = total_kv_heads if total_kv_heads is not None else kv_pool.head_num
        hybrid = getattr(token_to_kv_pool, "full_attention_layer_id_mapping", None)
        layers = _by_position(hybrid) if hybrid is not None else range(kv_pool.start_layer, kv_pool.end_layer + 1)
        _add_mha(entries, tensors, kv_pool, "", "token", kv_head_start, total, layers)
    elif isinstance(kv_pool, MLATokenToKVPool):
        for i, kv in enumerate(kv_pool.kv_buffer):
            layer = kv_pool.start_layer + i
            _add(entries, tensors, f"kv.{layer}", kv, "token", layer=layer)
    else:
        kind = type(token_to_kv_pool).__name__
        raise TypeError(f"{kind} cannot be transferred yet (MHA, MLA, SWA and hybrid Mamba pools can)")
    if mamba_pool is not None:
        for s, state in enumerate(mamba_pool.states()):
            for i, layer in enumerate(mamba_pool.layer_ids):
                _add(entries, tensors, f"state.{s}.{layer}", state[i], "state", layer=layer)
    if num_layers is None:
        num_layers = 1 + max((b.layer for b in entries if b.layer is not None), default=-1)
    return KVLayout(kv_pool.page_size, tuple(entries), num_layers), tensors


def pool_allocators(token_to_kv_pool) -> List[BufferAllocator]:
    """The distinct buffer allocators behind a pool's transferable buffers (the
    KV pool's, and the Mamba pool's for hybrid models): what a same-node
    backend exports in its endpoint (``create_agent(..., allocators=...)``)."""
    found: List[BufferAllocator] = []
    for pool in (token_to_kv_pool, getattr(token_to_kv_pool, "mamba_pool", None)):
        allocator = getattr(pool, "buffer_allocator", None)
        if allocator is not None and all(allocator is not a for a in found):
            found.append(allocator)
    return found
