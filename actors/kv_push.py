"""A prefill rank's KV pushes, run off the engine loop (SGLang's inflight queue).

After each prefill forward the scheduler hands every rank the new prompt rows
of the requests in the batch as :class:`PushChunk` s; the rank's
:class:`KVPusher` copies them to the decode ranks it serves on its transfer
threads while the next batch runs — one per lane, a decode worker's pushes
always on the same lane, so a slow destination does not hold up the others. Per request the chunks go in
order through one :class:`~transfer.base.KVSender` per decode rank; the
Mamba state and the sliding-window rows go with the last chunk. A request is
done on a rank when its last chunk was pushed (or skipped after an earlier
chunk failed): :meth:`KVPusher.take_finished` reports it once, or — when set —
the ``on_finished`` hook is called with it on the transfer thread (a hook that
raises leaves it to ``take_finished``).

Ordering: a chunk may only read KV its forward already wrote. On the CPU the
forward has returned when ``submit`` is called; on CUDA ``submit`` records an
event on the compute stream and the transfer thread's own stream waits for it
before copying, so the copies overlap the next forward but never precede the
one that wrote their rows.

Pushes are keyed by a push id (the request id and the attempt, ``"{rid}#{n}"``),
never by the request id alone: a late report of an earlier attempt (an engine
step failed, the client retried under the same id) cannot settle the new one.
``cancel(push_id)`` drops the push's queued chunks, fails its senders and
waits for a copy of it already running to end: once it returns this rank
writes nothing more for it, so the decode side may reuse the slots at once.
A lane whose transfer thread died (a ``BaseException`` escaped a push: ``SystemExit``,
``CancelledError``; or its set-up raised: the CUDA device is gone) is seen at the next
``submit`` or ``take_finished``: the requests open on it fail at once with what killed it
(instead of waiting out the timeout), and it gets a new thread — at once the first time,
then after a backoff doubling from ``restart_backoff_s``. Its thread dying again after
``max_restarts`` restarts in a row (no chunk pushed in between) leaves the lane *broken*:
every push on it, open or later, fails at once naming the cause, and
:attr:`KVPusher.broken` says so (the worker's ``health()`` and ``load()`` raise with it,
so heartbeats take the worker out of rotation).
With ``asynchronous=False`` chunks are pushed inside ``submit`` (the loop
stalls for them: the behaviour before overlap, kept for comparison).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Deque, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from transfer.base import KVHandoff, KVPoll, KVSender, TransferAgent, head_overlap
from transfer.plan import copied_heads, plan_copies, sends_heads, sends_replicated

logger = logging.getLogger(__name__)


class PushChunk(NamedTuple):
    """Prompt tokens ``[start, start + len(src_slots))`` of push ``push_id``, their KV
    now written at ``src_slots``. ``handoffs`` come with a request's first chunk;
    ``state_slot`` and ``src_swa`` (the SWA slots of the prompt's last tokens,
    aligned to its end as ``dst_swa_slots``) with its last."""

    push_id: str
    start: int
    src_slots: List[int]
    is_last: bool
    state_slot: Optional[int] = None
    src_swa: Sequence[int] = ()
    handoffs: Optional[List[bytes]] = None
    dest: str = ""  # the decode worker pushed to (its lane; chunks of a request share it)


class PushResult(NamedTuple):
    """One rank's share of a push, done: bytes it moved, why it failed (or None), and
    ``written``: per decode rank it pushed to (by its hand-off's position in the
    request's list), the heads of each buffer it wrote there (``transfer.plan.copied_heads``:
    rank 0 checks that the ranks together wrote every buffer of every decode rank)."""

    push_id: str
    moved: int
    error: Optional[str]
    written: Optional[Dict[int, Dict[str, int]]] = None


@dataclass
class _Job:
    lane: "_Lane"
    dest: str
    senders: List[Tuple[KVHandoff, KVSender]] = field(default_factory=list)
    written: Dict[int, Dict[str, int]] = field(default_factory=dict)  # see PushResult
    moved: int = 0
    error: Optional[str] = None
    cancelled: bool = False


@dataclass
class _Lane:
    """A transfer thread and its queue; the destinations it serves never wait on another lane's."""

    index: int
    queue: Deque[Tuple[PushChunk, Optional["torch.cuda.Event"]]] = field(default_factory=collections.deque)
    running: Optional[str] = None  # push whose chunk this lane's thread copies now
    thread: Optional[threading.Thread] = None
    death: Optional[BaseException] = None  # what ended its last thread, if one died
    reaped: Optional[threading.Thread] = None  # the last dead thread whose death was handled
    deaths: int = 0  # threads that died in a row, none having pushed a chunk
    retry_at: float = 0.0  # (monotonic) no new thread before this
    broken: Optional[str] = None  # why it gets no thread any more: its pushes fail at once


def serves(handoff: KVHandoff, agent: TransferAgent) -> bool:
    """Whether this prefill rank pushes to the hand-off's decode rank: the two must hold
    some layer alike (the same buffer: pipeline stages hold their own layers), and of it
    head-sharded buffers pair ranks whose head ranges overlap (of the ranks holding a
    replica of the same heads, only the one :func:`~transfer.plan.sends_heads` picks);
    replicated ones (MLA, Mamba states) take the KV of decode TP rank r from prefill TP
    rank ``r % tp_size`` (:func:`~transfer.plan.sends_replicated`). As
    :func:`~transfer.plan.plan_copies` picks what it copies."""
    mine = agent.layout.by_name()
    for b in handoff.layout.buffers:
        m = mine.get(b.name)
        if m is None:  # a layer of another stage
            continue
        if b.head_axis is None:
            if sends_replicated(agent.tp_rank, agent.tp_size, handoff.tp_rank):
                return True
        elif sends_heads(m, agent.tp_rank, agent.tp_size, handoff.tp_rank) and head_overlap(m, b) is not None:
            return True
    return False


class KVPusher:
    """One per prefill rank: its agents, the chunks queued, the requests in progress.

    Chunks queue on ``num_lanes`` lanes, each with its own transfer thread; a decode
    worker keeps one lane while pushes to it are open (given the lane serving the fewest
    destinations), so a slow destination (a link across nodes, a large prompt) holds up only
    the destinations that share its lane — as SGLang shards its transfer queues by destination."""

    def __init__(self, agents: Dict[str, TransferAgent], asynchronous: bool = True, name: str = "raydix-kv-push",
                 num_lanes: int = 4, max_restarts: int = 3, restart_backoff_s: float = 0.05):
        self.agents, self.asynchronous, self.name = agents, asynchronous, name
        self.max_restarts, self.restart_backoff_s = max_restarts, restart_backoff_s
        tensors = [t for agent in agents.values() for t in agent.buffers.values()]
        self.device = tensors[0].device if tensors else torch.device("cpu")
        self._cond = threading.Condition()
        self._lanes = [_Lane(i) for i in range(max(1, num_lanes))]
        self._lane_of: Dict[str, _Lane] = {}  # destination → its lane (dropped once no push to it is open)
        self._jobs: Dict[str, _Job] = {}
        self._finished: List[PushResult] = []
        self._closed = False
        self.num_chunks = 0  # chunks that moved rows to at least one decode rank
        # called on the transfer thread when a request's share ends, instead of queueing it
        # for take_finished (rank 0: the scheduler's early notice; a TP follower: its report to rank 0)
        self.on_finished: Optional[Callable[[PushResult], None]] = None

    # ---- the engine loop's side ------------------------------------------------------
    def submit(self, chunks: Sequence[PushChunk]) -> None:
        """Queue ``chunks`` (a request's first one opens it); their forward has been issued."""
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))  # the pools' device, whatever the thread's current one
        with self._cond:
            failed = self._revive() if self.asynchronous else []
            for chunk in chunks:
                if chunk.handoffs is not None:
                    lane = self._lane_for(chunk.dest)
                    if lane.broken is not None:  # fails now; its later chunks find no job and are dropped
                        self._finished.append(PushResult(chunk.push_id, 0, self._lane_error(lane)))
                        continue
                    self._jobs[chunk.push_id] = _Job(lane, chunk.dest)
                job = self._jobs.get(chunk.push_id)
                if job is not None:  # a cancelled request's late chunks are dropped
                    job.lane.queue.append((chunk, event))
                    if self.asynchronous:
                        self._start(job.lane)
            self._cond.notify_all()
        self._abort_senders(failed)
        if not self.asynchronous:
            for lane in self._lanes:
                while self._run_one(lane, block=False):
                    pass

    def _lane_for(self, dest: str) -> _Lane:
        """(Under the lock) destinations with no push open are forgotten first: a decode rank's agent id
        changes when its pools are released and resumed (sleep mode) and a removed worker's never comes
        back, so the map would otherwise keep one entry per id ever pushed to."""
        open_dests = {job.dest for job in self._jobs.values()}
        self._lane_of = {d: lane for d, lane in self._lane_of.items() if d in open_dests}
        lane = self._lane_of.get(dest)
        if lane is None:
            lane = min(self._lanes, key=lambda candidate: sum(held is candidate for held in self._lane_of.values()))
            self._lane_of[dest] = lane
        return lane

    @property
    def broken(self) -> Optional[str]:
        """Why some lane is broken (its thread kept dying), or None: the rank cannot push to
        the destinations on that lane any more."""
        with self._cond:
            return next((self._lane_error(lane) for lane in self._lanes if lane.broken is not None), None)

    def _lane_error(self, lane: _Lane) -> str:
        return f"the KV transfer lane {self.name}-{lane.index} is broken: {lane.broken}"

    def take_finished(self) -> List[PushResult]:
        """Requests whose share on this rank ended since the last call (a lane whose
        transfer thread died is seen here too: its requests failed, a new thread started)."""
        with self._cond:
            failed = self._revive()
            out, self._finished = self._finished, []
        self._abort_senders(failed)
        return out

    def cancel(self, push_id: Optional[str] = None) -> None:
        """Stop push ``push_id`` (None: every push); returns once no copy of it runs."""
        with self._cond:
            ids = list(self._jobs) if push_id is None else [push_id]
            cancelled = [job for job in (self._jobs.pop(r, None) for r in ids) if job is not None]
            for job in cancelled:
                job.cancelled = True
            gone = set(ids)
            for lane in self._lanes:
                lane.queue = collections.deque(item for item in lane.queue if item[0].push_id not in gone)
        self._abort_senders(cancelled, "aborted")
        with self._cond:
            while any(lane.running in gone for lane in self._lanes):
                self._cond.wait()
            self._finished = [r for r in self._finished if r.push_id not in gone]  # (a failed hook's, too)

    def close(self) -> None:
        self.cancel()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for lane in self._lanes:
            if lane.thread is not None and lane.thread.ident is not None:  # (one whose start failed never ran)
                lane.thread.join(timeout=10)

    # ---- the transfer threads ---------------------------------------------------------
    def _start(self, lane: _Lane) -> None:
        """(Under the lock) give the lane a transfer thread if it has none, unless it is
        broken or its dead thread's backoff has not passed (``_revive`` starts it then)."""
        if self._closed or lane.broken is not None or (lane.thread is not None and lane.thread.is_alive()):
            return
        if lane.thread is not None and (lane.thread is not lane.reaped or time.monotonic() < lane.retry_at):
            return
        lane.thread = threading.Thread(target=self._loop, args=(lane,), name=f"{self.name}-{lane.index}",
                                       daemon=True)
        try:
            lane.thread.start()
        except RuntimeError as exc:  # (no thread can be started) a death like any other
            lane.death = exc

    def _revive(self) -> List[_Job]:
        """(Under the lock) handle every lane whose transfer thread died: its open requests
        fail now (left, its queued chunks would never be pushed and their requests fail only
        at the prefill side's waiting timeout); it gets a new thread once its backoff passed
        and it has work, or is marked broken after ``max_restarts`` deaths in a row. Returns
        the failed pushes, whose senders the caller aborts once it let go of the lock."""
        failed: List[_Job] = []
        for lane in self._lanes:
            if self._closed or lane.thread is None or lane.thread.is_alive() or lane.broken is not None:
                continue  # (closed: its threads ended as they should)
            if lane.thread is not lane.reaped:
                lane.reaped, lane.deaths = lane.thread, lane.deaths + 1
                failed += self._fail_lane(lane)
                if lane.deaths > self.max_restarts:
                    lane.broken = f"its transfer thread died {lane.deaths} times in a row ({self._death(lane)})"
                    logger.error("%s", self._lane_error(lane))
                    continue
                lane.retry_at = time.monotonic() + (self.restart_backoff_s * 2 ** (lane.deaths - 2)
                                                    if lane.deaths > 1 else 0.0)
            if lane.queue:
                self._start(lane)
        return failed

    @staticmethod
    def _death(lane: _Lane) -> str:
        death = lane.death
        return f"{type(death).__name__}: {death}" if death is not None else "no exception"

    def _fail_lane(self, lane: _Lane) -> List[_Job]:
        """(Under the lock) every request still open on the lane fails now with what killed
        its thread: reported for ``take_finished``, its queued chunks dropped. Returned: their
        senders are to be aborted (:meth:`_abort_senders`), off the lock."""
        error = f"the KV transfer thread {self.name}-{lane.index} died ({self._death(lane)})"
        failed = {push_id: job for push_id, job in self._jobs.items() if job.lane is lane}
        for push_id, job in failed.items():
            del self._jobs[push_id]
            job.error = job.error or error
            logger.error("failing push %s: %s", push_id, job.error)
            self._finished.append(PushResult(push_id, job.moved, job.error))
        lane.queue = collections.deque(item for item in lane.queue if item[0].push_id not in failed)
        return list(failed.values())

    @staticmethod
    def _abort_senders(jobs: Sequence[_Job], reason: Optional[str] = None) -> None:
        """The pushes failed or were cancelled: their senders not yet done fail with ``reason``
        (by default each push's error), each telling its decode rank where the backend can (a
        sender that failed itself told it already) so that a receiver does not wait for the
        client's abort or its timeout. Never under the lock: telling it may take a while (a
        message over a torch_dist pair), and every lane's thread and ``submit`` wait on the lock."""
        for job in jobs:
            for _, sender in job.senders:
                sender.abort(reason or job.error)

    def _lane_setup(self) -> ContextManager:
        """On a new transfer thread, before its first chunk: the context it pushes in (on
        CUDA its own stream: the copies overlap the forward). Raising, the thread dies."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        torch.cuda.set_device(self.device)
        return torch.cuda.stream(torch.cuda.Stream(self.device))

    def _loop(self, lane: _Lane) -> None:
        try:
            with self._lane_setup():
                while self._run_one(lane, block=True):
                    pass
        except BaseException as exc:  # (SystemExit, CancelledError, ...) the next submit or take_finished restarts it
            with self._cond:
                lane.death = exc
            logger.exception("the KV transfer thread %s-%d died", self.name, lane.index)

    def _run_one(self, lane: _Lane, block: bool) -> bool:
        """Push the lane's next queued chunk; False when closed (or, not blocking, when none is queued)."""
        with self._cond:
            while not lane.queue:
                if self._closed or not block:
                    return False
                self._cond.wait()
            chunk, event = lane.queue.popleft()
            job = self._jobs.get(chunk.push_id)
            if job is None:
                return True
            lane.running = chunk.push_id
        died = False
        try:
            if chunk.handoffs is not None:
                self._open(job, chunk)
            if job.error is None:
                if event is not None:
                    torch.cuda.current_stream(self.device).wait_event(event)
                self._push(job, chunk)
        except BaseException as exc:  # a bug or a broken agent fails this request, not the rank
            job.error = job.error or f"KV push failed: {type(exc).__name__}: {exc}"
            if not isinstance(exc, Exception):  # the thread ends (its last chunk reports the failure, not success)
                died = True
                raise
            logger.exception("pushing the KV of %s failed", chunk.push_id)
        finally:
            with self._cond:
                ended = chunk.is_last and self._jobs.get(chunk.push_id) is job
                if ended:
                    del self._jobs[chunk.push_id]
            if ended:
                if job.error is not None:
                    self._abort_senders([job])
                self._report(PushResult(chunk.push_id, job.moved, job.error, job.written))
            with self._cond:
                lane.running = None
                if not died:  # a thread that pushes: the deaths before it were not in a row
                    lane.deaths = 0
                self._cond.notify_all()
        return True

    def _report(self, result: PushResult) -> None:
        """Tell ``on_finished`` (the request still "running": a cancel of it waits until it
        is told), or queue it for take_finished — also when the hook raised."""
        hook = self.on_finished
        if hook is not None:
            try:
                hook(result)
                return
            except Exception:  # (a TP follower whose rank 0 is gone) the transfer thread goes on
                logger.exception("the push-finished hook failed for %s; take_finished reports it", result.push_id)
        with self._cond:
            self._finished.append(result)

    def _open(self, job: _Job, chunk: PushChunk) -> None:
        """A sender per decode rank this rank serves, and what it writes there."""
        for i, raw in enumerate(chunk.handoffs):
            handoff = KVHandoff.from_bytes(raw)
            agent = self.agents.get(handoff.backend)
            if agent is None:
                job.error = f"hand-off over backend {handoff.backend!r}; this rank has {sorted(self.agents)}"
                return
            if not serves(handoff, agent):
                continue
            sender = KVSender(agent, handoff.rid)
            sender.init(handoff)  # a layout mismatch raises: the request fails
            job.senders.append((handoff, sender))
            job.written[i] = copied_heads(plan_copies(agent.layout, handoff.layout, agent.tp_rank, agent.tp_size,
                                                      handoff.tp_rank, handoff.dst_state_slot is not None))

    def _push(self, job: _Job, chunk: PushChunk) -> None:
        """The chunk's rows past each decode rank's own prefix; with the last, the state and window."""
        end = chunk.start + len(chunk.src_slots)
        pushed = False
        for handoff, sender in job.senders:
            if job.cancelled:
                return
            lo = max(chunk.start, handoff.dst_prefix_len)
            swa: Sequence[int] = []
            if chunk.is_last:
                num_swa = len(handoff.dst_swa_slots)
                swa = list(chunk.src_swa)[-num_swa:] if num_swa else []
                if len(swa) < num_swa or 0 in swa:  # SWA slot 0 is the padding row: that token's SWA KV is gone
                    held = sum(1 for s in chunk.src_swa if s > 0)
                    job.error = (f"decode rank {handoff.tp_rank} asks for the SWA KV of {num_swa} tokens; "
                                 f"this rank has it for {held}")
                    return
            elif lo >= end:
                continue
            before = sender.bytes_sent
            sender.send_chunk(chunk.src_slots[lo - chunk.start :], lo - handoff.dst_prefix_len, chunk.is_last,
                              chunk.state_slot if chunk.is_last else None, swa)
            job.moved += sender.bytes_sent - before
            if sender.poll() == KVPoll.Failed:
                job.error = f"KV transfer to decode rank {handoff.tp_rank} failed: {sender.failure_reason()}"
                return
            pushed = True
        if pushed:
            self.num_chunks += 1


__all__ = ["KVPusher", "PushChunk", "PushResult", "serves"]
