"""One attempt of a request on its workers (a mixin of :class:`cluster.pd_client.PDClient`, whose
retries run attempts until one ends without losing a worker).

On a (prefill, decode) pair (:meth:`PDAttempts._attempt`)::

    reserve on decode → prefill + push on prefill → stream from decode

A prompt scored only (``max_new_tokens`` 0) runs on a prefill worker alone
(:meth:`PDAttempts._prefill_only_attempt`). However an attempt ends, it leaves nothing on either
worker and releases its route: a failed call stops the prefill (:meth:`PDAttempts._stop_prefill`)
and ends the decode side's reservation (:meth:`PDAttempts._abort_quietly`); a push that failed
because its decode worker died is that worker's :class:`~cluster.pd_rotation.WorkerLostError`, which
the client may retry. The mixin reads the client's ``backend``, ``device``, ``inflight``,
``bootstrap_timeout_s``, ``waiting_timeout_s``, ``_pick_pair`` and ``_release``, and the rotation's
``_call`` and ``_mark_dead``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Set

from actors.pd_scheduler import PDRequestError, is_worker_death
from cluster.pd_rotation import WorkerLostError, WorkerRef
from transfer import select_backend

logger = logging.getLogger("cluster.pd_client")  # the client's: its warnings keep their logger


class PDAttempts:
    """The client's attempts on its workers (see the module docstring)."""

    backend: str
    device: str
    inflight: int
    bootstrap_timeout_s: float
    waiting_timeout_s: float

    async def _attempt(self, rid: str, input_ids: List[int], sampling_params: Optional[Dict[str, Any]],
                       exclude: Set[str], attempt: int = 0, priority: int = 0,
                       lora_path: Optional[str] = None, mm_inputs=None) -> AsyncIterator[Dict[str, Any]]:
        """Attempt ``attempt`` of ``rid`` on a pair outside ``exclude``; on its way out (however)
        it leaves nothing on either worker and releases its route."""
        prefill, decode, routed_room = await self._pick_pair(rid, input_ids, exclude, attempt, lora_path=lora_path)
        # this attempt: every abort below names it, never a later one under rid; the router's (the
        # workers report it, and the router judges a route whose release was lost by it)
        room = routed_room if routed_room is not None else random.getrandbits(63)
        override = None if self.backend == "auto" else self.backend
        try:
            backend = select_backend(prefill.node_id == decode.node_id, self.device, override)
        except BaseException:  # (a backend the pair cannot use): nothing asked of either side yet
            await self._release(rid, attempt=attempt, room=routed_room)
            raise
        prefill.inflight += 1
        decode.inflight += 1
        self.inflight += 1
        start = time.perf_counter()
        finished = decode_told = False  # decode_told: the decode side was told how to end this attempt
        try:
            try:
                handoffs = await self._call(
                    decode, decode.handle.reserve.remote(rid, input_ids, sampling_params, backend, room, priority,
                                                               lora_path, mm_inputs),
                    self.bootstrap_timeout_s, rid)
            except BaseException:  # no prefill has its hand-offs: the slots can go back at once
                decode_told = True
                await self._abort_quietly(decode, rid, room, safe=True)
                raise
            try:
                notice = await self._call(
                    prefill, prefill.handle.prefill.remote(rid, input_ids, sampling_params, handoffs, priority,
                                                                 lora_path, mm_inputs),
                    self.waiting_timeout_s, rid)
            except BaseException as exc:
                decode_told = True  # (an unconfirmed stop quarantines the slots: nothing below may free them)
                try:
                    safe = await self._stop_prefill(prefill, rid, room)
                except BaseException:  # cancelled meanwhile (the client left): the decode side is told
                    if not decode.dead:  # all the same, the prefill not known stopped
                        decode.handle.abort.remote(rid, "the client went away", False, room)
                    raise
                decode_died = await self._abort_quietly(decode, rid, room, safe=safe)
                if decode_died and _failed_push(exc):  # the push failed because its decode worker died
                    raise WorkerLostError(f"decode worker {decode.worker_id} died while {rid}'s KV moved to it "
                                          f"({exc})", decode, died=True) from exc
                raise
            await self._release(rid, "prefill", wait=False, attempt=attempt, room=routed_room)
            gen = decode.handle.stream.options(num_returns="streaming").remote(rid, notice)
            async for ref in gen:
                out = await self._call(decode, ref, self.waiting_timeout_s, rid)
                out["meta_info"]["decode_cached_tokens"] = out["meta_info"]["cached_tokens"]  # their KV did not move
                out["meta_info"]["cached_tokens"] = max(out["meta_info"]["cached_tokens"], notice["cached_tokens"])
                out["meta_info"]["prefill_worker"] = prefill.worker_id
                out["meta_info"]["prefill_cached_tokens"] = notice["cached_tokens"]
                out["meta_info"]["decode_worker"] = decode.worker_id
                out["meta_info"]["ttft_pd"] = notice["prefill_latency"]
                out["meta_info"]["transfer_time"] = notice.get("transfer_time")
                out["meta_info"]["transfer_bytes"] = notice.get("transfer_bytes")
                out["meta_info"]["e2e_latency_pd"] = time.perf_counter() - start
                finished = out["meta_info"]["finish_reason"] is not None
                yield out
        finally:
            prefill.inflight -= 1
            decode.inflight -= 1
            self.inflight -= 1
            if not (finished or decode_told) and not decode.dead:  # after the notice: the caller went away or a
                decode.handle.abort.remote(rid, "the client went away", True, room)  # call failed; nothing can push
            # (before the id is free again or routed anew: a new request or attempt under it routes afresh)
            await self._release(rid, attempt=attempt, room=routed_room)

    async def _prefill_only_attempt(self, rid: str, input_ids: List[int], sampling_params: Optional[Dict[str, Any]],
                                    exclude: Set[str], attempt: int = 0, priority: int = 0,
                                    lora_path: Optional[str] = None, mm_inputs=None) -> AsyncIterator[Dict[str, Any]]:
        """Attempt ``attempt`` of a prompt scored only on a prefill worker outside ``exclude``, with no
        decode worker: its one result, the worker's. On its way out (however) it leaves nothing on
        the worker (a call that failed, timed out or was cancelled aborts its room) and releases
        its route."""
        prefill, _, routed_room = await self._pick_pair(rid, input_ids, exclude, attempt, prefill_only=True,
                                                        lora_path=lora_path)
        room = routed_room if routed_room is not None else random.getrandbits(63)
        prefill.inflight += 1
        self.inflight += 1
        start = time.perf_counter()
        try:
            try:
                out = await self._call(
                    prefill, prefill.handle.prefill_only.remote(rid, input_ids, sampling_params, room, priority,
                                                                      lora_path, mm_inputs),
                    self.waiting_timeout_s, rid)
            except BaseException:
                await self._stop_prefill(prefill, rid, room)
                raise
            meta = out["meta_info"]
            meta.update(prefill_worker=prefill.worker_id, prefill_cached_tokens=meta["cached_tokens"],
                        decode_worker=None, decode_cached_tokens=0, ttft_pd=meta["e2e_latency"], transfer_time=None,
                        transfer_bytes=0, e2e_latency_pd=time.perf_counter() - start)
            yield out
        finally:
            prefill.inflight -= 1
            self.inflight -= 1
            await self._release(rid, attempt=attempt, room=routed_room)

    async def _stop_prefill(self, prefill: WorkerRef, rid: str, room: int) -> bool:
        """Make sure ``prefill`` will not push the KV of ``rid``'s attempt ``room`` (its
        hand-offs' room; the client may send the id again); True when that is certain."""
        if prefill.dead:
            return True  # a dead process writes nothing (one only out of the rotation may)
        try:
            await asyncio.wait_for(prefill.handle.abort.remote(rid, "aborted", room), timeout=5)
            return True
        except Exception as exc:
            if is_worker_death(exc):  # (not one only unavailable for a moment: it may come back and push)
                self._mark_dead(prefill, type(exc).__name__)
                return True
            logger.warning("could not stop the prefill of %s on %s: %s", rid, prefill.worker_id, exc)
            return False

    async def _abort_quietly(self, worker: WorkerRef, rid: str, room: int, safe: bool) -> bool:
        """End ``rid``'s attempt ``room`` on the decode worker; ``safe``: no prefill can still write
        its slots. True when the worker turned out dead (it is marked so)."""
        try:
            await asyncio.wait_for(worker.handle.abort.remote(rid, "the prefill side failed", safe, room), timeout=5)
        except Exception as exc:  # the decode side's waiting timeout frees it if this cannot
            if is_worker_death(exc):
                self._mark_dead(worker, type(exc).__name__)
                return True
            logger.warning("could not abort %s on %s", rid, worker.worker_id)
        return False


def _failed_push(exc: BaseException) -> bool:
    """A prefill call that failed on the transfer (its error came back from the worker), not
    on a timeout of the call, bad input or a lost prefill worker: the decode side's death is
    then the likely cause."""
    return (isinstance(exc, PDRequestError) and not isinstance(exc, WorkerLostError)
            and not isinstance(exc.__cause__, asyncio.TimeoutError))
