"""Copies between the tiers of the hierarchical cache (reference §5).

The tree cache decides *what* moves and *which* slots it uses; the controller
only copies: device → host (``write``), host → device layer by layer
(``load``), host ↔ storage (``write_storage`` / ``read_storage``). Here every
copy is synchronous, which is what the CPU build runs. On CUDA, ``write`` and
``load`` are where a write stream and a load stream would go, with
``LayerDoneCounter`` recording one event per layer instead of blocking.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from mem_cache.hicache_storage import HiCacheStorage
from mem_cache.integrity import ensure
from mem_cache.memory_pool import KVCache
from mem_cache.memory_pool_host import HostKVCache


class LayerDoneCounter:
    """Which layers of the load in flight have reached the device pool.

    The loader calls ``begin()`` before the first layer and ``complete(layer_id)``
    after each layer, in layer order. A reader's ``wait_until(layer_id)`` returns
    once that layer is complete — at once when no load is in flight — so the
    forward pass can read layer 0 while later layers are still copying.
    """

    def __init__(self, start_layer: int, num_layers: int):
        self.start_layer = start_layer
        self.num_layers = num_layers
        self._cond = threading.Condition()
        self._num_done = num_layers  # idle: every layer is on the device

    @property
    def num_done(self) -> int:
        with self._cond:
            return self._num_done

    def begin(self) -> None:
        with self._cond:
            self._num_done = 0

    def complete(self, layer_id: int) -> None:
        with self._cond:
            expected = self.start_layer + self._num_done
            ensure(layer_id == expected, f"layer {layer_id} completed out of order, expected {expected}")
            self._num_done += 1
            self._cond.notify_all()

    def wait_until(self, layer_id: int, timeout: Optional[float] = None) -> None:
        """Block until ``layer_id`` is loaded; ``TimeoutError`` after ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._num_done > layer_id - self.start_layer, timeout):
                raise TimeoutError(f"layer {layer_id} not loaded after {timeout}s ({self._num_done} layers done)")


class HiCacheController:
    """Moves KV between ``device_pool``, ``host_pool`` and an optional ``storage``.

    Construction registers the controller's ``layer_done_counter`` with the
    device pool, so its ``get_*_buffer(layer_id)`` waits for loads.

    ``op_log``, when a list, records every copy between the tiers, in order:
    ``("write" | "load", host_indices, device_indices)`` and
    ``("write_storage", host_indices, keys)`` (CPU tensors). A tensor-parallel
    rank 0 sends them to the other ranks, whose controllers :meth:`replay`
    them on their own head shards (and their own storage) before the next
    forward: the tree, and so the choice of slots and pages, lives on rank 0
    only. Reads from storage are not replayed but asked for: ``peers_read``
    (rank 0 with TP > 1) has every other rank read the same pages into the
    same host slots and answer how many it read, and :meth:`read_storage`
    keeps the pages every rank has.
    """

    def __init__(self, device_pool: KVCache, host_pool: HostKVCache, storage: Optional[HiCacheStorage] = None):
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.storage = storage
        self.layer_done_counter = LayerDoneCounter(device_pool.start_layer, device_pool.layer_num)
        device_pool.register_layer_transfer_counter(self.layer_done_counter)
        self.op_log: Optional[List[Tuple[str, torch.Tensor, Any]]] = None
        self.written_tokens = 0  # device → host, and host → device, since start (SGLang's hicache metrics)
        self.loaded_tokens = 0
        self.peers_read: Optional[Callable[[List[str], torch.Tensor], List[Any]]] = None

    def write(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Back up ``device_indices`` into ``host_indices`` (all layers)."""
        self.host_pool.backup_from_device_all_layer(self.device_pool, host_indices, device_indices)
        self.written_tokens += len(host_indices)
        self._log("write", host_indices, device_indices)

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Copy ``host_indices`` into ``device_indices``, one layer after another."""
        counter = self.layer_done_counter
        counter.begin()
        for layer_id in range(counter.start_layer, counter.start_layer + counter.num_layers):
            self.host_pool.load_to_device_per_layer(self.device_pool, host_indices, device_indices, layer_id)
            counter.complete(layer_id)
        self.loaded_tokens += len(host_indices)
        self._log("load", host_indices, device_indices)

    def _log(self, op: str, host_indices: torch.Tensor, other: Any) -> None:
        if self.op_log is not None:  # (only then: a device tensor's copy to the host waits for the device)
            other = other.cpu() if isinstance(other, torch.Tensor) else other
            self.op_log.append((op, host_indices.cpu(), other))

    def replay(self, ops: Sequence[Tuple[str, torch.Tensor, Any]]) -> None:
        """Apply another rank's ``op_log`` entries, in order, to this rank's pools."""
        device = self.device_pool.device
        for op, host_indices, other in ops:
            if op == "write":
                self.write(host_indices, other.to(device))
            elif op == "load":
                self.load(host_indices, other.to(device))
            elif op == "write_storage":
                self.write_storage(other, host_indices)
            else:
                raise ValueError(f"unknown host-tier op {op!r}")

    def write_storage(self, keys: Sequence[str], host_indices: torch.Tensor) -> int:
        """Write the pages of ``host_indices`` (page ``i`` keyed ``keys[i]``) from
        the first one storage lacks; returns how many of those are stored now."""
        ps = self.host_pool.page_size
        self._log("write_storage", host_indices, list(keys))
        first_missing = self.storage.batch_exists(keys)
        # pages [first_missing, len(keys)): written (one that exists is skipped by the backend)
        pages = range(first_missing, len(keys))
        values = [self.host_pool.get_page_bytes(host_indices[i * ps : (i + 1) * ps]) for i in pages]
        return sum(self.storage.batch_set(keys[first_missing:], values))

    def read_storage(self, keys: Sequence[str], host_indices: torch.Tensor) -> int:
        """Read pages ``keys`` into ``host_indices`` in order, stopping at the
        first one that is absent or not one page long; returns pages read —
        with ``peers_read``, the leading pages every rank read."""
        ps = self.host_pool.page_size
        count = len(keys)
        for i, data in enumerate(self.storage.batch_get(keys)):
            if data is None or len(data) != self.host_pool.page_nbytes:
                count = i
                break
            self.host_pool.set_page_bytes(host_indices[i * ps : (i + 1) * ps], data)
        if count and self.peers_read is not None:  # a rank that failed to answer read nothing
            replies = self.peers_read(list(keys[:count]), host_indices[: count * ps].cpu())
            count = min([count] + [n if isinstance(n, int) else 0 for n in replies])
        return count
