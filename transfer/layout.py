"""A rank's transferable buffers, read off its pools.

Every row-addressed tensor of the KV pool (and of the Mamba pool for hybrid
models) becomes one :class:`~transfer.base.BufferLayout` plus the tensor
itself, named the same on every rank and worker so that prefill and decode
agree by name:

* MHA (also a hybrid model's full-attention layers): ``k.{layer}`` and
  ``v.{layer}``, rows ``[num_kv_heads, head_dim]``, head axis 0, heads
  ``[kv_head_start, kv_head_start + num_kv_heads)`` of ``total_kv_heads``;
* sliding-window models (``SWAKVPool``): the full-attention layers as MHA
  ``k.{layer}``/``v.{layer}``, the sliding-window layers as ``swa_k.{layer}``
  and ``swa_v.{layer}``, index ``"swa"`` (rows are SWA slots), head-sharded
  the same way;
* MLA: ``kv.{layer}``, rows ``[1, kv_lora_rank + qk_rope_head_dim]``, replicated;
* Mamba: ``state.{i}.{layer}`` (conv states, then the temporal state), rows
  are one state slot of one Mamba layer, addressed by state slot.

Layer numbers are positions in the pool (not global model layer ids), which
both sides share because they serve the same model.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from mem_cache.buffer_allocator import BufferAllocator, dtype_to_str
from mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from mem_cache.swa_memory_pool import SWAKVPool
from transfer.base import BufferLayout, KVLayout


def _add(entries, tensors, name, tensor, index, head_axis=None, head_start=0, total_heads=0):
    entries.append(BufferLayout(name, index, tuple(tensor.shape[1:]), dtype_to_str(tensor.dtype), head_axis, head_start, total_heads))
    tensors[name] = tensor


def _add_mha(entries, tensors, pool: MHATokenToKVPool, prefix: str, index: str, head_start: int, total_heads: int):
    for i, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer)):
        _add(entries, tensors, f"{prefix}k.{i}", k, index, 0, head_start, total_heads)
        _add(entries, tensors, f"{prefix}v.{i}", v, index, 0, head_start, total_heads)


def pool_layout(
    token_to_kv_pool, kv_head_start: int = 0, total_kv_heads: Optional[int] = None
) -> Tuple[KVLayout, Dict[str, torch.Tensor]]:
    """The layout and ``{name: tensor}`` of every transferable buffer of a KV pool."""
    entries, tensors = [], {}
    mamba_pool = getattr(token_to_kv_pool, "mamba_pool", None)
    kv_pool = getattr(token_to_kv_pool, "full_kv_pool", token_to_kv_pool)
    if isinstance(kv_pool, MHATokenToKVPool):
        total = total_kv_heads if total_kv_heads is not None else kv_pool.head_num
        _add_mha(entries, tensors, kv_pool, "", "token", kv_head_start, total)
        if isinstance(token_to_kv_pool, SWAKVPool):
            _add_mha(entries, tensors, token_to_kv_pool.swa_kv_pool, "swa_", "swa", kv_head_start, total)
    elif isinstance(kv_pool, MLATokenToKVPool):
        for i, kv in enumerate(kv_pool.kv_buffer):
            _add(entries, tensors, f"kv.{i}", kv, "token")
    else:
        kind = type(token_to_kv_pool).__name__
        raise TypeError(f"{kind} cannot be transferred yet (MHA, MLA, SWA and hybrid Mamba pools can)")
    if mamba_pool is not None:
        for s, state in enumerate(mamba_pool.states()):
            for layer in range(mamba_pool.num_mamba_layers):
                _add(entries, tensors, f"state.{s}.{layer}", state[layer], "state")
    return KVLayout(kv_pool.page_size, tuple(entries)), tensors


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
