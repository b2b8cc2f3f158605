"""Continuous batching: which requests run in the next forward, and what to do after.

One ``step()`` = pick a batch (a prefill batch if any waiting request fits,
else the running decode batch — with speculative decoding a verify step of
their drafts when it can be one), run the model, process the results. The
control path reads top to bottom in :meth:`Scheduler.step`.

Memory rules (seed 000 §10.4): a prefill is admitted only if its tokens plus
a reserve for the running requests' future decode tokens
(``remaining max_new_tokens × new_token_ratio``, in each request's whole
pages) fit in free + evictable
slots (for a sliding-window model, the smaller of its full and SWA pools); a
long prompt is cut into ``chunked_prefill_size`` chunks cached with
``cache_unfinished_req``; when a decode step cannot get its slots even after
eviction, requests are retracted to the waiting queue (their KV freed,
recomputed later) until the rest have room for ``RETRACT_DECODE_STEPS`` more
steps, and ``new_token_ratio`` is estimated anew (SGLang's ``retract_decode``).

Where the parts live (SGLang's split): admission and prefill planning in
:mod:`actors.engine.schedule_policy` (:class:`PrefillAdmissionMixin`), the
decode step and retraction beside the batch preparation in
:mod:`actors.engine.schedule_batch` (:class:`DecodeRetractionMixin`), the verify
step in :mod:`actors.engine.spec_decode` (:class:`SpecDecodeMixin`); the loop,
the results and aborts here.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, List, Optional, Tuple

import torch

from actors.engine.config import CHUNKED_PREFILL_DEFAULT
from actors.engine.finish import check_finished, stream_text
from actors.engine.grammar import GrammarBackend, active_matcher
from actors.engine.micro_batch import MicroBatchMixin
from actors.engine.models.base import InputLogprobs
from actors.engine.multimodal import check_mm_count
from actors.engine.pooling import PoolingParams, pool_embedding
from actors.engine.req import Req
from actors.engine.sampling import Pick, pick_tokens
from actors.engine.sampling_params import bad_words_token_ids
from actors.engine.sparse_logits import LogitState
from actors.engine.schedule_batch import DecodeRetractionMixin, logits_rows
from actors.engine.schedule_order import SchedulePolicy
from actors.engine.schedule_policy import PrefillAdmissionMixin
from actors.engine.spec_decode import SpecDecodeMixin
from mem_cache.hicache_storage import HiCacheFile, rank_storage_dir
from mem_cache.hiradix_cache import HiRadixCache
from mem_cache.mamba_radix_cache import MambaRadixCache
from mem_cache.radix_cache import RadixCache
from mem_cache.swa_hiradix_cache import SWAHiRadixCache
from mem_cache.swa_hiradix_storage import swa_storage_backends
from mem_cache.swa_hiradix_tiers import PoolOpLog
from mem_cache.swa_radix_cache import SWARadixCache

logger = logging.getLogger(__name__)


class Scheduler(MicroBatchMixin, PrefillAdmissionMixin, DecodeRetractionMixin, SpecDecodeMixin):
    def __init__(self, runner, tokenizer=None):
        self.runner = runner
        self.config = cfg = runner.config
        self.tokenizer = tokenizer
        self.page_size = cfg.page_size
        self.hybrid = runner.spec.kind == "hybrid_mamba"
        self.swa = runner.spec.kind == "swa"
        self.file_tier = False  # a HiRadixCache with storage: admission prefetches from it
        self.host_tier = False  # a HiRadixCache (or SWAHiRadixCache): its loads start before a forward, end after it
        if self.swa and cfg.enable_hierarchical_cache:
            self.tree_cache = self._swa_host_tier(cfg, runner)
            self.host_tier, self.file_tier = True, bool(cfg.hicache_storage_dir)
        elif self.swa:
            self.tree_cache = SWARadixCache(
                runner.req_to_token_pool, runner.allocator, runner.spec.sliding_window, page_size=cfg.page_size,
                enable_kv_events=cfg.enable_kv_events, disable=cfg.disable_radix_cache,
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
            controller.set_peers_loads(runner.host_peers_loads)
            # a failed load's readers go through: only the requests whose prefix it was read garbage
            # (attention is per request), and the step requeues them (_requeue_failed_loads)
            controller.layer_done_counter.fail_readers = False
        else:
            self.tree_cache = RadixCache(
                runner.req_to_token_pool, runner.allocator, page_size=cfg.page_size, disable=cfg.disable_radix_cache,
                eviction_policy=cfg.radix_eviction_policy, enable_kv_events=cfg.enable_kv_events,
            )
        self.policy = SchedulePolicy(cfg, self.tree_cache, self._match_prefix)
        self._init_spec()
        self.grammars = GrammarBackend(tokenizer, cfg.tokenizer_path or cfg.model_path,
                                       runner.model_config.get_text_config().vocab_size,
                                       any_whitespace=not cfg.constrained_json_disable_any_whitespace)
        chunk = cfg.chunked_prefill_size if cfg.chunked_prefill_size is not None else CHUNKED_PREFILL_DEFAULT
        self.chunked_prefill_size = None if chunk <= 0 else max(self.page_size, chunk // self.page_size * self.page_size)
        self.context_len = min(runner.context_len, self._max_request_len())
        if self.context_len < 2:  # not even a one-token prompt and one output token: refused at start
            pools = f"{runner.allocator.size} KV slots" + (
                f", {runner.allocator.size_swa} SWA slots for a window of {self._swa_window_slots()}" if self.swa else "")
            raise ValueError(f"the KV pools ({pools}, page_size {self.page_size}) cannot hold a single request: "
                             "raise max_total_tokens (or swa_full_tokens_ratio) or lower page_size")
        if self.context_len < runner.context_len:
            logger.warning("requests are held to %d tokens (prompt + output), what the KV pool holds for one "
                           "request; the model's context is %d", self.context_len, runner.context_len)
        self.waiting: List[Req] = []
        self.running: List[Req] = []
        self.chunked_req: Optional[Req] = None
        self.new_token_ratio = cfg.init_new_token_ratio
        self.num_retractions = 0
        self.num_preemptions = 0  # requests retracted for one of a higher priority (in num_retractions too)
        self._aborted: List[Req] = []  # finished while waiting: reported at the next step
        self.in_flight: List[Req] = []  # the prefill batch being run and processed (every micro-batch's)
        self._init_micro_batches()
        self._prefetch_blocked = False  # the last admission skipped a request whose prefetch is not ready
        self.stalled = False  # the last step ran nothing only because of that

    @staticmethod
    def _swa_host_tier(cfg, runner) -> SWAHiRadixCache:
        """A sliding-window model's hierarchical cache: host pools for both halves of its KV,
        copies made at once (``hicache_overlap_load`` / ``_write`` do not apply), each pool's
        pages in a file tier of its own (``hicache_storage_dir``, written off the loop, read at
        admission); with TP their copies go to the followers tagged with their pool, and so do
        the reads rank 0 asks of them."""
        storage = (None, None)
        if cfg.hicache_storage_dir:
            storage = swa_storage_backends(rank_storage_dir(cfg.hicache_storage_dir, runner.tp.rank, runner.tp.size))
        tree = SWAHiRadixCache(
            runner.req_to_token_pool, runner.allocator, runner.token_to_kv_pool, runner.spec.sliding_window,
            cfg.page_size, host_to_device_ratio=cfg.hicache_ratio, write_policy=cfg.hicache_write_policy,
            storage_backends=storage, async_storage_writes=True, enable_kv_events=cfg.enable_kv_events,
            disable=cfg.disable_radix_cache,
        )
        for pool, controller in enumerate((tree.cache_controller, tree.swa_cache_controller)):
            if runner.host_op_log is not None:  # TP rank 0: what the other ranks replay
                controller.op_log = PoolOpLog(runner.host_op_log, pool)
            if runner.storage_peers_read is not None:  # ... and the reads they make alike
                controller.peers_read = lambda keys, host, pool=pool: runner.storage_peers_read(keys, host, pool)
        return tree

    def _max_request_len(self) -> int:
        """Tokens (prompt + output) one request can hold in the empty pools, less a page
        of slack for the admission check (SGLang's ``max_req_len``): a request held to it
        is admitted once the requests before it are done. A sliding-window model's SWA
        pool needs to hold a prefill chunk, not the prompt, if it has room for two chunks
        and two windows (a chunked request's lock holds the SWA KV of the tree nodes
        covering its last window — whole nodes, up to a chunk and a window; without the
        tree, its own last window — and the next chunk comes on top, with up to a window
        of decode reserve); otherwise the whole
        prompt (a retracted request's too) must fit it besides a window. Paged, a window
        is whole pages (``_swa_window_slots``)."""
        alloc, page = self.runner.allocator, self.page_size
        if not self.swa:
            return self.total_tokens() - page
        window, chunk = self._swa_window_slots(), self.chunked_prefill_size
        if chunk is not None and 2 * (chunk + window) + page <= alloc.size_swa:
            return alloc.size - page
        return min(alloc.size, alloc.size_swa - window) - page

    def check_request(self, req: Req) -> None:
        """Refuse a prompt longer than a request may be, a token id outside the vocabulary in the
        prompt, ``logit_bias``, ``allowed_token_ids``, ``bad_words`` (which need the tokenizer:
        their tokens are found here, ``req.bad_words_ids``) or a score's ``classifier_token_ids``, a
        priority without priority scheduling, an embedding's ``dimensions`` beyond the hidden size,
        a LoRA adapter this engine does not serve, or a grammar that does not compile (ValueError);
        hold ``max_new_tokens`` to what fits after it, as the context length would end it anyway — a
        reservation for more could never be granted. A request with a grammar gets its matcher
        here, compiled on the caller's thread (:mod:`actors.engine.grammar`)."""
        if len(req.origin_input_ids) >= self.context_len:
            held = "" if self.context_len == self.runner.context_len else " (what this worker's KV pool holds)"
            raise ValueError(f"prompt of {len(req.origin_input_ids)} tokens does not fit the context length "
                             f"{self.context_len}{held}")
        vocab, ids = self.runner.model_config.get_text_config().vocab_size, req.origin_input_ids_unpadded
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:  # it would fail the whole batch (on CUDA: a device-side assert)
            raise ValueError(f"token id {bad} in the prompt is out of the vocabulary (ids are 0..{vocab - 1})")
        if req.mm_inputs is not None:  # (processed inputs too: a PD worker's, from the server's tokenizer side)
            for modality, count in req.mm_inputs.counts.items():
                check_mm_count(modality, count, self.config.limit_mm_per_prompt)
        if req.priority and not self.config.enable_priority_scheduling:  # (vLLM refuses it too)
            raise ValueError(f"priority {req.priority}: priority scheduling is not enabled "
                             "(enable_priority_scheduling)")
        params = req.sampling_params
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words: need the tokenizer (skip_tokenizer_init=True)")
            req.bad_words_ids = bad_words_token_ids(params.bad_words, self.tokenizer)
        for field, ids in (("logit_bias", params.logit_bias or {}),
                           ("allowed_token_ids", params.allowed_token_ids or ()),
                           ("bad_words", [t for word in req.bad_words_ids for t in word])):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{field}: token id {bad} is out of the vocabulary (ids are 0..{vocab - 1})")
        if params.pooling is not None:
            self._check_pooling(params.pooling, vocab)
        if req.lora_path is not None:
            req.extra_key = self.runner.check_lora(req.lora_path)
        params.max_new_tokens = min(params.max_new_tokens, self.context_len - len(req.origin_input_ids))
        req.grammar = self.grammars.matcher(params, req.eos_token_ids)

    def _check_pooling(self, pooling: PoolingParams, vocab: int) -> None:
        hidden = self.runner.model_config.get_text_config().hidden_size
        if (pooling.dimensions or 0) > hidden:
            raise ValueError(f"dimensions: {pooling.dimensions} is more than the model's hidden size ({hidden})")
        bad = next((t for t in pooling.classifier_token_ids or () if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"classifier_token_ids: token id {bad} is out of the vocabulary (ids are 0..{vocab - 1})")

    # ---- the loop ---------------------------------------------------------------
    def step(self) -> List[Req]:
        """Run one forward; returns the requests that produced output (or finished)."""
        released = self._release_aborted()
        try:
            if self.pp_micro_batches > 1:
                out = released + self._step_micro_batches()
            else:
                out = released + self._run_batch(bool(released))
        except BaseException:  # released already: the loop's failure path only tells them
            self._aborted[:0] = released
            self.micro_batches.clear()  # (their requests are in ``in_flight``: the failure path ends them)
            raise
        if not self.has_work():  # idle: the ratio a retraction raised starts over (SGLang's idle self-check)
            self.new_token_ratio = self.config.init_new_token_ratio
        return out

    def _run_batch(self, released: bool) -> List[Req]:
        self.end_orphan_prefetches()
        if self.host_tier:  # backups done: their prefixes are evictable again
            self.tree_cache.writing_check()
            self._drop_unread_load_failures()
        self.stalled = False
        batch_reqs, forward_batch = self._next_prefill()
        if forward_batch is not None:
            self.in_flight = batch_reqs  # out of every queue until processed: a failure must still find them
            output = self._forward(forward_batch)
            self._add_input_logprobs(batch_reqs, forward_batch, output.input_logprobs)
            self._add_embeddings(batch_reqs, output.embeddings, output.classifier_logits)
            # (what each forward read: its cached part; asked only after a failed load)
            batch_reqs, logits = self._requeue_failed_loads(batch_reqs, lambda r: len(r.prefix_indices),
                                                            output.next_token_logits)
            out = self._process_prefill(batch_reqs, logits)
            self.in_flight = []
            return out
        if self.host_tier:  # loads of a batch that was not run end now
            self.tree_cache.loading_check(raise_failed=False)
            self._drop_unread_load_failures()
        if self.running:
            batch_reqs, forward_batch = self._next_decode()
            if forward_batch is not None:
                logits = self._forward(forward_batch).next_token_logits
                if forward_batch.forward_mode.is_target_verify:
                    return self._process_verify(batch_reqs, forward_batch, logits)
                # (the last sampled token has no KV yet)
                batch_reqs, logits = self._requeue_failed_loads(batch_reqs, lambda r: r.seqlen - 1, logits)
                # (picked for the batch: no logits row per request, a view each cost ~45 us a step of 64)
                return self._process_decode(batch_reqs, [[pick] for pick in self._pick_tokens(batch_reqs, logits)])
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
        finally:  # (a failed load is kept for _requeue_failed_loads)
            self.tree_cache.loading_check(raise_failed=False)

    def _requeue_failed_loads(self, reqs: List[Req], read_len: Callable[[Req], int], logits):
        """After a forward: the requests whose row ``[0, read_len(req))`` holds a slot a failed
        host-tier load was to fill (here or on another TP rank) read garbage there, and so did
        what they computed. Each is requeued at the head of ``waiting``, its KV freed (none of
        it cached), to be recomputed without the host tier (the slots the load lost have left
        the device: no match finds them). Returns the other requests and their logits rows
        (:func:`logits_rows`), which are valid (attention reads each request's own rows).

        In a prefill batch only a request at its first chunk can be hit: a load fills slots
        allocated at this step's admission (``_load_host_prefix``, new requests only) and ends
        in :meth:`_forward`, so its failure is known here, after the forward beside it; a
        continuing chunk reads only slots it held through the step before. A PD prefill
        scheduler has pushed none of a requeued request's KV yet (it pushes a chunk only after
        this check)."""
        failed = self.tree_cache.take_failed_loads() if self.host_tier else None
        if failed is None:
            return reqs, logits
        table = self.runner.req_to_token_pool.req_to_token
        slots = failed.slots.to(table.device)
        hit = [bool(torch.isin(table[r.req_pool_idx, :read_len(r)].to(torch.int64), slots).any()) for r in reqs]
        requeued = [r for r, h in zip(reqs, hit) if h]
        logger.error("loading KV from the host tier failed (%s); requeued the requests that read it: %s",
                     failed.error, [r.rid for r in requeued])
        if not requeued:
            return reqs, logits
        for req in requeued:
            self._requeue(req)
        self.waiting[:0] = requeued
        rows = logits_rows(reqs)
        kept = [i for i, h in enumerate(hit) if not h]
        kept_rows = [rows[i] for i in kept if i in rows]
        return [reqs[i] for i in kept], logits[torch.tensor(kept_rows, dtype=torch.int64, device=logits.device)]

    def _requeue(self, req: Req) -> None:
        """Free all of ``req``'s KV without caching any of it. At its first chunk (no KV of its
        own committed) it is no retraction: a request not retracted before reports what its
        re-admission reuses (``cached_tokens``), not the prefix it read garbage in. Past it (a
        decode's load hit it), its earlier chunks stay in the tree, where its re-admission
        finds them: reset as a retraction, its count stays its first admission's."""
        if req in self.running:
            self.running.remove(req)
        ran = req.kv_committed_len > 0  # (before this forward)
        req.kv_committed_len = max(req.kv_committed_len, req.kv_allocated_len)  # the forward's slots too
        try:
            self.tree_cache.cache_finished_req(req, is_insert=False)
        finally:
            if ran:
                req.reset_for_retract()
            else:
                req.reset_kv()
                if req.num_retractions == 0:  # (a retracted one's count is its first admission's)
                    req.cached_tokens = 0
            # (read garbage too: computed again)
            req.input_token_logprobs, req.input_token_ranks, req.input_top_logprobs = [], [], []
            req.host_load_failed = True

    def _drop_unread_load_failures(self) -> None:
        """Failed loads no forward read (ended before one ran): logged, nothing to requeue."""
        failed = self.tree_cache.take_failed_loads()
        if failed is not None:
            logger.error("loading KV from the host tier failed outside a forward: %s", failed.error)

    def close(self) -> None:
        """End the host tier's loads and its loader thread (after the loop stopped)."""
        if self.host_tier:
            try:
                self.tree_cache.writing_check(wait=True)
                self.tree_cache.loading_check()
                self.tree_cache.cancel_prefetches()
            finally:
                self.tree_cache.cache_controller.close()
                if self.swa:
                    self.tree_cache.swa_cache_controller.close()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req or self._aborted or self.micro_batches)

    # ---- results ----------------------------------------------------------------------
    def _sample(self, req: Req, logits_row, pick: Optional[Pick] = None) -> None:
        """Append ``req``'s next token (``pick``: already picked by the batch's
        :meth:`_pick_tokens`; else picked here from its logits row, which is read only then) and
        see whether it finished."""
        if pick is None:
            pick = self._pick_tokens([req], logits_row[None])[0]
        req.append_token(pick.token)
        if req.sampling_params.return_logprob:
            req.output_logprobs.append(pick.logprob)
            if pick.top_logprobs is not None:
                req.output_top_logprobs.append(pick.top_logprobs)
        stream_text(req, self.tokenizer)
        check_finished(req, self.tokenizer, self.context_len)

    @staticmethod
    def _pick_tokens(reqs: List[Req], logits) -> List[Pick]:
        """Each request's next token and raw logprobs from its row of the step's ``logits``
        ``[bs, vocab]`` (:func:`~actors.engine.sampling.pick_tokens`, which adjusts them in
        place and samples on their device): a request's bias, masks and seen tokens are kept
        with it (``req.logit_state``) and take only its new tokens each step; a seeded one
        draws from its own generator on the logits' device; one with a grammar from the tokens
        its matcher allows (any while the grammar is held back for its thinking)."""
        states = [Scheduler._logit_state(req, logits.shape[-1]) for req in reqs]
        generators = [req.generator_on(logits.device) for req in reqs]
        matchers = [active_matcher(r.grammar) for r in reqs]
        return pick_tokens(logits, [r.sampling_params for r in reqs], generators, states, matchers)

    @staticmethod
    def _logit_state(req: Req, vocab: int) -> Optional[LogitState]:
        """``req``'s :class:`LogitState` synced to its output (made at its first use), None when it
        has nothing to adjust."""
        state = req.logit_state
        if state is None or state.vocab != vocab or state.params is not req.sampling_params:
            needed = LogitState.needed(req.sampling_params)
            state = req.logit_state = LogitState(req.sampling_params, req.origin_input_ids_unpadded,
                                                 req.eos_token_ids, vocab, req.bad_words_ids) if needed else None
        if state is not None:
            state.sync(req.output_ids)
        return state

    @staticmethod
    def _add_input_logprobs(reqs: List[Req], forward_batch, logprobs: Optional[InputLogprobs]) -> None:
        """Append each request's rows of the forward's input logprobs (``input_logprob_counts``, in
        batch order) to what its earlier chunks gave."""
        if logprobs is None:
            return
        values, ranks = logprobs.token_logprobs.tolist(), logprobs.token_ranks.tolist()
        tops = None if logprobs.top_values is None else (logprobs.top_ids.tolist(), logprobs.top_values.tolist())
        start = 0
        for req, n in zip(reqs, forward_batch.input_logprob_counts):
            req.input_token_logprobs += values[start:start + n]
            req.input_token_ranks += ranks[start:start + n]
            k = req.sampling_params.top_logprobs_num
            if k and n:
                req.input_top_logprobs += [list(zip(ids[:k], vals[:k]))
                                           for ids, vals in zip(tops[0][start:start + n], tops[1][start:start + n])]
            start += n

    @staticmethod
    def _add_embeddings(reqs: List[Req], embeddings: Optional[torch.Tensor],
                        classifier_logits: Optional[torch.Tensor]) -> None:
        """Each embedding request whose prompt ended in this forward takes its row (in batch order,
        as ``embed_indices``), cut and normalised as it asks, or its score from its row of
        ``classifier_logits``; one copy off the device for them all."""
        if embeddings is None:
            return
        pooled = [r for r in reqs if r.pools_at(len(r.fill_ids))]
        scores = [None] * len(pooled) if classifier_logits is None else classifier_logits.cpu()
        for req, row, logits in zip(pooled, embeddings.cpu(), scores):
            req.embedding = pool_embedding(row, logits, req.sampling_params.pooling)

    def _process_prefill(self, reqs: List[Req], logits) -> List[Req]:
        out: List[Req] = []
        rows = logits_rows(reqs)
        done = [i for i, req in enumerate(reqs)  # the requests sampled now, in one batch
                if len(req.fill_ids) >= req.seqlen and req.sampling_params.max_new_tokens > 0]
        picks = {}
        if done:
            picks = dict(zip(done, self._pick_tokens([reqs[i] for i in done], logits[[rows[i] for i in done]])))
        self.runner.allocator.free_group_begin()
        try:  # (failing, the batch is still ``in_flight``: the loop's failure path finds it)
            for i, req in enumerate(reqs):
                req.kv_committed_len = len(req.fill_ids)
                if len(req.fill_ids) < req.seqlen:  # more chunks to go
                    self.tree_cache.cache_unfinished_req(req)
                    self.chunked_req = req
                    continue
                if req.mm_inputs is not None:  # its prompt is in the KV: its images' embeddings are done with
                    req.mm_inputs.release_embeddings()
                self._prefill_done(req, logits[rows[i]] if i in rows else None, picks.get(i))
                out.append(req)
        finally:  # the group's frees happen even if a request failed: a failure path's frees are not parked
            self.runner.allocator.free_group_end()
        return out

    def _prefill_done(self, req: Req, logits_row, pick: Optional[Pick] = None) -> None:
        """A request's whole prompt is in the KV: sample (``pick``, when the batch picked it
        already), then cache or keep running."""
        if req.sampling_params.max_new_tokens == 0:
            req.finish({"type": "length", "length": 0})
        else:
            self._sample(req, logits_row, pick)
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        if req.finished:
            self.tree_cache.cache_finished_req(req)
        else:
            self.tree_cache.cache_unfinished_req(req)
            self.running.append(req)

    def _process_decode(self, reqs: List[Req], runs: List[List[Pick]], verified: bool = False) -> List[Req]:
        """Each request's run of picked tokens (one; a verify step's: its accepted drafts and the
        token after them) appended until one finishes it — where as many decode steps would have
        stopped —; the KV of the tokens kept is committed (``verified``: and a hybrid model's state
        after them, for the whole batch in one commit before any finished request is cached), a
        verify step's other slots freed."""
        commits: List[Tuple[int, int, int]] = []
        done: List[Req] = []
        released: List[Req] = []
        self.runner.allocator.free_group_begin()
        try:
            try:
                for req, run in zip(reqs, runs):
                    for pick in run:
                        self._sample(req, None, pick)
                        if req.finished:
                            break
                    computed = req.kv_committed_len
                    req.kv_committed_len = req.seqlen - 1  # (the last token has no KV yet)
                    if verified:
                        commits += self._verified_state_commits(req, req.kv_committed_len - computed)
                    self._free_draft_slots(req)
                    done.append(req)
            finally:  # (after a failure too: those processed before it are committed and released)
                self._commit_verified_states(commits)
                for req in done:
                    if req.finished:
                        self.tree_cache.cache_finished_req(req)
                        released.append(req)
        except BaseException:  # those released before the failure: only told
            self._aborted += released
            raise
        finally:  # a released request never stays in ``running``, where it would count as an abort; a
            # finished one not released (a failure before) stays, for ``_release_aborted`` to release
            self.runner.allocator.free_group_end()
            gone = {id(r) for r in released}
            self.running = [r for r in self.running if id(r) not in gone]
        return reqs

    # ---- abort --------------------------------------------------------------------------
    def abort(self, rid: str) -> bool:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish({"type": "abort", "message": "aborted"})  # (waiting, it holds nothing: see _drop_planned)
                self._aborted.append(req)
                return True
        for req in self.running + ([self.chunked_req] if self.chunked_req else []) + self.in_flight:
            if req.rid == rid and not req.finished:  # (in flight: released when its batch's output comes back)  # (a finished one: ended already, its id maybe reused)
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
                if self.chunked_req.mm_inputs is not None:  # (its prefill ends here: a TP follower's too)
                    self.chunked_req.mm_inputs.release_embeddings()
                released.append(self.chunked_req)
                self.chunked_req = None
        except BaseException:
            self._aborted[:0] = released
            raise
        return released
