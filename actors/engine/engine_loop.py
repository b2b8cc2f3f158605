"""The background thread that drives the scheduler, and per-request delivery.

Callers (sync or asyncio) submit requests with a callback; the loop thread
runs ``scheduler.step()`` while there is work and, after every step, calls
the callback of each request that produced output. A failure inside a step
is delivered to every request in flight (nothing waits forever).

An asyncio caller's callback does not wake its event loop itself: it snapshots
the request on this thread and returns the calls to run there (``Post``); the
loop hands a step's posts to each event loop in one ``call_soon_threadsafe``
(one self-pipe write and wakeup for the step, not one per stream — vLLM's
AsyncLLM output handler and SGLang's tokenizer manager batch a step the same way).

A request id names one unfinished request at a time. Once a request has
finished — an abort finishes it at once, its last word is delivered at the
loop's next step — its id may be submitted again (a client retrying under its
own id): callbacks belong to request objects, so the old request's last word
still goes to its own caller, never to the new request's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from actors.engine.req import Req

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.002
STEP_FAILED = "engine step failed"  # what a request failed by a step's failure ends with


class Post(NamedTuple):
    """``fn(*args)``, to run on the asyncio event loop ``loop``."""

    loop: asyncio.AbstractEventLoop
    fn: Callable[..., Any]
    args: Tuple[Any, ...]


# returns the posts for its caller's event loop (None: it told a sync caller itself)
Callback = Callable[[Req, Optional[BaseException]], Optional[Sequence[Post]]]


class EngineLoop:
    def __init__(self, scheduler):
        self.scheduler = scheduler
        self._callbacks: Dict[int, Tuple[Req, Callback]] = {}  # by id(req), the request kept alive here
        self._by_rid: Dict[str, Req] = {}  # the request last submitted under each id, until delivered finished
        self._callbacks_lock = threading.Lock()  # not the loop's: deliver_now must not wait for a step
        self._cond = threading.Condition()
        self._stopped = False
        self._paused = False
        self._holds = 0  # hold() calls not yet released
        self._parked: List[Req] = []  # submitted while held, for the scheduler at the last release
        self._parked_aborts: List[Tuple[str, tuple, dict]] = []  # scheduler.abort calls for them meanwhile
        # raises to refuse a request, called as it is submitted, under the lock a release takes (sleep mode)
        self.check_admission: Callable[[], None] = lambda: None
        self._thread = threading.Thread(target=self._run, name="raydix-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, req: Req, callback: Callback) -> None:
        with self._cond:
            if self._stopped:
                raise RuntimeError("the engine is shut down")
            self.check_admission()
            with self._callbacks_lock:
                old = self._by_rid.get(req.rid)
                if old is not None and not old.finished:
                    raise ValueError(f"request id {req.rid!r} is already in flight")
                self._callbacks[id(req)] = (req, callback)
                self._by_rid[req.rid] = req
            if self._holds:
                self._parked.append(req)
            else:
                self.scheduler.add_request(req)
            self._cond.notify()

    def abort(self, rid: str, *args, **kwargs) -> bool:
        """``scheduler.abort(rid, *args, **kwargs)`` (a disaggregated scheduler's take more), then wake
        the loop. A parked request under ``rid`` gets the same call once it reaches the scheduler."""
        with self._cond:
            found = self.scheduler.abort(rid, *args, **kwargs)
            if any(req.rid == rid for req in self._parked):
                self._parked_aborts.append((rid, args, kwargs))
                found = True
            self._cond.notify()
            return found

    def hold(self) -> None:
        """Park the requests submitted from now on until :meth:`release`: they wait, registered here
        but not given to the scheduler, while the requests in flight end (a weight update drains the
        engine so, as SGLang's model_update_lock holds new requests back while it waits)."""
        with self._cond:
            self._holds += 1

    def release(self) -> int:
        """End one :meth:`hold`; at the last, the parked requests go to the scheduler in the order they
        came, then the aborts that came for them. Returns how many are (or were) parked."""
        with self._cond:
            self._holds -= 1
            parked = len(self._parked)
            if self._holds:
                return parked
            for req in self._parked:
                self.scheduler.add_request(req)
            for rid, args, kwargs in self._parked_aborts:
                self.scheduler.abort(rid, *args, **kwargs)
            self._parked, self._parked_aborts = [], []
            self._cond.notify()
            return parked

    def in_flight_rooms(self) -> Dict[str, Optional[int]]:
        """:meth:`held_rooms` of the requests not parked."""
        with self._cond:
            parked = {id(req) for req in self._parked}
            with self._callbacks_lock:
                return {rid: getattr(req, "pd_room", None) for rid, req in self._by_rid.items()
                        if id(req) not in parked}

    def drained(self) -> bool:
        """Whether every request held is parked and the scheduler has nothing left to do."""
        with self._cond:
            return not self.in_flight_rooms() and not self.scheduler.has_work()

    def pause(self, retract: bool = False) -> None:
        """Stop stepping after the current step (SGLang's pause_generation); requests stay queued, the
        running ones with their KV (mode "in_place"), or with ``retract`` back to waiting, their KV
        freed (mode "retract")."""
        with self._cond:
            self._paused = True
            if retract:
                self.scheduler.retract_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    def held_rids(self) -> List[str]:
        """The ids of the requests submitted and not yet delivered finished — queued, running,
        waiting on a KV transfer or on its push, whatever the scheduler's state — without waiting
        for the step in progress (what a worker's load report tells the router it holds)."""
        with self._callbacks_lock:
            return list(self._by_rid)

    def held_reqs(self) -> List[Req]:
        """The requests of :meth:`held_rids`."""
        with self._callbacks_lock:
            return list(self._by_rid.values())

    def held_rooms(self) -> Dict[str, Optional[int]]:
        """:meth:`held_rids` with each request's bootstrap room (the PD attempt it is; None: it has
        none), read the same way."""
        with self._callbacks_lock:
            return {rid: getattr(req, "pd_room", None) for rid, req in self._by_rid.items()}

    def run_exclusive(self, fn):
        """Run ``fn()`` with the loop paused (for idle checks and cache flushes)."""
        with self._cond:
            return fn()

    def _run(self) -> None:
        device = getattr(getattr(self.scheduler, "runner", None), "device", None)
        if device is not None and device.type == "cuda":  # kernels and streams of this thread: the runner's GPU
            torch.cuda.set_device(device)
        while True:
            with self._cond:
                while not self._stopped and (self._paused or not self.scheduler.has_work()):
                    self._cond.wait()
                if self._stopped:
                    return
                failed = set()
                try:
                    produced = self.scheduler.step()
                    error = None
                except BaseException as exc:  # delivered to every caller, then the loop goes on
                    logger.exception("engine step failed")
                    produced, failed, error = *self._fail_all(), exc
                if not produced and (not getattr(self.scheduler, "progressed", True)
                                     or getattr(self.scheduler, "stalled", False)):
                    # only waiting on something outside (a KV transfer, a storage read): don't spin
                    self._cond.wait(timeout=IDLE_POLL_S)
            posts: List[Post] = []
            for req in produced:  # the step's error goes to those it failed; the others ended their own way
                posts += self._deliver(req, error if id(req) in failed else None)
            hand_over(posts)

    def _fail_all(self):
        """Drop every request in flight, giving back what each holds; returns them all and
        the ids of those failed here. A request already finished (aborted, or done before
        the step failed) was released by whoever finished it; it is only told."""
        sched = self.scheduler
        queued = []
        try:  # requests aborted since the last step began: finished, still holding what they had
            queued += sched._release_aborted()
        except Exception:
            logger.exception("could not release the aborted requests")
        queued += list(sched.waiting) + list(sched.running) + ([sched.chunked_req] if sched.chunked_req else [])
        queued += list(getattr(sched, "in_flight", []))
        sched.waiting.clear()
        sched.running.clear()
        sched.chunked_req = None
        sched.in_flight = []
        failed = set()
        if hasattr(sched, "fail_all"):  # a disaggregated scheduler's own queues (released there)
            try:
                dropped = sched.fail_all(STEP_FAILED)
                failed.update(id(r) for r in dropped if (r.finished_reason or {}).get("message") == STEP_FAILED)
                queued += dropped
            except Exception:  # never the loop's end: its requests would wait forever
                logger.exception("could not fail the disaggregated queues")
        try:
            sched.end_orphan_prefetches()  # theirs were waiting requests
        except Exception:
            logger.exception("could not end the prefetches of the failed requests")
        reqs = list({id(r): r for r in queued}.values())
        for req in reqs:
            if req.finished:
                continue
            failed.add(id(req))
            try:
                if req.req_pool_idx is not None:
                    req.kv_committed_len = max(req.kv_committed_len, req.kv_allocated_len)  # the forward's slots too
                    sched.tree_cache.cache_finished_req(req, is_insert=False)
                    req.req_pool_idx = None
                else:  # a hybrid request matched by the failed plan may hold a copy of a cached state
                    sched.free_mamba_copy(req)
            except Exception:  # keep releasing the others; the idle check will report a leak
                logger.exception("could not release request %s", req.rid)
            if req.mm_inputs is not None:  # (one failed between chunks: rank 0's and so a TP follower's copies)
                req.mm_inputs.release_embeddings()
            req.finish({"type": "abort", "message": STEP_FAILED})
        return reqs, failed

    def deliver_now(self, req: Req) -> None:
        """Deliver ``req``'s output from another thread, without waiting for the step in
        progress (a prefill's completion notice once its KV push ended on the transfer
        thread). Its callback is dropped here; a delivery the loop had already begun
        for the same request may also see it finished, and then says the same (readers
        stop at the first finished output). Handed over at once, not with the loop's step."""
        hand_over(self._deliver(req, None))

    def _deliver(self, req: Req, error: Optional[BaseException]) -> Sequence[Post]:
        """Call ``req``'s callback; returns its posts (handed over by the caller)."""
        with self._callbacks_lock:
            entry = self._callbacks.get(id(req))
            if entry is None:
                return ()
            callback = entry[1]
            if req.finished or error is not None:
                del self._callbacks[id(req)]
                if self._by_rid.get(req.rid) is req:
                    del self._by_rid[req.rid]
        try:
            return callback(req, error) or ()
        except Exception:  # a caller's bug must not stop the loop every other request needs
            logger.exception("output callback of %s failed", req.rid)
            return ()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=10)


def hand_over(posts: Sequence[Post]) -> None:
    """Schedule ``posts`` with one ``call_soon_threadsafe`` per event loop, each loop's in
    their order (so each request's outputs stay in order: a step's come after the last's)."""
    by_loop: Dict[asyncio.AbstractEventLoop, List[Post]] = {}
    for post in posts:
        by_loop.setdefault(post.loop, []).append(post)
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_run_posts, batch)
        except RuntimeError:  # the caller's event loop is gone: nobody to tell
            logger.debug("dropping %d outputs: their event loop is closed", len(batch))


def _run_posts(batch: List[Post]) -> None:
    """On the event loop: one post's failure must not lose the others' outputs."""
    for post in batch:
        try:
            post.fn(*post.args)
        except Exception:
            logger.exception("output delivery %r failed", post.fn)
