"""The decoder-only skeleton every model shares (HF parameter names).

``DecoderModel``: ``embed_tokens`` → each layer ``(positions, x, forward_batch)``
→ ``norm``; layers are built as ``layer_cls(config, layer_id, tp)``.
``CausalLM``: ``model`` + ``lm_head``, returning fp32 logits of each request's
last token (optionally soft-capped, after the vocabulary is whole, in the
model's dtype before the cast). Under TP
the embedding and ``lm_head`` are split by vocabulary (``parallel``'s
``VocabParallelEmbedding`` / ``ParallelLMHead``): every rank computes its
range of the logits and joins their all-gather; rank 0 returns the whole
vocabulary, the other ranks an empty tensor (they never sample).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from actors.engine.models.spec import KVCacheSpec
from actors.engine.parallel import SINGLE, ParallelLMHead, TPGroup, VocabParallelEmbedding


class DecoderModel(nn.Module):
    def __init__(self, config, layer_cls: Callable, norm: nn.Module, embed_scale: Optional[float] = None,
                 tp: TPGroup = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layer_cls(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = norm
        self.tp = tp
        self.embed_scale = embed_scale

    def forward(self, forward_batch) -> torch.Tensor:
        x = self.embed_tokens(forward_batch.input_ids)
        if self.embed_scale is not None:  # the normalizer in the model's dtype, as HF's (Gemma 3)
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        for layer in self.layers:
            x = layer(forward_batch.positions, x, forward_batch)
        return self.norm(x)


class CausalLM(nn.Module):
    def __init__(self, config, model: DecoderModel, final_logit_softcap: Optional[float] = None):
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, model.tp)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcap = final_logit_softcap

    def make_spec(self, **fields) -> KVCacheSpec:
        """This rank's :class:`KVCacheSpec` (its TP place filled in)."""
        return KVCacheSpec(tp_rank=self.model.tp.rank, tp_size=self.model.tp.size, **fields)

    def forward(self, forward_batch) -> torch.Tensor:
        hidden = self.model(forward_batch)
        logits = self.lm_head(hidden[forward_batch.last_token_indices()])  # every rank: one all-gather
        if not self.model.tp.is_leader:  # TP: only rank 0 samples; the other ranks' forward ends here
            return logits.new_empty(0)
        cap = self.final_logit_softcap
        if cap:  # in the model's dtype, as HF's Gemma and vLLM's logits processor; sampling is in fp32
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
