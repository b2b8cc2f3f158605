"""The decode side's transfers and how a reservation ends (SGLang's
``DecodeTransferQueue``), a mixin of :class:`~actors.pd_scheduler.DecodeScheduler`.

A reserved request waits in ``transfer`` for the prefill side's completion
notice (its first token, through ``on_transfer_done``) and for its bytes to
land on every rank — or a timeout. Landed, it takes the notice and joins the
running batch (or, ended by its first token, is cached); failed, it is
dropped. A dropped reservation's slots go back at once when no prefill rank
can write them any more; otherwise they wait in ``quarantine`` until the
hand-off's deadline plus ``quarantine_grace_s``: a late push must never land
in another request's KV.

The mixin reads the scheduler's ``runner``, ``tree_cache``, ``tokenizer``,
``context_len``, queues (``transfer``, ``running``, ``quarantine``,
``_aborted``), the notices taken (``_notices``), ``tp_worker`` and
``has_followers``; it counts in ``backend_counts`` and
``num_transfer_failures``, and gives back a lone Mamba slot with the engine's
``free_mamba_copy`` (:mod:`actors.engine.schedule_policy`).
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional

import torch

from actors.engine.finish import check_finished, stream_text
from actors.engine.req import Req
from actors.engine.sampling import make_generator
from actors.engine.tp_worker import FollowerError
from transfer.base import KVPoll, KVReceiver

logger = logging.getLogger("actors.pd_scheduler")


class DecodeTransferMixin:
    """The ``transfer`` queue (``_process_transfers``), and drops, releases and quarantine."""

    def _process_transfers(self) -> List[Req]:
        """Poll every transfer, never blocking on bytes in flight. A request whose share
        landed on rank 0 waits for the followers' shares: one "land" call per step asks
        about all of them (a follower's own receiver times out ``land_timeout_s`` after
        its first question, as rank 0's does after the notice)."""
        done: List[Req] = []
        try:
            self._poll_transfers(done)
        except BaseException:  # those that ended before the failure are released: only told
            self._aborted += [r for r in done if r.finished]
            raise
        return done

    def _poll_transfers(self, done: List[Req]) -> None:
        landed: List[Req] = []  # rank 0's share is in its pools
        for req in list(self.transfer):
            receiver: KVReceiver = req.pd_receiver
            notice = self._notices.pop(req.rid, None)
            if notice is not None:
                req.pd_notice = notice
                receiver.mark_done()
            state = receiver.poll()
            if state == KVPoll.Success:
                landed.append(req)
            elif state == KVPoll.Failed:
                done.append(req)  # (first, here and below: told even if giving back its slots fails)
                self._transfer_failed(req, receiver.failure_reason())
        errors = self._land_on_followers(landed) if self.has_followers and landed else {}
        started: List[Req] = []
        for req in landed:
            if req.rid in errors and errors[req.rid] is None:
                continue  # a follower's share is still on its way
            done.append(req)
            if req.rid in errors:
                self._transfer_failed(req, errors[req.rid])
            else:
                self.backend_counts[req.pd_backend] = self.backend_counts.get(req.pd_backend, 0) + 1
                self.transfer.remove(req)
                if self._took_notice(req):
                    started.append(req)
        self._start_decoding(started)

    def _transfer_failed(self, req: Req, error: str) -> None:
        self.transfer.remove(req)
        self.num_transfer_failures += 1
        # after the notice every prefill rank has finished pushing: nothing can write these slots
        self._drop(req, f"KV transfer failed: {error}", safe=getattr(req, "pd_notice", None) is not None)

    def _land_on_followers(self, reqs: List[Req]) -> Dict[str, Optional[str]]:
        """``{rid: error}`` for the requests a follower failed, ``{rid: None}`` for those
        some follower is still receiving; absent: every rank holds its share."""
        out: Dict[str, Optional[str]] = {}
        rids = [req.rid for req in reqs]
        for reply in self.tp_worker.call_followers("land", rids):
            if isinstance(reply, FollowerError):  # its handler raised: none of its shares is known
                return {rid: reply.message for rid in rids}
            for rid in rids:
                if rid not in reply:
                    out.setdefault(rid, None)
                elif reply[rid] is not None:
                    out[rid] = reply[rid]
        return out

    def _took_notice(self, req: Req) -> bool:
        """Whether ``req`` took its notice: one it cannot take fails this request alone (dropped:
        its row and slots go back), not the step."""
        try:
            self._take_notice(req, req.pd_notice)
        except Exception as exc:
            logger.exception("could not start decoding %s", req.rid)
            self._drop(req, f"bad completion notice from the prefill side: {exc!r}", safe=True)
            return False
        return True

    def _start_decoding(self, reqs: List[Req]) -> None:
        """Requests that took their notice join the running batch — or, ended by their first token,
        are cached; with a draft model, once one forward of it wrote their prompts' draft KV (every
        committed slot has both KVs; the requests of a step together, as a prefill batch). A failure
        caching one is the engine's own and fails the step, as in a decode batch; it is never
        retried as a drop's release: its frees may have been made."""
        if self.runner.draft is not None and reqs:
            self.runner.draft.prefill(reqs, self.runner.req_to_token_pool)
        for req in reqs:
            if req.finished:
                self.tree_cache.cache_finished_req(req)
            else:
                self.running.append(req)

    def _take_notice(self, req: Req, notice: dict) -> None:
        """The first token (its grammar, if any, takes it: the prefill side's matcher did) and the
        sampler's state from the prefill side, and the prompt's logprobs it computed; whether it
        ended."""
        req.kv_committed_len = len(req.origin_input_ids)
        req.first_token_time = time.perf_counter()
        req.pd_state = "running"
        if notice.get("input_token_logprobs") is not None:
            req.input_token_logprobs = list(notice["input_token_logprobs"])
            req.input_token_ranks = list(notice["input_token_ranks"])
            req.input_top_logprobs = [[tuple(x) for x in top] for top in notice.get("input_top_logprobs") or []]
        req.append_token(int(notice["first_token"]))
        if notice.get("generator_state") and req.sampling_params.seed is not None:  # on this side's device
            req.generator = make_generator(req.sampling_params.seed, self.runner.device)
            req.generator.set_state(torch.frombuffer(bytearray(notice["generator_state"]), dtype=torch.uint8))
        if notice.get("logprob") is not None:
            req.output_logprobs.append(notice["logprob"])
            if notice.get("top_logprobs") is not None:
                req.output_top_logprobs.append([tuple(x) for x in notice["top_logprobs"]])
        stream_text(req, self.tokenizer)
        check_finished(req, self.tokenizer, self.context_len)

    def _drop(self, req: Req, message: str, safe: bool) -> None:
        """End a reserved request. ``safe``: no prefill rank can write its slots any more
        (nothing was handed off, the prefill side confirmed, or it is dead; or its backend
        lands bytes only on this side, which the abort below stops), so they go back now;
        otherwise they stay quarantined until the hand-off's deadline plus a grace period
        has passed — a late push must never land in another request's KV."""
        self._notices.pop(req.rid, None)
        receiver = getattr(req, "pd_receiver", None)
        if receiver is not None:
            receiver.abort(message)
            if self.has_followers:
                try:
                    self.tp_worker.call_followers("cancel", req.rid)
                except Exception:  # a broken TP group: its ranks take nothing more
                    logger.exception("cancelling %s on the TP followers failed", req.rid)
        req.pd_error = message
        req.finish({"type": "abort", "message": message})
        deadline = receiver.handoff.deadline if receiver is not None and receiver.handoff is not None else None
        if safe or deadline is None or not receiver.agent.writes_in_place:
            self._release(req)
        else:
            self.quarantine.append((deadline + self.quarantine_grace_s, req))

    def _release(self, req: Req) -> None:
        """Give back the row (its slots, its prefix lock) or the lone Mamba slot of ``req``, at
        most once: a release that fails partway is not tried again — its frees may have been
        made, and a row or slot freed twice could go to two requests at once."""
        try:
            if req.req_pool_idx is not None:
                req.kv_committed_len = req.kv_allocated_len
                self.tree_cache.cache_finished_req(req, is_insert=False)
            else:
                self.free_mamba_copy(req)
        finally:
            req.req_pool_idx, req.mamba_pool_idx = None, None

    def _release_quarantine(self, force: bool = False) -> None:
        now = time.time()
        keep = []
        for release_at, req in self.quarantine:
            if force or now >= release_at:
                self._release(req)
            else:
                keep.append((release_at, req))
        self.quarantine = keep
