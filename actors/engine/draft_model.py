"""The draft model of draft-model speculative decoding (SGLang's STANDALONE draft worker, vLLM's
``draft_model`` method): a small model of the target's vocabulary proposes each request's next
tokens, one decode step of its own per token, and the target verifies them
(:mod:`actors.engine.spec_decode`).

Memory, as SGLang's draft worker: the draft has its own KV pool (its layers, heads and head size;
built by the model runner in the target's KV dtype, with as many slots) but shares the target's
``req_to_token_pool`` and allocator, so a slot is one token position in both pools: allocation,
the freeing of rejected drafts' pages, the radix cache's prefix sharing and retraction need no
bookkeeping of their own, and the memory budget counts the draft's bytes in every slot.

Invariant: **every committed slot below the draft's context (``max_context_len``) holds both
models' KV.** Every target forward but a verify is
mirrored by the draft over the same batch (:meth:`mirror`, from ``ModelRunner.forward``: prefill
chunks, decode steps, a retracted request's re-prefill), and a verify step's slots are written by
the drafting itself (:meth:`propose`; for request ``i``, ``L`` its length, ``d`` its draft)::

    step j = 0 .. d:   feeds the token at position L - 1 + j (the last sampled one, then draft[j - 1]),
                       writes its draft KV there, proposes draft[j] (step d only writes)

so the accepted drafts' draft KV was computed from exactly the tokens kept, over the committed
context; the bonus token's is written at the next step, as the target's. A prefix-cache hit shares
committed slots only, so it has the draft's KV too. The host tier backs up the target's pool only:
refused with a draft model (:func:`~actors.engine.config.draft_model_error`). PD's decode side gets
the target's KV of a prompt from the prefill side and computes the draft's itself when the request
arrives (:meth:`prefill`, over the prompt past the prefix its own tree held; its matched prefix
was committed there, so it has the draft's KV; the requests that arrive in one step in one forward).

TP: the draft runs whole (unsharded) on rank 0 only, which alone samples and so alone drafts; its
forwards do not go through ``tp_step`` and the followers never see them. Rank 0's budget counts its
KV (the slot count is every rank's smallest).

A draft trained on a shorter context than the target serves (its ``max_position_embeddings``,
scaled by its RoPE scaling as the target's: :func:`~actors.engine.model_loader.get_context_length`)
drafts no position past it, as vLLM caps its draft's ``max_model_len`` at the target's and leaves
a sequence that outgrew it undrafted: such a request decodes plainly on, and the served context
stays the target's. Nor does the draft compute there: its forwards (mirrored, on PD's arrival, a
step of an undrafted request) are cut to the positions below its context, so it never writes nor
attends past it (where its RoPE was never trained), and a slot past it holds no draft KV — none
that a draft step could read: a position past the limit is past it in every request sharing it.

A vision-language target (Qwen2.5-VL, Qwen3-VL) takes a draft of its vocabulary as any other, and only
the target sees the images, as SGLang's and vLLM's drafts without the target's hidden states: the
draft reads an image's tokens as the image token (``Req.origin_input_ids_unpadded``; their ids in
the target's batch, the images' pad values, are in no vocabulary), at its own plain positions (not
the target's M-RoPE ones), so its KV of them is the same for every image. Its drafts are proposals
only: the target's verify forward, at its M-RoPE positions, keeps plain decoding's tokens. A
vision-language draft (a smaller Qwen2.5-VL) drafts so too, its vocabulary read from its text config.

A Mamba hybrid target (Qwen3-Next) takes such a draft as any other: the target's states are
committed from its verify scratch (:mod:`actors.engine.spec_decode`) and the draft keeps none. A
hybrid draft is refused by its KV cache kind: its recurrent state cannot drop a rejected draft
token, so it would need, of its own, what the target has for that — a Mamba pool of its layers at
the target's slot ids, and a verify scratch its steps write one position each (step ``j`` from the
scratch's ``j - 1``, which the gated delta net's verify path does not do: it runs a whole verify
from the slot) — and every state write the target's pool makes outside a forward (zeroing at alloc,
the radix cache's checkpoint copies, the verify commits: the same rows and positions in both
scratches) replayed on the draft's, as a TP follower replays ``MambaPool.op_log``; on PD's decode
side its state of a transferred prompt (only the target's is transferred) computed on arrival. A
dense target would need a Mamba request table and radix cache for the draft alone (README).

Drafts are the draft's argmax: a one-hot proposal, so the rejection sampler stays exact for sampled
requests. The argmax is taken as plain decoding's pick would be, under the request's logit
adjustments (allowed ids, bad words, min-tokens, bias, penalties) and its grammar's mask after the
draft so far, the matcher advanced tentatively and rolled back (:mod:`actors.engine.draft_masks`, as
SGLang's EAGLE drafts under xgrammar): a draft the target would refuse is not proposed. The
adjustments stay on the device, the draft tokens with them: only a grammar's rows are copied to
the host, once a step, for their matchers. What the verify step cuts (a grammar ended by a draft
token) is cut as an n-gram draft is. LoRA adapters apply to the target only (a request under one
is drafted as the base model would write; verification keeps the adapter's tokens).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import List, Optional

import numpy as np
import torch

from actors.engine.attention import create_attention_backend
from actors.engine.forward_batch import ForwardBatch, ForwardMode, int64_tensor
from actors.engine.model_loader import get_context_length, load_model
from actors.engine.multimodal import MM_PAD_BASE
from actors.engine.req import Req
from actors.engine.draft_masks import DraftMasks

logger = logging.getLogger(__name__)

DRAFT_KV_KINDS = ("mha", "mla")  # a draft's KV lives in one attention pool indexed by the target's slots


class DraftModel:
    """The draft model, its KV pool (:attr:`token_to_kv_pool`, set by the model runner once the
    slot count is known) and its own attention backend (a backend keeps a forward's metadata)."""

    def __init__(self, path: str, dtype: str, device: torch.device, attention_backend: str, target_vocab: int,
                 context_len: int, image_token_id: Optional[int] = None):
        """``context_len``: the target's, as served; ``image_token_id``: a vision-language target's, what the
        draft reads an image's tokens as."""
        self.model, self.model_config, self.dtype = load_model(path, dtype, str(device))
        self.vocab_size = self.model_config.get_text_config().vocab_size  # (a vision-language draft's text config)
        if self.vocab_size != target_vocab:
            raise ValueError(f"speculative_draft_model_path: the draft's vocabulary ({self.vocab_size} ids) is not "
                             f"the target's ({target_vocab}): its tokens would mean other text")
        self.max_context_len = min(context_len, get_context_length(self.model_config))
        if self.max_context_len < context_len:
            logger.warning("speculative_draft_model_path: the draft's context length (%d) is below the served "
                           "context length (%d): requests are not drafted past it", self.max_context_len, context_len)
        self.spec = self.model.kv_cache_spec()
        if self.spec.kind not in DRAFT_KV_KINDS:
            raise ValueError(f"speculative_draft_model_path: a draft of KV cache kind {self.spec.kind!r} is not "
                             f"supported (a recurrent state would need states and a verify scratch of the "
                             f"draft's own); supported: {', '.join(DRAFT_KV_KINDS)}")
        self.device, self.image_token_id = device, image_token_id
        self.attn_backend = create_attention_backend(attention_backend, device=device)
        self.token_to_kv_pool = None

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """The draft's logits of ``forward_batch`` (its rows as the target's would be), its KV
        written at the batch's slots of the draft's pool."""
        batch = dataclasses.replace(forward_batch, token_to_kv_pool=self.token_to_kv_pool,
                                    attn_backend=self.attn_backend)
        self.attn_backend.init_forward_metadata(batch)
        return self.model(batch).next_token_logits

    def mirror(self, forward_batch: ForwardBatch) -> None:
        """Write the draft's KV of a target forward's tokens below the draft's context (the module's
        invariant); what only the target computes — logits, input logprobs, embeddings, LoRA, images — is
        left out."""
        if max(forward_batch.seq_lens_cpu) > self.max_context_len:
            forward_batch = self._within_context(forward_batch)
            if forward_batch is None:
                return
        self.forward(dataclasses.replace(
            forward_batch, input_ids=self._text_ids(forward_batch), logits_indices=self._no_rows(),
            input_logprob_indices=None, input_logprob_next_ids=None, input_logprob_counts=None, embed_indices=None,
            classifier_token_ids=None, lora_slots=None, lora_slot_names=None, mrope_positions=None, mm_items=None,
            deepstack_embeds=None))

    def _text_ids(self, batch: ForwardBatch) -> torch.Tensor:
        """``batch``'s input ids with its image tokens' (their pad values) the image token (the module's docstring)."""
        if batch.mm_items is None:  # (no image token computed)
            return batch.input_ids
        return torch.where(batch.input_ids >= MM_PAD_BASE, self.image_token_id, batch.input_ids)

    def _within_context(self, batch: ForwardBatch) -> Optional[ForwardBatch]:
        """``batch`` cut to its tokens at positions below ``max_context_len`` (request ``i``'s
        ``[extend_prefix_lens[i], min(seq_lens[i], max_context_len))``, a request with none left
        out), or None when no token is: indexed on the device from the batch's host lengths, no sync.
        Only the draft's fields are kept (the Mamba ones are the target's, per request)."""
        prefix_lens = batch.extend_prefix_lens_cpu
        seq_lens = [min(s, self.max_context_len) for s in batch.seq_lens_cpu]
        keep = [i for i, (p, s) in enumerate(zip(prefix_lens, seq_lens)) if p < s]
        if not keep:
            return None
        starts, device = np.cumsum([0] + batch.extend_seq_lens_cpu), self.device
        prefix_lens, seq_lens = [prefix_lens[i] for i in keep], [seq_lens[i] for i in keep]
        extend_lens = [s - p for p, s in zip(prefix_lens, seq_lens)]
        tokens = int64_tensor([t for i, n in zip(keep, extend_lens) for t in range(starts[i], starts[i] + n)], device)
        extend_lens_t = int64_tensor(extend_lens, device)
        return dataclasses.replace(
            batch, input_ids=batch.input_ids[tokens], positions=batch.positions[tokens],
            out_cache_loc=batch.out_cache_loc[tokens],
            req_pool_indices=batch.req_pool_indices[int64_tensor(keep, device)],
            seq_lens=int64_tensor(seq_lens, device), extend_prefix_lens=int64_tensor(prefix_lens, device),
            extend_seq_lens=extend_lens_t, extend_start_loc=torch.cumsum(extend_lens_t, 0) - extend_lens_t,
            seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=prefix_lens, extend_seq_lens_cpu=extend_lens,
            mamba_pool_indices=None, mamba_track_slots=None, mamba_track_lens=None)

    def _no_rows(self) -> torch.Tensor:
        """``logits_indices`` of a forward that only writes KV: no row, so no ``lm_head`` (a large part
        of a small draft's cost: its vocabulary is the target's)."""
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def prefill(self, reqs: List[Req], req_to_token_pool) -> None:
        """The draft's KV of each request's prompt past the prefix it matched, ``[len(prefix_indices),
        kv_committed_len)`` below ``max_context_len``, in one forward (PD's decode side, where the
        target's came from the prefill side; the matched prefix is committed here, so it holds the
        draft's already)."""
        reqs = [r for r in reqs if len(r.prefix_indices) < min(r.kv_committed_len, self.max_context_len)]
        if reqs:
            starts = [len(r.prefix_indices) for r in reqs]
            ends = [min(r.kv_committed_len, self.max_context_len) for r in reqs]
            tokens = int64_tensor([t for r, s, e in zip(reqs, starts, ends) for t in r.origin_input_ids_unpadded[s:e]],
                                  self.device)
            self.forward(self._batch(ForwardMode.EXTEND, tokens, [r.req_pool_idx for r in reqs], starts, ends,
                                     req_to_token_pool, logits_indices=self._no_rows()))

    def propose(self, reqs: List[Req], draft_lens: List[int], req_to_token_pool,
                masks: Optional[DraftMasks] = None) -> List[List[int]]:
        """Each request's draft of ``draft_lens[i]`` tokens, through ``max(draft_lens) + 1`` decode
        steps of the draft over the slots its row holds for the step (the module's docstring), each
        token the argmax of the step's logits under ``masks`` (its request's). The tokens stay on the
        device between the steps, one copy to the host at the end (and a step's grammar rows for
        their matchers: :class:`DraftMasks`). A step's ``lm_head`` takes the rows that pick a token at
        it only: an undrafted request's step 0, and a draft's step past its last token, write KV only.
        An undrafted request's step 0 writes its last token's draft KV only below ``max_context_len``
        (a drafted one's steps stay below it: ``draft_lens`` are cut so)."""
        device, steps = self.device, max(draft_lens)
        tokens = int64_tensor([r.output_ids[-1] for r in reqs], device)
        proposed = torch.zeros(len(reqs), steps, dtype=torch.int64, device=device)  # [i, j]: draft[j] of request i
        for j in range(steps + 1):
            index = [i for i, n in enumerate(draft_lens) if n >= j and reqs[i].seqlen - 1 + j < self.max_context_len]
            rows, positions = [reqs[i].req_pool_idx for i in index], [reqs[i].seqlen - 1 + j for i in index]
            picking = [r for r, i in enumerate(index) if draft_lens[i] > j]  # (their rows: they pick draft[j])
            logits = self.forward(self._batch(ForwardMode.DECODE, tokens[int64_tensor(index, device)], rows, positions,
                                              [p + 1 for p in positions], req_to_token_pool,
                                              logits_indices=int64_tensor(picking, device)))
            if picking:
                picked = [index[r] for r in picking]
                picked_t = int64_tensor(picked, device)
                if masks is not None:
                    logits = masks.apply(logits, picked)
                tokens[picked_t] = proposed[picked_t, j] = logits.argmax(dim=-1)
                if masks is not None:
                    masks.take(picked, proposed[picked_t, j])
        if masks is not None:
            masks.rollback()
        return [row[:n] for row, n in zip(proposed.tolist(), draft_lens)]

    def _batch(self, mode: ForwardMode, input_ids: torch.Tensor, rows: List[int], prefix_lens: List[int],
               seq_lens: List[int], req_to_token_pool, **fields) -> ForwardBatch:
        """The draft's forward of tokens ``[prefix_lens[i], seq_lens[i])`` of rows ``rows``, into the
        slots the rows hold there (no LoRA, logprobs nor embeddings: only the target computes those);
        ``fields``: the batch's others."""
        device, table = self.device, req_to_token_pool.req_to_token
        extend_lens = [s - p for p, s in zip(prefix_lens, seq_lens)]
        positions = [t for p, s in zip(prefix_lens, seq_lens) for t in range(p, s)]
        token_rows = [row for row, n in zip(rows, extend_lens) for _ in range(n)]
        slots = table[int64_tensor(token_rows, table.device), int64_tensor(positions, table.device)]
        extend_lens_t = int64_tensor(extend_lens, device)
        return ForwardBatch(
            forward_mode=mode, input_ids=input_ids, positions=int64_tensor(positions, device),
            out_cache_loc=slots.to(device, torch.int64), req_pool_indices=int64_tensor(rows, device),
            seq_lens=int64_tensor(seq_lens, device), extend_prefix_lens=int64_tensor(prefix_lens, device),
            extend_seq_lens=extend_lens_t, extend_start_loc=torch.cumsum(extend_lens_t, 0) - extend_lens_t,
            req_to_token_pool=req_to_token_pool, token_to_kv_pool=self.token_to_kv_pool, seq_lens_cpu=list(seq_lens),
            extend_prefix_lens_cpu=list(prefix_lens), extend_seq_lens_cpu=extend_lens, **fields,
        )
