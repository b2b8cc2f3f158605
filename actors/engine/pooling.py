"""Embeddings by last-token pooling (vLLM's ``--runner pooling`` embed task, SGLang's ``--is-embedding``),
and scores from two tokens' logits (vLLM's ``classifier_from_token``, the Qwen3-Reranker recipe).

A decoder model's embedding is the final hidden state (after the final norm) of the prompt's last
token — what Qwen3-Embedding and e5-mistral are trained to put there. An embedding request is a
prompt scored only (``max_new_tokens`` 0) whose sampling params carry :class:`PoolingParams`: it
prefills, its prompt is cached like any other, and the forward of its last chunk returns that row
(``ForwardBatch.embed_indices`` → ``LogitsOutput.embeddings``), made the request's ``embedding``
here. Any served model answers; only a model trained for embeddings gives vectors worth comparing.

A reranker such as Qwen3-Reranker is a causal LM asked whether a document answers a query: its
score is P("yes") against P("no") at the prompt's last position, ``sigmoid(logit_yes - logit_no)``
(vLLM loads it as a one-label classifier whose weight is ``lm_head[yes] - lm_head[no]``). A request
whose pooling names ``classifier_token_ids`` gets the logits of those two tokens only, at that
same last position (``ForwardBatch.classifier_token_ids`` → ``LogitsOutput.classifier_logits``: two
rows of ``lm_head``, not the vocabulary), and its ``embedding`` is the one-element score vector, as
vLLM's classify output of one label (and SGLang's, which returns scores in ``embedding`` too).
"""

from __future__ import annotations

from typing import List, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


class PoolingParams(BaseModel):
    """vLLM's ``PoolingParams`` of the embed task, or (``classifier_token_ids``) of a score."""

    model_config = ConfigDict(extra="forbid")

    dimensions: Optional[int] = Field(None, ge=1, description="Matryoshka: the first this many dimensions "
                                      "(normalised after the cut, as vLLM); at most the model's hidden size")
    normalize: bool = Field(True, description="L2-normalise the vector (what cosine similarity assumes)")
    classifier_token_ids: Optional[List[int]] = Field(
        None, min_length=2, max_length=2, description="a score instead of an embedding: the ids of the \"false\" "
        "and the \"true\" token (vLLM's classifier_from_token, say \"no\" and \"yes\"), scored "
        "sigmoid(logit_true - logit_false) at the prompt's last position")

    @model_validator(mode="after")
    def _one_task(self):
        if self.classifier_token_ids is not None and self.dimensions is not None:
            raise ValueError("dimensions: a score (classifier_token_ids) has no dimensions to cut")
        return self


def pool_embedding(hidden: torch.Tensor, classifier_logits: Optional[torch.Tensor],
                   params: PoolingParams) -> List[float]:
    """The output of one request from its last token's fp32 hidden state ``[hidden_size]``: cut to
    ``dimensions``, then normalised; or, with ``classifier_token_ids``, the one-element score from
    those tokens' fp32 logits ``[2]`` (false, true)."""
    if params.classifier_token_ids is not None:
        return [torch.sigmoid(classifier_logits[1] - classifier_logits[0]).item()]
    vector = hidden[:params.dimensions] if params.dimensions else hidden
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.tolist()
