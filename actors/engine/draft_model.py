"""The draft model of draft-model speculative decoding (SGLang's STANDALONE draft worker, vLLM's
``draft_model`` method): a small model of the target's vocabulary proposes each request's next
tokens, one decode step of its own per token, and the target verifies them
(:mod:`actors.engine.spec_decode`).

Memory, as SGLang's draft worker: the draft has its own KV pool (its layers, heads and head size;
built by the model runner in the target's KV dtype, with as many slots) but shares the target's
``req_to_token_pool`` and allocator, so a slot is one token position in both pools: allocation,
the freeing of rejected drafts' pages, the radix cache's prefix sharing and retraction need no
bookkeeping of their own, and the memory budget counts the draft's bytes in every slot.

Invariant: **every committed slot holds both models' KV.** Every target forward but a verify is
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
was committed there, so it has the draft's KV).

TP: the draft runs whole (unsharded) on rank 0 only, which alone samples and so alone drafts; its
forwards do not go through ``tp_step`` and the followers never see them. Rank 0's budget counts its
KV (the slot count is every rank's smallest).

Drafts are the draft's argmax: a one-hot proposal, so the rejection sampler stays exact for sampled
requests. The draft reads no sampling parameter nor grammar: a draft is cut to what its grammar
accepts afterwards, as an n-gram draft is. LoRA adapters apply to the target only (a request under
one is drafted as the base model would write; verification keeps the adapter's tokens).
"""

from __future__ import annotations

import dataclasses
from typing import List

import torch

from actors.engine.attention import create_attention_backend
from actors.engine.forward_batch import ForwardBatch, ForwardMode, int64_tensor
from actors.engine.model_loader import load_model
from actors.engine.req import Req
from actors.engine.schedule_batch import extend_batch

DRAFT_KV_KINDS = ("mha", "mla")  # a draft's KV lives in one attention pool indexed by the target's slots


class DraftModel:
    """The draft model, its KV pool (:attr:`token_to_kv_pool`, set by the model runner once the
    slot count is known) and its own attention backend (a backend keeps a forward's metadata)."""

    def __init__(self, path: str, dtype: str, device: torch.device, attention_backend: str, target_vocab: int):
        self.model, self.model_config, self.dtype = load_model(path, dtype, str(device))
        vocab = self.model_config.vocab_size
        if vocab != target_vocab:
            raise ValueError(f"speculative_draft_model_path: the draft's vocabulary ({vocab} ids) is not the "
                             f"target's ({target_vocab}): its tokens would mean other text")
        self.spec = self.model.kv_cache_spec()
        if self.spec.kind not in DRAFT_KV_KINDS:
            raise ValueError(f"speculative_draft_model_path: a draft of KV cache kind {self.spec.kind!r} is not "
                             f"supported; supported: {', '.join(DRAFT_KV_KINDS)}")
        self.device = device
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
        """Write the draft's KV of a target forward's tokens (the module's invariant); what only the
        target computes — input logprobs, embeddings, LoRA — is left out."""
        self.forward(dataclasses.replace(
            forward_batch, input_logprob_indices=None, input_logprob_next_ids=None, input_logprob_counts=None,
            embed_indices=None, classifier_token_ids=None, lora_slots=None, lora_slot_names=None))

    def prefill(self, req: Req, runner) -> None:
        """The draft's KV of ``req``'s prompt past the prefix it matched, ``[len(prefix_indices),
        kv_committed_len)`` (PD's decode side, where the target's came from the prefill side; the
        matched prefix is committed here, so it holds the draft's already)."""
        start, end = len(req.prefix_indices), req.kv_committed_len
        if start >= end:
            return
        table = runner.req_to_token_pool.req_to_token
        slots = table[req.req_pool_idx, start:end].to(torch.int64)
        self.mirror(extend_batch(ForwardMode.EXTEND, runner, [req], req.origin_input_ids[start:end],
                                 list(range(start, end)), slots, [start], [end]))

    def propose(self, reqs: List[Req], draft_lens: List[int], req_to_token_pool) -> List[List[int]]:
        """Each request's draft of ``draft_lens[i]`` tokens, through ``max(draft_lens) + 1`` decode
        steps of the draft over the slots its row holds for the step (the module's docstring). The
        tokens stay on the device between the steps: one copy to the host at the end."""
        table, device, steps = req_to_token_pool.req_to_token, self.device, max(draft_lens)
        tokens = int64_tensor([r.output_ids[-1] for r in reqs], device)
        proposed = torch.zeros(len(reqs), steps, dtype=torch.int64, device=device)  # [i, j]: draft[j] of request i
        for j in range(steps + 1):
            index = [i for i, n in enumerate(draft_lens) if n >= j]
            index_t = int64_tensor(index, device)
            rows = int64_tensor([reqs[i].req_pool_idx for i in index], table.device)
            positions = [reqs[i].seqlen - 1 + j for i in index]
            logits = self.forward(self._decode_batch(tokens[index_t], positions, rows, req_to_token_pool))
            if j < steps:
                tokens[index_t] = proposed[index_t, j] = logits.argmax(dim=-1)
        return [row[:n] for row, n in zip(proposed.tolist(), draft_lens)]

    def _decode_batch(self, tokens: torch.Tensor, positions: List[int], rows: torch.Tensor,
                      req_to_token_pool) -> ForwardBatch:
        """A decode batch of one token per request at ``positions``, into the slots its row holds there."""
        device, bs = self.device, len(positions)
        positions_t = int64_tensor(positions, self.device)
        slots = req_to_token_pool.req_to_token[rows, positions_t.to(rows.device)].to(device, torch.int64)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, input_ids=tokens, positions=positions_t,
            out_cache_loc=slots, req_pool_indices=rows.to(device), seq_lens=positions_t + 1,
            extend_prefix_lens=positions_t, extend_seq_lens=torch.ones(bs, dtype=torch.int64, device=device),
            extend_start_loc=torch.arange(bs, dtype=torch.int64, device=device), req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool, seq_lens_cpu=[p + 1 for p in positions],
            extend_prefix_lens_cpu=list(positions), extend_seq_lens_cpu=[1] * bs,
        )
