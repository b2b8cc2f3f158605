"""SWAKVPool: full-attention and sliding-window layers in two MHA pools (seed 000 §3.4).

Hybrid sliding-window models keep every token's KV in their full-attention
layers but only the window's in their SWA layers, so the SWA layers live in
a smaller pool (``size_swa``). Requests and the tree cache hold *full* slot
numbers; the SWA allocator owns ``full_to_swa_index_mapping`` (indexed by
full slot, 0 = no SWA slot) and registers it here with ``register_mapping``.
Writes to an SWA layer translate ``loc`` through it, unless the caller passes
the SWA slots itself (``swa_loc=``).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from mem_cache.buffer_allocator import BufferAllocator
from mem_cache.integrity import ensure
from mem_cache.memory_pool import BufInfos, KVCache, MHATokenToKVPool, Scale


class SWAKVPool(KVCache):
    """Dispatches every per-layer call to the full or the SWA sub-pool.

    ``layers_mapping[global_layer_id] = (pool_local_id, is_swa)``; a layer in
    neither list raises ValueError. Both sub-pools draw from one buffer
    allocator under the name prefixes ``full.`` and ``swa.``.
    """

    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        swa_attention_layer_ids: Sequence[int],
        full_attention_layer_ids: Sequence[int],
        device: Union[str, torch.device] = "cpu",
        buffer_allocator: Optional[BufferAllocator] = None,
    ):
        overlap = sorted(set(swa_attention_layer_ids) & set(full_attention_layer_ids))
        if overlap:
            raise ValueError(f"layers {overlap} are both sliding-window and full-attention")
        layer_num = len(swa_attention_layer_ids) + len(full_attention_layer_ids)
        super().__init__(size, page_size, dtype, layer_num, device, 0, buffer_allocator)
        self.size_swa = size_swa
        self.swa_layer_nums = len(swa_attention_layer_ids)
        self.full_layer_nums = len(full_attention_layer_ids)

        def sub_pool(pool_size: int, num_layers: int, prefix: str) -> MHATokenToKVPool:
            return MHATokenToKVPool(
                pool_size, page_size, dtype, head_num, head_dim, num_layers,
                device=device, buffer_allocator=self.buffer_allocator, name_prefix=prefix,
            )

        self.full_kv_pool = sub_pool(size, self.full_layer_nums, "full.")
        self.swa_kv_pool = sub_pool(size_swa, self.swa_layer_nums, "swa.")
        self.layers_mapping: Dict[int, Tuple[int, bool]] = {}
        for local_id, layer_id in enumerate(full_attention_layer_ids):
            self.layers_mapping[layer_id] = (local_id, False)
        for local_id, layer_id in enumerate(swa_attention_layer_ids):
            self.layers_mapping[layer_id] = (local_id, True)
        self.full_to_swa_index_mapping: Optional[torch.Tensor] = None

    def register_mapping(self, full_to_swa_index_mapping: torch.Tensor) -> None:
        """Adopt the SWA allocator's int64 mapping (shared, not copied)."""
        self.full_to_swa_index_mapping = full_to_swa_index_mapping

    def translate_loc_from_full_to_swa(self, loc: torch.Tensor) -> torch.Tensor:
        """SWA slots of full slots ``loc`` (int32; 0 where a slot has none)."""
        if self.full_to_swa_index_mapping is None:
            raise RuntimeError("SWAKVPool: no full→SWA mapping registered (call register_mapping first)")
        return self.full_to_swa_index_mapping[loc].to(torch.int32)

    def translate_layer_loc(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        """Rows of ``layer_id``'s buffers that hold full slots ``loc`` (any shape,
        dtype kept): ``loc`` itself for a full layer, the SWA slots for an SWA
        layer — 0, the zero dummy row, for tokens whose SWA KV is gone (out of
        every window, so attention masks them). Attention backends read
        through this; a whole ``req_to_token`` table translates the same way."""
        _, _, is_swa = self._route(layer_id)
        return self.translate_loc_from_full_to_swa(loc).to(loc.dtype) if is_swa else loc

    translate_layer_table = translate_layer_loc

    def _route(self, layer_id: int) -> Tuple[MHATokenToKVPool, int, bool]:
        if layer_id not in self.layers_mapping:
            raise ValueError(f"layer_id={layer_id} is neither a full-attention nor a sliding-window layer of this pool")
        local_id, is_swa = self.layers_mapping[layer_id]
        return (self.swa_kv_pool if is_swa else self.full_kv_pool), local_id, is_swa

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        pool, local_id, _ = self._route(layer_id)
        return pool.get_key_buffer(local_id)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        pool, local_id, _ = self._route(layer_id)
        return pool.get_value_buffer(local_id)

    def get_kv_buffer(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        pool, local_id, _ = self._route(layer_id)
        return pool.get_kv_buffer(local_id)

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: Scale = None,
        v_scale: Scale = None,
        swa_loc: Optional[torch.Tensor] = None,
    ) -> None:
        """``loc`` are full slots; for an SWA layer they are translated (or
        ``swa_loc`` is used as given)."""
        pool, local_id, is_swa = self._route(layer_id)
        if is_swa:
            loc = swa_loc if swa_loc is not None else self.translate_loc_from_full_to_swa(loc)
        pool.set_kv_buffer(local_id, loc, cache_k, cache_v, k_scale, v_scale)

    def get_contiguous_buf_infos(self) -> BufInfos:
        full_ptrs, full_lens, full_items = self.full_kv_pool.get_contiguous_buf_infos()
        swa_ptrs, swa_lens, swa_items = self.swa_kv_pool.get_contiguous_buf_infos()
        return full_ptrs + swa_ptrs, full_lens + swa_lens, full_items + swa_items

    def check_integrity(self) -> None:
        """Both sub-pools as built; every layer routed once; a registered
        mapping covers every full slot and points only at real SWA rows."""
        self.full_kv_pool.check_integrity()
        self.swa_kv_pool.check_integrity()
        num_swa = sum(is_swa for _, is_swa in self.layers_mapping.values())
        ensure(
            (len(self.layers_mapping), num_swa) == (self.layer_num, self.swa_layer_nums),
            f"SWAKVPool: {len(self.layers_mapping)} layers mapped ({num_swa} SWA), "
            f"expected {self.layer_num} ({self.swa_layer_nums} SWA)",
        )
        if self.full_to_swa_index_mapping is None:
            return
        full_rows = self.size + self.page_size
        mapping = self.full_to_swa_index_mapping.cpu()
        ensure(mapping.numel() >= full_rows, f"SWAKVPool: mapping has {mapping.numel()} entries for {full_rows} full rows")
        swa_slots = mapping[:full_rows]
        lo, hi = int(swa_slots.min()), int(swa_slots.max())
        top = self.size_swa + self.page_size - 1
        ensure(lo >= 0 and hi <= top, f"SWAKVPool: mapping targets span [{lo}, {hi}], SWA rows are [0, {top}]")
