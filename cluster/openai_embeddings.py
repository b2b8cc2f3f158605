"""POST /v1/embeddings: OpenAI's embeddings, with vLLM's extras, over the generation service.

Each input runs as one embedding request (:mod:`actors.engine.pooling`: a prompt scored only, its
last token's final hidden state returned), which a PD cluster runs on a prefill worker alone (the
client's ``prefill_only`` path) and an engine beside its generation; a batch's inputs are one HTTP
request's choices (admitted once, ids ``{rid}-{i}``), as /v1/completions' prompts. ``encoding_format``
"base64" — what the openai client asks for unless told otherwise, and decodes — is each vector's
little-endian float32 bytes, base64-encoded, as OpenAI's. The request's common fields
(:class:`PoolingRequest`), the truncation and the run are /score's and /rerank's too
(:mod:`cluster.openai_score`).
"""

from __future__ import annotations

import base64
import time
from typing import Any, Callable, Dict, List, Literal, Optional, Union

import numpy as np
from pydantic import Field, field_validator

from cluster.api_errors import APIError
from cluster.completion_protocol import as_prompt_batch, check_prompt_batch
from cluster.openai_protocol import NullIsDefault
from cluster.openai_serving import GenerationService, internal_rid, validated
from cluster.streaming import ABORTED


class PoolingRequest(NullIsDefault):
    """The fields every pooling endpoint takes (/v1/embeddings, /score, /rerank)."""

    model: Optional[str] = Field(None, min_length=1, description="None: the served model")
    truncate_prompt_tokens: Optional[int] = Field(None, description="vLLM's: each prompt cut to its last this "
                                                  "many tokens (-1: to the longest prompt the model takes)")
    priority: int = Field(0, description="vLLM's: each prompt's scheduling priority, as a completion's (needs "
                          "enable_priority_scheduling unless 0)")

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and v < 1 and v != -1:
            raise ValueError(f"must be -1 (the longest prompt the model takes) or at least 1, not {v}")
        return v


class EmbeddingRequest(PoolingRequest):
    """POST /v1/embeddings. ``input``: a string or a list of token ids, or a batch (a list of either)
    of at most ``MAX_PROMPTS``."""

    input: Union[str, List[str], List[int], List[List[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1, description="Matryoshka: the first this many dimensions, "
                                      "normalised after the cut (at most the model's hidden size)")
    user: Optional[str] = Field(None, description="OpenAI's end-user id: accepted, not used")
    normalize: bool = Field(True, description="vLLM's: L2-normalise each vector")
    add_special_tokens: bool = Field(True, description="vLLM's: text inputs get the tokenizer's BOS (and the like)")

    @field_validator("input")
    @classmethod
    def _inputs(cls, v):
        return check_prompt_batch(v, "input")

    @property
    def inputs(self) -> List[Union[str, List[int]]]:
        return as_prompt_batch(self.input)


def pooling_prompt(service: GenerationService, ids: List[int], keep: Optional[int], param: str) -> List[int]:
    """``ids`` cut to their last ``keep`` tokens (vLLM's ``truncate_prompt_tokens``; -1: the longest
    prompt served); a ``keep`` over that is a 400, as vLLM's, and so is a prompt that does not fit
    after the cut (``param`` names it)."""
    limit = service.backend.max_prompt_len
    if keep is not None:
        if keep > limit:
            raise APIError(400, f"truncate_prompt_tokens: {keep} is more than the longest prompt this model takes "
                           f"({limit})", param="truncate_prompt_tokens")
        ids = ids[-(limit if keep == -1 else keep):]
    service.max_new_tokens(len(ids), None, param)  # (the 400 of a prompt that does not fit)
    return ids


def _encoded(vector: List[float], encoding_format: str) -> Union[List[float], str]:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def run_pooling(service: GenerationService, prompts: List[List[int]], pooling: Dict[str, Any], model: str,
                      response_id: str, request_id: str, arrival: float,
                      respond: Callable[[List[Dict[str, Any]], int], Dict[str, Any]], priority: int = 0) -> Any:
    """Run ``prompts`` as pooling requests (:class:`~actors.engine.pooling.PoolingParams` ``pooling``
    for all) under ``model`` (an adapter's name: its hidden states), one HTTP request's choices
    (admitted once, ids ``{rid}-{i}``, found by ``request_id`` as a completion is); ``respond(results,
    num_tokens)`` makes the answer from their results, in order, and the prompt tokens they ran;
    each queues under ``priority``. A ``pooling`` the workers refuse is a 400; one aborted
    (/abort_request, /pause_generation) has no vectors to answer with: a 503."""
    params = validated({"max_new_tokens": 0, "pooling": pooling})

    def response(events) -> Dict[str, Any]:
        results = [e.result for e in sorted(events, key=lambda e: e.index)]
        if any(r["meta_info"]["finish_reason"] == ABORTED for r in results):
            raise APIError(503, "the request was aborted (/abort_request or /pause_generation)",
                           "service_unavailable", code="aborted")
        return respond(results, sum(r["meta_info"]["prompt_tokens"] for r in results))

    return await service._run([(ids, params) for ids in prompts], 1, internal_rid(response_id), arrival, None,
                              response, priority, lora_path=service.lora_path(model), request_id=request_id)


async def create_embeddings(service: GenerationService, req: EmbeddingRequest, arrival: float,
                            request_id: str) -> Any:
    """The embeddings of ``req``'s inputs: 400 for an input longer than the model takes (after any
    truncation) or a ``dimensions`` over its hidden size (the workers refuse it)."""
    model = service.check_model(req.model)
    prompts = []
    for one in req.inputs:
        ids = (service.encode(one, "input", req.add_special_tokens) if isinstance(one, str)
               else service.token_ids(one, "input"))
        prompts.append(pooling_prompt(service, ids, req.truncate_prompt_tokens, "input"))
    response_id = f"embd-{request_id}"

    def response(results, num_tokens) -> Dict[str, Any]:
        data = [{"object": "embedding", "index": i, "embedding": _encoded(r["embedding"], req.encoding_format)}
                for i, r in enumerate(results)]
        return {"id": response_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    return await run_pooling(service, prompts, {"dimensions": req.dimensions, "normalize": req.normalize}, model,
                             response_id, request_id, arrival, response, req.priority)
