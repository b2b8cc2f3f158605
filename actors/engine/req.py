"""A request's state as the scheduler and the tree cache see it.

Token bookkeeping (positions in ``origin_input_ids + output_ids``)::

    [0, len(prefix_indices))      reused from the tree cache (locked at last_node)
    [0, cache_protected_len)      the tree's own slots: never freed by the request
    [0, kv_committed_len)         tokens whose KV is in the request's row
    fill_ids                      what the next extend computes up to (a chunk may stop early)

The last sampled token has no KV until the next decode step computes it.

A request is equal only to itself (``eq=False``): the queues' ``in`` and ``remove`` compare
identities, not every field of every request they pass (which cost milliseconds per prefill
batch, and could take a different request with the same fields for this one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from actors.engine.sampling import make_generator
from actors.engine.sampling_params import SamplingParams


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: List[int]
    sampling_params: SamplingParams
    eos_token_ids: List[int] = field(default_factory=list)
    extra_key: Optional[str] = None
    priority: int = 0
    lora_path: Optional[str] = None  # its LoRA adapter's name (SGLang's lora_path); None: the base model
    # its images (actors.engine.multimodal.MultimodalInputs): their tokens in origin_input_ids hold each
    # image's pad value (the prefix cache's key), origin_input_ids_unpadded the image token
    mm_inputs: Any = None
    output_ids: List[int] = field(default_factory=list)
    fill_ids: List[int] = field(default_factory=list)
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    req_pool_idx: Optional[int] = None
    cache_protected_len: int = 0
    kv_committed_len: int = 0
    kv_allocated_len: int = 0  # slots written into the row (>= committed while a forward is in flight)
    cached_tokens: int = 0
    # with a host tier: [len(prefix_indices), + host_hit_length) is on the host, ending at last_host_node
    # (loaded back once the request is taken)
    host_hit_length: int = 0
    last_host_node: Any = None
    prefetch_op: Any = None  # the file tier's fetch of its pages, from its arrival to its admission
    storage_checked_len: int = 0  # the file tier was asked for this many leading tokens (asked once per length)
    host_load_failed: bool = False  # requeued after a failed host-tier load: its prefix is not loaded again
    finished_reason: Optional[dict] = None
    output_text: str = ""
    min_tokens_text_len: int = 0  # the text of the first min_new_tokens output tokens: no stop string ends in it
    detokenizer: Any = None  # its IncrementalText (actors.engine.finish), from the first token on
    output_logprobs: List[float] = field(default_factory=list)
    output_top_logprobs: List[List[tuple]] = field(default_factory=list)
    # prompt positions [input_logprob_start(), + len) (return_logprob with logprob_start_len), one forward's at a time
    input_token_logprobs: List[float] = field(default_factory=list)
    input_token_ranks: List[int] = field(default_factory=list)  # each one's rank in the vocabulary (1: the best)
    input_top_logprobs: List[List[tuple]] = field(default_factory=list)
    embedding: Optional[List[float]] = None  # an embedding request's (sampling_params.pooling), once its prompt ran
    bad_words_ids: List[List[int]] = field(default_factory=list)  # its bad words' tokens (bad_words_token_ids)
    logit_state: Any = None  # its sparse bias, masks and seen tokens (sparse_logits.LogitState), once sampled
    grammar: Any = None  # its xgrammar GrammarMatcher or ReasonerGrammar (actors.engine.grammar), after output_ids
    ngram_index: Any = None  # its n-gram lookup for speculative drafts (actors.engine.ngram.NgramIndex), once drafted
    created_time: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_retractions: int = 0
    # hybrid (Mamba) models
    mamba_pool_idx: Optional[int] = None
    mamba_next_track_idx: int = 0
    mamba_last_track_seqlen: Optional[int] = None
    mamba_branching_seqlen: Optional[int] = None
    kv_only_lock: bool = False  # the lock at last_node holds its path's KV, no state (a decode reservation's)
    # sliding-window models: [cache_protected_len, swa_evicted_seqlen) of the row had their
    # SWA slots freed (out of the window); swa_uuid_for_lock is what dec_lock_ref needs back
    swa_evicted_seqlen: int = 0
    swa_uuid_for_lock: Optional[int] = None

    def __post_init__(self):
        if self.lora_path is not None and self.extra_key is None:
            # KV computed under an adapter is that adapter's: the tree shares it only within the adapter
            # (SGLang keys a LoRA request's prefixes by its adapter)
            self.extra_key = self.lora_path
        self.generator: Optional[torch.Generator] = None  # a seeded request's, on the device it samples on

    def generator_on(self, device) -> Optional[torch.Generator]:
        """A seeded request's generator on ``device`` (made, from the seed, at its first draw
        there); None for an unseeded one, which draws from the device's default generator."""
        seed = self.sampling_params.seed
        if seed is None:
            return None
        if self.generator is None or self.generator.device != torch.device(device):
            self.generator = make_generator(seed, device)
        return self.generator

    @property
    def origin_input_ids_unpadded(self) -> List[int]:
        """The prompt as token ids (SGLang's): an image's tokens the image token, not its pad value."""
        return self.origin_input_ids if self.mm_inputs is None else self.mm_inputs.unpadded_input_ids

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def extend_input_len(self) -> int:
        return len(self.fill_ids) - len(self.prefix_indices)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def input_logprob_start(self) -> Optional[int]:
        """The first prompt position given an input logprob: ``logprob_start_len``, but at least
        1 (position 0 has no context to be predicted from); None when none are asked for."""
        params = self.sampling_params
        if not params.return_logprob or params.logprob_start_len < 0:
            return None
        return min(max(1, params.logprob_start_len), len(self.origin_input_ids))

    def input_logprob_pending(self) -> Optional[int]:
        """The first prompt position whose input logprob is still to compute (None: none is):
        the logits row before it is the first a forward must keep, so no cached prefix is
        reused past ``pending - 1``."""
        start = self.input_logprob_start()
        if start is None or start + len(self.input_token_logprobs) >= len(self.origin_input_ids):
            return None
        return start + len(self.input_token_logprobs)

    def input_logprob_rows(self, prefix_len: int, seq_len: int) -> range:
        """Positions ``q`` of an extend over ``[prefix_len, seq_len)`` whose logits give input
        logprobs (of prompt token ``q + 1``): from the pending one on, the prompt's last excluded
        (its logits are the first output token's)."""
        pending = self.input_logprob_pending()
        if pending is None:
            return range(0)
        if pending - 1 < prefix_len:  # (the prefix match stops before it: these rows would never be computed)
            raise RuntimeError(f"request {self.rid}: its {prefix_len}-token prefix covers prompt positions whose "
                               f"input logprobs are pending (from {pending})")
        return range(pending - 1, min(seq_len, len(self.origin_input_ids) - 1))

    @property
    def has_logits_row(self) -> bool:
        """Whether an extend returns this request's logits row: an embedding request's never (it
        samples nothing, so no ``lm_head`` row is computed for it)."""
        return self.sampling_params.pooling is None

    def pools_at(self, seq_len: int) -> bool:
        """Whether an extend up to ``seq_len`` gives this request's embedding: it is an embedding
        request and the extend is its prompt's last chunk."""
        return self.sampling_params.pooling is not None and seq_len >= len(self.origin_input_ids)

    def all_ids(self) -> List[int]:
        return self.origin_input_ids + self.output_ids

    def append_token(self, token: int) -> None:
        """Append a generated token; the grammar, if any, takes it too. A token the grammar
        rejects (its mask leaves none other drawable: only logits that were all NaN or
        ``-inf`` give one) ends the request."""
        self.output_ids.append(token)
        if self.grammar is not None and not self.grammar.accept_token(token):
            self.finish({"type": "abort", "message": f"token {token} does not follow the request's grammar"})

    def finish(self, reason: dict) -> None:
        self.finished_reason = reason
        self.finished_time = time.perf_counter()

    def reset_for_retract(self) -> None:
        """Back to waiting: everything is recomputed (prompt and output so far)."""
        self.reset_kv()
        self.num_retractions += 1

    def reset_kv(self) -> None:
        """No KV, no row, no prefix: its next admission starts over (a retraction's reset,
        or a requeue's after a failed host-tier load, which is no retraction)."""
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.req_pool_idx = None
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.fill_ids = []
        self.mamba_pool_idx = None
        self.mamba_last_track_seqlen = None
        self.kv_only_lock = False
        self.swa_evicted_seqlen = 0
        self.swa_uuid_for_lock = None
        if self.mm_inputs is not None:  # (its prefill starts over: encoded again, by the weights then served)
            self.mm_inputs.release_embeddings()
