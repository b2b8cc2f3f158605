"""The PD client's workers: which are in its rotation, and how it learns one is gone (a mixin
of :class:`cluster.pd_client.PDClient`).

A worker (:class:`WorkerRef`) is in the rotation while ``alive``: round-robin picks from
those (:meth:`WorkerRotation._pick`), and a retry needs one of each role. It leaves the
rotation when

* its actor died (a call or a heartbeat says so): ``dead``, for good;
* it missed ``heartbeat_max_failures`` heartbeats in a row: ``suspended``, back once it
  answers one again (a long step or a pause: it may still be pushing);
* it reports itself broken (a TP rank gone, a transfer lane broken; to a call or a
  heartbeat): out of the rotation but never taken for dead, and every call waiting on it
  fails at once (:meth:`WorkerRotation._broken`).

:meth:`WorkerRotation._call` awaits one call to a worker and turns its failures into the
client's: :class:`WorkerLostError` for a worker that died, was unavailable or is broken
(the request may go to a new pair), :class:`PDRequestError` for the rest. The mixin reads
the client's ``prefill``, ``decode``, ``_rr``, ``_waiting_on``, ``heartbeat_interval_s``,
``heartbeat_max_failures`` and ``_heartbeat_task``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Set

import ray

from actors.pd_scheduler import PDRequestError, WorkerBrokenError, is_worker_death, worker_broken
from cluster.aio import wait_for

logger = logging.getLogger("cluster.pd_client")  # the client's: its warnings keep their logger


@dataclass
class WorkerRef:
    """A worker actor as the client sees it."""

    worker_id: str
    role: str
    handle: Any
    node_id: str
    alive: bool = True  # in the rotation
    dead: bool = False  # its actor is gone: it writes nothing more (out of the rotation for good)
    suspended: bool = False  # out of the rotation for missed heartbeats: back when it answers again
    missed_heartbeats: int = 0
    inflight: int = 0
    stats: Dict[str, Any] = field(default_factory=dict)
    followers: List[Any] = field(default_factory=list)  # TP ranks > 0
    watcher: Any = None  # rank 0's watch over its followers (an ObjectRef that resolves when one is gone)
    placement_group: Any = None


class WorkerLostError(PDRequestError):
    """A call to ``worker`` failed because its actor died or it reports itself broken (``died``),
    or it was unavailable: the request may go to another worker if nothing of it was delivered yet."""

    def __init__(self, message: str, worker: WorkerRef, died: bool):
        super().__init__(message)
        self.worker, self.died = worker, died


class WorkerRotation:
    """The client's workers in and out of its rotation (see the module docstring)."""

    prefill: List[WorkerRef]
    decode: List[WorkerRef]
    heartbeat_interval_s: float
    heartbeat_max_failures: int
    _rr: Dict[str, Iterator[int]]
    _heartbeat_task: Optional[asyncio.Task]
    _waiting_on: Dict[str, Set[asyncio.Future]]

    # ---- the rotation -----------------------------------------------------------------
    def _candidates(self, role: str, exclude: Set[str] = frozenset()) -> List[WorkerRef]:
        return [w for w in (self.prefill if role == "prefill" else self.decode)
                if w.alive and w.worker_id not in exclude]

    def _pick(self, role: str, exclude: Set[str] = frozenset()) -> WorkerRef:
        pool = self._candidates(role, exclude)
        if not pool:
            raise PDRequestError(f"no live {role} worker")
        return pool[next(self._rr[role]) % len(pool)]

    def _mark_dead(self, worker: WorkerRef, why: str, died: bool = True) -> None:
        """Out of the rotation: for good if ``died`` (its actor is gone), else until it answers a
        heartbeat again (a long step or a pause; it may still be pushing, so it is never taken
        for a process that writes nothing)."""
        if worker.alive:
            logger.warning("worker %s leaves the rotation: %s", worker.worker_id, why)
        worker.alive = False
        if died:
            worker.dead, worker.suspended = True, False
        elif not worker.dead:
            worker.suspended = True

    # ---- calls to workers ------------------------------------------------------------
    async def _call(self, worker: WorkerRef, ref, timeout_s: float, rid: str):
        try:  # (a client gone as a token came: not decoded to the end)
            return await self._unless_broken(worker, wait_for(ref, timeout_s))
        except ray.exceptions.ActorUnavailableError as exc:  # maybe back later (a blip): heartbeats decide
            raise WorkerLostError(f"{worker.role} worker {worker.worker_id} was unavailable while serving {rid}",
                                  worker, died=False) from exc
        except ray.exceptions.RayActorError as exc:
            self._mark_dead(worker, type(exc).__name__)
            raise WorkerLostError(f"{worker.role} worker {worker.worker_id} died while serving {rid}",
                                  worker, died=True) from exc
        except asyncio.TimeoutError as exc:
            raise PDRequestError(f"{worker.role} worker {worker.worker_id} did not answer within {timeout_s}s") from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.as_instanceof_cause()
            if isinstance(cause, WorkerBrokenError):
                raise self._lost_to_broken(worker, rid, cause) from exc
            if isinstance(cause, (PDRequestError, ValueError)):
                raise cause from None
            raise PDRequestError(f"{worker.role} worker {worker.worker_id}: {exc}") from exc
        except WorkerBrokenError as exc:  # (an in-process worker's, or the heartbeat's finding)
            raise self._lost_to_broken(worker, rid, exc) from exc

    async def _unless_broken(self, worker: WorkerRef, call) -> Any:
        """``await call``, or its ``WorkerBrokenError`` as soon as ``worker`` is found broken
        (:meth:`_broken`): a worker whose TP rank is gone may answer nothing more, and the request
        would hold its other side's slots until its timeout."""
        broken = asyncio.get_running_loop().create_future()
        waiting = self._waiting_on.setdefault(worker.worker_id, set())
        waiting.add(broken)
        task = asyncio.ensure_future(call)
        try:
            await asyncio.wait((task, broken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.discard(broken)
            if not task.done():
                task.cancel()
        if task.done():
            return task.result()
        raise broken.result()

    def _lost_to_broken(self, worker: WorkerRef, rid: str, exc: BaseException) -> "WorkerLostError":
        """A call of ``rid`` failed because ``worker`` is broken: the request may go elsewhere, as
        when its actor died (:meth:`_broken`)."""
        self._broken(worker, exc)
        return WorkerLostError(f"{worker.role} worker {worker.worker_id} is broken ({exc}) while serving {rid}",
                               worker, died=True)

    def _broken(self, worker: WorkerRef, exc: BaseException) -> None:
        """``worker`` reports itself broken (a TP rank gone, a transfer lane broken; to a call or a
        heartbeat): it serves nothing more. Out of the rotation, but never taken for dead — its
        process lives and may yet hold a push, so its requests are still told to abort — and every
        call waiting on it ends now: each attempt on it fails as a lost worker's (its other side
        aborted, its route released, retried on a new pair if nothing was delivered yet)."""
        self._mark_dead(worker, f"it is broken ({exc})", died=False)
        for waiting in self._waiting_on.pop(worker.worker_id, ()):
            if not waiting.done():
                waiting.set_result(exc)

    # ---- heartbeats --------------------------------------------------------------------
    async def heartbeat_once(self) -> None:
        workers = [w for w in self.prefill + self.decode if w.alive or w.suspended]

        async def ping(w: WorkerRef) -> None:
            try:
                # a TP worker's rank 0 watches its followers: load() fails once one is gone
                report = await asyncio.wait_for(w.handle.load.remote(), timeout=self.heartbeat_interval_s)
                # (the requests it holds, by id and room, are for the router's reconciliation; not in /workers)
                w.stats = {k: v for k, v in report.items() if k not in ("rids", "rooms")}
                w.missed_heartbeats = 0
            except Exception as exc:
                w.missed_heartbeats += 1
                broken = worker_broken(exc)
                if broken is not None:  # (its process lives: not dead, as is_worker_death has it)
                    self._broken(w, broken)
                    return
                died = is_worker_death(exc)
                if died or w.missed_heartbeats >= self.heartbeat_max_failures:
                    self._mark_dead(w, f"{w.missed_heartbeats} missed heartbeats ({type(exc).__name__})", died=died)
                return
            if w.suspended:  # it answers again (never a dead one): back in the rotation
                logger.warning("worker %s is back in the rotation", w.worker_id)
                w.alive, w.suspended = True, False

        await asyncio.gather(*(ping(w) for w in workers))

    def start_heartbeats(self) -> None:
        async def run():
            while True:
                await self.heartbeat_once()
                await asyncio.sleep(self.heartbeat_interval_s)

        self._heartbeat_task = asyncio.get_running_loop().create_task(run())

    def stop_heartbeats(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
