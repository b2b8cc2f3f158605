"""The engine scheduler in its two disaggregated roles: decode here, prefill in
``actors.pd_prefill``.

Decode (``DecodeScheduler``), queues in the order a request moves (SGLang's
``DecodePreallocQueue`` → ``DecodeTransferQueue`` → running)::

    prealloc   waiting for a request row and KV slots for its prompt, with a
               reserve of ``num_reserved_decode_tokens`` counted as taken
    transfer   slots reserved, hand-off sent; waiting for the completion notice
               (the first token) and for the bytes to land — or a timeout
    running    the continuous decode batch; retraction under KV pressure, or for a
               reservation of a much higher priority, sends a request to ``waiting``,
               from where it is re-prefilled locally

Where the parts live (SGLang's split of ``disaggregation/decode.py``): the
reservations, with their slot bookkeeping for sliding-window and hybrid
models, in :mod:`actors.pd_decode_prealloc` (:class:`DecodePreallocMixin`);
the transfers, drops and quarantine in :mod:`actors.pd_decode_transfer`
(:class:`DecodeTransferMixin`); the queues' entry, the step, the engine's
hooks and aborts here.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

from actors.engine.req import Req
from actors.engine.scheduler import Scheduler
from actors.pd_decode_prealloc import DecodePreallocMixin
from actors.pd_decode_transfer import DecodeTransferMixin
from mem_cache.kv_events import ReuseRule
from transfer.base import TransferAgent

logger = logging.getLogger(__name__)


class PDRequestError(RuntimeError):
    """A disaggregated request failed (transfer, timeout, abort); its slots are freed."""


class WorkerBrokenError(RuntimeError):
    """The worker can no longer serve (one of its TP ranks is gone, a KV push lane broken): its
    requests go elsewhere, as a dead worker's; but its process lives, so the client and the router
    take it out of the rotation without taking it for dead (:func:`worker_broken`)."""


def is_worker_death(exc: BaseException) -> bool:
    """A dead actor, or a worker that reports itself broken (also through a RayTaskError). An
    actor only *unavailable* (Ray's ActorUnavailableError, a RayActorError: "may be available
    later", a network blip) is not dead: heartbeats decide."""
    try:
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
    except ImportError:  # pragma: no cover - ray is a dependency
        return isinstance(exc, WorkerBrokenError)
    if isinstance(exc, RayTaskError):
        exc = exc.as_instanceof_cause()
    if isinstance(exc, ActorUnavailableError):
        return False
    return isinstance(exc, (RayActorError, WorkerBrokenError))


def worker_broken(exc: BaseException) -> Optional[WorkerBrokenError]:
    """The ``WorkerBrokenError`` a failed call carries (itself, or as a RayTaskError's cause), or
    None. Its process lives — it may still hold a push — so a heartbeat that finds it takes the
    worker out of the rotation without taking it for a dead actor."""
    from ray.exceptions import RayTaskError

    cause = exc.as_instanceof_cause() if isinstance(exc, RayTaskError) else exc
    return cause if isinstance(cause, WorkerBrokenError) else None


# ---- decode ------------------------------------------------------------------------------
class DecodeScheduler(DecodePreallocMixin, DecodeTransferMixin, Scheduler):
    """``agents``: rank 0's transfer agent per backend name; ``tp_worker``: the
    rank-0 TPModelWorker, whose followers build their own hand-offs ("expect")
    and confirm their bytes landed ("land")."""

    def __init__(self, runner, tokenizer, agents: Dict[str, TransferAgent], tp_worker=None,
                 num_reserved_decode_tokens: int = 512, waiting_timeout_s: Optional[float] = 300.0):
        super().__init__(runner, tokenizer)
        self.agents, self.tp_worker = agents, tp_worker
        self.pp_micro_batches = 1  # (a KV hand-off follows its batch's forward: one batch in flight)
        self.has_followers = tp_worker is not None and tp_worker.tp.size > 1
        self.num_reserved_decode_tokens = num_reserved_decode_tokens
        self.waiting_timeout_s = waiting_timeout_s
        self.prealloc: List[Req] = []
        self.transfer: List[Req] = []
        self._notices: Dict[str, dict] = {}
        self.num_transfer_failures = 0
        # (release time, request): dropped reservations a late push could still write
        self.quarantine: List = []
        self.quarantine_grace_s = min(10.0, waiting_timeout_s or 10.0)
        self.backend_counts: Dict[str, int] = {}

    # ---- queues --------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        req.pd_state = "prealloc"
        self.policy.enqueue(self.prealloc, req)

    def has_work(self) -> bool:
        return bool(self.prealloc or self.transfer or self.quarantine) or super().has_work()

    def _live(self, rid: str) -> Optional[Req]:
        """The unfinished request under ``rid``, wherever it is (the engine loop allows one)."""
        queued = self.prealloc + self.transfer + self.running + self.waiting
        return next((r for r in queued + [self.chunked_req] if r is not None and r.rid == rid and not r.finished), None)

    def live_room(self, rid: str) -> Optional[int]:
        """The room of the unfinished request under ``rid`` (None: there is none)."""
        return getattr(self._live(rid), "pd_room", None)

    def on_transfer_done(self, rid: str, notice: dict) -> bool:
        """The prefill side's completion notice (first token, its finish state), for the
        attempt whose hand-offs carried the notice's ``room``."""
        if any(r.rid == rid and notice.get("room") in (None, r.pd_room) for r in self.transfer):
            self._notices[rid] = notice
            return True
        return False

    def step(self) -> List[Req]:
        produced: List[Req] = []
        try:
            self._release_quarantine()
            produced += self._process_prealloc()
            produced += self._process_transfers()
            self.progressed = bool(produced)
            before = self.runner.num_forwards
            produced += super().step()
        except BaseException:  # those that ended here (released) are told by the loop's failure path
            self._aborted[:0] = [r for r in produced if r.finished]
            raise
        self.progressed = self.progressed or self.runner.num_forwards != before or bool(produced)
        return produced

    # ---- the engine's hooks ------------------------------------------------------------
    def check_request(self, req: Req) -> None:
        """A prompt scored only (``max_new_tokens`` 0) is the prefill worker's alone
        (``PrefillWorker.prefill_only``): it never reserves here."""
        if req.sampling_params.max_new_tokens == 0:
            raise ValueError("max_new_tokens 0 (a prompt scored only) runs on the prefill worker alone: "
                             "nothing to decode")
        super().check_request(req)

    def _decoding_reqs(self) -> List[Req]:
        return self.running + self.transfer

    def _rows_held_elsewhere(self) -> int:
        return len(self.transfer) + len(self.quarantine)  # reserved, their KV moving or maybe still landing

    def reuse_rule(self) -> ReuseRule:
        """A hybrid model's reservation reads the attention KV of any cached prefix."""
        return ReuseRule() if self.hybrid else super().reuse_rule()

    # ---- abort ---------------------------------------------------------------------------
    def abort(self, rid: str, message: str = "aborted", safe: bool = False, room: Optional[int] = None) -> bool:
        """``safe``: the caller knows no prefill rank will write this request's slots
        (then a reservation already dropped into quarantine goes back at once too).
        ``room``: only the attempt reserved with that room. Without it, the request in
        flight under ``rid`` comes first: a quarantined one of the same id is an earlier
        request (the client sent the id again), whose late push may still come — it goes
        back on a safe abort only when no request holds the id."""

        def meant(req: Req) -> bool:
            return req.rid == rid and room in (None, getattr(req, "pd_room", None))

        live = self._live(rid)
        if live is not None and meant(live):
            self._abort_live(live, message, safe)
            return True
        if safe:
            for i, (_, req) in enumerate(self.quarantine):
                if meant(req):
                    del self.quarantine[i]
                    self._release(req)
                    return True
        return False

    def _abort_live(self, req: Req, message: str, safe: bool) -> None:
        if req in self.prealloc:
            self.prealloc.remove(req)
            req.pd_error = message
            req.finish({"type": "abort", "message": message})
            self._aborted.append(req)
        elif req in self.transfer:
            self.transfer.remove(req)
            try:
                self._drop(req, message, safe=safe)
            finally:  # told even if giving back its slots failed (finished, in no queue)
                self._aborted.append(req)
        else:  # decoding, or retracted to ``waiting``
            super().abort(req.rid)

    def fail_all(self, message: str) -> List[Req]:
        """Every queued request ends with ``message`` and is returned, to be told; a reservation's
        slots go back (its completion notice came: no rank writes them any more) or into
        quarantine (see ``_drop``). The queues are emptied first, and a
        failure giving back one request's slots ends no other's."""
        prealloc, transfer = self.prealloc, self.transfer
        self.prealloc, self.transfer = [], []
        for req in prealloc:
            req.pd_error = message
            req.finish({"type": "abort", "message": message})
        for req in transfer:  # with its notice taken or waiting, every prefill rank has ended its push
            notified = getattr(req, "pd_notice", None) is not None or req.rid in self._notices
            try:
                self._drop(req, message, safe=notified)
            except Exception:  # finished already: told, never released again (the idle check sees a leak)
                logger.exception("could not release request %s", req.rid)
        return prealloc + transfer


__all__ = ["DecodeScheduler", "PDRequestError", "WorkerBrokenError", "is_worker_death", "worker_broken"]
