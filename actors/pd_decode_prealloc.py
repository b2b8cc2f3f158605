"""The decode side's reservations (SGLang's ``DecodePreallocQueue``), a mixin of
:class:`~actors.pd_scheduler.DecodeScheduler`.

A request waits in ``prealloc`` until a request row and KV slots for its prompt
fit, with a reserve of ``num_reserved_decode_tokens`` counted as taken; then one
hand-off per decode rank goes out and it moves to ``transfer``.

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

With priority scheduling the queue is served by priority, then arrival
(SGLang's ``DecodePreallocQueue`` sorts it so), and a head short of a row,
slots or state slots preempts running requests of a much lower priority as
the engine's admission does (:mod:`actors.engine.preemption`): they are
retracted — their KV freed, their output kept — and re-prefilled here once
room comes back, behind it. SGLang's decode side only orders the queue: a
high-priority request there waits for a low-priority batch to finish.

The mixin reads the scheduler's ``runner``, ``tree_cache``, ``page_size``,
``swa``, ``hybrid``, ``host_tier``, ``policy``, queues (``prealloc``, ``transfer``,
``waiting``, ``running``, ``chunked_req``, ``_aborted``), the decode settings
(``num_reserved_decode_tokens``, ``waiting_timeout_s``), ``agents``,
``tp_worker`` and ``has_followers``; the engine's matching, locking, room
accounting and preemption (``_match_prefix``, ``_lock``, ``_unlock``,
``_load_host_prefix``, ``_prefill_room``, ``_free_states``, ``_paged_after``,
``_swa_reserve``: :mod:`actors.engine.schedule_policy`; ``_preemptible``,
``_preempt_for``); and a failed hand-off ends its request through ``_drop``
(:mod:`actors.pd_decode_transfer`).
"""

from __future__ import annotations

import logging
from typing import List, Optional

import torch

from actors.engine.preemption import Room
from actors.engine.req import Req
from actors.engine.schedule_batch import _alloc_rows, _alloc_with_eviction
from actors.engine.tp_worker import FollowerError
from mem_cache.radix_key import RadixKey
from transfer.base import KVReceiver, TransferError

logger = logging.getLogger("actors.pd_scheduler")


class DecodePreallocMixin:
    """The ``prealloc`` queue: reservations of a row and slots per request (``_process_prealloc``)."""

    def _process_prealloc(self) -> List[Req]:
        """Reserve for the queue's head (the highest priority, then the earliest: ``add_request``)
        while it fits. Not while a retracted request of its priority or higher waits (``waiting``
        holds nothing else here): it was decoding before any of these arrived, and the room that
        frees is its first (SGLang's decode resumes its retracted queue before it pre-allocates);
        the engine's prefill re-admits it, in chunks as the ``chunked_req`` (on this side only a
        retracted request prefills). A head of a higher priority goes first, as it would in the
        engine's waiting queue: those it preempted (``_reserve``) wait behind it."""
        done: List[Req] = []
        rank = self.policy.rank
        try:
            while self.prealloc and self.chunked_req is None:
                req = self.prealloc[0]
                if any(rank(retracted) <= rank(req) for retracted in self.waiting):
                    break
                if not self.runner.req_to_token_pool.available_size() and not self._preemptible(req):
                    break  # (no row, and none to take: not matched again at every step)
                if not self._lora_slot(req, []):  # (running and transferring requests keep theirs)
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

    def _reserve(self, req: Req) -> bool:
        """Row + slots for the prompt beyond the decode tree's own prefix; False with nothing taken.
        Short of them, with priority scheduling it may preempt running requests of a much lower
        priority (the engine's ``_preempt_for``: all it lacks, or none is retracted); a request in
        ``transfer`` is never one (it is not running: a push may be writing its slots)."""
        prompt_len = len(req.origin_input_ids)
        self._match_reserved_prefix(req)
        prefix_len = len(req.prefix_indices)
        self._lock(req)  # first: the room it leaves is what the prompt can have (its prefix is not evictable)
        try:  # a failure below (a host-tier load, the allocator) gives back the lock and the row with it
            short = self._lacks(req, prefix_len, prompt_len)  # (a host-tier part of the prefix counts as new slots)
            if max(short) > 0 and self._preempt_for(req, short):
                short = self._lacks(req, prefix_len, prompt_len)
            taken = max(short) <= 0
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

    def _lacks(self, req: Req, prefix_len: int, prompt_len: int) -> Room:
        """What the reservation lacks of each resource (nothing above 0: it fits): a request row;
        room for the uncached prompt plus the request's decode reserve, after what the running and
        transferring requests will still need (a sliding-window model needs SWA slots only for the
        part of the prompt in its last window); a hybrid model's state slots of its row. Paged, the
        prompt's slots are whole pages, as the allocator takes them, and so is its reserve: the
        pages its first ``num_reserved_decode_tokens`` new tokens fill after the prompt (each
        request's own, as the engine counts the running and transferring requests')."""
        reserved_tokens = min(self.num_reserved_decode_tokens, req.sampling_params.max_new_tokens)
        reserve = self._paged_after(prompt_len, reserved_tokens)
        pool = self.runner.req_to_token_pool
        full, swa = self._prefill_room()
        full_lack = self._paged_after(prefix_len, prompt_len - prefix_len) + reserve + self.page_size - full
        swa_lack = 0
        if swa is not None:
            split = self._swa_split(prefix_len, prompt_len)
            swa_lack = self._paged_after(split, prompt_len - split) + self._swa_reserve(reserve) + self.page_size - swa
        states_lack = pool.mamba_slots_per_row - self._free_states() if self.hybrid else 0
        return Room(int(not pool.available_size()), full_lack, swa_lack, states_lack)

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
