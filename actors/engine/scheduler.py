"""Continuous batching: which requests run in the next forward, and what to do after.

One ``step()`` = pick a batch (a prefill batch if any waiting request fits,
else the running decode batch), run the model, process the results. The
control path reads top to bottom in :meth:`Scheduler.step`.

Memory rules (seed 000 §10.4): a prefill is admitted only if its tokens plus
a reserve for the running requests' future decode tokens
(``remaining max_new_tokens × new_token_ratio``) fit in free + evictable
slots (for a sliding-window model, the smaller of its full and SWA pools); a
long prompt is cut into ``chunked_prefill_size`` chunks cached with
``cache_unfinished_req``; when a decode step cannot get its slots even after
eviction, requests are retracted to the waiting queue (their KV freed,
recomputed later) until the rest have room for ``RETRACT_DECODE_STEPS`` more
steps, and ``new_token_ratio`` is estimated anew (SGLang's ``retract_decode``).
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional, Tuple

import torch

from actors.engine.finish import check_finished, stream_text
from actors.engine.req import Req
from actors.engine.sampling import logit_adjustments, plain_greedy_tokens, sample_next
from actors.engine.schedule_batch import prepare_for_decode, prepare_for_extend
from mem_cache.hicache_storage import HiCacheFile, rank_storage_dir
from mem_cache.hiradix_cache import HiRadixCache
from mem_cache.kv_events import ReuseRule
from mem_cache.mamba_radix_cache import MambaRadixCache
from mem_cache.radix_cache import RadixCache
from mem_cache.radix_key import RadixKey
from mem_cache.swa_radix_cache import SWARadixCache

logger = logging.getLogger(__name__)
RETRACT_DECODE_STEPS = 20


class Scheduler:
    def __init__(self, runner, tokenizer=None):
        self.runner = runner
        self.config = cfg = runner.config
        self.tokenizer = tokenizer
        self.page_size = cfg.page_size
        self.hybrid = runner.spec.kind == "hybrid_mamba"
        self.swa = runner.spec.kind == "swa"
        self.file_tier = False  # a HiRadixCache with storage: admission prefetches from it
        self.host_tier = False  # a HiRadixCache: its loads start before a forward and end after it
        if self.swa:
            for name in ("disable_radix_cache", "enable_hierarchical_cache"):
                if getattr(cfg, name):
                    raise ValueError(f"{name}=True is not supported for sliding-window models (KV cache kind 'swa')")
            self.tree_cache = SWARadixCache(
                runner.req_to_token_pool, runner.allocator, runner.spec.sliding_window, page_size=cfg.page_size,
                enable_kv_events=cfg.enable_kv_events,
            )
        elif self.hybrid:
            if cfg.enable_hierarchical_cache:
                raise ValueError("enable_hierarchical_cache=True is not supported for hybrid models (KV cache kind "
                                 "'hybrid_mamba'): the host tier holds attention KV, not Mamba states")
            self.tree_cache = MambaRadixCache(
                runner.req_to_token_pool, runner.allocator, page_size=cfg.page_size, disable=cfg.disable_radix_cache,
                mamba_scheduler_strategy=cfg.mamba_scheduler_strategy, enable_kv_events=cfg.enable_kv_events,
            )
        elif cfg.enable_hierarchical_cache:
            storage = None
            if cfg.hicache_storage_dir:
                storage = HiCacheFile(rank_storage_dir(cfg.hicache_storage_dir, runner.tp.rank, runner.tp.size))
                self.file_tier = True
            self.tree_cache = HiRadixCache(
                runner.req_to_token_pool, runner.allocator, runner.token_to_kv_pool, cfg.page_size,
                host_to_device_ratio=cfg.hicache_ratio, write_policy=cfg.hicache_write_policy, storage_backend=storage,
                disable=cfg.disable_radix_cache, eviction_policy=cfg.radix_eviction_policy,
                enable_kv_events=cfg.enable_kv_events, overlap_load=cfg.hicache_overlap_load,
                overlap_write=cfg.hicache_overlap_write,
                async_storage_writes=True,  # the file tier is written off the loop (shutdown waits for it)
            )
            self.host_tier = True
            controller = self.tree_cache.cache_controller  # TP rank 0: what the other ranks replay, and ask
            controller.op_log, controller.peers_read = runner.host_op_log, runner.storage_peers_read
            controller.peers_prefetch = runner.storage_peers_prefetch
        else:
            self.tree_cache = RadixCache(
                runner.req_to_token_pool, runner.allocator, page_size=cfg.page_size, disable=cfg.disable_radix_cache,
                eviction_policy=cfg.radix_eviction_policy, enable_kv_events=cfg.enable_kv_events,
            )
        chunk = cfg.chunked_prefill_size if cfg.chunked_prefill_size is not None else 2048
        self.chunked_prefill_size = None if chunk <= 0 else max(self.page_size, chunk // self.page_size * self.page_size)
        self.context_len = min(runner.context_len, self._max_request_len())
        if self.context_len < runner.context_len:
            logger.warning("requests are held to %d tokens (prompt + output), what the KV pool holds for one "
                           "request; the model's context is %d", self.context_len, runner.context_len)
        self.waiting: List[Req] = []
        self.running: List[Req] = []
        self.chunked_req: Optional[Req] = None
        self.new_token_ratio = cfg.init_new_token_ratio
        self.num_retractions = 0
        self._aborted: List[Req] = []  # finished while waiting: reported at the next step
        self.in_flight: List[Req] = []  # the prefill batch being run and processed
        self._prefetch_blocked = False  # the last admission skipped a request whose prefetch is not ready
        self.stalled = False  # the last step ran nothing only because of that

    def _max_request_len(self) -> int:
        """Tokens (prompt + output) one request can hold in the empty pools, less a page
        of slack for the admission check (SGLang's ``max_req_len``): a request held to it
        is admitted once the requests before it are done. A sliding-window model's SWA
        pool needs to hold a prefill chunk, not the prompt, if it has room for two chunks
        and two windows (a chunked request's lock holds the SWA KV of the tree nodes
        covering its last window — whole nodes, up to a chunk and a window — and the next
        chunk comes on top, with up to a window of decode reserve); otherwise the whole
        prompt (a retracted request's too) must fit it besides a window."""
        alloc, page = self.runner.allocator, self.page_size
        if not self.swa:
            return self.total_tokens() - page
        window, chunk = self.tree_cache.sliding_window_size, self.chunked_prefill_size
        if chunk is not None and 2 * (chunk + window) + page <= alloc.size_swa:
            return alloc.size - page
        return min(alloc.size, alloc.size_swa - window) - page

    def check_request(self, req: Req) -> None:
        """Refuse a prompt longer than a request may be, or a token id outside the vocabulary in
        the prompt or ``logit_bias`` (ValueError); hold ``max_new_tokens`` to what fits after it,
        as the context length would end it anyway — a reservation for more could never be granted."""
        if len(req.origin_input_ids) >= self.context_len:
            held = "" if self.context_len == self.runner.context_len else " (what this worker's KV pool holds)"
            raise ValueError(f"prompt of {len(req.origin_input_ids)} tokens does not fit the context length "
                             f"{self.context_len}{held}")
        vocab, ids = self.runner.model_config.vocab_size, req.origin_input_ids
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:  # it would fail the whole batch (on CUDA: a device-side assert)
            raise ValueError(f"token id {bad} in the prompt is out of the vocabulary (ids are 0..{vocab - 1})")
        params = req.sampling_params
        bad = next((t for t in params.logit_bias or {} if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is out of the vocabulary (ids are 0..{vocab - 1})")
        params.max_new_tokens = min(params.max_new_tokens, self.context_len - len(req.origin_input_ids))

    # ---- the loop ---------------------------------------------------------------
    def step(self) -> List[Req]:
        """Run one forward; returns the requests that produced output (or finished)."""
        released = self._release_aborted()
        try:
            out = released + self._run_batch(bool(released))
        except BaseException:  # released already: the loop's failure path only tells them
            self._aborted[:0] = released
            raise
        if not self.has_work():  # idle: the ratio a retraction raised starts over (SGLang's idle self-check)
            self.new_token_ratio = self.config.init_new_token_ratio
        return out

    def _run_batch(self, released: bool) -> List[Req]:
        self.end_orphan_prefetches()
        if self.host_tier:  # backups done: their prefixes are evictable again
            self.tree_cache.writing_check()
        self.stalled = False
        batch_reqs, forward_batch = self._next_prefill()
        if forward_batch is not None:
            self.in_flight = batch_reqs  # out of every queue until processed: a failure must still find them
            logits = self._forward(forward_batch)
            out = self._process_prefill(batch_reqs, logits)
            self.in_flight = []
            return out
        if self.host_tier:  # loads of a batch that was not run end now
            self.tree_cache.loading_check()
        if self.running:
            batch_reqs, forward_batch = self._next_decode()
            if forward_batch is not None:
                logits = self._forward(forward_batch)
                return self._process_decode(batch_reqs, logits)
        # waits on storage reads, or on backups to give their slots back: the loop may sleep
        self.stalled = (self._prefetch_blocked or (self.host_tier and self.tree_cache.writes_pending)) and not released
        return []

    def _forward(self, forward_batch):
        """The runner's forward; the host-tier loads the batch needs copy while it runs
        (its attention reads a layer once that layer's copy is done)."""
        if not self.host_tier:
            return self.runner.forward(forward_batch)
        try:
            self.tree_cache.ready_to_load_host_cache()
            return self.runner.forward(forward_batch)
        finally:
            self.tree_cache.loading_check()

    def close(self) -> None:
        """End the host tier's loads and its loader thread (after the loop stopped)."""
        if self.host_tier:
            try:
                self.tree_cache.writing_check(wait=True)
                self.tree_cache.loading_check()
                self.tree_cache.cancel_prefetches()
            finally:
                self.tree_cache.cache_controller.close()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req or self._aborted)

    # ---- admission ----------------------------------------------------------------
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
        model's matched Mamba state is copied into the request's own slot. False: no
        Mamba slot for that copy, every one is held (a logical OOM: the request waits)."""
        req.fill_ids = req.all_ids()
        copied = True
        if self.hybrid:
            if req.mamba_pool_idx is not None:  # a copy from an earlier attempt may be stale
                self.runner.mamba_pool.free(torch.tensor([req.mamba_pool_idx]))
                req.mamba_pool_idx = None
            key = RadixKey(req.fill_ids, req.extra_key)  # the cache keeps one token to compute
            match = self.tree_cache.match_prefix(key, req=req, cow_mamba=admit)
            req.mamba_branching_seqlen, copied = match.mamba_branching_seqlen, not match.mamba_cow_failed
        else:
            key = RadixKey(req.fill_ids[: len(req.fill_ids) - 1], req.extra_key)  # one token is always computed
            if admit and self.file_tier and len(key) > req.storage_checked_len:  # pages past the host hit
                self.tree_cache.prefetch_from_storage(key)  # come from the file tier first (asked once, not
                req.storage_checked_len = len(key)          # at every step the request waits for room)
            match = self.tree_cache.match_prefix(key)
        req.prefix_indices, req.last_node = match.device_indices, match.last_device_node
        req.host_hit_length, req.last_host_node = match.host_hit_length, match.last_host_node
        req.cache_protected_len = len(req.prefix_indices)
        return copied

    def _load_host_prefix(self, req: Req) -> int:
        """Bring the host-tier continuation of a taken request's locked device prefix back to
        the device and move its lock to the deepest loaded node; returns the room it took.
        Only once the request is taken (SGLang's PrefillAdder loads after its fit check): loaded
        before, a request that then waited for room had its prefix loaded, evicted by the
        running requests' decode and loaded again at every step."""
        if not req.host_hit_length:
            return 0
        before = self._free_room()[0]
        loaded, node = self.tree_cache.init_load_back(req.last_host_node, req.host_hit_length)
        req.host_hit_length, req.last_host_node = 0, None
        if loaded.numel():
            old = req.last_node
            req.prefix_indices, req.last_node = torch.cat([req.prefix_indices, loaded]), node
            self._lock(req)  # the new path first: the old one stays locked all along
            self.tree_cache.dec_lock_ref(old)  # (a host tier means a plain tree: no SWA or state locks)
            req.cache_protected_len = len(req.prefix_indices)
        return before - self._free_room()[0]

    def _sorted_waiting(self) -> List[Req]:
        if self.config.schedule_policy == "lpm":
            for req in self.waiting:
                self._match_prefix(req)
            return sorted(self.waiting, key=lambda r: -len(r.prefix_indices))
        return list(self.waiting)

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
        of the window are the tree's to evict, so the SWA pool bounds a chunk, not a prompt."""
        reserve = self._decode_reserve()
        full, swa = self._free_room()
        if swa is None:
            return full - reserve, None
        return full - reserve, swa - self._swa_reserve(reserve, len(self._decoding_reqs()))

    def _swa_reserve(self, reserve: int, num_reqs: int = 1) -> int:
        """SWA slots of ``reserve`` decode tokens of ``num_reqs`` requests: past its window
        each new token of a request frees one."""
        return min(reserve, self.tree_cache.sliding_window_size * num_reqs) if self.swa else reserve

    def _request_reserve(self, req: Req) -> int:
        """Slots a newly admitted request is expected to need for its future decode tokens."""
        return int(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0) * self.new_token_ratio)

    def _decoding_reqs(self) -> List[Req]:
        """The requests whose future decode tokens are reserved for."""
        return self.running

    def _decode_reserve(self) -> int:
        remaining = sum(max(r.sampling_params.max_new_tokens - len(r.output_ids), 0) for r in self._decoding_reqs())
        return int(remaining * self.new_token_ratio)

    def _next_prefill(self):
        """The next prefill batch and its forward batch (None, None: none can run now). If
        planning raises, the requests it locked and gave no row are unlocked first (they stay
        queued: the engine loop's failure path finds no row to release them by)."""
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

    def _unlock_planned(self, req: Req) -> None:
        self._unlock(req)
        self._plan_locks.remove(req)

    def _plan_prefill(self):
        self._prefetch_blocked = False
        budget_running = self.runner.max_running_requests - len(self.running)
        if budget_running <= 0 or not (self.waiting or self.chunked_req):
            return None, None
        rem_total, rem_swa = self._prefill_room()
        rem_input, rem_chunk = self.config.max_prefill_tokens, self.chunked_prefill_size
        picked: List[Req] = []
        candidates = ([self.chunked_req] if self.chunked_req else []) + self._sorted_waiting()
        self.chunked_req = None
        for req in candidates:
            if len(picked) >= budget_running:
                break
            new_req = req.req_pool_idx is None
            if new_req and req.prefetch_op is not None:
                if not self._prefetch_ready(req):
                    self._prefetch_blocked = True  # the next in line may go first
                    continue
                self.tree_cache.finish_prefetch(req.prefetch_op)
                req.prefetch_op = None
            if new_req:
                if not self._match_prefix(req, admit=True):  # no Mamba slot for its state's copy: all are
                    break  # held (running requests', locked nodes'); it keeps its place (SGLang: a failed alloc)
                # locking its prefix takes what of it was evictable out of the room (SGLang's PrefillAdder
                # reads the room after each lock): counted as room, every step planned the same batch
                # that could not be allocated, forever
                before = self._free_room()
                self._lock_planned(req)
                after = self._free_room()
                rem_total -= before[0] - after[0]
                if rem_swa is not None:
                    rem_swa -= before[1] - after[1]
            else:  # a chunked request continues after its cached chunks
                req.fill_ids = req.all_ids()
            extend = req.extend_input_len
            reserve = self._request_reserve(req)
            if not picked and not self._decoding_reqs():  # its decode reserve would protect nobody: capped to
                # what the pool leaves, a request held to ``_max_request_len`` always comes in (with the ratio
                # near 1 after a retraction, its page-rounded prompt and reserve could exceed an empty pool)
                reserve = max(0, min(reserve, rem_total - self._paged(req, extend) - self.page_size))
            chunk = extend if rem_chunk is None else min(extend, rem_chunk // self.page_size * self.page_size)
            swa_need = chunk + self._swa_reserve(reserve) + self.page_size
            fits = not (self._paged(req, extend) + reserve + self.page_size > rem_total
                        or (rem_swa is not None and swa_need > rem_swa) or (picked and extend > rem_input))
            if chunk < extend and chunk <= 0:
                fits = False
            if not fits:
                if new_req:
                    self._unlock_planned(req)
                else:
                    self.chunked_req = req  # keeps its place at the head
                break
            if new_req and req.host_hit_length:  # its fit counted the host part as new slots: they are now
                rem_total -= self._load_host_prefix(req)
                extend = req.extend_input_len
                chunk = extend if rem_chunk is None else min(extend, rem_chunk // self.page_size * self.page_size)
            if chunk < extend:
                req.fill_ids = req.fill_ids[: len(req.prefix_indices) + chunk]
                extend = chunk
            if new_req and req.num_retractions == 0:
                req.cached_tokens = len(req.prefix_indices)
            picked.append(req)
            rem_total -= self._paged(req, extend) + reserve
            if rem_swa is not None:
                rem_swa -= swa_need - self.page_size
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
            self._unlock_planned(dropped)
            new_reqs.remove(dropped)
            forward_batch = prepare_for_extend(picked, self.runner, self.tree_cache)
        if forward_batch is None:  # short even after eviction: give the locks back, try later
            for req in new_reqs:
                self._unlock_planned(req)
            continuing = [r for r in picked if r not in new_reqs]
            if continuing:
                self.chunked_req = continuing[0]
            return None, None
        for req in picked:
            if req in self.waiting:
                self.waiting.remove(req)
        return picked, forward_batch

    def _next_decode(self):
        """The running batch's decode step. When its slots cannot be had even after eviction,
        requests are retracted (:meth:`_retract_decode`) and the smaller batch is tried again."""
        retracted = False
        while self.running:
            forward_batch = prepare_for_decode(self.running, self.runner, self.tree_cache)
            if forward_batch is not None:
                if not retracted:  # (a retraction set the ratio from the requests it left)
                    self.new_token_ratio = max(
                        self.config.min_new_token_ratio, self.new_token_ratio - self.config.new_token_ratio_decay
                    )
                return list(self.running), forward_batch
            self._retract_decode()
            retracted = True
        return None, None

    def _retract_decode(self) -> List[Req]:
        """SGLang's ``retract_decode``: retract running requests — fewest output tokens first
        (the least work lost), then the longest prompt (the most room won) — at least one, then
        more until the rest have room for their next ``RETRACT_DECODE_STEPS`` decode steps, so
        the next steps do not retract again (or until one is left). ``new_token_ratio`` is then
        estimated from those left. The retracted go to the head of ``waiting`` in the order they
        ran in; returns them."""
        ran_in = {id(r): i for i, r in enumerate(self.running)}
        retracted: List[Req] = []
        for req in sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids))):
            if retracted and (len(self.running) <= 1 or self._decode_steps_fit(self.running)):
                break
            retracted.append(req)
            self._retract(req)
        self.waiting[: len(retracted)] = sorted(self.waiting[: len(retracted)], key=lambda r: ran_in[id(r)])
        decoded = sum(len(r.output_ids) for r in self.running)
        max_new = sum(r.sampling_params.max_new_tokens for r in self.running) or 1
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self.running)) / max_new)
        logger.info("retracted %d request(s) %s (%d retractions so far)", len(retracted),
                    [r.rid for r in retracted], self.num_retractions)
        return retracted

    def _decode_steps_fit(self, reqs: List[Req]) -> bool:
        """Whether free + evictable slots hold the KV of each request's next ``RETRACT_DECODE_STEPS``
        decode tokens (fewer if it has fewer to go), in whole pages; for a sliding-window model
        also its SWA pool, where past its window a request frees a slot for each new one."""
        full_need = swa_need = 0
        for req in reqs:
            steps = max(1, min(RETRACT_DECODE_STEPS, req.sampling_params.max_new_tokens - len(req.output_ids)))
            full_need += self._paged_after(req.seqlen - 1, steps)  # (the last sampled token has no KV yet)
            swa_need += self._swa_reserve(steps)
        full, swa = self._free_room()
        return full_need <= full and (swa is None or swa_need <= swa)

    def _retract(self, req: Req) -> None:
        """Retract a running request: free its KV, requeue it at the head of ``waiting`` — even
        if freeing fails partway (it holds nothing then: not freed again, it is where a failure
        path finds it)."""
        self.running.remove(req)
        try:
            self.tree_cache.cache_finished_req(req, is_insert=False)
        finally:
            req.reset_for_retract()
            self.waiting.insert(0, req)
        self.num_retractions += 1

    # ---- results ----------------------------------------------------------------------
    def _sample(self, req: Req, logits_row, token: Optional[int] = None, adjust=None) -> None:
        """Sample ``req``'s next token from its logits row (``token``: already picked by
        the batch's argmax; ``adjust``: its row of the batch's :meth:`_logit_adjustments`,
        built here for a row sampled on its own) and see whether it finished."""
        logprobs = None
        if token is None:
            if adjust is None:
                own = self._logit_adjustments([req], logits_row[None])
                adjust = None if own is None else own[0]
            token, logprobs = sample_next(logits_row, req.sampling_params, req.origin_input_ids, req.output_ids,
                                          req.generator, adjust)
        req.output_ids.append(token)
        if req.sampling_params.return_logprob:
            req.output_logprobs.append(float(logprobs[token]))
            k = req.sampling_params.top_logprobs_num
            if k:
                top = logprobs.topk(k)
                req.output_top_logprobs.append(list(zip(top.indices.tolist(), top.values.tolist())))
        stream_text(req, self.tokenizer)
        check_finished(req, self.tokenizer, self.context_len)

    @staticmethod
    def _logit_adjustments(reqs: List[Req], logits):
        """What ``reqs``' logit_bias and min_new_tokens masks add to their logits rows ``[bs, vocab]``
        (:func:`~actors.engine.sampling.logit_adjustments`, on the logits' device); None if nothing."""
        masked = [r.sampling_params.masked_token_ids(len(r.output_ids), r.eos_token_ids) for r in reqs]
        return logit_adjustments([r.sampling_params for r in reqs], masked, logits.shape[-1], logits.device)

    def _process_prefill(self, reqs: List[Req], logits) -> List[Req]:
        out: List[Req] = []
        self.runner.allocator.free_group_begin()
        try:  # (failing, the batch is still ``in_flight``: the loop's failure path finds it)
            for i, req in enumerate(reqs):
                req.kv_committed_len = len(req.fill_ids)
                if len(req.fill_ids) < req.seqlen:  # more chunks to go
                    self.tree_cache.cache_unfinished_req(req)
                    self.chunked_req = req
                    continue
                self._prefill_done(req, logits[i])
                out.append(req)
        finally:  # the group's frees happen even if a request failed: a failure path's frees are not parked
            self.runner.allocator.free_group_end()
        return out

    def _prefill_done(self, req: Req, logits_row) -> None:
        """A request's whole prompt is in the KV: sample, then cache or keep running."""
        if req.sampling_params.max_new_tokens == 0:
            req.finish({"type": "length", "length": 0})
        else:
            self._sample(req, logits_row)
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        if req.finished:
            self.tree_cache.cache_finished_req(req)
        else:
            self.tree_cache.cache_unfinished_req(req)
            self.running.append(req)

    def _process_decode(self, reqs: List[Req], logits) -> List[Req]:
        self.runner.allocator.free_group_begin()
        try:
            adjust = self._logit_adjustments(reqs, logits)
            greedy = plain_greedy_tokens(logits, [r.sampling_params for r in reqs], adjust)
            for i, req in enumerate(reqs):
                req.kv_committed_len = req.seqlen
                self._sample(req, logits[i], greedy.get(i), None if adjust is None else adjust[i])
                if req.finished:
                    self.tree_cache.cache_finished_req(req)
        except BaseException:  # those that finished before the failure are released: only told
            self._aborted += [r for r in reqs if r.finished]
            raise
        finally:  # a finished request never stays in ``running``, where it would count as an abort
            self.runner.allocator.free_group_end()
            self.running = [r for r in self.running if not r.finished]
        return reqs

    # ---- abort --------------------------------------------------------------------------
    def abort(self, rid: str) -> bool:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish({"type": "abort", "message": "aborted"})
                if req.mamba_pool_idx is not None:  # a copy-on-write slot taken at a failed admission
                    self.runner.mamba_pool.free(torch.tensor([req.mamba_pool_idx]))
                    req.mamba_pool_idx = None
                self._aborted.append(req)
                return True
        for req in self.running + ([self.chunked_req] if self.chunked_req else []):
            if req.rid == rid and not req.finished:  # (a finished one: ended already, its id maybe reused)
                req.finish({"type": "abort", "message": "aborted"})
                return True
        return False

    def _release_aborted(self) -> List[Req]:
        """The requests aborted since the last step, to tell: those queued were released by
        ``abort``; a running (or chunked) one is released here. Failing, nothing is lost: a
        request leaves ``running`` only once released (a retry does the rest, nothing twice)
        and every one released stays to be told."""
        released, self._aborted = self._aborted, []
        try:
            for req in [r for r in self.running if r.finished]:
                self.tree_cache.cache_finished_req(req)
                self.running.remove(req)
                released.append(req)
            if self.chunked_req is not None and self.chunked_req.finished:
                self.tree_cache.cache_finished_req(self.chunked_req, is_insert=False)
                released.append(self.chunked_req)
                self.chunked_req = None
        except BaseException:
            self._aborted[:0] = released
            raise
        return released
