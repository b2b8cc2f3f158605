"""The cross-rank side of :class:`~mem_cache.hicache_controller.HiCacheController`.

With tensor parallelism only rank 0 has a tree: its controller logs every copy between
the tiers (``op_log``) and the other ranks replay the log on their own head shards
(:meth:`PeerSyncMixin.replay`). Failures on those ranks are reported, not raised: rank 0
asks after ending its own loads (:meth:`PeerSyncMixin.end_peer_loads`, answered by
:meth:`PeerSyncMixin.take_load_report`). Prefetches from storage are started and ended on
every rank by calls (``peer_prefetch_start`` / ``peer_prefetch_end``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from mem_cache.hicache_storage_io import PrefetchOp

logger = logging.getLogger(__name__)


class LoadReport(NamedTuple):
    """A TP follower's loads that failed since rank 0 last asked (:meth:`HiCacheController.take_load_report`):
    why, the device slots left without KV (None: the copies again landed), and the device
    slots of every failed load (a forward that ran alongside read garbage in them); and its
    backups that failed since (``error`` is about loads only)."""

    error: str
    lost: Optional[torch.Tensor]
    failed: Optional[torch.Tensor] = None
    failed_writes: Optional[torch.Tensor] = None  # the host slots of its backups that failed


class PeerSyncMixin:
    """Op logging, replay and failure reports between TP ranks. Relies on the controller's
    pools, ``op_log``, ``peers_loads``, load and write queues and storage methods."""

    def log_write_sync(self) -> None:
        """Log that the writes logged so far may have ended here: a replaying rank ends its
        own at the same point, before the device slots they read can be freed and reused."""
        if self.op_log is not None and self._write_sync_due:  # (the log may have been sent since the
            self.op_log.append(("write_sync", torch.empty(0, dtype=torch.int64), None))  # write_async)
            self._write_sync_due = False

    def log_load_sync(self) -> None:
        """Log that every load logged so far has ended here: a replaying rank ends its own
        at the same point of the op sequence. (Ended outside a forward — a request not
        taken after all — its slots may be freed and reused before the next forward; a
        rank that ran it alongside that forward would write over the new KV.)"""
        if self.op_log is not None and self.op_log and self.op_log[-1][0] != "load_sync":
            self.op_log.append(("load_sync", torch.empty(0, dtype=torch.int64), None))

    def _log(self, op: str, host_indices: torch.Tensor, other: Any) -> None:
        if self.op_log is not None:  # (only then: a device tensor's copy to the host waits for the device)
            other = other.cpu() if isinstance(other, torch.Tensor) else other
            if op == "load" and self.peers_loads is not None:
                self._unasked_loads.append(other)
            self.op_log.append((op, host_indices.cpu(), other))

    def replay(self, ops: Sequence[Tuple[str, torch.Tensor, Any]]) -> None:
        """Apply another rank's ``op_log`` entries, in order, to this rank's pools (its loads
        are queued: :meth:`start_loading` them before the forward, as rank 0 does)."""
        device = self.device_pool.device
        for op, host_indices, other in ops:
            if op == "write":
                self._replay_write(host_indices, other.to(device))
            elif op == "write_async":
                self.start_write(host_indices, other.to(device))
            elif op == "write_sync":
                self.finish_writes(raise_errors=True)
            elif op == "load":  # started by the caller's start_loading, as on rank 0
                self._replay_load(host_indices, other.to(device))
            elif op == "load_sync":
                self.start_loading()
                self.wait_loading()
            elif op == "write_storage":
                if self._holds_bad_host(host_indices):  # (its pages would be garbage; absent, no rank reads them)
                    continue
                self.write_storage(other, host_indices)
            else:
                raise ValueError(f"unknown host-tier op {op!r}")

    def _replay_load(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        if self._holds_bad_host(host_indices):  # (rank 0 was not told yet) its slots would get garbage
            self._lost_loads.append(device_indices)
            self._failed_loads.append(device_indices)
            self._load_errors.append("the host copy it reads failed to back up on this rank")
            return
        try:
            self.queue_load(host_indices, device_indices)
        except Exception as exc:  # (without overlap_load: copied now) its slots hold no KV
            self._lost_loads.append(device_indices)
            self._failed_loads.append(device_indices)
            self._load_failed(exc)

    def _replay_write(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        try:
            self.write(host_indices, device_indices)
        except Exception:
            if not self.keep_load_errors:
                raise
            logger.exception("backing KV up to the host tier failed")
            self._backup_failed(host_indices)

    # ---- failed backups on a TP follower ----------------------------------------------
    def _backup_failed(self, host_indices: torch.Tensor) -> None:
        """(``keep_load_errors``) ``host_indices`` do not hold the KV rank 0 takes them for:
        reported (:meth:`take_load_report`), and no load or storage write reads them until
        a backup fills them again."""
        host_indices = host_indices.cpu()
        self._failed_writes.append(host_indices)
        bad = self._bad_host
        self._bad_host = host_indices if bad is None else torch.cat([bad, host_indices]).unique()

    def _clear_bad_host(self, host_indices: torch.Tensor) -> None:
        if self._bad_host is not None:
            kept = self._bad_host[~torch.isin(self._bad_host, host_indices.cpu())]
            self._bad_host = kept if kept.numel() else None

    def _holds_bad_host(self, host_indices: torch.Tensor) -> bool:
        return self._bad_host is not None and bool(torch.isin(host_indices.cpu(), self._bad_host).any())

    # ---- failed loads across TP ranks -----------------------------------------------
    def take_load_report(self) -> Optional[LoadReport]:
        """(A TP follower, ``keep_load_errors``) its loads that failed since the last call —
        their errors, the slots they left without KV and the slots they wrote (CPU) — or None
        when all landed."""
        errors, self._load_errors = self._load_errors, []
        writes, self._failed_writes = self._failed_writes, []
        lost, failed = self.take_lost_loads(), self.take_failed_loads()
        if not errors and lost is None and failed is None and not writes:
            return None
        cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
        return LoadReport("; ".join(errors), cpu(lost), cpu(failed), torch.cat(writes) if writes else None)

    @property
    def load_failures_pending(self) -> bool:
        """Failed loads or backups :meth:`take_load_report` has not handed over yet."""
        return bool(self._load_errors or self._lost_loads or self._failed_loads or self._failed_writes)

    def set_peers_loads(self, peers_loads: Optional[Callable[[], List[Any]]]) -> None:
        """(TP rank 0) ``peers_loads()`` asks every other rank for its :meth:`take_load_report`.
        With it, readers of a failed load go through on this rank too: its forward must reach
        the collectives the other ranks' forwards wait in."""
        self.peers_loads = peers_loads
        self.layer_done_counter.fail_readers = peers_loads is None

    @property
    def peer_loads_due(self) -> bool:
        """(TP rank 0) loads were logged since the other ranks were last asked how theirs ended."""
        return bool(self._unasked_loads)

    def end_peer_loads(self) -> Optional[Exception]:
        """(TP rank 0, its own loads ended) Ask every other rank how its copies of the loads
        logged since the last ask ended (:meth:`ask_peers`; it ends them first: the ask
        follows the op log). Returns the error — the forward of a rank read garbage in the
        slots of its failed loads, so the outputs of the requests that read them are
        garbage — or None."""
        if self.peers_loads is not None and self._unasked_loads:
            self.ask_peers()
        errors, self._peer_load_errors = self._peer_load_errors, []
        if not errors:
            return None
        return RuntimeError("loading KV from the host tier failed on another TP rank: " + "; ".join(errors))

    def ask_peers(self) -> None:
        """(TP rank 0) Ask every other rank for its :meth:`take_load_report` now (it replays
        this rank's op log first: every load and backup logged has ended there). The slots a
        rank could not fill join :meth:`take_lost_loads`, those of its failed loads
        :meth:`take_failed_loads` (a rank that could not answer: every load slot asked about),
        the host slots of its failed backups :meth:`take_peer_failed_writes`."""
        asked = torch.cat(self._unasked_loads) if self._unasked_loads else torch.empty(0, dtype=torch.int64)
        self._unasked_loads = []
        device = self.device_pool.device
        for rank, reply in enumerate(self.peers_loads(), start=1):
            if reply is None:
                continue
            report = reply if isinstance(reply, LoadReport) else LoadReport(str(reply), asked, asked)
            if report.error:
                self._peer_load_errors.append(f"TP rank {rank}: {report.error}")
            if report.lost is not None:
                self._lost_loads.append(report.lost.to(device))
            if report.failed is not None:
                self._failed_loads.append(report.failed.to(device))
            if report.failed_writes is not None:
                logger.error("TP rank %d: backing %d tokens up to the host tier failed", rank,
                             len(report.failed_writes))
                self._peer_failed_writes.append(report.failed_writes)

    def take_peer_failed_writes(self) -> Optional[torch.Tensor]:
        """(TP rank 0) The host slots another rank's backups failed to fill, reported since
        the last call (CPU), or None: their host copies are not whole."""
        bad, self._peer_failed_writes = self._peer_failed_writes, []
        return torch.cat(bad).unique() if bad else None

    # the other ranks' side of peers_prefetch: their own thread reads the same pages
    def peer_prefetch_start(self, payload) -> None:
        op_id, keys, host_indices = payload
        op = PrefetchOp(None, 0, keys, host_indices, op_id=op_id)
        self._peer_prefetches[op_id] = op
        self.start_prefetch(op)

    def peer_prefetch_end(self, payload) -> int:
        op_id, wait = payload
        op = self._peer_prefetches.pop(op_id, None)
        return 0 if op is None else self.end_prefetch(op, wait)
