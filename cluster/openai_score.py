"""POST /score and /v1/score (vLLM's), /rerank, /v1/rerank and /v2/rerank (Jina's and Cohere's, as
vLLM serves them): how well texts match, over the pooling path of /v1/embeddings.

A decoder model scores a pair in one of two ways, as vLLM's (:class:`Scorer`):

- embedding similarity (vLLM's score of an embedding model; the default): every text is embedded
  once, all of them one HTTP request's choices, and a pair's score is the cosine of its two vectors;
- a classifier from two tokens (``server.classifier_from_token``, vLLM's ``hf_overrides`` of the
  Qwen3-Reranker recipe): each pair is one prompt — ``server.score_template`` with ``{query}`` and
  ``{document}`` filled in, or the tokenizer's pair encoding of the two texts (vLLM's cross-encoder
  prompt) — whose score is ``sigmoid(logit_true - logit_false)`` at its last position; the workers
  compute those two logits only (:mod:`actors.engine.pooling`). A 1→N request's pairs share the
  query's prefix: the radix cache computes it once.

Pairs go as vLLM's: ``text_1`` one text against each of ``text_2`` (1→N), or the two lists side by
side (N→N); a rerank is its ``query`` against each document (a text, or Cohere's object with a
``text``), answered best first. ``usage`` counts each pair's prompt tokens, as vLLM's.
"""

from __future__ import annotations

import re
import time
from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cluster.api_errors import APIError
from cluster.openai_embeddings import PoolingRequest, pooling_prompt, run_pooling
from cluster.openai_serving import GenerationService

MAX_SCORE_TEXTS = 1000  # texts on either side of one request (Cohere's rerank takes at most 1000 documents)
PLACEHOLDER = re.compile(r"\{(query|document)\}")


class ScoreRequest(PoolingRequest):
    """POST /score, /v1/score (vLLM's ``ScoreRequest``): ``text_1`` against ``text_2``, each a text
    or a list of them, paired 1→N or N→N."""

    text_1: Union[str, List[str]]
    text_2: Union[str, List[str]]


class RerankDocument(BaseModel):
    """A document as an object (Cohere's rerank, v1 and v2): ranked by its ``text``; with
    ``return_documents`` it comes back as sent, its other fields too (Cohere's)."""

    model_config = ConfigDict(extra="allow")

    text: str


class RerankRequest(PoolingRequest):
    """POST /rerank, /v1/rerank, /v2/rerank (vLLM's ``RerankRequest``, Jina's and Cohere's fields)."""

    query: str
    documents: List[Union[str, RerankDocument]]
    top_n: int = Field(0, ge=0, description="the best this many results (0: all of them, as vLLM's)")
    return_documents: bool = Field(True, description="each result carries its document's text (Jina's default)")


class Scorer:
    """How this server scores a pair of texts: by the cosine of their embeddings, or, with
    ``classifier_token_ids`` (the "false" and "true" tokens' ids), by a classifier from those two
    tokens over the pair's prompt (``score_template``'s, else the tokenizer's pair encoding)."""

    def __init__(self, service: GenerationService, classifier_token_ids: Optional[List[int]] = None,
                 score_template: Optional[str] = None):
        self.service, self.classifier_token_ids, self.score_template = service, classifier_token_ids, score_template

    @classmethod
    def from_config(cls, service: GenerationService, server) -> "Scorer":
        """The ServerConfig's ``classifier_from_token`` resolved to token ids with the tokenizer (each
        must be one token of it: ValueError otherwise), and its ``score_template``."""
        tokens = server.classifier_from_token
        if tokens is None:
            return cls(service)
        tokenizer = service.tokenizer
        if tokenizer is None:
            raise ValueError("server.classifier_from_token: the server has no tokenizer to find the tokens in")
        ids = tokenizer.convert_tokens_to_ids(tokens)
        bad = next((t for t, i in zip(tokens, ids) if i is None or tokenizer.convert_ids_to_tokens(i) != t), None)
        if bad is not None:
            raise ValueError(f"server.classifier_from_token: {bad!r} is not a token of the model's tokenizer")
        return cls(service, ids, server.score_template)

    async def run(self, texts_1: List[str], texts_2: List[str], params: Sequence[str], req: PoolingRequest,
                  model: str, response_id: str, request_id: str, arrival: float, respond) -> Any:
        """Score ``texts_1`` against ``texts_2`` (``params``: their fields' names, for the 400s) with
        ``model`` (checked); ``respond(scores, num_tokens)`` makes the answer from the pairs' scores,
        in order, and the prompt tokens run."""
        for texts, param in zip((texts_1, texts_2), params):
            if not texts:
                raise APIError(400, f"{param}: at least one text is needed", param=param)
            if len(texts) > MAX_SCORE_TEXTS:
                raise APIError(400, f"{param}: at most {MAX_SCORE_TEXTS} texts per request; got {len(texts)}",
                               param=param)
        if len(texts_1) > 1 and len(texts_1) != len(texts_2):
            raise APIError(400, f"{params[0]} and {params[1]} pair 1:1, 1:N or N:N; got {len(texts_1)} and "
                           f"{len(texts_2)} texts", param=params[1])
        by = self._by_embeddings if self.classifier_token_ids is None else self._by_classifier
        pool = partial(run_pooling, self.service, model=model, response_id=response_id, request_id=request_id,
                       arrival=arrival, priority=req.priority)
        return await by(texts_1, texts_2, params, req, pool, respond)

    async def _by_classifier(self, texts_1, texts_2, params, req, pool, respond) -> Any:
        """Each pair one prompt (a 400 naming the second text's field when it does not fit), its
        score the workers' ``sigmoid(logit_true - logit_false)``."""
        pairs = zip(texts_1 * len(texts_2) if len(texts_1) == 1 else texts_1, texts_2)
        prompts = [self._prompt(self._pair_ids(query, document, params[1]), req, params[1], i)
                   for i, (query, document) in enumerate(pairs)]

        def response(results, num_tokens):
            return respond([r["embedding"][0] for r in results], num_tokens)

        return await pool(prompts, {"classifier_token_ids": self.classifier_token_ids}, respond=response)

    async def _by_embeddings(self, texts_1, texts_2, params, req, pool, respond) -> Any:
        """Each text embedded once (text_1's first, one batch), a pair's score the cosine of its two
        normalised vectors. Its tokens are counted per pair, as vLLM's: its two prompts and the pad
        token vLLM puts between them (when the tokenizer has one), a 1→N ``text_1`` once per pair."""
        prompts = [self._prompt(self.service.encode(text, param), req, param, i)
                   for texts, param in zip((texts_1, texts_2), params) for i, text in enumerate(texts)]
        pad = int(self.service.tokenizer.pad_token_id is not None)

        def response(results, _):
            vectors = np.asarray([r["embedding"] for r in results], dtype=np.float64)
            first, second = vectors[:len(texts_1)], vectors[len(texts_1):]
            lens = [r["meta_info"]["prompt_tokens"] for r in results]
            lens_1, lens_2 = lens[:len(texts_1)], lens[len(texts_1):]
            if len(lens_1) == 1:  # (1→N: text_1 in every pair)
                lens_1 = lens_1 * len(lens_2)
            num_tokens = sum(len_1 + pad + len_2 for len_1, len_2 in zip(lens_1, lens_2))
            return respond((first * second).sum(axis=1).tolist(), num_tokens)  # (one first row: broadcast, 1→N)

        return await pool(prompts, {"normalize": True}, respond=response)

    def _pair_ids(self, query: str, document: str, param: str) -> List[int]:
        """A pair's prompt (a classifier's: :meth:`from_config` made sure of a tokenizer)."""
        if self.score_template is None:  # (vLLM's cross-encoder tokenization)
            return self.service.tokenizer(text=query, text_pair=document)["input_ids"]
        text = PLACEHOLDER.sub(lambda m: query if m.group(1) == "query" else document, self.score_template)
        return self.service.encode(text, param)

    def _prompt(self, ids: List[int], req: PoolingRequest, param: str, index: int) -> List[int]:
        """Prompt ``index`` of ``param`` cut as ``truncate_prompt_tokens`` asks; 400 when it does not
        fit or has no tokens."""
        ids = pooling_prompt(self.service, ids, req.truncate_prompt_tokens, param)
        if not ids:
            raise APIError(400, f"{param} {index}: a text with no tokens has nothing to score", param=param)
        return ids


async def create_score(scorer: Scorer, req: ScoreRequest, arrival: float, request_id: str) -> Any:
    """vLLM's ``ScoreResponse``: ``data`` in pair order, each ``{"index", "object": "score", "score"}``."""
    model = scorer.service.check_model(req.model)
    texts_1, texts_2 = ([t] if isinstance(t, str) else t for t in (req.text_1, req.text_2))
    response_id = f"score-{request_id}"

    def respond(scores: List[float], num_tokens: int) -> Dict[str, Any]:
        data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
        return {"id": response_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    return await scorer.run(texts_1, texts_2, ("text_1", "text_2"), req, model, response_id, request_id, arrival,
                            respond)


async def create_rerank(scorer: Scorer, req: RerankRequest, arrival: float, request_id: str) -> Any:
    """vLLM's ``RerankResponse``: ``results`` best first (ties in document order), the ``top_n`` best
    if asked, each ``{"index", "document", "relevance_score"}``: ``document`` ``{"text"}`` for a text,
    an object as sent (Cohere's), none when ``return_documents`` is false (as Cohere's)."""
    model = scorer.service.check_model(req.model)
    response_id = f"rerank-{request_id}"
    documents = [{"text": d} if isinstance(d, str) else d.model_dump() for d in req.documents]

    def respond(scores: List[float], num_tokens: int) -> Dict[str, Any]:
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
        results = [{"index": i, **({"document": documents[i]} if req.return_documents else {}),
                    "relevance_score": scores[i]} for i in order]
        return {"id": response_id, "model": model, "results": results,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    return await scorer.run([req.query], [d["text"] for d in documents], ("query", "documents"), req, model,
                            response_id, request_id, arrival, respond)
