"""The engine scheduler in its two disaggregated roles: decode here, prefill in
``actors.pd_prefill``.

Decode (``DecodeScheduler``), queues in the order a request moves (SGLang's
``DecodePreallocQueue`` → ``DecodeTransferQueue`` → running)::

    prealloc   waiting for a request row and KV slots for its prompt, with a
               reserve of ``num_reserved_decode_tokens`` counted as taken
    transfer   slots reserved, hand-off sent; waiting for the completion notice
               (the first token) and for the bytes to land — or a timeout
    running    the continuous decode batch; retraction under KV pressure sends a
               request to ``waiting``, from where it is re-prefilled locally

Slot bookkeeping of a decode request in transfer (positions in its row)::

    [0, prefix_len)             matched in the decode worker's own tree, locked
    [prefix_len, prompt_len)    its own slots; the prefill side writes them

A sliding-window model's reservation takes full slots for
``[prefix_len, prompt_len)`` but SWA slots only for
``[max(prefix_len, window_start), prompt_len)``: the tokens before are outside
the window at the prompt's end (``swa_evicted_seqlen``; the engine frees their
SWA half right after a prefill), so a prompt longer than the SWA pool fits.
The hand-off names the SWA slots of that window.

A hybrid (Mamba) model's prefix is matched for its attention KV only
(``MambaRadixCache.match_kv_prefix``) and locked KV-only: the prefill side
pushes the prompt's final Mamba state whole into the request's own slot, so
no cached state is read here, and the prefix may reach past the deepest
state the tree holds (a tombstone). The finished request inserts its own
state at its end, as in the engine.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional

import torch

from actors.engine.finish import check_finished, stream_text
from actors.engine.req import Req
from actors.engine.sampling import make_generator
from actors.engine.schedule_batch import _alloc_rows, _alloc_with_eviction
from actors.engine.scheduler import Scheduler
from actors.engine.tp_worker import FollowerError
from mem_cache.kv_events import ReuseRule
from mem_cache.radix_key import RadixKey
from transfer.base import KVPoll, KVReceiver, TransferAgent, TransferError

logger = logging.getLogger(__name__)


class PDRequestError(RuntimeError):
    """A disaggregated request failed (transfer, timeout, abort); its slots are freed."""


class WorkerBrokenError(RuntimeError):
    """The worker can no longer serve (one of its TP ranks is gone): treat it as dead."""


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


# ---- decode ------------------------------------------------------------------------------
class DecodeScheduler(Scheduler):
    """``agents``: rank 0's transfer agent per backend name; ``tp_worker``: the
    rank-0 TPModelWorker, whose followers build their own hand-offs ("expect")
    and confirm their bytes landed ("land")."""

    def __init__(self, runner, tokenizer, agents: Dict[str, TransferAgent], tp_worker=None,
                 num_reserved_decode_tokens: int = 512, waiting_timeout_s: Optional[float] = 300.0):
        super().__init__(runner, tokenizer)
        self.agents, self.tp_worker = agents, tp_worker
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
        self.prealloc.append(req)

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

    def _decoding_reqs(self) -> List[Req]:
        return self.running + self.transfer

    # ---- pre-allocation --------------------------------------------------------------
    def _process_prealloc(self) -> List[Req]:
        """Reserve for the queue's head while it fits. Not while a retracted request waits
        (``waiting`` holds nothing else here): it was decoding before any of these arrived,
        and the room that frees is its first (SGLang's decode resumes its retracted queue
        before it pre-allocates); the engine's prefill re-admits it, in chunks as the
        ``chunked_req`` (on this side only a retracted request prefills)."""
        done: List[Req] = []
        try:
            while self.prealloc and not self.waiting and self.chunked_req is None:
                req = self.prealloc[0]
                if len(self.running) + len(self.transfer) >= self.runner.max_running_requests:
                    break
                if not self._reserve(req):
                    break
                self.prealloc.pop(0)
                if not req.finished:
                    self.transfer.append(req)
                done.append(req)
        except BaseException:  # those dropped before the failure are released: only told
            self._aborted += [r for r in done if r.finished]
            raise
        return done

    def _rows_held_elsewhere(self) -> int:
        return len(self.transfer) + len(self.quarantine)  # reserved, their KV moving or maybe still landing

    def _reserve(self, req: Req) -> bool:
        """Row + slots for the prompt beyond the decode tree's own prefix; False with nothing taken."""
        prompt_len = len(req.origin_input_ids)
        self._match_reserved_prefix(req)
        prefix_len = len(req.prefix_indices)
        self._lock(req)  # first: the room it leaves is what the prompt can have (its prefix is not evictable)
        try:  # a failure below (a host-tier load, the allocator) gives back the lock and the row with it
            taken = self._fits(req, prefix_len, prompt_len)  # (a host-tier part of the prefix counts as new slots)
            if taken:
                self._load_reserved_host_prefix(req)
                prefix_len = len(req.prefix_indices)
                taken = self._alloc_prompt(req, prefix_len, prompt_len)
        except BaseException:
            self._unlock(req)
            raise
        if not taken:
            self._unlock(req)
            return False
        req.cache_protected_len = prefix_len
        req.kv_allocated_len = prompt_len
        req.cached_tokens = prefix_len
        if self.swa:  # [prefix_len, split) took no SWA slots (see _alloc_swa_prompt)
            req.swa_evicted_seqlen = self._swa_split(prefix_len, prompt_len)
        if self.hybrid and self.runner.device.type == "cuda":  # the state slot's zeroing is done before
            torch.cuda.current_stream(self.runner.device).synchronize()  # the prefill side may write it
        try:
            self._make_handoffs(req, prefix_len, prompt_len)
        except Exception as exc:  # no hand-off went out: nobody can write these slots, free them now
            logger.exception("could not set up the KV transfer of %s", req.rid)
            self._drop(req, f"could not set up the KV transfer: {exc}", safe=True)
            return True
        req.pd_state = "transfer"
        return True

    def _load_reserved_host_prefix(self, req: Req) -> None:
        """A taken reservation's host-tier part of the prefix comes back (only now, see the
        engine's ``_load_host_prefix``), at once: no forward of this request's to overlap it
        with. A load that fails costs that part, not the step: the request's prefix is matched
        again on the device only (slots the failed copy left without KV have left it at the
        unlock), and the prefill side pushes the rest."""
        self._load_host_prefix(req)
        if not self.host_tier:
            return
        self.tree_cache.loading_check(raise_failed=False)
        failed = self.tree_cache.take_failed_loads()
        if failed is None:
            return
        logger.error("loading %s's prefix from the host tier failed (%s); matching it on the device only",
                     req.rid, failed.error)
        old = req.last_node
        req.host_load_failed = True  # (its host part is not loaded again)
        self._match_reserved_prefix(req)
        req.host_hit_length, req.last_host_node = 0, None
        self._lock(req)  # the new path first: the old one stays locked all along
        self.tree_cache.dec_lock_ref(old)  # (a host tier means a plain tree: no SWA or state locks)

    def reuse_rule(self) -> ReuseRule:
        """A hybrid model's reservation reads the attention KV of any cached prefix."""
        return ReuseRule() if self.hybrid else super().reuse_rule()

    def _match_reserved_prefix(self, req: Req) -> None:
        """The decode tree's prefix of the prompt; a hybrid model's for the attention KV
        only (its Mamba state comes from the prefill side), under a KV-only lock."""
        if not self.hybrid:
            self._match_prefix(req, admit=True)  # with a host tier, its part of the prefix is loaded back once taken
            return
        req.fill_ids = req.all_ids()
        match = self.tree_cache.match_kv_prefix(RadixKey(req.fill_ids, req.extra_key), req=req)
        req.prefix_indices, req.last_node = match.device_indices, match.last_device_node
        req.cache_protected_len, req.kv_only_lock = len(req.prefix_indices), True

    def _fits(self, req: Req, prefix_len: int, prompt_len: int) -> bool:
        """Room for the uncached prompt plus the request's decode reserve, after what the
        running and transferring requests will still need. A sliding-window model needs
        SWA slots only for the part of the prompt in its last window. Paged, the prompt's
        slots are whole pages, as the allocator takes them, and so is its reserve: the pages its
        first ``num_reserved_decode_tokens`` new tokens fill after the prompt (each request's own,
        as the engine counts the running and transferring requests')."""
        reserved_tokens = min(self.num_reserved_decode_tokens, req.sampling_params.max_new_tokens)
        reserve = self._paged_after(prompt_len, reserved_tokens)
        full, swa = self._prefill_room()
        if self._paged_after(prefix_len, prompt_len - prefix_len) + reserve + self.page_size > full:
            return False
        if swa is None:
            return True
        split = self._swa_split(prefix_len, prompt_len)
        return self._paged_after(split, prompt_len - split) + self._swa_reserve(reserve) + self.page_size <= swa

    def _swa_split(self, prefix_len: int, prompt_len: int) -> int:
        """Where the uncached prompt's last window begins: the tokens before it are out of
        the window already (the engine frees their SWA KV right after a prefill)."""
        return max(prefix_len, self.tree_cache.window_start(prompt_len))

    def _alloc_swa_prompt(self, prefix_len: int, prompt_len: int) -> Optional[torch.Tensor]:
        """Full slots for ``[prefix_len, prompt_len)``, SWA slots for its last window only —
        a prompt longer than the SWA pool fits, and no cached SWA KV is evicted for tokens
        whose SWA half would be freed at once. Paged, ``split`` is a page boundary
        (``window_start``), so both parts are whole pages but the window's last."""
        alloc, tree = self.runner.allocator, self.tree_cache
        split = self._swa_split(prefix_len, prompt_len)
        full_need, swa_need = prompt_len - prefix_len, prompt_len - split
        if full_need > alloc.full_available_size() or swa_need > alloc.swa_available_size():
            tree.evict(max(0, full_need - alloc.full_available_size()), max(0, swa_need - alloc.swa_available_size()))
        outside = alloc.alloc_without_swa(split - prefix_len)
        if outside is None:
            return None
        split_t, seq_t = torch.tensor([split]), torch.tensor([prompt_len])  # split: a page boundary, no last_loc read
        window = alloc.alloc_extend(
            split_t.to(alloc.device), seq_t.to(alloc.device), torch.tensor([-1], device=alloc.device), swa_need,
            prefix_lens_cpu=split_t, seq_lens_cpu=seq_t,
        )
        if window is None:
            alloc.free(outside)
            return None
        return torch.cat([outside, window])

    def _alloc_prompt(self, req: Req, prefix_len: int, prompt_len: int) -> bool:
        runner, pool, allocator = self.runner, self.runner.req_to_token_pool, self.runner.allocator
        rows = _alloc_rows(pool, [req], self.tree_cache)
        if rows is None:
            return False
        req.req_pool_idx = rows[0]
        out = None
        try:
            if self.hybrid:
                req.mamba_pool_idx = int(pool.get_mamba_indices(req.req_pool_idx)[0])
            pool.write((req.req_pool_idx, slice(0, prefix_len)), req.prefix_indices.to(torch.int32))
            last_loc = int(pool.req_to_token[req.req_pool_idx, prefix_len - 1]) if prefix_len else -1
            n = prompt_len - prefix_len
            prefix_t, seq_t = torch.tensor([prefix_len]), torch.tensor([prompt_len])
            out = self._alloc_swa_prompt(prefix_len, prompt_len) if self.swa else _alloc_with_eviction(
                self.tree_cache, allocator,
                lambda: allocator.alloc_extend(
                    prefix_t.to(runner.device), seq_t.to(runner.device), runner.tensor([last_loc]), n,
                    prefix_lens_cpu=prefix_t, seq_lens_cpu=seq_t,
                ),
                n + self.page_size,
            )
            if out is None:
                self._free_row(req)
                return False
            pool.write((req.req_pool_idx, slice(prefix_len, prompt_len)), out.to(torch.int32))
        except BaseException:
            if out is not None:
                allocator.free(out)
            self._free_row(req)
            raise
        return True

    def _free_row(self, req: Req) -> None:
        """The row of a reservation not taken, with its Mamba slot."""
        self.runner.req_to_token_pool.free([req.req_pool_idx])
        req.req_pool_idx, req.mamba_pool_idx = None, None

    def _make_handoffs(self, req: Req, prefix_len: int, prompt_len: int) -> None:
        """One hand-off per decode rank: the same slots (every rank allocates alike),
        each rank's own layout, endpoint and receiver."""
        row = self.runner.req_to_token_pool.req_to_token[req.req_pool_idx]
        dst = row[prefix_len:prompt_len].tolist()
        dst_swa = []
        if self.swa:  # [swa_evicted_seqlen, prompt_len): the window's tokens this side does not hold
            window = row[req.swa_evicted_seqlen : prompt_len]
            dst_swa = self.runner.allocator.translate_loc_from_full_to_swa(window).tolist()
        agent = self.agents[req.pd_backend]
        req.pd_receiver = KVReceiver(agent, req.rid, req.pd_room, timeout_s=self.waiting_timeout_s)
        handoffs = [req.pd_receiver.send_metadata(dst, req.mamba_pool_idx, prefix_len, dst_swa).to_bytes()]
        if self.has_followers:
            payload = (req.rid, req.pd_room, req.pd_backend, dst, req.mamba_pool_idx, prefix_len, dst_swa)
            for reply in self.tp_worker.call_followers("expect", payload):
                if isinstance(reply, FollowerError):
                    raise TransferError(reply.message)
                handoffs.append(reply)
        req.pd_handoffs = handoffs

    # ---- transfers -----------------------------------------------------------------------
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
        for req in landed:
            if req.rid in errors and errors[req.rid] is None:
                continue  # a follower's share is still on its way
            done.append(req)
            if req.rid in errors:
                self._transfer_failed(req, errors[req.rid])
            else:
                self.backend_counts[req.pd_backend] = self.backend_counts.get(req.pd_backend, 0) + 1
                self.transfer.remove(req)
                self._start_decoding(req)

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

    def _start_decoding(self, req: Req) -> None:
        """Take the notice, then join the running batch — or, ended by its first token, be
        cached. A notice it cannot take fails this request alone (dropped: its row and slots go
        back). A failure caching it is the engine's own and fails the step, as in a decode batch;
        it is never retried as a drop's release: its frees may have been made."""
        try:
            self._take_notice(req, req.pd_notice)
        except Exception as exc:  # a notice it cannot take fails this request, not the step
            logger.exception("could not start decoding %s", req.rid)
            self._drop(req, f"bad completion notice from the prefill side: {exc!r}", safe=True)
            return
        if req.finished:
            self.tree_cache.cache_finished_req(req)
        else:
            self.running.append(req)

    def _take_notice(self, req: Req, notice: dict) -> None:
        """The first token and the sampler's state from the prefill side; whether it ended."""
        req.kv_committed_len = len(req.origin_input_ids)
        req.output_ids.append(int(notice["first_token"]))
        if notice.get("generator_state") and req.sampling_params.seed is not None:  # on this side's device
            req.generator = make_generator(req.sampling_params.seed, self.runner.device)
            req.generator.set_state(torch.frombuffer(bytearray(notice["generator_state"]), dtype=torch.uint8))
        if notice.get("logprob") is not None:
            req.output_logprobs.append(notice["logprob"])
            if notice.get("top_logprobs") is not None:
                req.output_top_logprobs.append([tuple(x) for x in notice["top_logprobs"]])
        req.first_token_time = time.perf_counter()
        req.pd_state = "running"
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


__all__ = ["DecodeScheduler", "PDRequestError", "WorkerBrokenError", "is_worker_death"]
