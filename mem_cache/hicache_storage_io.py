"""The host ↔ storage side of :class:`~mem_cache.hicache_controller.HiCacheController`:
backups of host pages to the storage tier (on a storage thread), synchronous reads, and
prefetches read on a prefetch thread (:class:`PrefetchOp`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import torch

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefetchOp:
    """One prefetch from storage: ``key[:matched]`` was cached when it began (ending at
    node ``end``); pages ``keys`` (the next ones, which storage had) are read into
    ``host_indices`` in order by the prefetch thread; ``pages_read`` counts those
    done. ``state``: queued → running → done (or queued → done when ended before the
    thread reached it); ``cancel`` stops a running one before its next batch."""

    key: Any  # RadixKey of the cached part and the pages fetched
    matched: int
    keys: List[str]
    host_indices: torch.Tensor
    end: Any = None  # the tree node it extends (host-ref'd while it runs)
    op_id: int = 0
    asked_len: int = 0  # leading tokens of the request's key storage has answered for (no need to ask again)
    pages_read: int = 0
    state: str = "queued"
    ended: bool = False  # finished or cancelled by the tree: its host slots are the tree's or freed
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    started_at: float = field(default_factory=time.monotonic)


class StorageIOMixin:
    """Copies between the host pool and storage. Relies on the controller's ``host_pool``,
    ``storage``, ``async_storage_writes``, ``max_pending_writes``, its page counters, thread
    pools, ``peers_read`` / ``peers_prefetch`` and ``_log``."""

    def write_storage(self, keys: Sequence[str], host_indices: torch.Tensor) -> Optional[int]:
        """Write the pages of ``host_indices`` (page ``i`` keyed ``keys[i]``) from
        the first one storage lacks; returns how many of those are stored now. With
        ``async_storage_writes`` the pages' bytes are taken now (the host slots are free
        to change once this returns) and the storage thread writes them (returns None;
        :meth:`flush_storage` waits). At most ``max_pending_writes`` batches wait: the
        next one waits for the oldest, so a slow backend slows backups down instead of
        holding ever more page copies."""
        ps = self.host_pool.page_size
        self._log("write_storage", host_indices, list(keys))
        if not self.async_storage_writes:
            first_missing = self.storage.batch_exists(keys)
            # pages [first_missing, len(keys)): written (one that exists is skipped by the backend)
            pages = range(first_missing, len(keys))
            values = [self.host_pool.get_page_bytes(host_indices[i * ps : (i + 1) * ps]) for i in pages]
            return self._count_stored(self.storage.batch_set(keys[first_missing:], values))
        values = [self.host_pool.get_page_bytes(host_indices[i * ps : (i + 1) * ps]) for i in range(len(keys))]
        self._storage_writes = [f for f in self._storage_writes if not f.done()]
        while len(self._storage_writes) >= self.max_pending_writes:
            self._storage_writes.pop(0).result()
        if self._storage_io is None:
            self._storage_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-storage")
        self._storage_writes.append(self._storage_io.submit(self._store, list(keys), values))
        return None

    def _store(self, keys: List[str], values: List[bytes]) -> int:
        """(The storage thread) the pages storage lacks, from the first; a failure loses the
        pages, which later reads find absent."""
        try:
            first_missing = self.storage.batch_exists(keys)
            return self._count_stored(self.storage.batch_set(keys[first_missing:], values[first_missing:]))
        except Exception:
            logger.exception("writing %d pages to the storage tier failed", len(keys))
            return 0

    def _count_stored(self, results: List[bool]) -> int:
        stored = sum(results)
        self.stored_pages += stored
        return stored

    def flush_storage(self) -> None:
        """Wait until every queued storage write has ended."""
        pending, self._storage_writes = self._storage_writes, []
        for future in pending:
            future.result()

    def use_storage(self, storage) -> None:
        """Write and read ``storage`` from now on, once the writes queued for the old one have ended
        (a weight update keys the pages of the new weights apart; no prefetch may be in flight)."""
        self.flush_storage()
        self.storage = storage

    # ---- prefetch off the loop ------------------------------------------------------
    PREFETCH_BATCH_PAGES = 8  # pages per storage read: a cancel waits for at most one batch

    def start_prefetch(self, op: PrefetchOp) -> None:
        """Read ``op``'s pages on the prefetch thread, in the order started; with
        ``peers_prefetch`` (TP rank 0) every other rank starts reading the same pages
        into the same host slots now too."""
        if self._prefetch_io is None:  # (not the writes' thread: a prefetch ended early must not wait for them)
            self._prefetch_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-prefetch")
        self._prefetch_io.submit(self._prefetch_pages, op)
        if self.peers_prefetch is not None:
            self.peers_prefetch("prefetch_start", (op.op_id, list(op.keys), op.host_indices.cpu()))

    def _prefetch_pages(self, op: PrefetchOp) -> None:
        with op.lock:
            if op.state != "queued":  # ended before the thread got to it
                return
            op.state = "running"
        ps, step = self.host_pool.page_size, self.PREFETCH_BATCH_PAGES
        try:
            for first in range(0, len(op.keys), step):
                if op.cancel.is_set():
                    return
                batch = op.keys[first : first + step]
                for i, data in enumerate(self.storage.batch_get(batch)[: len(batch)], start=first):
                    if data is None or len(data) != self.host_pool.page_nbytes:
                        return
                    self.host_pool.set_page_bytes(op.host_indices[i * ps : (i + 1) * ps], data)
                    op.pages_read = i + 1
                if op.pages_read < first + len(batch):  # pages it got no answer for: absent, and those after
                    return
        except Exception:  # what was read stays usable; the rest counts as absent
            logger.exception("prefetching %d pages from the storage tier failed", len(op.keys))
        finally:
            with op.lock:
                op.state = "done"
            op.done.set()

    def end_prefetch(self, op: PrefetchOp, wait: bool, keep: bool = True) -> int:
        """Stop ``op`` (or let it read every page, ``wait``) and return the leading pages
        it read that every TP rank has too (0 without ``keep``: a cancel, which still stops
        the other ranks' reads — they must not write slots freed next — but ignores their
        failures). One the thread has not reached ends at once; a running one ends after the
        batch it is reading. Once this rank has read every page, the others may finish too."""
        if not wait:
            op.cancel.set()
        with op.lock:
            if op.state == "queued" and not wait:
                op.state = "done"
                op.done.set()
        op.done.wait()
        count = op.pages_read if keep else 0
        if self.peers_prefetch is not None:
            peers_wait = wait or (keep and op.pages_read == len(op.keys))  # (not cut short for a slower rank)
            try:
                replies = self.peers_prefetch("prefetch_end", (op.op_id, peers_wait))
            except Exception:
                if keep:
                    raise
                logger.exception("ending a prefetch on the other TP ranks failed")
                replies = []
            count = min([count] + [n if isinstance(n, int) else 0 for n in replies])  # (a failed rank: 0)
        self.prefetched_pages += count
        return count

    def read_storage(self, keys: Sequence[str], host_indices: torch.Tensor) -> int:
        """Read pages ``keys`` into ``host_indices`` in order, stopping at the
        first one that is absent or not one page long; returns pages read —
        with ``peers_read``, the leading pages every rank read. A read that raises
        reads nothing (logged): a storage failure costs the hit, not the request."""
        ps = self.host_pool.page_size
        try:
            values = self.storage.batch_get(keys)
        except Exception:
            logger.exception("reading %d pages from the storage tier failed", len(keys))
            values = []
        count = 0
        for i, data in enumerate(values[: len(keys)]):
            if data is None or len(data) != self.host_pool.page_nbytes:
                break
            self.host_pool.set_page_bytes(host_indices[i * ps : (i + 1) * ps], data)
            count = i + 1
        self.read_pages += count
        if count and self.peers_read is not None:  # a rank that failed to answer read nothing
            replies = self.peers_read(list(keys[:count]), host_indices[: count * ps].cpu())
            count = min([count] + [n if isinstance(n, int) else 0 for n in replies])
        return count
