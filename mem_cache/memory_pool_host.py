"""Host copies of a device KV pool: the second tier of the hierarchical cache
(seed 000 §6, reference §5).

A host pool mirrors the layers of one device pool in host memory (pinned when
CUDA is present), ``size`` slots, every one usable (no dummy slot), handed out
in whole pages by its own free list. It copies KV between device slots and host
slots — all layers at once for a backup, one layer at a time for a load, so that
attention on layer ``i`` can run while layer ``i + 1`` is still arriving — and
turns one page's KV over all layers into bytes for the storage tier.

Buffer layouts (``L`` layers, rows are host slots)::

    MHA  layer_first [2, L, size, H, D]    page_first [2, size, L, H, D]
    MLA  layer_first [L, size, 1, D]       page_first [size, L, 1, D]

``layer_first`` keeps a layer contiguous (per-layer loads); ``page_first`` keeps
a slot's KV of every layer together (page-sized storage I/O). Both are read
through a layer-major view, so the copy code is the same for both.
"""

from __future__ import annotations

import abc
import math
import threading
from typing import List, Optional

import psutil
import torch

from mem_cache.integrity import check_unique_in_range, ensure
from mem_cache.memory_pool import KVCache, MHATokenToKVPool, MLATokenToKVPool

HOST_LAYOUTS = ("layer_first", "page_first")


class HostKVCache(abc.ABC):
    """Host slots for the KV of one device pool.

    Contract:

    * the buffer is allocated once, in ``__init__``; ``size`` is page-aligned
      and larger than the device pool's;
    * ``alloc(n)`` (``n`` a multiple of ``page_size``) takes ``n`` slots from the
      front of the free list, or returns ``None`` and takes nothing; ``free``
      gives slots back. Free-list changes hold ``self.lock`` (an ``RLock``), so
      a loader thread may share the pool with the scheduler;
    * copies touch only the slots they are given, in the device pool's storage
      dtype (bit-exact, fp8 included); ``device_pool`` must be the pool this
      one mirrors;
    * page bytes are a page's KV over all layers in a fixed order — layer, then
      K before V, then slot — whatever the layout, so either layout reads what
      the other wrote.
    """

    LAYER_DIM = 0  # where the layer axis sits in the layer_first buffer; the slot axis follows it

    def __init__(
        self,
        device_pool: KVCache,
        host_to_device_ratio: float,
        host_size_gb: float,
        page_size: Optional[int],
        layout: str,
        pin_memory: Optional[bool],
    ):
        if layout not in HOST_LAYOUTS:
            raise ValueError(f"unknown host KV layout {layout!r}; known: {', '.join(HOST_LAYOUTS)}")
        self.layout = layout
        self.page_size = page_size or device_pool.page_size
        self.dtype = device_pool.store_dtype
        self.layer_num = device_pool.layer_num
        self.start_layer = device_pool.start_layer
        self.size = self._host_size(device_pool.size, host_to_device_ratio, host_size_gb)
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.kv_buffer = torch.zeros(self._buffer_shape(), dtype=self.dtype, pin_memory=pin)
        self._layer_major = self.kv_buffer
        if layout == "page_first":
            self._layer_major = self.kv_buffer.transpose(self.LAYER_DIM, self.LAYER_DIM + 1)
        self.lock = threading.RLock()
        self.clear()

    # ---- what a subclass describes -------------------------------------------
    @property
    @abc.abstractmethod
    def size_per_token(self) -> int:
        """Bytes of one token's KV over all layers."""

    @abc.abstractmethod
    def _layer_first_shape(self) -> tuple:
        """The buffer's shape in the ``layer_first`` layout."""

    @abc.abstractmethod
    def _host_views(self, local_layer: int) -> List[torch.Tensor]:
        """This pool's ``[size, ...]`` rows of one layer: K then V (MHA), or the latent rows (MLA)."""

    @abc.abstractmethod
    def _device_buffers(self, device_pool: KVCache, local_layer: int) -> List[torch.Tensor]:
        """The device pool's raw buffers of one layer, matching ``_host_views``."""

    # ---- sizing --------------------------------------------------------------
    def _host_size(self, device_size: int, ratio: float, size_gb: float) -> int:
        wanted = int(size_gb * 1e9 // self.size_per_token) if size_gb > 0 else int(device_size * ratio)
        size = -(-wanted // self.page_size) * self.page_size  # round up to whole pages
        if size <= device_size:
            raise ValueError(
                f"host KV pool ({size} tokens) must be larger than the device pool ({device_size} tokens); "
                f"raise host_to_device_ratio ({ratio}) or host_size_gb ({size_gb})"
            )
        needed, available = size * self.size_per_token, psutil.virtual_memory().available
        if needed > available:
            raise ValueError(f"host KV pool needs {needed / 1e9:.2f} GB, only {available / 1e9:.2f} GB available")
        return size

    def _buffer_shape(self) -> tuple:
        shape = list(self._layer_first_shape())
        if self.layout == "page_first":  # swap the layer and slot axes
            d = self.LAYER_DIM
            shape[d], shape[d + 1] = shape[d + 1], shape[d]
        return tuple(shape)

    @property
    def page_nbytes(self) -> int:
        return self.page_size * self.size_per_token

    # ---- free list -----------------------------------------------------------
    def clear(self) -> None:
        with self.lock:
            self.free_slots = torch.arange(self.size, dtype=torch.int64)

    def available_size(self) -> int:
        with self.lock:
            return len(self.free_slots)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        if need_size % self.page_size != 0:
            raise ValueError(f"host alloc needs a multiple of page_size={self.page_size}, got {need_size}")
        with self.lock:
            if need_size > len(self.free_slots):
                return None
            taken, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return taken

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel() % self.page_size != 0:
            raise ValueError(f"host free needs whole pages of {self.page_size}, got {indices.numel()} slots")
        with self.lock:
            self.free_slots = torch.cat([self.free_slots, indices.to("cpu", torch.int64)])

    # ---- copies --------------------------------------------------------------
    def backup_from_device_all_layer(
        self, device_pool: KVCache, host_indices: torch.Tensor, device_indices: torch.Tensor
    ) -> None:
        """Copy ``device_indices`` → ``host_indices`` in every layer."""
        for layer in range(self.layer_num):
            for host, device in zip(self._host_views(layer), self._device_buffers(device_pool, layer)):
                host[host_indices] = device[device_indices].to(host.device)

    def stage_from_device(self, device_pool: KVCache, device_indices: torch.Tensor) -> List[torch.Tensor]:
        """Start copying ``device_indices`` of every layer (a CUDA pool) into new pinned
        buffers, asynchronously on the current stream; returns the buffers, which hold the
        rows once that stream has run the copies (:meth:`store_staged` puts them in place)."""
        staged = []
        for layer in range(self.layer_num):
            for host, device in zip(self._host_views(layer), self._device_buffers(device_pool, layer)):
                rows = torch.empty((len(device_indices),) + tuple(host.shape[1:]), dtype=host.dtype, pin_memory=True)
                rows.copy_(device[device_indices], non_blocking=True)
                staged.append(rows)
        return staged

    def store_staged(self, host_indices: torch.Tensor, staged: List[torch.Tensor]) -> None:
        """Put :meth:`stage_from_device`'s buffers (their copies done) into ``host_indices``."""
        views = [view for layer in range(self.layer_num) for view in self._host_views(layer)]
        for host, rows in zip(views, staged, strict=True):
            host[host_indices] = rows

    def load_to_device_per_layer(
        self,
        device_pool: KVCache,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        non_blocking: bool = False,
    ) -> List[torch.Tensor]:
        """Copy ``host_indices`` → ``device_indices`` in one layer (a global layer id).
        ``non_blocking`` on CUDA: the rows are gathered into pinned buffers and copied
        asynchronously on the current stream; the buffers are returned, to be kept until
        that stream has run the copies. (Gathered into pageable memory, the copy to the
        device would block the host.)"""
        local = layer_id - self.start_layer
        if not 0 <= local < self.layer_num:
            raise ValueError(f"layer_id={layer_id} outside [{self.start_layer}, {self.start_layer + self.layer_num})")
        staging = []
        for host, device in zip(self._host_views(local), self._device_buffers(device_pool, local)):
            if non_blocking and device.is_cuda:
                rows = torch.empty((len(host_indices),) + tuple(host.shape[1:]), dtype=host.dtype, pin_memory=True)
                torch.index_select(host, 0, host_indices.to("cpu", torch.int64), out=rows)
                device[device_indices] = rows.to(device.device, non_blocking=True)
                staging.append(rows)
            else:
                device[device_indices] = host[host_indices].to(device.device)
        return staging

    def get_page_bytes(self, host_indices: torch.Tensor) -> bytes:
        """The KV of ``host_indices`` (one page) over every layer, as bytes."""
        parts = [
            view[host_indices].reshape(-1).view(torch.uint8)
            for layer in range(self.layer_num)
            for view in self._host_views(layer)
        ]
        return torch.cat(parts).numpy().tobytes()

    def set_page_bytes(self, host_indices: torch.Tensor, data: bytes) -> None:
        """Inverse of ``get_page_bytes``; ``data`` must be exactly that long."""
        expected = len(host_indices) * self.size_per_token
        if len(data) != expected:
            raise ValueError(f"page data has {len(data)} bytes, expected {expected} for {len(host_indices)} slots")
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        offset = 0
        for layer in range(self.layer_num):
            for view in self._host_views(layer):
                shape = (len(host_indices), *view.shape[1:])
                nbytes = math.prod(shape) * self.dtype.itemsize
                # [offset, offset + nbytes): this layer's rows of this component
                view[host_indices] = flat[offset : offset + nbytes].view(self.dtype).reshape(shape)
                offset += nbytes

    # ---- integrity -----------------------------------------------------------
    def check_integrity(self, in_use: Optional[torch.Tensor] = None) -> None:
        """Free slots are unique whole pages in ``[0, size)``; with ``in_use``
        (every slot held elsewhere), free and used slots partition ``[0, size)``."""
        ensure(tuple(self.kv_buffer.shape) == self._buffer_shape(), "host KV buffer changed shape")
        with self.lock:
            free = self.free_slots
        name = type(self).__name__
        check_unique_in_range(f"{name} free slots", free, 0, self.size - 1)
        ensure(free.numel() % self.page_size == 0, f"{name}: {free.numel()} free slots are not whole pages")
        if in_use is None:
            return
        used = in_use.to("cpu", torch.int64)
        check_unique_in_range(f"{name} slots in use", used, 0, self.size - 1)
        both = int(torch.isin(used, free).sum())
        ensure(both == 0, f"{name}: {both} slots are both in use and free")
        ensure(
            used.numel() + free.numel() == self.size,
            f"{name} leak: {free.numel()} free + {used.numel()} in use != {self.size} slots",
        )


class MHATokenToKVPoolHost(HostKVCache):
    """Host copy of an :class:`MHATokenToKVPool` (K and V of equal head_dim)."""

    LAYER_DIM = 1

    def __init__(
        self,
        device_pool: MHATokenToKVPool,
        host_to_device_ratio: float = 2.0,
        host_size_gb: float = 0,
        page_size: Optional[int] = None,
        layout: str = "layer_first",
        pin_memory: Optional[bool] = None,
    ):
        if device_pool.v_head_dim != device_pool.head_dim:
            dims = f"{device_pool.v_head_dim} != {device_pool.head_dim}"
            raise ValueError(f"host KV pool needs v_head_dim == head_dim, got {dims}")
        self.head_num, self.head_dim = device_pool.head_num, device_pool.head_dim
        super().__init__(device_pool, host_to_device_ratio, host_size_gb, page_size, layout, pin_memory)

    @property
    def size_per_token(self) -> int:
        return 2 * self.layer_num * self.head_num * self.head_dim * self.dtype.itemsize

    def _layer_first_shape(self) -> tuple:
        return (2, self.layer_num, self.size, self.head_num, self.head_dim)

    def _host_views(self, local_layer: int) -> List[torch.Tensor]:
        return [self._layer_major[0, local_layer], self._layer_major[1, local_layer]]

    def _device_buffers(self, device_pool: MHATokenToKVPool, local_layer: int) -> List[torch.Tensor]:
        return [device_pool.k_buffer[local_layer], device_pool.v_buffer[local_layer]]


class MLATokenToKVPoolHost(HostKVCache):
    """Host copy of an :class:`MLATokenToKVPool` (one latent row per token and layer)."""

    LAYER_DIM = 0

    def __init__(
        self,
        device_pool: MLATokenToKVPool,
        host_to_device_ratio: float = 2.0,
        host_size_gb: float = 0,
        page_size: Optional[int] = None,
        layout: str = "layer_first",
        pin_memory: Optional[bool] = None,
    ):
        self.kv_dim = device_pool.kv_lora_rank + device_pool.qk_rope_head_dim
        super().__init__(device_pool, host_to_device_ratio, host_size_gb, page_size, layout, pin_memory)

    @property
    def size_per_token(self) -> int:
        return self.layer_num * self.kv_dim * self.dtype.itemsize

    def _layer_first_shape(self) -> tuple:
        return (self.layer_num, self.size, 1, self.kv_dim)

    def _host_views(self, local_layer: int) -> List[torch.Tensor]:
        return [self._layer_major[local_layer]]

    def _device_buffers(self, device_pool: MLATokenToKVPool, local_layer: int) -> List[torch.Tensor]:
        return [device_pool.kv_buffer[local_layer]]


HOST_POOLS = {MHATokenToKVPool: MHATokenToKVPoolHost, MLATokenToKVPool: MLATokenToKVPoolHost}


def host_pool_args(config) -> dict:
    """``create_host_pool`` keywords from an engine config: the same on every TP rank, so
    every rank's host pool has the slots rank 0's tree hands out."""
    return {"host_to_device_ratio": config.hicache_ratio, "page_size": config.page_size}


def create_host_pool(device_pool: KVCache, **kwargs) -> HostKVCache:
    """The host pool class that mirrors ``device_pool``'s type."""
    for device_type, host_type in HOST_POOLS.items():
        if isinstance(device_pool, device_type):
            return host_type(device_pool, **kwargs)
    known = ", ".join(t.__name__ for t in HOST_POOLS)
    raise ValueError(f"no host KV pool for {type(device_pool).__name__}; supported: {known}")
