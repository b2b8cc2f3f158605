"""Admission: which waiting requests the next prefill batch takes (SGLang's
``schedule_policy.py`` and its ``PrefillAdder``), mixed into the engine's
:class:`~actors.engine.scheduler.Scheduler`.

A prefill is admitted only if its tokens plus a reserve for the running
requests' future decode tokens (``remaining max_new_tokens ×
new_token_ratio``, each request's in the whole pages they fill after its own
KV) fit in free + evictable slots (for a sliding-window model, also in its
SWA pool); a long prompt is cut into
``chunked_prefill_size`` chunks. A hybrid model's request also needs its Mamba
state slots (free or evictable); one whose cached state cannot be copied (every
slot held) waits, as for any failed allocation.

Candidates are tried in the order of the scheduler's ``policy``
(:mod:`actors.engine.schedule_order`); with priority scheduling a request that
finds no row, room or state slot may preempt running requests of a much lower
priority (:mod:`actors.engine.preemption`). A request whose LoRA adapter finds no device
slot free of the running requests' adapters waits (:meth:`PrefillAdmissionMixin._lora_slot`).

The mixin reads the scheduler's ``runner``, ``config``, ``tree_cache``,
``page_size``, queues (``waiting``, ``running``, ``chunked_req``),
``new_token_ratio`` and ``policy``; the disaggregated roles override ``_request_reserve``
and ``_decoding_reqs``.
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional, Tuple

import torch

from actors.engine.preemption import PreemptionMixin, Room
from actors.engine.req import Req
from actors.engine.schedule_batch import prepare_for_extend
from mem_cache.kv_events import ReuseRule
from mem_cache.radix_key import RadixKey

logger = logging.getLogger(__name__)


class PrefillAdmissionMixin(PreemptionMixin):
    """Waiting requests, the room they may take, and the next prefill batch (``_next_prefill``)."""

    def add_request(self, req: Req) -> None:
        if self.file_tier:  # its pages come from storage while it waits (SGLang prefetches at arrival)
            key = RadixKey(req.all_ids()[:-1], req.extra_key)
            try:
                req.prefetch_op = self.tree_cache.start_prefetch(key)
            except Exception:  # (the other TP ranks could not be asked) it costs the hit, not the request
                logger.exception("could not start the storage prefetch of %s", req.rid)
                req.prefetch_op = None
            if req.prefetch_op is not None:  # what it covers; admission asks storage for the rest itself
                req.storage_checked_len = req.prefetch_op.asked_len
        self.waiting.append(req)

    def _prefetch_ready(self, req: Req) -> bool:
        """Whether admission may end the request's prefetch now (the policy's call)."""
        op, policy = req.prefetch_op, self.config.hicache_storage_prefetch_policy
        if policy == "best_effort" or op.done.is_set():
            return True
        if policy == "timeout":
            return time.monotonic() - op.started_at >= self.config.hicache_storage_prefetch_timeout_s
        return False

    def end_orphan_prefetches(self) -> None:
        """End the prefetches whose request left the queue (aborted, failed): what they read
        stays in the host tier."""
        ops = getattr(self.tree_cache, "prefetch_ops", None)
        if not ops:
            return
        live = {id(r.prefetch_op) for r in self.waiting if r.prefetch_op is not None}
        for op in [op for op in ops if id(op) not in live]:
            self.tree_cache.finish_prefetch(op)

    def evictable_tokens(self) -> int:
        """Cached KV slots eviction can free (with the host tier, also those only backups in
        flight lock: eviction waits for them)."""
        tree = self.tree_cache
        if self.hybrid or self.swa:
            return tree.full_evictable_size()
        return tree.evictable_size() + (tree.writing_size() if self.host_tier else 0)

    def cancel_prefetches(self) -> None:
        """End every storage prefetch in flight, keeping nothing: the waiting requests ask storage
        anew at admission (a weight update's: the pages read so far are of the old weights)."""
        self.tree_cache.cancel_prefetches()
        for req in self.waiting:
            req.prefetch_op, req.storage_checked_len = None, 0

    def drop_prefix_cache(self) -> None:
        """Evict every cached prefix, with a host tier its copies too (SGLang's flush: evicted from the
        device only, a prefix would be loaded back from the host); a file tier keeps its pages. The
        caller makes sure no request holds KV (a locked prefix stays)."""
        tree = self.tree_cache
        tree.evict(self.evictable_tokens())
        if self.host_tier:
            tree.evict_host(tree.host_pool.size)

    def available_tokens(self) -> int:
        """Free + evictable KV slots; a sliding-window model is bounded by the smaller of
        its two pools (every token of a prefill takes a full and an SWA slot)."""
        alloc, tree = self.runner.allocator, self.tree_cache
        if self.swa:
            full = alloc.full_available_size() + tree.full_evictable_size()
            return min(full, alloc.swa_available_size() + tree.swa_evictable_size())
        return alloc.available_size() + self.evictable_tokens()

    def total_tokens(self) -> int:
        """KV slots of the pool; a sliding-window model's, the smaller of its two pools."""
        alloc = self.runner.allocator
        if self.swa:
            return min(alloc.size, alloc.size_swa)
        return alloc.num_pages * alloc.page_size

    def _lock(self, req: Req) -> None:
        if self.swa:  # which node ends the lock's SWA window: dec_lock_ref needs it back
            req.swa_uuid_for_lock = self.tree_cache.inc_lock_ref(req.last_node)
        elif self.hybrid:  # a KV-only lock takes no state lock: dec_lock_ref must know
            self.tree_cache.inc_lock_ref(req.last_node, kv_only=req.kv_only_lock)
        else:
            self.tree_cache.inc_lock_ref(req.last_node)

    def _unlock(self, req: Req) -> None:
        if self.swa:
            self.tree_cache.dec_lock_ref(req.last_node, req.swa_uuid_for_lock)
        elif self.hybrid:
            self.tree_cache.dec_lock_ref(req.last_node, kv_only=req.kv_only_lock)
        else:
            self.tree_cache.dec_lock_ref(req.last_node)

    def reuse_rule(self) -> ReuseRule:
        """Where this scheduler reuses a cached prefix up to (for the router's index)."""
        return self.tree_cache.reuse_rule()

    def _match_prefix(self, req: Req, admit: bool = False) -> bool:
        """Longest cached prefix of the request's tokens; when ``admit``, a hybrid
        model's matched Mamba state is copied into the request's own slot (given back by
        ``_drop_planned`` if the plan does not take the request). False: no
        Mamba slot for that copy, every one is held (a logical OOM: the request waits)."""
        req.fill_ids = req.all_ids()
        copied = True
        # one token is always computed; so is every position whose logits give a pending input logprob
        # (SGLang cuts the match at logprob_start_len alike)
        pending = req.input_logprob_pending()
        reused = len(req.fill_ids) - 1 if pending is None else min(len(req.fill_ids) - 1, pending - 1)
        if self.hybrid:
            key = RadixKey(req.fill_ids[: reused + 1], req.extra_key)  # the cache keeps one token to compute
            match = self.tree_cache.match_prefix(key, req=req, cow_mamba=admit)
            req.mamba_branching_seqlen, copied = match.mamba_branching_seqlen, not match.mamba_cow_failed
        else:
            key = RadixKey(req.fill_ids[:reused], req.extra_key)
            if admit and self.file_tier and len(key) > req.storage_checked_len:  # pages past the host hit
                self.tree_cache.prefetch_from_storage(key)  # come from the file tier first (asked once, not
                req.storage_checked_len = len(key)          # at every step the request waits for room)
            match = self.tree_cache.match_prefix(key)
        req.prefix_indices, req.last_node = match.device_indices, match.last_device_node
        req.host_hit_length, req.last_host_node = match.host_hit_length, match.last_host_node
        req.cache_protected_len = len(req.prefix_indices)
        return copied

    def _load_host_prefix(self, req: Req) -> Tuple[int, int]:
        """Bring the host-tier continuation of a taken request's locked device prefix back to
        the device and move its lock to the deepest loaded node; returns the room it took (of
        the full pool, of the SWA pool: 0 without one).
        Only once the request is taken (SGLang's PrefillAdder loads after its fit check): loaded
        before, a request that then waited for room had its prefix loaded, evicted by the
        running requests' decode and loaded again at every step."""
        if not req.host_hit_length:
            return 0, 0
        before = self._free_room()
        if req.host_load_failed:  # its last one failed: recomputed, the host copy may be broken for good
            loaded = torch.empty(0, dtype=torch.int64)
        else:
            try:
                loaded, node = self.tree_cache.init_load_back(req.last_host_node, req.host_hit_length)
            except Exception:  # (a copy made at once) the host part is computed instead
                logger.exception("loading %d tokens from the host tier failed; computing them", req.host_hit_length)
                loaded = torch.empty(0, dtype=torch.int64)
        req.host_hit_length, req.last_host_node = 0, None
        if loaded.numel():
            old, old_swa_uuid = req.last_node, req.swa_uuid_for_lock
            req.prefix_indices, req.last_node = torch.cat([req.prefix_indices, loaded]), node
            self._lock(req)  # the new path first: the old one stays locked all along
            if self.swa:
                self.tree_cache.dec_lock_ref(old, old_swa_uuid)
            else:  # (a host tier otherwise means a plain tree: no state locks)
                self.tree_cache.dec_lock_ref(old)
            req.cache_protected_len = len(req.prefix_indices)
        after = self._free_room()
        return before[0] - after[0], 0 if after[1] is None else before[1] - after[1]

    def _paged(self, req: Req, num_tokens: int) -> int:
        """Slots the allocator takes for ``num_tokens`` after the request's prefix: whole pages
        (counted as tokens, a batch of short prompts was planned that could never be allocated)."""
        return self._paged_after(len(req.prefix_indices), num_tokens)

    def _paged_after(self, start: int, num_tokens: int) -> int:
        """Slots of the whole pages ``num_tokens`` tokens after ``start`` in a row take."""
        ps = self.page_size
        return (-(-(start + num_tokens) // ps) + (-start // ps)) * ps  # (ceil(end / ps) - ceil(start / ps)) pages

    def _free_room(self) -> Tuple[int, Optional[int]]:
        """Free + evictable slots of the full pool and of the SWA pool (None without one)."""
        if not self.swa:
            return self.available_tokens(), None
        alloc, tree = self.runner.allocator, self.tree_cache
        return alloc.full_available_size() + tree.full_evictable_size(), alloc.swa_available_size() + tree.swa_evictable_size()

    def _prefill_room(self) -> Tuple[int, Optional[int]]:
        """Slots new prefills may take after the running requests' decode reserve: of the
        full pool, and of the SWA pool (None without sliding-window layers). Every token of
        a prefill chunk takes an SWA slot, but the tokens of earlier chunks that slid out
        of the window are the tree's to evict (without the tree, the request frees them as
        each chunk ends), so the SWA pool bounds a chunk, not a prompt."""
        reserves = [self._request_reserve(r, r.kv_allocated_len) for r in self._decoding_reqs()]
        full, swa = self._free_room()
        if swa is None:
            return full - sum(reserves), None
        return full - sum(reserves), swa - sum(self._swa_reserve(n) for n in reserves)

    def _free_states(self) -> int:
        """Mamba state slots free or evictable (0 without Mamba layers)."""
        if not self.hybrid:
            return 0
        return self.runner.mamba_pool.available_size() + self.tree_cache.mamba_evictable_size()

    def _state_need(self, req: Req) -> int:
        """State slots a new request's row takes (0 without Mamba layers): its working slot, unless
        its match copied the cached state into one, and two track slots with ``extra_buffer``.
        (Unplanned, a request the pool had no slot for was planned and failed its allocation.)"""
        if not self.hybrid:
            return 0
        copied = 1 if req.mamba_pool_idx is not None else 0
        return self.runner.req_to_token_pool.mamba_slots_per_row - copied

    def _swa_reserve(self, reserve: int) -> int:
        """SWA slots of one request's decode reserve of ``reserve`` full slots (whole pages: the
        SWA pages are allocated as the full ones): a decoding request holds at most
        :meth:`_swa_window_slots` and the newest token's page, and it holds a page already, so
        it takes at most a window's slots more; past that each new page of it frees one."""
        if not self.swa:
            return reserve
        return min(reserve, self._swa_window_slots())

    def _swa_window_slots(self) -> int:
        """SWA slots of a decoding request's window before its newest token's page: paged,
        ``window_start`` floors to a page, so ``ceil(window / page)`` whole pages."""
        ps = self.page_size
        return -(-self.tree_cache.sliding_window_size // ps) * ps

    def _request_reserve(self, req: Req, kv_len: Optional[int] = None) -> int:
        """Slots of the whole pages a request's expected decode tokens (remaining
        ``max_new_tokens`` × ``new_token_ratio``) take after the KV of its first ``kv_len``
        tokens: by default all of them (a request being admitted, once prefilled); a decoding
        one's last sampled token has none yet. Each request fills its own pages: counted as a
        total of tokens, requests admitted together were short of up to a page each, and
        decode retracted them."""
        expected = int(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0) * self.new_token_ratio)
        return self._paged_after(req.seqlen if kv_len is None else kv_len, expected)

    def _decoding_reqs(self) -> List[Req]:
        """The requests whose future decode tokens are reserved for (after the KV in their rows)."""
        return self.running

    def _next_prefill(self):
        """The next prefill batch and its forward batch (None, None: none can run now). If
        planning raises, the requests it locked and gave no row are unlocked first (they stay
        queued: the engine loop's failure path finds no row to release them by; it gives back
        their Mamba copies, ``free_mamba_copy``)."""
        self._plan_locks: List[Req] = []
        continuing = self.chunked_req  # (the plan takes it off its slot: it is in no other queue)
        try:
            return self._plan_prefill()
        except BaseException:
            for req in self._plan_locks:
                if req.req_pool_idx is None:
                    self._unlock(req)
            if continuing is not None and self.chunked_req is None:
                self.chunked_req = continuing  # where the failure path releases it
            raise

    def _lock_planned(self, req: Req) -> None:
        self._lock(req)
        self._plan_locks.append(req)

    def _drop_planned(self, req: Req) -> None:
        """A new request the plan matched but does not take: its prefix lock goes back, and so
        does the Mamba slot its match copied the cached state into (as SGLang frees a request's
        early state slot when it is not scheduled) — kept, the slot was held while the request
        waited, taken from the running requests for nothing; its next match copies again."""
        self._unlock(req)
        self._plan_locks.remove(req)
        self.free_mamba_copy(req)

    def free_mamba_copy(self, req: Req) -> None:
        """Give back the Mamba slot of a request that has no row (a copy-on-write match's);
        a request with a row frees its slot with the row."""
        if req.mamba_pool_idx is not None:
            self.runner.mamba_pool.free(torch.tensor([req.mamba_pool_idx]))
            req.mamba_pool_idx = None

    def _lora_slot(self, req: Req, others: List[Req]) -> bool:
        """Whether a new request's LoRA adapter (if any) has a device slot, given one if one can be
        freed: not one whose adapter a request still running (``_decoding_reqs``) or in ``others``
        (those the batch takes) uses — a batch's distinct adapters never outnumber the slots
        (SGLang's ``can_run_lora_batch``)."""
        if req.lora_path is None:
            return True
        if req.lora_path not in self.runner.lora.host:  # unloaded after its check, before it was queued: it
            self.abort(req.rid)  # ends aborted (as one whose adapter is unknown at its check is refused)
            return False
        keep = {r.lora_path for r in self._decoding_reqs() + others}
        return self.runner.lora.fetch(req.lora_path, keep) is not None

    def _rows_held_elsewhere(self) -> int:
        """Request rows held by requests outside ``running`` and ``chunked_req`` (a PD worker's
        requests whose KV is still moving): the prefill plan's row budget leaves them out."""
        return 0

    def _plan_prefill(self):
        self._prefetch_blocked = False
        budget_running = self.runner.max_running_requests - len(self.running) - self._rows_held_elsewhere()
        if not (self.waiting or self.chunked_req):
            return None, None
        if budget_running <= 0 and not self.config.enable_priority_scheduling:  # (else a waiting one may preempt)
            return None, None
        rem_total, rem_swa = self._prefill_room()
        rem_states = self._free_states()
        rem_input, rem_chunk = self.config.max_prefill_tokens, self.chunked_prefill_size
        picked: List[Req] = []
        candidates = ([self.chunked_req] if self.chunked_req else []) + self.policy.order(self.waiting)
        self.chunked_req = None
        for req in candidates:
            new_req = req.req_pool_idx is None
            # no row left: only preemption gives it one, counted with the room it needs (retracted
            # for the row alone, a request short of room too was taken in vain, and the room it gave
            # back was not in the plan: the next preempted for it)
            row_short = len(picked) >= budget_running
            if row_short and not (new_req and self._preemptible(req)):
                break
            if new_req and req.prefetch_op is not None:
                if not self._prefetch_ready(req):
                    self._prefetch_blocked = True  # the next in line may go first
                    continue
                self.tree_cache.finish_prefetch(req.prefetch_op)
                req.prefetch_op = None
            if new_req and not self._lora_slot(req, picked):  # its adapter waits for a slot; the next in
                continue  # line may go first (SGLang skips it alike)
            copied = True
            if new_req:
                # locking its prefix takes what of it was evictable out of the room (SGLang's PrefillAdder
                # reads the room after each lock): counted as room, every step planned the same batch
                # that could not be allocated, forever; so does the state slot its match copies into
                before, states_before = self._free_room(), self._free_states()
                copied = self._match_prefix(req, admit=True)
                if not copied and not self._preemptible(req):  # no Mamba slot for its state's copy: all are held
                    break  # (running requests', locked nodes'); it keeps its place (SGLang: a failed alloc)
                self._lock_planned(req)
                after = self._free_room()
                rem_total -= before[0] - after[0]
                if rem_swa is not None:
                    rem_swa -= before[1] - after[1]
                rem_states -= states_before - self._free_states()
            else:  # a chunked request continues after its cached chunks
                req.fill_ids = req.all_ids()
            extend = req.extend_input_len
            reserve = self._request_reserve(req)
            if not picked and not self._decoding_reqs():  # its decode reserve would protect nobody: capped to
                # what the pool leaves, a request held to ``_max_request_len`` always comes in (with the ratio
                # near 1 after a retraction, its page-rounded prompt and reserve could exceed an empty pool)
                reserve = max(0, min(reserve, rem_total - self._paged(req, extend) - self.page_size))
            chunk = extend if rem_chunk is None else min(extend, rem_chunk // self.page_size * self.page_size)
            swa_need = self._paged(req, chunk) + self._swa_reserve(reserve) + self.page_size
            need = self._paged(req, extend) + reserve + self.page_size
            state_need = self._state_need(req) if new_req else 0
            short = Room(int(row_short), need - rem_total, 0 if rem_swa is None else swa_need - rem_swa,
                         state_need - rem_states)  # what it lacks of each
            over_budget = (picked and extend > rem_input) or (chunk < extend and chunk <= 0)
            fits = max(short) <= 0 and not over_budget
            if not fits and not over_budget and new_req:
                room, states = self._prefill_room(), self._free_states()  # what the preempted give back
                if self._preempt_for(req, short):  # comes into the plan's room (all it lacks: it fits now)
                    after = self._prefill_room()
                    rem_total += after[0] - room[0]
                    if rem_swa is not None:
                        rem_swa += after[1] - room[1]
                    rem_states += self._free_states() - states
                    budget_running = self.runner.max_running_requests - len(self.running) - self._rows_held_elsewhere()
                    fits = need <= rem_total and (rem_swa is None or swa_need <= rem_swa) and state_need <= rem_states
                    fits = fits and (copied or self._match_prefix(req, admit=True))  # its state's copy, now
            if not fits:
                if new_req:
                    self._drop_planned(req)
                else:
                    self.chunked_req = req  # keeps its place at the head
                break
            if new_req and req.host_hit_length:  # its fit counted the host part as new slots: they are now
                took_full, took_swa = self._load_host_prefix(req)
                rem_total -= took_full
                if rem_swa is not None:
                    rem_swa -= took_swa
                extend = req.extend_input_len
                chunk = extend if rem_chunk is None else min(extend, rem_chunk // self.page_size * self.page_size)
            if chunk < extend:
                req.fill_ids = req.fill_ids[: len(req.prefix_indices) + chunk]
                extend = chunk
            if new_req and req.num_retractions == 0:  # (retracted, it would count its own KV as reused)
                req.cached_tokens = len(req.prefix_indices)
            picked.append(req)
            rem_total -= self._paged(req, extend) + reserve
            if rem_swa is not None:
                rem_swa -= swa_need - self.page_size
            rem_states -= state_need
            rem_input -= extend
            if rem_chunk is not None:
                rem_chunk -= extend
            if len(req.fill_ids) < req.seqlen:  # chunked: nothing else joins after it
                break
        if not picked:
            return None, None
        new_reqs = [r for r in picked if r.req_pool_idx is None]
        forward_batch = prepare_for_extend(picked, self.runner, self.tree_cache)
        while forward_batch is None and len(picked) > 1:  # the plan overestimated the room: shorter, now (the
            dropped = picked.pop()  # same plan at the next step would fail again); a continuing chunk is first
            self._drop_planned(dropped)
            new_reqs.remove(dropped)
            forward_batch = prepare_for_extend(picked, self.runner, self.tree_cache)
        if forward_batch is None:  # short even after eviction: give the locks (and state copies) back, try later
            for req in new_reqs:
                self._drop_planned(req)
            continuing = [r for r in picked if r not in new_reqs]
            if continuing:
                self.chunked_req = continuing[0]
            return None, None
        for req in picked:
            if req in self.waiting:
                self.waiting.remove(req)
        return picked, forward_batch
