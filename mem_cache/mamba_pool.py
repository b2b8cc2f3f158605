"""Mamba / linear-attention state pools (seed 000 §3.5, §5; reference §2).

A hybrid model keeps two kinds of per-request memory:

* KV of its full-attention layers, per token, in :class:`HybridLinearKVPool`
  (an MHA pool over those layers only, addressed by global layer id);
* one fixed-size recurrent state (conv + temporal/SSM) per request and per
  Mamba layer, in :class:`MambaPool` slots. :class:`HybridReqToTokenPool`
  pairs every request row with its working Mamba slot and, in extra-buffer
  mode, two ping-pong track slots that hold checkpoints for the radix tree.
  Under speculative decoding the pool also holds a verify step's scratch:
  per request row, the state after each of its tokens (SGLang's
  ``SpeculativeState``), of which the step keeps only the last accepted one.

Running out of Mamba slots is a logical OOM like any other: ``alloc`` returns
``None`` and takes nothing.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from mem_cache.buffer_allocator import BufferAllocator, LocalBufferAllocator
from mem_cache.integrity import check_not_free, check_unique_in_range, debug_enabled, ensure
from mem_cache.memory_pool import BufInfos, KVCache, MHATokenToKVPool, Scale, check_buffer
from mem_cache.req_to_token_pool import ReqToTokenPool, Rows, as_row_list

Slots = Union[int, Sequence[int], torch.Tensor]


def _as_slot_tensor(slots: Slots, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(slots, dtype=torch.int64, device=device).reshape(-1)


class MambaPool:
    """``size`` state slots, each holding every Mamba layer's conv and temporal state.

    ``conv[i]`` is ``[num_mamba_layers, size + 1, *conv_state_shapes[i]]`` and
    ``temporal`` is ``[num_mamba_layers, size + 1, *temporal_state_shape]``.
    Slot ``size`` (index ``-1``) is the dummy padded requests use; it is never
    free. ``alloc`` takes from the front of ``free_slots`` and zeroes what it
    hands out; ``free`` appends.

    ``verify_shape`` ``(rows, positions)``: the verify scratch of speculative
    decoding, ``verify_states``: per tensor of ``states()``, one of shape
    ``[num_mamba_layers, rows, positions, *state_shape]``; entry ``[:, row, j]``
    is written by a verify forward (the state after the ``j``-th token of
    request row ``row``'s step) and read by ``commit_verify_states`` only. A plain
    allocation: it is never transferred.

    ``op_log``, when a list, records every state write made outside a model
    forward (``("zero", slots)`` at alloc, ``("copy", src, dst)``,
    ``("verify", rows, positions, slots)``) so that a pool on another TP rank,
    holding other heads of the same slots, can ``replay`` them in order.
    """

    def __init__(
        self,
        size: int,
        conv_state_shapes: List[Tuple[int, ...]],
        temporal_state_shape: Tuple[int, ...],
        num_mamba_layers: int,
        conv_dtype: torch.dtype,
        temporal_dtype: torch.dtype,
        device: Union[str, torch.device] = "cpu",
        buffer_allocator: Optional[BufferAllocator] = None,
        debug: Optional[bool] = None,
        verify_shape: Optional[Tuple[int, int]] = None,
        layer_ids: Optional[Sequence[int]] = None,
    ):
        if size <= 0 or num_mamba_layers < 0:  # (no layer: a pipeline stage of attention layers only)
            raise ValueError(f"MambaPool needs size > 0 and num_mamba_layers >= 0, got {size=}, {num_mamba_layers=}")
        self.size = size
        self.num_mamba_layers = num_mamba_layers
        # the global model layer of each (a pipeline stage's: what a KV transfer names its states by)
        self.layer_ids = list(range(num_mamba_layers) if layer_ids is None else layer_ids)
        if len(self.layer_ids) != num_mamba_layers:
            raise ValueError(f"{len(self.layer_ids)} layer ids for {num_mamba_layers} Mamba layers")
        self.device = torch.device(device)
        self.buffer_allocator = buffer_allocator or LocalBufferAllocator(self.device)
        lead = (num_mamba_layers, size + 1)
        self.state_specs = [(f"mamba.conv.{i}", lead + tuple(s), conv_dtype) for i, s in enumerate(conv_state_shapes)]
        self.state_specs.append(("mamba.temporal", lead + tuple(temporal_state_shape), temporal_dtype))
        states = [self.buffer_allocator.zeros(*spec) for spec in self.state_specs]
        self.conv: List[torch.Tensor] = states[:-1]
        self.temporal: torch.Tensor = states[-1]
        self.verify_specs = [] if verify_shape is None else [
            (name.replace("mamba.", "mamba.verify_"), shape[:1] + tuple(verify_shape) + shape[2:], dtype)
            for name, shape, dtype in self.state_specs]
        # (its own, process-private: no peer maps it; released and resumed with the states in sleep mode)
        self.verify_allocator = LocalBufferAllocator(self.device)
        self.verify_states: List[torch.Tensor] = [self.verify_allocator.zeros(*spec) for spec in self.verify_specs]
        self.op_log: Optional[List[Tuple]] = None
        self.debug = debug_enabled(debug)
        self.clear()

    def states(self) -> List[torch.Tensor]:
        return self.conv + [self.temporal]

    def available_size(self) -> int:
        return int(self.free_slots.numel())

    def clear(self) -> None:
        self.free_slots = torch.arange(self.size, dtype=torch.int64, device=self.device)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` zeroed slots (int64), or ``None`` with nothing taken."""
        if need_size > self.available_size():
            return None
        slots, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        self._zero(slots)
        return slots

    def _zero(self, slots: torch.Tensor) -> None:
        for state in self.states():
            state[:, slots] = 0
        if self.op_log is not None:
            self.op_log.append(("zero", slots.to("cpu", copy=True)))

    def free(self, slots: Slots) -> None:
        """Return ``slots``; in debug mode (``debug=True`` or ``RAYDIX_DEBUG_MEMORY_POOL``) a
        slot freed twice, or the dummy slot, raises ``IntegrityError``."""
        freed = _as_slot_tensor(slots, self.device)
        if self.debug:
            check_unique_in_range("freed Mamba slots", freed, 0, self.size - 1)
            check_not_free("Mamba slots", freed, self.free_slots)
        self.free_slots = torch.cat([self.free_slots, freed])

    def copy_from(self, src: Slots, dst: Slots) -> None:
        """Every layer's state of slots ``src`` into slots ``dst``."""
        src_t, dst_t = _as_slot_tensor(src, self.device), _as_slot_tensor(dst, self.device)
        for state in self.states():
            state[:, dst_t] = state[:, src_t]
        if self.op_log is not None:
            # copies: ``as_tensor`` keeps the caller's tensor, which it may reuse before replay
            self.op_log.append(("copy", src_t.to("cpu", copy=True), dst_t.to("cpu", copy=True)))

    def commit_verify_states(self, rows: Slots, positions: Slots, slots: Slots) -> None:
        """Every layer's scratch state of request row ``rows[i]`` after its verify step's token
        ``positions[i]`` into slot ``slots[i]``, for every ``i`` (a verify step keeps its accepted
        tokens' state only): one indexed copy per state tensor, not one per commit, and one logged op."""
        rows_t, positions_t, slots_t = (_as_slot_tensor(x, self.device) for x in (rows, positions, slots))
        for state, verify_state in zip(self.states(), self.verify_states):
            state[:, slots_t] = verify_state[:, rows_t, positions_t]
        if self.op_log is not None:
            self.op_log.append(("verify", *(x.to("cpu", copy=True) for x in (rows_t, positions_t, slots_t))))

    def replay(self, ops: List[Tuple]) -> None:
        """Apply another rank's recorded ``op_log`` entries to these states, in order."""
        for op in ops:
            if op[0] == "zero":
                self._zero(op[1].to(self.device))
            elif op[0] == "copy":
                self.copy_from(op[1], op[2])
            elif op[0] == "verify":
                self.commit_verify_states(*op[1:])
            else:
                raise ValueError(f"unknown Mamba state op {op[0]!r}")

    def fork_from(self, src: Slots) -> Optional[torch.Tensor]:
        """A fresh slot holding a copy of slot ``src``, or ``None`` if none is free."""
        dst = self.alloc(1)
        if dst is not None:
            self.copy_from(src, dst)
        return dst

    def get_contiguous_buf_infos(self) -> BufInfos:
        """Per state tensor, per layer: pointer, bytes, bytes of one slot."""
        layers = [state[layer] for state in self.states() for layer in range(self.num_mamba_layers)]
        return [t.data_ptr() for t in layers], [t.nbytes for t in layers], [t[0].nbytes for t in layers]

    def mem_usage_bytes(self) -> int:
        return sum(state.nbytes for state in self.states() + self.verify_states)

    def check_held(self, what: str, held: torch.Tensor) -> None:
        """``held`` slots are unique, real (not the dummy) and not free."""
        held = held.to("cpu", torch.int64)
        check_unique_in_range(what, held, 0, self.size - 1)
        both = torch.cat([held, self.free_slots.cpu()])
        shared = both.numel() - int(torch.unique(both).numel())
        ensure(shared == 0, f"{what}: {shared} slots are also free")

    def check_integrity(self, in_use: Optional[torch.Tensor] = None) -> None:
        """States as built; free slots unique in ``[0, size)``; with ``in_use``
        (every slot held by requests and the tree) free + in_use == size exactly."""
        states, specs = self.states() + self.verify_states, self.state_specs + self.verify_specs
        for state, (name, shape, dtype) in zip(states, specs):
            check_buffer(name, state, shape, dtype)
        check_unique_in_range("MambaPool.free_slots", self.free_slots, 0, self.size, forbidden=self.size)
        if in_use is None:
            return
        self.check_held("MambaPool in-use slots", in_use)
        num_free, num_used = self.available_size(), int(in_use.numel())
        ensure(num_free + num_used == self.size, f"MambaPool leak: {num_free} free + {num_used} in use != {self.size} slots")


class HybridReqToTokenPool(ReqToTokenPool):
    """Request rows that also own Mamba slots.

    Per live row: one working slot (``req_index_to_mamba_index_mapping``) and,
    with ``enable_mamba_extra_buffer``, two ping-pong track slots
    (``req_index_to_mamba_ping_pong_track_buffer_mapping``), so a request holds
    1 or 3 slots. Mapping entries of free rows are stale and never read.
    """

    def __init__(
        self,
        size: int,
        max_context_len: int,
        device: Union[str, torch.device],
        mamba_pool: MambaPool,
        mamba_layer_ids: Sequence[int],
        enable_mamba_extra_buffer: bool = False,
        debug: Optional[bool] = None,
    ):
        super().__init__(size, max_context_len, device, debug)
        if len(mamba_layer_ids) != mamba_pool.num_mamba_layers:
            raise ValueError(f"{len(mamba_layer_ids)} mamba layer ids for a pool of {mamba_pool.num_mamba_layers} layers")
        self.mamba_pool = mamba_pool
        self.mamba_map: Dict[int, int] = {layer_id: i for i, layer_id in enumerate(mamba_layer_ids)}
        self.enable_mamba_extra_buffer = enable_mamba_extra_buffer
        self.req_index_to_mamba_index_mapping = torch.zeros(size, dtype=torch.int64, device=self.device)
        if enable_mamba_extra_buffer:
            self.req_index_to_mamba_ping_pong_track_buffer_mapping = torch.zeros((size, 2), dtype=torch.int64, device=self.device)

    @property
    def mamba_slots_per_row(self) -> int:
        """Mamba slots a live row holds: its working slot, and its two track slots with extra buffers."""
        return 3 if self.enable_mamba_extra_buffer else 1

    def alloc(self, need_size: int, mamba_indices: Optional[Sequence[Optional[int]]] = None) -> Optional[List[int]]:
        """``need_size`` rows, each with its Mamba slots, or ``None`` with nothing taken.

        ``mamba_indices[i]``, when not None, is a slot the caller already owns
        for row i (a radix-cache copy-on-write); it is adopted, not reallocated.
        """
        given = list(mamba_indices) if mamba_indices is not None else [None] * need_size
        if len(given) != need_size:
            raise ValueError(f"{len(given)} mamba indices for {need_size} rows")
        num_fresh = sum(m is None for m in given)
        num_track = 2 * need_size if self.enable_mamba_extra_buffer else 0
        if need_size > self.available_size() or num_fresh + num_track > self.mamba_pool.available_size():
            return None
        rows = super().alloc(need_size)
        fresh = iter(self.mamba_pool.alloc(num_fresh + num_track).tolist())
        working = [next(fresh) if m is None else int(m) for m in given]
        self.req_index_to_mamba_index_mapping[rows] = torch.tensor(working, dtype=torch.int64, device=self.device)
        if self.enable_mamba_extra_buffer:
            track = torch.tensor(list(fresh), dtype=torch.int64, device=self.device).reshape(need_size, 2)
            self.req_index_to_mamba_ping_pong_track_buffer_mapping[rows] = track
        return rows

    def get_mamba_indices(self, rows: Rows) -> torch.Tensor:
        return self.req_index_to_mamba_index_mapping[as_row_list(rows)]

    def get_mamba_ping_pong_track_buffer(self, rows: Rows) -> torch.Tensor:
        if not self.enable_mamba_extra_buffer:
            raise ValueError("no ping-pong track buffers: enable_mamba_extra_buffer is off")
        return self.req_index_to_mamba_ping_pong_track_buffer_mapping[as_row_list(rows)]

    def free(
        self,
        rows: Rows,
        free_mamba_cache: bool = True,
        mamba_ping_pong_track_buffer_to_keep: Optional[int] = None,
    ) -> None:
        """Free ``rows``; their working slots too if ``free_mamba_cache``.

        Ping-pong track slots are reachable only through the row, so they are
        always freed with it, except the one at track index
        ``mamba_ping_pong_track_buffer_to_keep`` (0 or 1), now owned by the tree.
        """
        keep = mamba_ping_pong_track_buffer_to_keep
        if keep is not None and (not self.enable_mamba_extra_buffer or keep not in (0, 1)):
            raise ValueError(f"mamba_ping_pong_track_buffer_to_keep={keep} needs extra buffers and a value of 0 or 1")
        row_list = as_row_list(rows)
        if free_mamba_cache:
            self.mamba_pool.free(self.req_index_to_mamba_index_mapping[row_list])
        if self.enable_mamba_extra_buffer:
            track = self.req_index_to_mamba_ping_pong_track_buffer_mapping[row_list]
            self.mamba_pool.free(track if keep is None else track[:, 1 - keep])
        super().free(row_list)

    def clear(self) -> None:
        """Every row and every Mamba slot free again (reset with the tree cache)."""
        super().clear()
        self.mamba_pool.clear()

    def live_mamba_slots(self) -> torch.Tensor:
        """Working and ping-pong slots of every live row."""
        live = sorted(set(range(self.size)) - set(self.free_slots))
        held = [self.req_index_to_mamba_index_mapping[live]]
        if self.enable_mamba_extra_buffer:
            held.append(self.req_index_to_mamba_ping_pong_track_buffer_mapping[live].reshape(-1))
        return torch.cat(held)

    def check_integrity(self, tree_mamba_slots: Optional[torch.Tensor] = None) -> None:
        """Rows sound; live rows' Mamba slots unique and not free; with
        ``tree_mamba_slots``: free + live + tree == mamba pool size exactly."""
        super().check_integrity()
        self.mamba_pool.check_integrity()
        held = self.live_mamba_slots()
        self.mamba_pool.check_held("mamba slots of live rows", held)
        if tree_mamba_slots is not None:
            self.mamba_pool.check_integrity(in_use=torch.cat([held.cpu(), tree_mamba_slots.to("cpu", torch.int64)]))


class HybridLinearKVPool(KVCache):
    """KV of the full-attention layers of a hybrid model, by global layer id.

    ``full_attention_layer_id_mapping[global_id]`` is the layer's index in
    ``full_kv_pool``; asking for any other layer (a Mamba layer has no KV)
    raises ValueError naming it. Mamba state lives in ``mamba_pool``.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        full_attention_layer_ids: Sequence[int],
        mamba_pool: MambaPool,
        device: Union[str, torch.device] = "cpu",
        buffer_allocator: Optional[BufferAllocator] = None,
    ):
        super().__init__(size, page_size, dtype, len(full_attention_layer_ids), device, 0, buffer_allocator)
        self.full_kv_pool = MHATokenToKVPool(
            size, page_size, dtype, head_num, head_dim, self.layer_num,
            device=device, buffer_allocator=self.buffer_allocator,
        )
        self.full_attention_layer_id_mapping = {layer_id: i for i, layer_id in enumerate(full_attention_layer_ids)}
        self.mamba_pool = mamba_pool

    def _full_layer(self, layer_id: int) -> int:
        if layer_id not in self.full_attention_layer_id_mapping:
            known = sorted(self.full_attention_layer_id_mapping)
            raise ValueError(f"layer_id={layer_id} not in full attention layers: {known}")
        return self.full_attention_layer_id_mapping[layer_id]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.full_kv_pool.get_key_buffer(self._full_layer(layer_id))

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.full_kv_pool.get_value_buffer(self._full_layer(layer_id))

    def get_kv_buffer(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.full_kv_pool.get_kv_buffer(self._full_layer(layer_id))

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: Scale = None,
        v_scale: Scale = None,
    ) -> None:
        self.full_kv_pool.set_kv_buffer(self._full_layer(layer_id), loc, cache_k, cache_v, k_scale, v_scale)

    def get_contiguous_buf_infos(self) -> BufInfos:
        return self.full_kv_pool.get_contiguous_buf_infos()

    def get_state_buf_infos(self) -> BufInfos:
        return self.mamba_pool.get_contiguous_buf_infos()

    def check_integrity(self) -> None:
        self.full_kv_pool.check_integrity()
        self.mamba_pool.check_integrity()
        n = len(self.full_attention_layer_id_mapping)
        ensure(n == self.full_kv_pool.layer_num, f"HybridLinearKVPool: {n} layer ids for {self.full_kv_pool.layer_num} KV layers")
