"""Per-layer KV tensor pools (seed 000 §3, reference §2).

A pool owns the KV tensors and nothing else: which slot belongs to which
request is the allocators' and the tree cache's business. Every buffer is
allocated once, at construction, through a :class:`BufferAllocator`, with
``size + page_size`` rows per layer: row 0 (page 0) is the dummy that padded
tokens write to, real slots are ``1 .. size + page_size - 1``.

Layer ids are global model layer ids; a pool serving a pipeline stage holds
layers ``start_layer .. end_layer`` (inclusive) and indexes its buffers by
``layer_id - start_layer``.

fp8 KV (``float8_e4m3fn`` / ``float8_e5m2``) is *stored* as ``uint8`` because
``index_put`` has no fp8 kernel; writers cast then reinterpret, readers get
the fp8 view back. Nothing is ever reinterpreted in place on a caller's tensor.
"""

from __future__ import annotations

import abc
from typing import List, Optional, Sequence, Tuple, Union

import torch

from mem_cache.buffer_allocator import BufferAllocator, LocalBufferAllocator
from mem_cache.integrity import ensure

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
BufInfos = Tuple[List[int], List[int], List[int]]
Scale = Union[float, torch.Tensor, None]


def store_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The dtype buffers are allocated in: ``uint8`` for fp8, else ``dtype``."""
    return torch.uint8 if dtype in FP8_DTYPES else dtype


def check_buffer(what: str, buf: torch.Tensor, shape: Tuple[int, ...], dtype: torch.dtype) -> None:
    """Raise IntegrityError unless ``buf`` still has the shape/dtype it was built with."""
    ensure(tuple(buf.shape) == shape, f"{what}: shape {tuple(buf.shape)}, expected {shape}")
    ensure(buf.dtype == dtype, f"{what}: dtype {buf.dtype}, expected {dtype}")


class KVCache(abc.ABC):
    """Per-layer KV tensors addressed by slot number.

    Contract for every subclass:

    * buffers are allocated in ``__init__`` and never reallocated, so the
      pointers of ``get_contiguous_buf_infos()`` stay valid for the pool's life;
    * ``set_kv_buffer(layer_id, loc, ...)`` writes rows ``loc`` of one layer and
      nothing else; a tensor in another dtype is divided by its scale (into a
      new tensor) and cast to ``dtype`` first;
    * ``get_*_buffer(layer_id)`` return views in ``dtype`` over the whole layer
      (dummy rows included), never copies;
    * ``check_integrity()`` raises :class:`IntegrityError` with the numbers;
    * with a ``layer_transfer_counter`` registered (the hierarchical cache
      loading KV from host layer by layer), MHA/MLA ``get_*_buffer(layer_id)``
      first wait until that layer has arrived.
    """

    layer_transfer_counter = None  # anything with ``wait_until(layer_id)``

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        layer_num: int,
        device: Union[str, torch.device] = "cpu",
        start_layer: int = 0,
        buffer_allocator: Optional[BufferAllocator] = None,
    ):
        if size <= 0 or page_size <= 0 or layer_num < 0:
            raise ValueError(f"KV pool needs size > 0, page_size > 0, layer_num >= 0; got {size=}, {page_size=}, {layer_num=}")
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.store_dtype = store_dtype_for(dtype)
        self.layer_num = layer_num
        self.start_layer = start_layer
        self.end_layer = start_layer + layer_num - 1
        self.device = torch.device(device)
        self.buffer_allocator = buffer_allocator or LocalBufferAllocator(self.device)

    @abc.abstractmethod
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Whole K buffer of ``layer_id``, viewed in ``dtype``."""

    @abc.abstractmethod
    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """Whole V buffer of ``layer_id``, viewed in ``dtype``."""

    @abc.abstractmethod
    def get_kv_buffer(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(get_key_buffer(layer_id), get_value_buffer(layer_id))``."""

    @abc.abstractmethod
    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: Optional[torch.Tensor], *args, **kwargs) -> None:
        """Write rows ``loc`` of layer ``layer_id``."""

    @abc.abstractmethod
    def get_contiguous_buf_infos(self) -> BufInfos:
        """``(data_ptrs, data_lens, item_lens)`` of every buffer, for transfers;
        ``item_lens`` are bytes per page (one slot row × ``page_size``)."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Raise IntegrityError if any buffer differs from what was built."""

    def mem_usage_bytes(self) -> int:
        """Bytes of every KV buffer this pool exposes for transfer."""
        return sum(self.get_contiguous_buf_infos()[1])

    def rebind_buffers(self) -> None:
        """Once a released pool's buffers are allocated anew (sleep mode: its allocator's ``resume``),
        their new addresses are the ones :meth:`check_integrity` holds them to (a peer's mapping of
        the old ones is stale: its transfer agents drop it, ``TransferAgent.reset``)."""
        if hasattr(self, "_initial_ptrs"):
            self._initial_ptrs = self.get_contiguous_buf_infos()[0]

    def register_layer_transfer_counter(self, counter) -> None:
        """Make ``get_*_buffer(layer_id)`` call ``counter.wait_until(layer_id)`` first."""
        self.layer_transfer_counter = counter

    # ---- helpers for subclasses -------------------------------------------
    def _wait_for_layer(self, layer_id: int) -> None:
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id)

    def _local_layer(self, layer_id: int) -> int:
        if not self.start_layer <= layer_id <= self.end_layer:
            raise ValueError(f"layer_id={layer_id} outside this pool's layers [{self.start_layer}, {self.end_layer}]")
        return layer_id - self.start_layer

    def _to_store(self, cache: torch.Tensor, scale: Scale) -> torch.Tensor:
        """``cache`` as rows of ``store_dtype``: scaled and cast when its dtype differs."""
        if cache.dtype != self.dtype:
            if scale is not None:
                cache = cache / scale
            cache = cache.to(self.dtype)
        return cache.view(self.store_dtype) if self.store_dtype != self.dtype else cache

    def _as_dtype(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def _page_infos(self, buffers: Sequence[torch.Tensor]) -> BufInfos:
        ptrs = [b.data_ptr() for b in buffers]
        lens = [b.nbytes for b in buffers]
        items = [b[0].nbytes * self.page_size for b in buffers]
        return ptrs, lens, items

    def _check_pointers_unchanged(self, initial_ptrs: List[int]) -> None:
        ptrs = self.get_contiguous_buf_infos()[0]
        moved = sum(a != b for a, b in zip(ptrs, initial_ptrs)) + abs(len(ptrs) - len(initial_ptrs))
        ensure(moved == 0, f"{type(self).__name__}: {moved} of {len(initial_ptrs)} buffers were reallocated")


class MHATokenToKVPool(KVCache):
    """K and V buffers ``[size + page_size, head_num, head_dim | v_head_dim]`` per layer."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: Union[str, torch.device] = "cpu",
        v_head_dim: Optional[int] = None,
        start_layer: int = 0,
        buffer_allocator: Optional[BufferAllocator] = None,
        name_prefix: str = "",
    ):
        super().__init__(size, page_size, dtype, layer_num, device, start_layer, buffer_allocator)
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        rows = size + page_size
        self.k_shape = (rows, head_num, self.head_dim)
        self.v_shape = (rows, head_num, self.v_head_dim)
        layers = range(start_layer, start_layer + layer_num)
        zeros = self.buffer_allocator.zeros
        self.k_buffer = [zeros(f"{name_prefix}k_buffer.{i}", self.k_shape, self.store_dtype) for i in layers]
        self.v_buffer = [zeros(f"{name_prefix}v_buffer.{i}", self.v_shape, self.store_dtype) for i in layers]
        self._initial_ptrs = self.get_contiguous_buf_infos()[0]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        self._wait_for_layer(layer_id)
        return self._as_dtype(self.k_buffer[self._local_layer(layer_id)])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        self._wait_for_layer(layer_id)
        return self._as_dtype(self.v_buffer[self._local_layer(layer_id)])

    def get_kv_buffer(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: Scale = None,
        v_scale: Scale = None,
    ) -> None:
        i = self._local_layer(layer_id)
        self.k_buffer[i][loc] = self._to_store(cache_k, k_scale)
        self.v_buffer[i][loc] = self._to_store(cache_v, v_scale)

    def get_contiguous_buf_infos(self) -> BufInfos:
        return self._page_infos(self.k_buffer + self.v_buffer)

    def check_integrity(self) -> None:
        n_k, n_v = len(self.k_buffer), len(self.v_buffer)
        ensure(n_k == n_v == self.layer_num, f"MHATokenToKVPool: {n_k} K and {n_v} V buffers for {self.layer_num} layers")
        for i in range(self.layer_num):
            check_buffer(f"k_buffer[{i}]", self.k_buffer[i], self.k_shape, self.store_dtype)
            check_buffer(f"v_buffer[{i}]", self.v_buffer[i], self.v_shape, self.store_dtype)
        self._check_pointers_unchanged(self._initial_ptrs)


class MLATokenToKVPool(KVCache):
    """One latent buffer ``[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]`` per layer.

    A row is ``[k_nope (kv_lora_rank) | k_rope (qk_rope_head_dim)]``; the
    "value" is the ``k_nope`` part of the same row (no separate V buffer).
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: Union[str, torch.device] = "cpu",
        start_layer: int = 0,
        buffer_allocator: Optional[BufferAllocator] = None,
        name_prefix: str = "",
    ):
        super().__init__(size, page_size, dtype, layer_num, device, start_layer, buffer_allocator)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_shape = (size + page_size, 1, kv_lora_rank + qk_rope_head_dim)
        layers = range(start_layer, start_layer + layer_num)
        zeros = self.buffer_allocator.zeros
        self.kv_buffer = [zeros(f"{name_prefix}kv_buffer.{i}", self.kv_shape, self.store_dtype) for i in layers]
        self._initial_ptrs = self.get_contiguous_buf_infos()[0]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        self._wait_for_layer(layer_id)
        return self._as_dtype(self.kv_buffer[self._local_layer(layer_id)])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.get_key_buffer(layer_id)[..., : self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: Optional[torch.Tensor] = None,
        k_scale: Scale = None,
    ) -> None:
        """Write whole latent rows; ``cache_v`` is ignored (V is part of K)."""
        self.kv_buffer[self._local_layer(layer_id)][loc] = self._to_store(cache_k, k_scale)

    def set_mla_kv_buffer(self, layer_id: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Write rows ``loc`` as ``cat([k_nope, k_rope], -1)``."""
        row = torch.cat([self._to_store(k_nope, None), self._to_store(k_rope, None)], dim=-1)
        self.kv_buffer[self._local_layer(layer_id)][loc] = row

    def get_mla_kv_buffer(self, layer_id: int, loc: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(k_nope, k_rope)`` of rows ``loc`` (copies, in ``dtype``)."""
        rows = self.get_key_buffer(layer_id)[loc]
        return rows[..., : self.kv_lora_rank], rows[..., self.kv_lora_rank :]

    def get_contiguous_buf_infos(self) -> BufInfos:
        return self._page_infos(self.kv_buffer)

    def check_integrity(self) -> None:
        n = len(self.kv_buffer)
        ensure(n == self.layer_num, f"MLATokenToKVPool: {n} buffers for {self.layer_num} layers")
        for i, buf in enumerate(self.kv_buffer):
            check_buffer(f"kv_buffer[{i}]", buf, self.kv_shape, self.store_dtype)
        self._check_pointers_unchanged(self._initial_ptrs)
