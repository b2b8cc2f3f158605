"""Turning a list of requests into a ForwardBatch, with their KV slots allocated.

``prepare_for_extend`` and ``prepare_for_decode`` allocate the slots for the
tokens about to be computed (evicting from the tree cache when the pool is
short) and write them into the requests' ``req_to_token`` rows. They return
``None`` — having taken nothing — when memory is short even after eviction;
the scheduler then waits or retracts.

:class:`DecodeRetractionMixin` (mixed into the engine's
:class:`~actors.engine.scheduler.Scheduler`) makes the running batch's decode
step, retracting requests when its slots cannot be had (SGLang's
``ScheduleBatch.retract_decode``).
"""

from __future__ import annotations

import itertools
import logging
from typing import Dict, List, Optional

import torch

from actors.engine.forward_batch import ForwardBatch, ForwardMode, int64_tensor
from actors.engine.req import Req
from mem_cache.integrity import ensure
from mem_cache.mamba_tracking import decode_should_track, prefill_track_seqlen

logger = logging.getLogger(__name__)
_NO_SLOTS = torch.empty(0, dtype=torch.int64)
RETRACT_DECODE_STEPS = 20  # the decode steps a retraction leaves the rest of the batch room for (SGLang's)


def _alloc_with_eviction(tree_cache, allocator, alloc_fn, num_tokens: int):
    out = alloc_fn()
    if out is None:
        if hasattr(allocator, "swa_available_size"):  # two pools: evict each one's deficit
            full_deficit = max(0, num_tokens - allocator.full_available_size())
            tree_cache.evict(full_deficit, max(0, num_tokens - allocator.swa_available_size()))
        else:
            tree_cache.evict(num_tokens)
        out = alloc_fn()
    return out


def _alloc_rows(pool, reqs: List[Req], tree_cache):
    """Request rows (and, for hybrid models, Mamba slots: a copy-on-write slot the
    request already holds is adopted), evicting cached Mamba states when short."""
    if not hasattr(pool, "mamba_pool"):
        return pool.alloc(len(reqs))
    given = [r.mamba_pool_idx for r in reqs]
    rows = pool.alloc(len(reqs), given)
    if rows is None:
        tree_cache.evict_mamba(len(reqs) * pool.mamba_slots_per_row)
        rows = pool.alloc(len(reqs), given)
    return rows


def _mamba_indices(pool, reqs: List[Req], runner):
    return pool.get_mamba_indices([r.req_pool_idx for r in reqs]) if hasattr(pool, "mamba_pool") else None


def _mamba_tracks(pool, reqs: List[Req], track_lens: List[Optional[int]]):
    """extra_buffer: the ping-pong slot each tracked request's checkpoint goes to.

    The slot is the request's ``mamba_next_track_idx`` one; the index flips and
    ``mamba_last_track_seqlen`` moves to the tracked length right away (nothing
    reads them before the forward writes the slot)."""
    if not getattr(pool, "enable_mamba_extra_buffer", False):
        return None, None
    slots = []
    for req, length in zip(reqs, track_lens):
        if length is None:
            slots.append(None)
            continue
        slots.append(int(pool.get_mamba_ping_pong_track_buffer(req.req_pool_idx)[0, req.mamba_next_track_idx]))
        req.mamba_next_track_idx = 1 - req.mamba_next_track_idx
        req.mamba_last_track_seqlen = length
    return slots, track_lens


def _table_rows(pool, reqs: List[Req]) -> torch.Tensor:
    """The requests' rows of ``req_to_token``, int64 on the table's device."""
    return int64_tensor([r.req_pool_idx for r in reqs], pool.req_to_token.device)


def _last_locs(allocator, pool, rows: torch.Tensor, lens: torch.Tensor) -> Optional[torch.Tensor]:
    """The slot at column ``lens - 1`` of each table row ``rows`` (-1 where ``lens`` is 0), int64
    on the table's device: one gather, not a read (a device sync on CUDA) per request. None with
    one-slot pages, where the allocator does not need it (SGLang's ``alloc_for_decode``)."""
    if allocator.page_size == 1:
        return None
    table = pool.req_to_token
    lens = lens.to(table.device, torch.int64)
    return torch.where(lens > 0, table[rows, (lens - 1).clamp(min=0)].to(torch.int64), -1)


def _prefix_last_locs(reqs: List[Req], prefix_t: torch.Tensor, page_size: int) -> Optional[torch.Tensor]:
    """The last slot of each request's prefix (-1 where it has none), from ``prefix_indices``
    (as SGLang's ``alloc_for_extend``): a new row holds no prefix until ``write_extend``. None with
    one-slot pages, where the allocator does not need it."""
    if page_size == 1:
        return None
    held = [r.prefix_indices[-1:] for r in reqs if len(r.prefix_indices)]
    if not held:
        return torch.full((len(reqs),), -1, dtype=torch.int64)
    last_loc = torch.full((len(reqs),), -1, dtype=torch.int64, device=held[0].device)
    last_loc[(prefix_t > 0).to(last_loc.device)] = torch.cat(held).to(torch.int64)
    return last_loc


def _check_kept_rows(pool, reqs: List[Req]) -> None:
    """Debug mode (the pool's): each kept row holds its request's prefix, which ``write_extend``
    does not write again — a cache that left a row pointing elsewhere would have the forward read
    other KV, silently."""
    for req in reqs:
        held = pool.req_to_token[req.req_pool_idx, : len(req.prefix_indices)].to(torch.int64)
        ensure(torch.equal(held, req.prefix_indices.to(held.device, torch.int64)),
               f"request {req.rid}'s row {req.req_pool_idx} does not hold its {len(held)}-token prefix")


def prepare_for_extend(reqs: List[Req], runner, tree_cache) -> Optional[ForwardBatch]:
    """Rows for new requests, slots for ``[len(prefix_indices), len(fill_ids))`` of each."""
    pool, ps = runner.req_to_token_pool, runner.config.page_size
    fresh = [r.req_pool_idx is None for r in reqs]
    new = [r for r, f in zip(reqs, fresh) if f]
    if pool.debug:  # (before anything is taken)
        _check_kept_rows(pool, [r for r, f in zip(reqs, fresh) if not f])
    rows = _alloc_rows(pool, new, tree_cache) if new else []
    if rows is None:
        return None
    for req, row in zip(new, rows):
        req.req_pool_idx = row
        if hasattr(pool, "mamba_pool"):
            req.mamba_pool_idx = int(pool.get_mamba_indices(row)[0])
    prefix_lens = [len(r.prefix_indices) for r in reqs]
    seq_lens = [len(r.fill_ids) for r in reqs]
    num_tokens = sum(seq_lens) - sum(prefix_lens)
    prefix_t, seq_t = int64_tensor(prefix_lens), int64_tensor(seq_lens)
    out = alloc_extend_slots(runner, tree_cache, prefix_t, seq_t, _prefix_last_locs(reqs, prefix_t, ps), num_tokens)
    if out is None:
        pool.free([r.req_pool_idx for r in new])  # (a hybrid pool frees each row's Mamba slot with it)
        for req in new:
            req.req_pool_idx, req.mamba_pool_idx = None, None
        return None
    extend_lens = [s - p for p, s in zip(prefix_lens, seq_lens)]
    # a row kept from an earlier chunk holds its prefix already (cache_unfinished_req pointed it at the
    # tree's slots): only new rows get theirs (SGLang writes every row's)
    pool.write_extend([r.req_pool_idx for r in reqs], [r.prefix_indices if f else _NO_SLOTS for r, f in zip(reqs, fresh)],
                      prefix_lens, extend_lens, out)
    input_ids, positions = [], []
    for req, p, s in zip(reqs, prefix_lens, seq_lens):
        req.kv_allocated_len = s
        input_ids.extend(req.fill_ids[p:s])
        positions.extend(range(p, s))
    logprob_rows = [r.input_logprob_rows(p, s) for r, p, s in zip(reqs, prefix_lens, seq_lens)]
    track_slots, track_lens = _mamba_tracks(pool, reqs, [
        prefill_track_seqlen(p, e, r.mamba_branching_seqlen) for r, p, e in zip(reqs, prefix_lens, extend_lens)
    ])
    return extend_batch(
        ForwardMode.EXTEND, runner, reqs, input_ids, positions, out, prefix_lens, seq_lens,
        mamba_pool_indices=_mamba_indices(pool, reqs, runner),
        mamba_track_slots=track_slots,
        mamba_track_lens=track_lens,
        **_input_logprob_fields(reqs, logprob_rows, prefix_lens, extend_lens, runner),
        **_embed_fields(reqs, seq_lens, extend_lens, runner),
        **_mm_extend_fields(reqs, prefix_lens, seq_lens, runner),
    )


def alloc_extend_slots(runner, tree_cache, prefix_t: torch.Tensor, seq_t: torch.Tensor,
                       last_loc: Optional[torch.Tensor], num_tokens: int) -> Optional[torch.Tensor]:
    """Slots for tokens ``[prefix_len, seq_len)`` of each request (one ``alloc_extend`` over the
    batch; ``last_loc``: the slot before each one's first, or None with one-slot pages), evicting
    from the tree cache when short; None when they cannot be had even so."""
    allocator, device = runner.allocator, runner.device
    return _alloc_with_eviction(
        tree_cache, allocator,
        lambda: allocator.alloc_extend(
            prefix_t.to(device), seq_t.to(device), None if last_loc is None else last_loc.to(device),
            num_tokens, prefix_lens_cpu=prefix_t, seq_lens_cpu=seq_t,
        ),
        num_tokens + len(prefix_t) * runner.config.page_size,
    )


def extend_batch(mode: ForwardMode, runner, reqs: List[Req], input_ids: List[int], positions: List[int],
                 out: torch.Tensor, prefix_lens: List[int], seq_lens: List[int], **fields) -> ForwardBatch:
    """The :class:`ForwardBatch` of an extend-shaped step (a prefill's, a verify's): request ``i``
    computes tokens ``[prefix_lens[i], seq_lens[i])`` into slots ``out``; ``fields``: the others."""
    device, extend_lens = runner.device, [s - p for p, s in zip(prefix_lens, seq_lens)]
    extend_lens_t = runner.tensor(extend_lens)
    return ForwardBatch(
        forward_mode=mode,
        input_ids=runner.tensor(input_ids),
        positions=runner.tensor(positions),
        out_cache_loc=out.to(torch.int64),
        req_pool_indices=_table_rows(runner.req_to_token_pool, reqs).to(device),
        seq_lens=runner.tensor(seq_lens),
        extend_prefix_lens=runner.tensor(prefix_lens),
        extend_seq_lens=extend_lens_t,
        extend_start_loc=torch.cumsum(extend_lens_t, 0) - extend_lens_t,
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool=runner.token_to_kv_pool,
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefix_lens,
        extend_seq_lens_cpu=extend_lens,
        **runner.lora_fields(reqs),
        **fields,
    )


def _input_logprob_fields(reqs: List[Req], rows: List[range], prefix_lens: List[int], extend_lens: List[int],
                          runner) -> dict:
    """The extend batch's input-logprob fields (none when no request has a row to compute):
    request ``i``'s positions ``rows[i]`` as flat token indices, and the prompt token after each."""
    if not any(rows):
        return {}
    index, next_ids, start = [], [], 0
    for req, positions, p, e in zip(reqs, rows, prefix_lens, extend_lens):
        index.extend(range(start + positions.start - p, start + positions.stop - p))
        next_ids.extend(req.origin_input_ids_unpadded[positions.start + 1:positions.stop + 1])
        start += e
    top = max((r.sampling_params.top_logprobs_num for r, positions in zip(reqs, rows) if positions), default=0)
    return dict(input_logprob_indices=runner.tensor(index), input_logprob_next_ids=runner.tensor(next_ids),
                input_logprob_counts=[len(positions) for positions in rows], input_top_logprobs_num=top)


def _embed_fields(reqs: List[Req], seq_lens: List[int], extend_lens: List[int], runner) -> dict:
    """The extend batch's fields for its embedding requests (none when it has none):
    ``logits_indices``, the flat index of the last token of each other request (an embedding
    request has no logits row), ``embed_indices``, of each one that ends its prompt in it, and
    ``classifier_token_ids`` when one of those scores."""
    if all(r.has_logits_row for r in reqs):
        return {}
    ends = list(itertools.accumulate(extend_lens))
    fields = dict(logits_indices=runner.tensor([end - 1 for req, end in zip(reqs, ends) if req.has_logits_row]))
    pooled = [(req, end) for req, s, end in zip(reqs, seq_lens, ends) if req.pools_at(s)]
    if not pooled:
        return fields
    fields["embed_indices"] = runner.tensor([end - 1 for _, end in pooled])
    tokens = [req.sampling_params.pooling.classifier_token_ids for req, _ in pooled]
    if any(tokens):
        fields["classifier_token_ids"] = runner.tensor([ids or [0, 0] for ids in tokens])
    return fields


def _mm_extend_fields(reqs: List[Req], prefix_lens: List[int], seq_lens: List[int], runner) -> dict:
    """An extend batch's multimodal fields (none without an image request): every token's M-RoPE
    positions (a text request's its position thrice), and ``mm_items`` when it computes image tokens."""
    if all(r.mm_inputs is None for r in reqs):
        return {}
    positions = [torch.arange(p, s).expand(3, -1) if r.mm_inputs is None else r.mm_inputs.rope_positions(p, s)
                 for r, p, s in zip(reqs, prefix_lens, seq_lens)]
    items = [[] if r.mm_inputs is None else r.mm_inputs.images_in(p, s) for r, p, s in zip(reqs, prefix_lens, seq_lens)]
    fields = dict(mrope_positions=torch.cat(positions, dim=1).to(runner.device))
    if any(items):
        fields["mm_items"] = items
    return fields


def _mm_decode_fields(reqs: List[Req], positions: torch.Tensor) -> dict:
    """A decode batch's M-RoPE positions (none without an image request): each token's position
    plus its request's ``mrope_position_delta``, thrice."""
    if all(r.mm_inputs is None for r in reqs):
        return {}
    deltas = [0 if r.mm_inputs is None else r.mm_inputs.mrope_position_delta for r in reqs]
    return dict(mrope_positions=(positions + int64_tensor(deltas, positions.device)).expand(3, -1))


def logits_rows(reqs: List[Req]) -> Dict[int, int]:
    """Request index → its row of the logits of a forward of ``reqs`` (in batch order; an
    embedding request has none: :func:`_embed_fields`' ``logits_indices``)."""
    return {i: row for row, i in enumerate(i for i, r in enumerate(reqs) if r.has_logits_row)}


def free_swa_out_of_windows(reqs: List[Req], tree_cache) -> None:
    """Sliding-window models: free the SWA slots of the tokens that slid out of each request's
    window, from its committed KV (a no-op for other caches)."""
    free_swa_out_of_window = getattr(tree_cache, "free_swa_out_of_window", None)
    if free_swa_out_of_window is not None:
        for req in reqs:
            free_swa_out_of_window(req)


def prepare_for_decode(reqs: List[Req], runner, tree_cache) -> Optional[ForwardBatch]:
    """One slot per request for its last sampled token, at position ``seqlen - 1``.
    Sliding-window models first free the SWA slots of tokens that slid out of the window.
    The per-request arrays are built from the lengths and rows once, not a list each."""
    pool, allocator, device = runner.req_to_token_pool, runner.allocator, runner.device
    free_swa_out_of_windows(reqs, tree_cache)
    seq_lens = [r.seqlen for r in reqs]
    seq_t = int64_tensor(seq_lens)
    seq_dev = seq_t.to(device)
    # the batch's table cells as index tensors: one gather and one scatter on the table's device,
    # not a read (a device sync on CUDA) and a write per request
    rows = _table_rows(pool, reqs)
    cols = seq_t.to(pool.req_to_token.device, torch.int64) - 1
    last_loc = _last_locs(allocator, pool, rows, cols)
    out = _alloc_with_eviction(
        tree_cache, allocator,
        lambda: allocator.alloc_decode(seq_dev, None if last_loc is None else last_loc.to(device), seq_lens_cpu=seq_t),
        len(reqs) * runner.config.page_size,
    )
    if out is None:
        return None
    pool.req_to_token[rows, cols] = out.to(pool.req_to_token.device, pool.req_to_token.dtype)
    for req, s in zip(reqs, seq_lens):
        req.kv_allocated_len = s
    bs = len(reqs)
    interval = runner.config.mamba_track_interval
    track_slots, track_lens = _mamba_tracks(pool, reqs, [s if decode_should_track(s, interval) else None for s in seq_lens])
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        input_ids=runner.tensor([r.output_ids[-1] for r in reqs]),
        positions=seq_dev - 1,
        out_cache_loc=out.to(torch.int64),
        req_pool_indices=rows.to(device),
        seq_lens=seq_dev,
        extend_prefix_lens=seq_dev - 1,
        extend_seq_lens=torch.ones(bs, dtype=torch.int64, device=device),
        extend_start_loc=torch.arange(bs, dtype=torch.int64, device=device),
        req_to_token_pool=pool,
        token_to_kv_pool=runner.token_to_kv_pool,
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=[s - 1 for s in seq_lens],
        extend_seq_lens_cpu=[1] * bs,
        **runner.lora_fields(reqs),
        mamba_pool_indices=_mamba_indices(pool, reqs, runner),
        mamba_track_slots=track_slots,
        mamba_track_lens=track_lens,
        **_mm_decode_fields(reqs, seq_dev - 1),
    )


class DecodeRetractionMixin:
    """The decode step of the scheduler's ``running`` batch. Reads the scheduler's ``runner``,
    ``config``, ``tree_cache``, ``waiting``, ``new_token_ratio``, its room accounting
    (``_free_room``, ``_paged_after``, ``_swa_reserve``: :mod:`actors.engine.schedule_policy`) and
    its verify step (``_prepare_verify``: :mod:`actors.engine.spec_decode`)."""

    def _next_decode(self):
        """The running batch's decode step (a verify step when it can be one). When its slots cannot be had even after eviction,
        requests are retracted (:meth:`_retract_decode`) and the smaller batch is tried again."""
        retracted = False
        while self.running:
            # a verify step when requests have drafts and room for them (not right after a retraction)
            forward_batch = None if retracted else self._prepare_verify()
            if forward_batch is None:
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
        estimated from those left (from the retracted if none is). The retracted go to the head
        of ``waiting`` in the order they ran in; returns them."""
        ran_in = {id(r): i for i, r in enumerate(self.running)}
        retracted: List[Req] = []
        for req in sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids))):
            if retracted and (len(self.running) <= 1 or self._decode_steps_fit(self.running)):
                break
            retracted.append(req)
            self._retract(req)
        self.waiting[: len(retracted)] = sorted(self.waiting[: len(retracted)], key=lambda r: ran_in[id(r)])
        # every one retracted (the last one's slot was held elsewhere): from them, who come back first
        # (an empty batch gave 0, and the admissions right after an out-of-memory reserved nothing)
        left = self.running or retracted
        decoded = sum(len(r.output_ids) for r in left)
        max_new = sum(r.sampling_params.max_new_tokens for r in left) or 1
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(left)) / max_new)
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
            need = self._paged_after(req.seqlen - 1, steps)  # (the last sampled token has no KV yet)
            full_need += need
            swa_need += self._swa_reserve(need)
        full, swa = self._free_room()
        return full_need <= full and (swa is None or swa_need <= swa)

    def retract_all(self) -> List[Req]:
        """SGLang's ``pause_generation(mode="retract")``: every running request back to the head of
        ``waiting`` in the order they ran in, then the one prefilling in chunks (``chunked_req``), its
        KV freed (its prompt and output re-prefilled when it is admitted again); returns them. Then no
        request holds KV: a paused update may flush the cache."""
        retracted = list(self.running) + ([self.chunked_req] if self.chunked_req is not None else [])
        for req in reversed(retracted):
            self._retract(req)
        return retracted

    def _retract(self, req: Req) -> None:
        """Retract a running request (or the chunked one): free its KV, requeue it at the head of
        ``waiting`` — even if freeing fails partway (it holds nothing then: not freed again, it is
        where a failure path finds it)."""
        if req is self.chunked_req:
            self.chunked_req = None
        else:
            self.running.remove(req)
        try:
            self.tree_cache.cache_finished_req(req, is_insert=False)
        finally:
            req.reset_for_retract()
            self.waiting.insert(0, req)
        self.num_retractions += 1
