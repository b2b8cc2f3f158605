"""Copies between the tiers of the hierarchical cache (reference §5).

The tree cache decides *what* moves and *which* slots it uses; the controller
only copies: device → host (``write``), host → device layer by layer
(``load``), host ↔ storage (``write_storage`` / ``read_storage``).

Loads overlap the forward that needs them (SGLang's layer-wise load): the tree
queues them (``queue_load``) while the batch is scheduled, ``start_loading``
merges the queue into one transfer just before the forward, and the device
pool's ``get_*_buffer(layer)`` waits for that layer only. On CUDA the copies
go on a load stream, one event per layer, and the compute stream waits on the
event (the host never blocks); on CPU a loader thread copies layer after layer
while the forward runs. ``wait_loading`` ends the transfer (after the forward).
Backups overlap the loop too (SGLang's write stream; ``overlap_write``):
``start_write`` returns at once and the copy runs on a writer thread — on CUDA
it is enqueued on a write stream that first waits for the compute stream,
into pinned buffers the thread puts in place once the copies ran. The caller
keeps the device slots from being freed until the write's future is done.
Writes to storage are queued for a storage thread (``async_storage_writes``)
with the pages' bytes taken at once; ``write``, ``load`` and storage reads are
synchronous.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch

from mem_cache.hicache_peers import LoadReport, PeerSyncMixin
from mem_cache.hicache_storage import HiCacheStorage
from mem_cache.hicache_storage_io import PrefetchOp, StorageIOMixin
from mem_cache.integrity import ensure
from mem_cache.memory_pool import KVCache
from mem_cache.memory_pool_host import HostKVCache

__all__ = ["HiCacheController", "LayerDoneCounter", "LoadReport", "PrefetchOp", "WriteInFlight"]

logger = logging.getLogger(__name__)


class LayerDoneCounter:
    """Which layers of the load in flight have reached the device pool.

    The loader calls ``begin()`` before the first layer and ``complete(layer_id)``
    after each layer, in layer order. A reader's ``wait_until(layer_id)`` returns
    once that layer is complete — at once when no load is in flight — so the
    forward pass can read layer 0 while later layers are still copying. A CUDA
    loader passes the event recorded after the layer's copies on its stream:
    the reader's current stream waits for it (the host does not). ``fail(exc)``
    ends a load that cannot finish: readers get an error, not a hang — or, without
    ``fail_readers`` (a TP rank), go through: the failed layers' slots hold garbage,
    and the forward runs on to every collective in step with the other ranks (ending
    the load reports the failure, and the step's outputs are discarded).
    """

    fail_readers = True

    def __init__(self, start_layer: int, num_layers: int):
        self.start_layer = start_layer
        self.num_layers = num_layers
        self._cond = threading.Condition()
        self._num_done = num_layers  # idle: every layer is on the device
        self._events: List[Any] = []  # CUDA: per completed layer, the event its copies recorded
        self._error: Optional[BaseException] = None

    @property
    def num_done(self) -> int:
        with self._cond:
            return self._num_done

    def begin(self) -> None:
        with self._cond:
            self._num_done, self._events, self._error = 0, [], None

    def complete(self, layer_id: int, event: Any = None) -> None:
        with self._cond:
            expected = self.start_layer + self._num_done
            ensure(layer_id == expected, f"layer {layer_id} completed out of order, expected {expected}")
            self._events.append(event)
            self._num_done += 1
            self._cond.notify_all()

    def end(self) -> None:
        """No load in flight any more (after a failed one too): readers go straight through."""
        with self._cond:
            self._num_done, self._events, self._error = self.num_layers, [], None
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def wait_until(self, layer_id: int, timeout: Optional[float] = None) -> None:
        """Block until ``layer_id`` is loaded; ``TimeoutError`` after ``timeout`` seconds."""
        index = layer_id - self.start_layer
        with self._cond:
            if not self._cond.wait_for(lambda: self._num_done > index or self._error is not None, timeout):
                raise TimeoutError(f"layer {layer_id} not loaded after {timeout}s ({self._num_done} layers done)")
            if self._num_done <= index and self.fail_readers:
                raise RuntimeError(f"loading layer {layer_id} from the host tier failed: {self._error!r}")
            event = self._events[index] if 0 <= index < len(self._events) else None
        if event is not None:  # ordered on the device: this stream's next kernels wait for the layer's copies
            event.wait()  # (the current stream of this thread's device)


@dataclass(eq=False)
class WriteInFlight:
    """A tree node's backup started off the loop: its copy (``future``) to ``host_indices``
    and the page keys it had then (the pages go to storage once the copy is done; a split
    meanwhile does not change which pages those slots hold)."""

    node: Any
    future: Future
    keys: List[str]
    host_indices: torch.Tensor


class HiCacheController(PeerSyncMixin, StorageIOMixin):
    """Moves KV between ``device_pool``, ``host_pool`` and an optional ``storage``.

    Construction registers the controller's ``layer_done_counter`` with the
    device pool, so its ``get_*_buffer(layer_id)`` waits for loads.

    ``op_log``, when a list, records every copy between the tiers, in order:
    ``("write" | "write_async" | "load", host_indices, device_indices)``,
    ``("write_storage", host_indices, keys)`` (CPU tensors) and the points where
    the asynchronous copies so far have ended (``"load_sync"``, ``"write_sync"``:
    see :meth:`log_load_sync`, :meth:`log_write_sync`). A tensor-parallel
    rank 0 sends them to the other ranks, whose controllers :meth:`replay`
    them on their own head shards (and their own storage) before the next
    forward: the tree, and so the choice of slots and pages, lives on rank 0
    only. Reads from storage are not replayed but asked for: ``peers_read``
    (rank 0 with TP > 1) has every other rank read the same pages into the
    same host slots and answer how many it read, and :meth:`read_storage`
    keeps the pages every rank has.

    Loads failing on another rank (its own host copy unreadable) must not stop it midway
    through a forward, nor backups failing there stop its loop: its ``keep_load_errors``
    controller lets the readers through and keeps the failures (:meth:`take_load_report`);
    rank 0, ``peers_loads`` set (:meth:`set_peers_loads`), asks every rank after ending its
    own loads or backups (:meth:`ask_peers`): the slots of a load that failed anywhere are
    failed on every rank (:meth:`take_failed_loads`; those a rank could not fill lost:
    :meth:`take_lost_loads`), and so are the host copies a rank's backup could not fill
    (:meth:`take_peer_failed_writes`).
    """

    def __init__(
        self,
        device_pool: KVCache,
        host_pool: HostKVCache,
        storage: Optional[HiCacheStorage] = None,
        overlap_load: bool = True,
        async_storage_writes: bool = False,
        max_pending_writes: int = 64,
        overlap_write: bool = False,
        keep_load_errors: bool = False,
    ):
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.storage = storage
        self.layer_done_counter = LayerDoneCounter(device_pool.start_layer, device_pool.layer_num)
        device_pool.register_layer_transfer_counter(self.layer_done_counter)
        # queue_load → start_loading → wait_loading (without overlap, queue_load copies at once)
        self.overlap_load = overlap_load
        self._queued: List[Tuple[torch.Tensor, torch.Tensor]] = []
        # the transfer in flight: its host and device slots, and "future" (CPU: the loader thread's),
        # "done" + "staging" (CUDA: the last layer's event, the pinned buffers read), or "error"
        self._transfer: Optional[dict] = None
        self._load_stream: Any = None
        self._loader: Optional[ThreadPoolExecutor] = None
        self._lost_loads: List[torch.Tensor] = []  # device slots of failed loads copied again in vain
        self._failed_loads: List[torch.Tensor] = []  # device slots of failed loads (a forward may have read them)
        # a TP follower: failed loads and backups are kept for rank 0 (take_load_report), not raised;
        # readers go through; _bad_host: host slots whose last backup failed here
        self.keep_load_errors = keep_load_errors
        self.layer_done_counter.fail_readers = not keep_load_errors
        self._load_errors: List[str] = []
        self._failed_writes: List[torch.Tensor] = []
        self._bad_host: Optional[torch.Tensor] = None
        # TP rank 0: () -> every other rank's LoadReport (or None); the device slots of the loads
        # logged since it was last called; what the reports said, until taken
        self.peers_loads: Optional[Callable[[], List[Any]]] = None
        self._unasked_loads: List[torch.Tensor] = []
        self._peer_load_errors: List[str] = []
        self._peer_failed_writes: List[torch.Tensor] = []
        # start_write → (the writer thread) → the future done; finish_writes waits for all
        self.overlap_write = overlap_write
        self._writes: List[Tuple[Future, torch.Tensor]] = []  # (the copy, its host slots)
        self._write_stream: Any = None
        self._writer: Optional[ThreadPoolExecutor] = None
        self._write_sync_due = False  # a write_async was logged since the last write_sync
        self.async_storage_writes = async_storage_writes
        self.max_pending_writes = max_pending_writes
        self.stored_pages = 0  # pages this controller wrote to storage (not counting those it found there)
        self.prefetched_pages = 0  # pages its prefetches read from storage
        self.read_pages = 0  # pages its synchronous reads (read_storage) read
        self._storage_io: Optional[ThreadPoolExecutor] = None
        self._prefetch_io: Optional[ThreadPoolExecutor] = None
        self._storage_writes: List[Future] = []
        self.op_log: Optional[List[Tuple[str, torch.Tensor, Any]]] = None
        self.written_tokens = 0  # device → host, and host → device, since start (SGLang's hicache metrics)
        self.loaded_tokens = 0
        self.failed_written_tokens = 0  # device → host copies that failed (the tree dropped their host copy)
        self.peers_read: Optional[Callable[[List[str], torch.Tensor], List[Any]]] = None
        # TP rank 0: ("prefetch_start" | "prefetch_end", payload) → every other rank's reply
        self.peers_prefetch: Optional[Callable[[str, Any], List[Any]]] = None
        self._peer_prefetches: dict = {}  # another rank's side: op id → its own prefetch of the same pages

    def write(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Back up ``device_indices`` into ``host_indices`` (all layers)."""
        self._clear_bad_host(host_indices)
        self.host_pool.backup_from_device_all_layer(self.device_pool, host_indices, device_indices)
        self.written_tokens += len(host_indices)
        self._log("write", host_indices, device_indices)

    def start_write(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> Future:
        """Back up ``device_indices`` into ``host_indices`` off the loop; the future is done
        once the host slots hold the KV (its ``result()`` raises a failed copy). Until then
        the caller keeps the device slots from being freed (their KV is read meanwhile) and
        nothing reads the host slots. Without ``overlap_write`` the copy is made now."""
        future: Future = Future()
        if not self.overlap_write:
            self.write(host_indices, device_indices)
            future.set_result(None)
            return future
        if self._writer is None:  # (on CUDA the thread works on the pool's GPU, not the default one)
            dev = device_indices.device
            init = (lambda: torch.cuda.set_device(dev)) if dev.type == "cuda" else None
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-write", initializer=init)
        self._clear_bad_host(host_indices)
        if device_indices.device.type == "cuda":
            done, staged = self._start_cuda_write(device_indices)
            future = self._writer.submit(self._store_staged, done, host_indices, staged)
        else:
            pool = self.host_pool
            future = self._writer.submit(pool.backup_from_device_all_layer, self.device_pool, host_indices,
                                         device_indices)
        # (a failed one stays for finish_writes to report)
        self._writes = [(f, h) for f, h in self._writes if not f.done() or f.exception() is not None]
        self._writes.append((future, host_indices))
        self.written_tokens += len(host_indices)
        self._log("write_async", host_indices, device_indices)
        self._write_sync_due = self.op_log is not None
        return future

    def _start_cuda_write(self, device_indices: torch.Tensor) -> Tuple[Any, List[torch.Tensor]]:
        """Enqueue the gather of every layer's rows into pinned buffers on the write stream,
        after what the compute stream has queued (the forward that wrote the KV); returns the
        event that ends them and the buffers."""
        dev = device_indices.device
        if self._write_stream is None:
            self._write_stream = torch.cuda.Stream(dev)
        stream = self._write_stream
        stream.wait_stream(torch.cuda.current_stream(dev))
        device_indices.record_stream(stream)
        with torch.cuda.stream(stream):
            staged = self.host_pool.stage_from_device(self.device_pool, device_indices)
            done = torch.cuda.Event(blocking=True)  # (the writer thread sleeps on it instead of spinning)
            done.record(stream)
        return done, staged

    def _store_staged(self, done: Any, host_indices: torch.Tensor, staged: List[torch.Tensor]) -> None:
        done.synchronize()
        self.host_pool.store_staged(host_indices, staged)

    def finish_writes(self, raise_errors: bool = False) -> None:
        """Wait for every write started. A failed one is logged, and with ``raise_errors``
        the first failure is raised once all have ended (a replaying rank: its host copy is
        not what rank 0's tree takes it for, so it must not go on as if it were) — with
        ``keep_load_errors`` (a TP follower) kept for rank 0 instead (:meth:`take_load_report`)."""
        pending, self._writes = self._writes, []
        error = None
        for future, host_indices in pending:
            try:
                future.result()
            except Exception as exc:
                logger.exception("backing KV up to the host tier failed")
                error = error or exc
                if self.keep_load_errors:
                    self._backup_failed(host_indices)
        if error is not None and raise_errors and not self.keep_load_errors:
            raise error

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Copy ``host_indices`` into ``device_indices``, one layer after another, now."""
        self.wait_loading()
        self._copy_now(host_indices, device_indices)
        self.loaded_tokens += len(host_indices)
        self._log("load", host_indices, device_indices)

    def _copy_now(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        counter = self.layer_done_counter
        counter.begin()
        try:
            for layer_id in range(counter.start_layer, counter.start_layer + counter.num_layers):
                self.host_pool.load_to_device_per_layer(self.device_pool, host_indices, device_indices, layer_id)
                counter.complete(layer_id)
        finally:
            counter.end()  # (after a failure too: readers must not wait for a copy nobody makes)

    # ---- overlapped loads ---------------------------------------------------------
    def queue_load(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Load ``host_indices`` into ``device_indices`` with the next :meth:`start_loading`
        (at once without ``overlap_load``). Until :meth:`wait_loading` returns, the caller
        keeps both slot sets from being freed."""
        if not self.overlap_load:
            self.load(host_indices, device_indices)
            return
        self._queued.append((host_indices, device_indices))
        self._log("load", host_indices, device_indices)

    @property
    def load_pending(self) -> bool:
        """Loads queued or in flight."""
        return bool(self._queued) or self._transfer is not None

    def start_loading(self) -> None:
        """Start the queued loads as one layer-wise transfer; the device pool's readers
        wait per layer. An earlier transfer still in flight ends first. A transfer that
        cannot start fails its readers, and :meth:`wait_loading` raises it."""
        if not self._queued:
            return
        self.wait_loading()
        host = torch.cat([h for h, _ in self._queued])
        device = torch.cat([d for _, d in self._queued])
        self._queued = []
        self.loaded_tokens += len(host)
        self._transfer = {"host": host, "device": device}
        self.layer_done_counter.begin()
        try:
            if device.device.type == "cuda":
                self._transfer["done"], self._transfer["staging"] = self._start_cuda_load(host, device)
            else:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-load")
                self._transfer["future"] = self._loader.submit(self._load_layers, host, device)
        except BaseException as exc:
            self.layer_done_counter.fail(exc)
            self._transfer["error"] = exc

    def _load_layers(self, host: torch.Tensor, device: torch.Tensor) -> None:
        counter = self.layer_done_counter
        try:
            for layer_id in range(counter.start_layer, counter.start_layer + counter.num_layers):
                self.host_pool.load_to_device_per_layer(self.device_pool, host, device, layer_id)
                counter.complete(layer_id)
        except BaseException as exc:
            counter.fail(exc)
            raise

    def _start_cuda_load(self, host: torch.Tensor, device: torch.Tensor) -> Tuple[Any, List[torch.Tensor]]:
        """Enqueue every layer's copy on the load stream, recording one event per layer;
        returns the last event and the pinned staging buffers the copies read (kept until
        the transfer ends). The host only gathers into pinned memory: the copies are async."""
        counter, dev = self.layer_done_counter, device.device
        if self._load_stream is None:
            self._load_stream = torch.cuda.Stream(dev)
        stream = self._load_stream
        stream.wait_stream(torch.cuda.current_stream(dev))  # the slots' earlier users are done with them
        device.record_stream(stream)  # (freed by this thread meanwhile, its memory waits for the copies)
        staging: List[torch.Tensor] = []
        with torch.cuda.stream(stream):
            for layer_id in range(counter.start_layer, counter.start_layer + counter.num_layers):
                staging += self.host_pool.load_to_device_per_layer(
                    self.device_pool, host, device, layer_id, non_blocking=True
                )
                event = torch.cuda.Event()
                event.record(stream)
                counter.complete(layer_id, event)
        return event, staging

    def wait_loading(self) -> None:
        """Block until the transfer in flight has reached the device. If it failed, its
        loads are copied again here, synchronously (the forward that read them failed;
        the slots must not keep what did not land), and the error is raised (with
        ``keep_load_errors``: kept for :meth:`take_load_report`); :meth:`take_failed_loads`
        names its slots. If the copy again fails too, its device slots hold no KV:
        :meth:`take_lost_loads` names them."""
        transfer, self._transfer = self._transfer, None
        if transfer is None:
            return
        try:
            if "error" in transfer:
                raise transfer["error"]
            if "future" in transfer:
                transfer["future"].result()
            if "done" in transfer:
                transfer["done"].synchronize()
        except BaseException as exc:
            self.layer_done_counter.end()
            self._failed_loads.append(transfer["device"])
            logger.exception("loading KV from the host tier failed; copying it again before going on")
            if self._load_stream is not None:  # copies it did enqueue land first, not over the new ones
                try:
                    self._load_stream.synchronize()
                except Exception:
                    logger.exception("the load stream failed too")
            try:
                self._copy_now(transfer["host"], transfer["device"])
            except BaseException as again:
                self._lost_loads.append(transfer["device"])
                self._load_failed(again)
                return
            self._load_failed(exc)
            return
        self.layer_done_counter.end()

    def _load_failed(self, exc: BaseException) -> None:
        """Raise ``exc`` — with ``keep_load_errors`` (a TP follower) keep it for rank 0 instead."""
        if not self.keep_load_errors or not isinstance(exc, Exception):
            raise exc
        self._load_errors.append(f"{type(exc).__name__}: {exc}")

    def take_failed_loads(self) -> Optional[torch.Tensor]:
        """The device slots of every transfer that failed (here, or on another TP rank: see
        :meth:`end_peer_loads`) since the last call, copied again or not, or None: a forward
        that ran alongside such a transfer read garbage in them."""
        failed, self._failed_loads = self._failed_loads, []
        return torch.cat(failed) if failed else None

    def take_lost_loads(self) -> Optional[torch.Tensor]:
        """The device slots of the loads that failed twice (see :meth:`wait_loading`) since
        the last call, or None; whoever holds them must not read them as KV."""
        lost, self._lost_loads = self._lost_loads, []
        return torch.cat(lost) if lost else None

    def close(self) -> None:
        """End any transfer, backup and storage write, and their threads."""
        try:
            self.start_loading()
            self.wait_loading()
        finally:
            self.finish_writes()
            self.flush_storage()
            for pool in (self._loader, self._writer, self._storage_io, self._prefetch_io):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._loader = self._writer = self._storage_io = self._prefetch_io = None
