"""The driver-side client of the PD cluster: runs one request through a (prefill, decode) pair.

The pair comes from a router (an ``actors.router.Router`` actor: cached prefix and
load) when the client has one, round-robin otherwise; then an attempt
(:mod:`cluster.pd_attempt`) runs it there::

    reserve on decode → prefill + push on prefill → stream from decode

A prompt scored only (``max_new_tokens`` 0: its logprobs, nothing generated) has
nothing to decode: it goes to a prefill worker alone (``prefill_only``), which
prefills it, caches it and returns the result; no decode worker is picked,
loaded or sent any KV.

A failure on either side (an actor died, a transfer failed or timed out)
ends the attempt within the configured timeouts and tells the other side to
free what it holds. Which workers are in the rotation, the calls to them and
the heartbeats that check them are :mod:`cluster.pd_rotation`'s (a worker
that misses ``heartbeat_max_failures`` heartbeats in a row leaves the
rotation; one a heartbeat finds broken leaves it at once, and the calls
waiting on it fail then). An attempt whose prefill or decode
worker died, was unavailable or reported itself broken (:class:`WorkerLostError`) before anything
was yielded to the caller is retried on a new pair without that worker, up
to ``max_retries`` times after a short backoff (as SGLang's router and Ray
Serve retry a request whose worker died under it); any other failure — a
timeout, bad input, a cancelled caller, a draining cluster — or one after
the first output ends the request with :class:`PDRequestError`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Set

from actors.pd_scheduler import PDRequestError
from actors.router import ROLES, call_method
from cluster.aio import wait_for
from cluster.pd_attempt import PDAttempts
from cluster.pd_rotation import WorkerLostError, WorkerRef, WorkerRotation

logger = logging.getLogger(__name__)
RETRY_BACKOFF_MAX_S = 1.0  # the longest pause before a retry (the backoff doubles from retry_backoff_s)


class PDClient(WorkerRotation, PDAttempts):
    """Runs requests through the cluster; one per driver (the router later)."""

    def __init__(self, prefill: List[WorkerRef], decode: List[WorkerRef], backend: str = "shm", tokenizer=None,
                 device: str = "cpu", bootstrap_timeout_s: float = 300.0, waiting_timeout_s: float = 300.0,
                 heartbeat_interval_s: float = 5.0, heartbeat_max_failures: int = 2, router=None,
                 router_timeout_s: float = 30.0, max_retries: int = 2, retry_backoff_s: float = 0.05):
        self.prefill, self.decode = prefill, decode
        # anything with async route(rid, input_ids[, extra_key, exclude, attempt]) and
        # release(rid, role=None, attempt=None[, room]), as actors.router.Router; None: round-robin
        self.router = router
        # adapter name -> the radix extra_key the workers cache its requests' prefixes under where it is
        # not the name (a reloaded adapter's, PDBackend.load_lora_adapter's): the router hashes by it too
        self.lora_cache_keys: Dict[str, str] = {}
        self.router_timeout_s = router_timeout_s  # a route or release the router does not answer in time
        self.max_retries = max_retries  # new pairs a request may try after its worker died or was unavailable
        self.retry_backoff_s = retry_backoff_s  # the pause before the first retry (doubled per retry)
        self.num_retries = 0  # retries made (every request)
        self.backend, self.device, self.tokenizer = backend, device, tokenizer
        self.bootstrap_timeout_s, self.waiting_timeout_s = bootstrap_timeout_s, waiting_timeout_s
        self.heartbeat_interval_s, self.heartbeat_max_failures = heartbeat_interval_s, heartbeat_max_failures
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}
        self._heartbeat_task: Optional[asyncio.Task] = None
        self.draining = False
        self.inflight = 0
        self._live_rids: set = set()  # ids of the requests in flight through this client
        self._unreleased: set = set()  # ids of requests given up while routed, until their route is released
        self._tasks: set = set()
        # per worker id, a future per call waiting on it: a heartbeat that finds it broken ends them
        self._waiting_on: Dict[str, Set[asyncio.Future]] = {}

    # ---- choosing a pair -------------------------------------------------------------
    async def _pick_pair(self, rid: str, input_ids: List[int], exclude: Set[str] = frozenset(), attempt: int = 0,
                         prefill_only: bool = False, lora_path: Optional[str] = None):
        """(prefill, decode, room) for attempt ``attempt`` of a request: the router's decision, or
        round-robin without one; never a worker in ``exclude`` (those that failed an earlier
        attempt of the request). ``room``: the attempt's bootstrap room the router picked (its
        releases name it; the workers report it), None without one. ``prefill_only``: a prompt
        scored only, whose decode is None. ``lora_path``: the request's adapter, whose prefixes the
        router matches apart (its ``extra_key``, the workers' cache key of it)."""
        if self.router is None:
            return self._pick("prefill", exclude), None if prefill_only else self._pick("decode", exclude), None
        args = (rid, input_ids)
        if exclude or attempt or prefill_only or lora_path:
            args += (self.lora_cache_keys.get(lora_path, lora_path), sorted(exclude), attempt) + ((True,) if prefill_only else ())
        routing = asyncio.ensure_future(call_method(self.router, "route", *args))
        try:
            decision = await wait_for(asyncio.shield(routing), self.router_timeout_s)
        except (asyncio.CancelledError, asyncio.TimeoutError) as exc:  # the caller left (its client did) or
            self._unreleased.add(rid)  # the router is slow: it places it all the same; its route is released
            routing.add_done_callback(lambda done: self._on_late_route(done, rid, attempt))  # once made, its id
            if isinstance(exc, asyncio.TimeoutError):  # not free until then
                raise PDRequestError(f"the router did not place {rid} within {self.router_timeout_s}s") from None
            raise
        except Exception as exc:
            raise PDRequestError(f"the router could not place {rid}: {exc}") from exc
        refs = {w.worker_id: w for w in self.prefill + self.decode}
        prefill, decode = refs.get(decision.prefill_id), refs.get(decision.decode_id)
        room = getattr(decision, "room", None)
        if prefill is None or (decode is None) != prefill_only:
            await self._release(rid, attempt=attempt, room=room)
            raise PDRequestError(f"the router chose a worker this client does not know: {decision}")
        return prefill, decode, room

    def _background(self, coro) -> None:
        """Run ``coro`` on its own, referenced until done (a task nobody holds may be collected)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_late_route(self, routing: asyncio.Future, rid: str, attempt: int) -> None:
        """The router answered a request given up while it placed it: a route it made is
        released; one it refused (say the id was already routed, by another client) is not
        this client's to release."""
        if routing.cancelled() or routing.exception() is not None:
            self._unreleased.discard(rid)
        else:
            self._background(self._forget_route(rid, attempt, getattr(routing.result(), "room", None)))

    async def _forget_route(self, rid: str, attempt: int, room: Optional[int] = None) -> None:
        """Release the route of a request given up while the router placed it."""
        try:
            await self._release(rid, attempt=attempt, room=room)
        finally:
            self._unreleased.discard(rid)

    async def _release(self, rid: str, role: Optional[str] = None, wait: bool = True, attempt: int = 0,
                       room: Optional[int] = None) -> None:
        """Tell the router attempt ``attempt`` (bootstrap room ``room``, the router's) of ``rid`` is
        done with ``role`` (None: both); ``wait=False`` does not wait for a router actor's answer
        (release is idempotent, and a later full release covers a lost partial one; routing a
        retry, a lost full one)."""
        if self.router is None:
            return
        args = (rid, role, attempt) + (() if room is None else (room,))
        remote = getattr(self.router.release, "remote", None)
        try:
            if remote is not None and not wait:
                remote(*args)  # submitted now; off the path to the first token
            else:
                await wait_for(call_method(self.router, "release", *args), self.router_timeout_s)
        except Exception as exc:  # the router is gone (a new one counts load afresh) or hung: it drops the
            # route once neither worker holds the request (route_grace_s), route_ttl_s at the latest
            logger.warning("router release of %s failed: %s", rid, exc)

    # ---- requests ---------------------------------------------------------------------
    async def generate(self, input_ids: List[int], sampling_params: Optional[Dict[str, Any]] = None,
                       rid: Optional[str] = None, priority: int = 0, lora_path: Optional[str] = None) -> Dict[str, Any]:
        final = None
        async for final in self.generate_stream(input_ids, sampling_params, rid, priority, lora_path):
            pass
        return final

    async def generate_stream(self, input_ids: List[int], sampling_params: Optional[Dict[str, Any]] = None,
                              rid: Optional[str] = None, priority: int = 0, lora_path: Optional[str] = None,
                              mm_inputs=None) -> AsyncIterator[Dict[str, Any]]:
        """Yield cumulative results as the decode worker produces tokens (a prompt scored only: the
        prefill worker's one result). ``priority`` orders the request in both workers' queues
        (their ``enable_priority_scheduling``); ``lora_path``: the LoRA adapter both workers run it
        under (None: the base model); ``mm_inputs``: an image request's (``input_ids`` padded: the
        router routes by its images' pad values), sent to both workers."""
        if self.draining:
            raise PDRequestError("the cluster is draining: no new requests")
        rid = rid or uuid.uuid4().hex
        # (as SGLang and vLLM refuse one): the workers and the router key state by it
        if rid in self._live_rids or rid in self._unreleased:
            raise ValueError(f"request id {rid!r} is already in flight")
        self._live_rids.add(rid)  # live across its attempts: freed once the last one has cleaned up
        scored_only = (sampling_params or {}).get("max_new_tokens") == 0
        attempt, roles = (self._prefill_only_attempt, ("prefill",)) if scored_only else (self._attempt, ROLES)
        try:
            failed: Set[str] = set()  # workers that died or were unavailable under this request
            for retry in itertools.count():
                delivered = False
                try:
                    async with aclosing(attempt(rid, input_ids, sampling_params, failed, retry, priority,
                                                 lora_path, mm_inputs)) as outs:
                        async for out in outs:
                            delivered = True
                            yield out
                    return
                except WorkerLostError as exc:
                    failed.add(exc.worker.worker_id)
                    if delivered or not self._may_retry(retry, failed, roles):
                        raise
                    self.num_retries += 1
                    logger.warning("retrying %s on a new pair (retry %d of %d): %s worker %s %s", rid, retry + 1,
                                   self.max_retries, exc.worker.role, exc.worker.worker_id,
                                   "died" if exc.died else "was unavailable")
                    await asyncio.sleep(min(self.retry_backoff_s * 2 ** retry, RETRY_BACKOFF_MAX_S))
                    if self.draining:
                        raise
        finally:
            self._live_rids.discard(rid)

    def _may_retry(self, retry: int, failed: Set[str], roles: Sequence[str] = ROLES) -> bool:
        """Whether a request whose attempt lost a worker (nothing delivered) goes to a new pair:
        retries left, the cluster not draining, and a live worker of each role it needs outside
        ``failed`` (those that failed it; else the error stands as it is)."""
        if retry >= self.max_retries or self.draining:
            return False
        return all(self._candidates(role, failed) for role in roles)

    async def drain(self, timeout_s: float = 120.0) -> None:
        """Refuse new requests; return once every accepted one has ended (those the router is
        still placing included)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self._live_rids and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
