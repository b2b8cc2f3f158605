"""The prefill role of the engine scheduler (SGLang's disaggregation prefill).

Prefill (``PrefillScheduler``), queues in SGLang's order (bootstrap → waiting
→ inflight): a request arrives with the decode side's hand-offs. It is
matched in the prefill worker's own radix cache and (chunk by chunk)
prefilled as usual; after each chunk's forward every rank's
:class:`~actors.kv_push.KVPusher` is handed the chunk's new prompt rows
(whole pages) and copies those past each decode rank's ``dst_prefix_len`` on
its transfer thread while the next batch runs. After the last chunk the
first output token is sampled and the rest goes — the remaining rows, the
Mamba state, and for sliding-window layers the SWA KV of the last window
only. The request then waits in ``inflight`` (row, slots and tree lock
held) until every rank's push ended; only then is the completion notice (or
the error) sent and the prompt cached in the tree. It never decodes::

    chunk k done   cache_unfinished_req, then push rows [sent_upto, chunk_end) of it
    last chunk     sample; push [sent_upto, prompt_len) + state + window → inflight
    inflight       every rank done → finish (notice or error), cache_finished_req
                   (a rank silent past waiting_timeout_s: its pushes stopped, finished with the error)

With the asynchronous push the notice does not wait for the loop
(:meth:`PrefillScheduler.enable_early_notice`): whichever thread reports the
last rank's push of a request sends it, while the forward of the next batch
is still running — rank 0's transfer thread, or with TP > 1 the rank-0
actor's thread that takes a follower's report (each follower's transfer
thread sends one to rank 0 as its share of a request ends:
:meth:`PrefillScheduler.on_pushed`). The loop caches the prompt and drops
the lock at its next step. With TP > 1 a push that failed waits for the
loop, which stops every rank's pushes of it before the error notice; and a
follower's report that could not be sent comes in the reply to the loop's
next call to it instead (``push`` / ``push_status``).

A prompt scored only (``max_new_tokens`` 0: its logprobs, nothing generated) has
no decode side: it runs here as in the engine, chunk by chunk, pushes nothing,
and ends at its last chunk with finish ``length`` 0, its prompt cached and its
lock dropped (``PrefillWorker.prefill_only`` returns its result).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Callable, Dict, List, Optional

import torch

from actors.engine.req import Req
from actors.engine.sampling import Pick
from actors.engine.scheduler import Scheduler
from actors.engine.tp_worker import FollowerError
from actors.kv_push import KVPusher, PushChunk, PushResult
from transfer.base import TransferAgent
from transfer.plan import unwritten

logger = logging.getLogger(__name__)


class PrefillScheduler(Scheduler):
    """``agents``: rank 0's transfer agents; ``pusher``: rank 0's KVPusher; ``tp_worker``:
    the rank-0 :class:`~actors.engine.tp_worker.TPModelWorker` whose followers push their share.

    Every rank pushes each chunk itself; rank 0 tracks per request the ranks still
    pushing (``req.pd_pending``). Requests with an open push (``_pushing``) are the
    chunked one and those in ``inflight``. ``_push_lock`` guards those (and each request's
    push state) against the threads that report pushes (:meth:`on_pushed`). A request
    waits in ``inflight`` at most ``waiting_timeout_s`` (the decode side's wait for its KV,
    which began before its prefill): a rank whose report never came by then fails it
    (:meth:`_expire_inflight`).
    """

    def __init__(self, runner, tokenizer, agents: Dict[str, TransferAgent], pusher: KVPusher, tp_worker=None,
                 waiting_timeout_s: Optional[float] = 300.0):
        super().__init__(runner, tokenizer)
        self.agents, self.pusher, self.tp_worker = agents, pusher, tp_worker
        self.pp_micro_batches = 1  # (a KV hand-off follows its batch's forward: one batch in flight)
        self.waiting_timeout_s = waiting_timeout_s  # longest wait in ``inflight`` (None: no limit)
        self.clock: Callable[[], float] = time.monotonic  # what that wait is measured by
        self.tp_size = tp_worker.tp.size if tp_worker is not None else 1
        self.inflight: List[Req] = []  # prefill done, the push still running on some rank
        self._pushing: Dict[str, Req] = {}  # by push id (rid and attempt: see actors.kv_push)
        self._push_serial = itertools.count()
        self._outbox: List[PushChunk] = []  # this step's chunks, submitted after its forward
        self._push_lock = threading.RLock()
        self._deliver_early: Optional[Callable[[Req], None]] = None
        self.bytes_pushed = 0
        self.push_time = 0.0

    def has_work(self) -> bool:
        return bool(self.inflight) or super().has_work()

    def enable_early_notice(self, deliver: Callable[[Req], None]) -> None:
        """With the asynchronous push: ``deliver(req)`` (thread-safe) is called, with the
        request finished, as soon as every rank's push of it ended — by :meth:`on_pushed`,
        on the thread that reports the last rank (rank 0's pusher reports its own rank;
        the followers' reports are the caller's to pass on)."""
        if self.pusher.asynchronous:
            self._deliver_early = deliver
            self.pusher.on_finished = lambda result: self.on_pushed(0, [result])

    def step(self) -> List[Req]:
        before = self.runner.num_forwards
        out: List[Req] = []
        try:
            out += self._process_inflight()  # pushes that ended since: their notices don't wait for this forward
            out += super().step()
            self._flush_pushes()
            out += self._process_inflight()
        except BaseException:  # those that ended here (released) are told by the loop's failure path
            self._aborted[:0] = [r for r in out if r.finished]
            raise
        self.progressed = bool(out) or self.runner.num_forwards != before
        return out

    def retract_all(self) -> List[Req]:
        """``pause_generation(mode="retract")`` retracts nothing here: no request decodes on this
        side, and the one prefilling in chunks keeps its slots, which pushes of its first chunks
        may be reading (its chunks would go again, on other slots)."""
        return []

    def _request_reserve(self, req: Req, kv_len: Optional[int] = None) -> int:
        return 0  # it never decodes: the decode worker reserves for the new tokens

    def check_request(self, req: Req) -> None:
        """Only the prompt must fit here: the output is the decode worker's (which holds
        ``max_new_tokens`` to its own pool)."""
        max_new = req.sampling_params.max_new_tokens
        super().check_request(req)
        req.sampling_params.max_new_tokens = max_new

    # ---- chunks ------------------------------------------------------------------------
    def _process_prefill(self, reqs: List[Req], logits) -> List[Req]:
        out = super()._process_prefill(reqs, logits)
        req = self.chunked_req  # more chunks to go; its rows read after cache_unfinished_req re-pointed them
        if req is not None and any(r is req for r in reqs) and not _scored_only(req):
            ready = len(req.fill_ids) // self.page_size * self.page_size  # whole pages, as SGLang
            self._queue_push(req, ready, is_last=False)
        return out

    def _prefill_done(self, req: Req, logits_row, pick: Optional[Pick] = None) -> None:
        """Sample the first token (``pick``, when the batch picked it already) and queue the last
        chunk; the request waits in ``inflight`` (row, slots and lock held) until every rank has
        pushed. A prompt scored only ends here, cached, as in the engine."""
        if _scored_only(req):
            super()._prefill_done(req, logits_row, pick)
            return
        self._sample(req, logits_row, pick)
        req.pd_first_finish = req.finished_reason  # the first token may already end it (EOS, stop, length 1)
        req.finished_reason = None
        req.first_token_time = time.perf_counter()
        with self._push_lock:
            self._queue_push(req, len(req.origin_input_ids), is_last=True)
            req.pd_last_chunk_time = time.perf_counter()
            timeout = self.waiting_timeout_s
            req.pd_inflight_deadline = None if timeout is None else self.clock() + timeout
            self.inflight.append(req)

    def _queue_push(self, req: Req, end: int, is_last: bool) -> None:
        """Prompt tokens ``[req.pd_sent_upto, end)`` for every rank (and with the last
        chunk the Mamba state slot and the window's SWA slots)."""
        start = getattr(req, "pd_sent_upto", 0)
        if end <= start and not is_last:
            return
        row = self.runner.req_to_token_pool.req_to_token[req.req_pool_idx, :end]
        first = getattr(req, "pd_push_id", None) is None
        if first:
            with self._push_lock:
                req.pd_push_id = f"{req.rid}#{next(self._push_serial)}"
                self._pushing[req.pd_push_id] = req
                req.pd_pending, req.pd_transfer_bytes, req.pd_error = set(range(self.tp_size)), 0, None
                req.pd_written = {}  # hand-off position -> heads written per buffer, over the ranks settled
        self._outbox.append(PushChunk(
            req.pd_push_id, start, row[start:].tolist(), is_last, req.mamba_pool_idx if is_last else None,
            self._window_swa_slots(row) if is_last else [], list(req.pd_handoffs) if first else None,
            getattr(req, "pd_dest", ""),
        ))
        req.pd_sent_upto = end

    def _window_swa_slots(self, row: torch.Tensor) -> List[int]:
        """SWA slots of the prompt's last window (``row``: its full slots); read before
        the prompt is cached, as the tree may tombstone them from then on."""
        if not self.swa:
            return []
        window = row[self.tree_cache.window_start(len(row)) :]
        return self.runner.allocator.translate_loc_from_full_to_swa(window).tolist()

    def _flush_pushes(self) -> None:
        """Hand this step's chunks to every rank: rank 0's pusher, then one call to the
        followers, whose reply says which requests they finished (those they could not
        report early); with no chunks, the followers are asked only while a request in
        ``inflight`` waits on one of them."""
        chunks, self._outbox = self._outbox, []
        if chunks:
            self.pusher.submit(chunks)
        if self.tp_size == 1:
            return
        if chunks:
            name, push_ids = "push", {c.push_id for c in chunks}
        elif any(len(req.pd_pending - {0}) for req in self.inflight):
            name, push_ids = "push_status", {req.pd_push_id for req in self.inflight}
        else:
            return
        try:
            replies = self.tp_worker.call_followers(name, chunks or None)
        except Exception as exc:  # a broken TP group: its ranks copy nothing more
            logger.exception("asking the TP followers to push failed")
            replies = [FollowerError(f"{type(exc).__name__}: {exc}")] * (self.tp_size - 1)
        for rank, reply in enumerate(replies, start=1):
            if isinstance(reply, FollowerError):  # its handler raised before queueing anything
                for push_id in push_ids:
                    self._settle(rank, PushResult(push_id, 0, f"KV push failed: {reply.message}"))
                continue
            for result in reply:
                self._settle(rank, result)

    def _settle(self, rank: int, result: PushResult) -> Optional[Req]:
        """Rank ``rank`` is done with the request; returns it (None: cancelled meanwhile)."""
        with self._push_lock:
            req = self._pushing.get(result.push_id)
            if req is None or rank not in req.pd_pending:
                return None
            req.pd_pending.discard(rank)
            req.pd_transfer_bytes += result.moved
            req.pd_error = req.pd_error or result.error
            for i, heads in (result.written or {}).items():
                req.pd_written.setdefault(i, collections.Counter()).update(heads)
            return req

    def on_pushed(self, rank: int, results: List[PushResult]) -> None:
        """Any thread: rank ``rank``'s share of these requests ended. One that no rank still
        pushes is finished and its notice sent now, not after the forward in progress (the
        loop caches it at its next step); with TP > 1 an error waits for the loop, which
        first stops the pushes of a rank settled by a failed call. A result already
        settled, or for a request no longer pushed, is ignored."""
        done = []
        with self._push_lock:
            for result in results:
                req = self._settle(rank, result)
                if req is not None and self._notice_now(req):
                    self._finish_push(req)
                    done.append(req)
        for req in done:
            self._deliver_early(req)

    def _notice_now(self, req: Req) -> bool:
        """Under ``_push_lock``: no rank pushes ``req`` any more and it waits in ``inflight``
        (not an error with TP > 1: a rank settled by a failed call may still be copying)."""
        if self._deliver_early is None or req.pd_pending or not any(r is req for r in self.inflight):
            return False
        return req.pd_error is None or self.tp_size == 1

    def _finish_push(self, req: Req) -> None:
        """Every rank settled: the notice, or the error, a push's or the ranks' shares together not
        writing every decode rank's buffers (their settlement is done: no rank copies any more)."""
        req.pd_transfer_time = time.perf_counter() - req.pd_last_chunk_time  # the part prefill did not hide
        error = req.pd_error = req.pd_error or _unwritten_error(req)
        req.finish({"type": "prefill_done"} if error is None else {"type": "abort", "message": error})

    # ---- inflight --------------------------------------------------------------------
    def _rows_held_elsewhere(self) -> int:
        return len(self.inflight)  # (their rows stay held until every rank's push ended)

    def _process_inflight(self) -> List[Req]:
        """Finish the requests every rank has pushed: notice (or error), then cache the prompt."""
        for result in self.pusher.take_finished():
            self._settle(0, result)
        with self._push_lock:
            expired = self._expire_inflight()
            done = [req for req in self.inflight if not req.pd_pending]
        for req in done:  # a rank settled by an error (its handler failed, or it timed out) may still be
            # copying: stop it before the error notice lets the decode side free the slots
            if req.pd_error is not None and (self.tp_size > 1 or any(r is req for r in expired)):
                self._cancel_pushes(req.pd_push_id)
        with self._push_lock:
            for req in done:
                self._pushing.pop(req.pd_push_id, None)
                if not req.finished:  # (finished: the transfer thread sent its notice already)
                    self._finish_push(req)
                self.push_time += req.pd_transfer_time
                self.bytes_pushed += req.pd_transfer_bytes
        cached = []
        try:  # each leaves ``inflight`` once cached: failing, the rest stay there, finished, for fail_all
            for req in done:
                self.tree_cache.cache_finished_req(req)
                with self._push_lock:
                    self.inflight.remove(req)
                cached.append(req)
        except BaseException:  # those cached are in no queue now: the loop's failure path only tells them
            self._aborted += cached
            raise
        return done

    def _expire_inflight(self) -> List[Req]:
        """Under ``_push_lock``: the requests in ``inflight`` past their deadline whose push
        some rank has not reported yet (a TP follower's report lost on its way, its transfer
        thread gone) — failed: those ranks are settled with the timeout as the error, so a
        late report of theirs is ignored, and the request ends as a failed push does (every
        rank's pushes of it stopped, then the error notice and its release)."""
        if self.waiting_timeout_s is None or not self.inflight:
            return []
        now, expired = self.clock(), []
        for req in self.inflight:
            if req.pd_pending and now >= req.pd_inflight_deadline:
                ranks, req.pd_pending = sorted(req.pd_pending), set()
                req.pd_error = req.pd_error or (f"KV push timed out: TP rank(s) {ranks} did not report the end "
                                                f"of their push within {self.waiting_timeout_s}s")
                logger.error("request %s: %s", req.rid, req.pd_error)
                expired.append(req)
        return expired

    def _cancel_pushes(self, push_id: Optional[str]) -> None:
        """No rank copies the KV of push ``push_id`` (None: any) once this returns."""
        self.pusher.cancel(push_id)
        if self.tp_size > 1:
            try:
                self.tp_worker.call_followers("cancel_push", push_id)
            except Exception:  # a broken TP group: its ranks copy nothing more
                logger.exception("cancelling push %s on the TP followers failed", push_id)
        with self._push_lock:
            for r in [push_id] if push_id is not None else list(self._pushing):
                self._pushing.pop(r, None)

    def abort(self, rid: str, room: Optional[int] = None) -> bool:
        """Stop every rank pushing ``rid`` (waiting for a copy in progress), then end it:
        from ``inflight`` it ends here (its complete prompt cached), otherwise as the
        engine ends it. ``room``: only the attempt whose hand-offs have that room. A
        request that finished already (its notice went out; it is cached at the next
        step) is not the one meant: the id may name a new request by now."""

        def meant(r: Optional[Req]) -> bool:
            return r is not None and r.rid == rid and not r.finished and room in (None, getattr(r, "pd_room", None))

        with self._push_lock:
            push_id = next((k for k, r in self._pushing.items() if meant(r)), None)
        if push_id is not None:
            self._cancel_pushes(push_id)  # (not under _push_lock: it waits for the transfer thread)
        req = next((r for r in self.inflight if meant(r)), None)
        if req is not None:
            with self._push_lock:
                self.inflight.remove(req)
            req.pd_error = "aborted"
            req.finish({"type": "abort", "message": "aborted"})
            try:
                self.tree_cache.cache_finished_req(req)
            finally:  # told even if caching it failed (finished and in no queue, it was never answered)
                self._aborted.append(req)
            return True
        req = next((r for r in self.waiting + [self.chunked_req] if meant(r)), None)
        if req is None:
            return False
        req.pd_error = "aborted"
        return super().abort(rid)  # (the one unfinished request under rid: the engine loop allows no other)

    def fail_all(self, message: str) -> List[Req]:
        """The engine step failed: stop every push; the loop releases what they held
        (those whose notice went out early are finished: released here, as usual)."""
        self._cancel_pushes(None)
        self._outbox = []
        with self._push_lock:
            out, self.inflight = self.inflight, []
        for req in out:
            if req.finished:
                try:
                    self.tree_cache.cache_finished_req(req)
                except Exception:  # keep releasing the others (and return them all: each is told)
                    logger.exception("could not release request %s", req.rid)
        return out


def _unwritten_error(req: Req) -> Optional[str]:
    """Why the decode ranks of ``req`` would not hold all of its KV once every prefill rank pushed
    its share: a buffer of theirs the ranks' shares (``pd_written``) do not cover exactly once — a
    push backend's bytes land unseen by the decode side (shm, CUDA IPC), so this is the count that
    its completion rests on (a pipeline stage's layers missing from the other side's layout). Checked
    against ``pd_expected``, each hand-off's TP rank and :func:`~transfer.plan.expected_heads` read where
    the hand-offs were parsed: parsing them here, under ``_push_lock``, took ms per decode rank at 32k+
    tokens."""
    for i, (tp_rank, expected) in enumerate(req.pd_expected):
        missing = unwritten(expected, req.pd_written.get(i, {}))
        if missing:
            return (f"KV push left {len(missing)} buffers of decode rank {i} (TP rank {tp_rank}) unwritten "
                    f"or written twice: {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''} (the two "
                    "sides' layers do not fit together)")
    return None


def _scored_only(req: Req) -> bool:
    """A prompt scored only (``max_new_tokens`` 0): it has no decode side, so nothing to push."""
    return req.sampling_params.max_new_tokens == 0


__all__ = ["PrefillScheduler"]
