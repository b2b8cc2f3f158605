"""The HTTP API's request bodies (OpenAI's and SGLang's names, validated at the edge): what they
all share, and the sampling fields of completions and chat (:class:`OpenAISampling`). Each
endpoint's body is in a module of its own: /v1/completions' and /generate's in
:mod:`cluster.completion_protocol`, /v1/chat/completions' in :mod:`cluster.chat_protocol`,
/tokenize's and /detokenize's in :mod:`cluster.openai_tokenization`; POST /workers' is here.

Every model rejects unknown fields (:data:`FORBID`), so a typo fails with a 400 that names it
instead of being ignored (vLLM ignores them with a warning; a silently ignored
``max_tokenz`` costs more than a 400). As in OpenAI's spec and vLLM, ``null`` means "the default"
for any optional parameter (:class:`NullIsDefault`). :func:`describe_validation_error` makes a
400's message of pydantic's errors.

``to_sampling_params`` maps an OpenAI request onto the engine's
:class:`~actors.engine.sampling_params.SamplingParams` names; SGLang's extra
sampling fields (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``), vLLM's ``min_tokens`` (SGLang's
``min_new_tokens``), ``include_stop_str_in_output``, ``allowed_token_ids`` and ``bad_words``,
structured output's grammars — SGLang's
``json_schema``, ``regex`` and ``ebnf``, vLLM's ``guided_json``, ``guided_regex``,
``guided_choice`` (a regex of the escaped choices) and ``guided_grammar`` —, vLLM's ``priority`` (not a sampling
field: it orders the request in the workers' queues) and vLLM's ``prompt_logprobs`` are accepted at the top
level, as SGLang and vLLM accept them (the openai client's ``extra_body``). OpenAI's own ``response_format`` asks for
structured output too, on chat and completions as in vLLM: ``json_object`` (any JSON value,
xgrammar's built-in JSON grammar, as SGLang's), ``json_schema`` (its ``json_schema.schema``) or
``structural_tag`` (vLLM's shapes: ``structures`` of ``{begin, schema, end}`` and ``triggers``, or
xgrammar's ``format``; the engine's ``structural_tag``);
one grammar per request, however it is asked for.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Literal, Optional, Tuple, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from actors.engine.sampling_params import ANY_JSON, TOP_K_DISABLED, check_structural_tag, check_top_k

FORBID = ConfigDict(extra="forbid")
MAX_LOGPROBS = 20  # alternatives per position: vLLM's default max_logprobs (and the engine's top_logprobs_num cap)


def _regex_literal(text: str) -> str:
    """``text`` as a regex that matches it alone: its regex metacharacters escaped (only those:
    ``re.escape`` also escapes characters xgrammar's regexes take as they are)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


def _response_format_grammar(fmt: Dict[str, Any]) -> Optional[Tuple[str, str]]:
    """``(engine field, spec)`` of OpenAI's ``response_format``; None for ``text``."""
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", ANY_JSON
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, (dict, bool)):
            raise ValueError("response_format: a json_schema format needs its json_schema.schema (a JSON schema)")
        return "json_schema", json.dumps(schema)
    if kind == "structural_tag":
        try:
            check_structural_tag(fmt)
        except ValueError as exc:
            raise ValueError(f"response_format: {exc}") from None
        return "structural_tag", json.dumps(fmt)
    raise ValueError(f"response_format: type {kind!r} is not one of text, json_object, json_schema, structural_tag")


def _nullable(field) -> bool:
    return field.annotation is type(None) or type(None) in get_args(field.annotation)


class NullIsDefault(BaseModel):
    """``"temperature": null`` is the default temperature; a field whose default is None
    (``max_tokens``: up to the context) keeps its None."""

    model_config = FORBID

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or _nullable(fields[k])}


class StreamOptions(NullIsDefault):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, every chunk carries "
                                         "its choice's usage so far")


class OpenAISampling(NullIsDefault):
    """The sampling fields completions and chat share."""

    model: Optional[str] = Field(None, min_length=1, description="None: the served model (as in vLLM and SGLang)")
    n: int = Field(1, ge=1, le=64, description="choices; each runs as its own request")
    max_tokens: Optional[int] = Field(None, ge=1, description="None: up to the context length")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=-2 ** 63, le=2 ** 63 - 1, description="an int64, as vLLM's (choice i "
                                "runs seeded seed + i, which a torch generator still takes)")
    stop: Optional[Union[str, List[str]]] = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # SGLang / vLLM extras
    top_k: int = Field(TOP_K_DISABLED, description="-1 or 0 (vLLM's): disabled, all tokens")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    ignore_eos: bool = False
    stop_token_ids: List[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = Field(False, description="vLLM's: the stop string or stop token that "
                                             "ended a choice stays in its text")
    skip_special_tokens: bool = True
    rid: Optional[str] = Field(None, description="request id (choice i runs as rid-i when n > 1)")
    min_tokens: int = Field(0, ge=0, description="vLLM's: tokens to generate at least (EOS, stop_token_ids and "
                            "stop strings end nothing before)")
    logit_bias: Optional[Dict[str, float]] = Field(None, description="{token id: bias in [-100, 100]} added to the "
                                                   "logits before sampling")
    allowed_token_ids: Optional[List[int]] = Field(None, description="vLLM's: only these token ids may be sampled")
    bad_words: List[str] = Field(default_factory=list, description="vLLM's: words never generated (with and without "
                                 "a leading space)")
    priority: int = Field(0, description="vLLM's: the request's scheduling priority (higher first unless the "
                          "engine's schedule_low_priority_values_first); needs enable_priority_scheduling unless 0")
    prompt_logprobs: Optional[int] = Field(None, description="vLLM's: the prompt scored, each position's token (with "
                                           "its rank in the vocabulary) and this many most likely alternatives")
    # structured output: at most one of these (the engine's json_schema, regex or ebnf)
    response_format: Optional[Dict[str, Any]] = Field(None, description="OpenAI's: text, json_object or json_schema; "
                                                      "vLLM's structural_tag")
    json_schema: Optional[Union[str, Dict[str, Any]]] = Field(None, description="SGLang's: a JSON schema")
    regex: Optional[str] = Field(None, description="SGLang's: the whole output matches this regex")
    ebnf: Optional[str] = Field(None, description="SGLang's: an EBNF (GBNF) grammar")
    guided_json: Optional[Union[str, Dict[str, Any]]] = Field(None, description="vLLM's: a JSON schema")
    guided_regex: Optional[str] = Field(None, description="vLLM's: the whole output matches this regex")
    guided_choice: Optional[List[str]] = Field(None, min_length=1, description="vLLM's: the output is one of these")
    guided_grammar: Optional[str] = Field(None, description="vLLM's: an EBNF (GBNF) grammar")
    _grammar: Optional[Tuple[str, str, str]] = PrivateAttr(None)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        return check_top_k(v)

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, v):
        """vLLM's range: a count or -1 (the whole vocabulary), which is over vLLM's default cap as here."""
        if v is not None and v < -1:
            raise ValueError(f"must be a count of alternatives (or -1: the whole vocabulary); got {v}")
        if v is not None and (v == -1 or v > MAX_LOGPROBS):
            asked = "the whole vocabulary" if v == -1 else v
            raise ValueError(f"at most {MAX_LOGPROBS} alternatives per position; got {asked}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        """vLLM's refusal; its ``prompt_logprobs`` 0 streams on without them, a silent no-op refused here too."""
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available when stream is true")
        return self

    @property
    def grammar(self) -> Optional[Tuple[str, str, str]]:
        """``(request field, engine field, spec)`` of the grammar the request asks for; None without one."""
        return self._grammar

    @model_validator(mode="after")
    def _one_grammar(self):
        self._grammar = self._asked_grammar()
        return self

    def _asked_grammar(self) -> Optional[Tuple[str, str, str]]:
        asked = []
        if self.response_format is not None:
            engine = _response_format_grammar(self.response_format)
            if engine is not None:
                asked.append(("response_format", *engine))
        for field, engine in (("json_schema", "json_schema"), ("guided_json", "json_schema"), ("regex", "regex"),
                              ("guided_regex", "regex"), ("ebnf", "ebnf"), ("guided_grammar", "ebnf")):
            spec = getattr(self, field)
            if spec is not None:
                asked.append((field, engine, spec if isinstance(spec, str) else json.dumps(spec)))
        if self.guided_choice is not None:
            asked.append(("guided_choice", "regex", "(" + "|".join(map(_regex_literal, self.guided_choice)) + ")"))
        asked += self._tool_grammar()
        if len(asked) > 1:
            raise ValueError(f"{asked[1][0]}: one structured output per request; got "
                             f"{' and '.join(field for field, _, _ in asked)}")
        return asked[0] if asked else None

    def _tool_grammar(self) -> List[Tuple[str, str, str]]:
        return []

    @property
    def top_logprobs_num(self) -> Optional[int]:
        """The alternatives each output token's logprobs carry; None: no output logprobs."""
        raise NotImplementedError

    def to_sampling_params(self, max_new_tokens: int) -> Dict[str, Any]:
        params = dict(
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty, stop=self.stop,
            stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens, min_new_tokens=self.min_tokens,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
        )
        grammar = self.grammar
        if grammar is not None:
            params[grammar[1]] = grammar[2]
        top = self.top_logprobs_num
        if top is not None:
            params.update(return_logprob=True, top_logprobs_num=top)
        if self.prompt_logprobs is not None:  # the engine's top-N serves both: each response trims its own
            params.update(return_logprob=True, logprob_start_len=0,
                          top_logprobs_num=max(top or 0, self.prompt_logprobs))
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: only with ``include_usage`` (the last chunk still sums it up)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class AddWorkerRequest(BaseModel):
    """POST /workers."""

    model_config = FORBID

    role: Literal["prefill", "decode"]


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    model_config = FORBID

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body)."""

    model_config = FORBID

    lora_name: str = Field(min_length=1)


class UpdateWeightsFromDiskRequest(BaseModel):
    """POST /update_weights_from_disk: SGLang's UpdateWeightFromDiskReqInput, every field, so that an
    RL framework's body is taken as sent; a value raydix cannot honour is a 400 naming its field."""

    model_config = FORBID

    model_path: str = Field(min_length=1)
    load_format: Optional[Literal["auto", "safetensors"]] = None  # (safetensors is what is read)
    weight_version: Optional[str] = Field(None, min_length=1)
    abort_all_requests: bool = False
    flush_cache: bool = True
    torch_empty_cache: bool = False  # every rank on CUDA empties its allocator's cache after the load
    keep_pause: bool = False  # a paused server stays paused after the update; else it continues
    recapture_cuda_graph: bool = False  # (not needed: updates copy into the parameters the decode graphs read)
    token_step: int = Field(0, ge=0)  # the trainer's step (SGLang's bookkeeping; not reported here)
    is_async: bool = False
    manifest: Optional[Dict[str, Any]] = None

    @field_validator("is_async")
    @classmethod
    def _synchronous(cls, value: bool) -> bool:
        if value:
            raise ValueError("an update is answered once the new weights serve (is_async true is not served)")
        return value

    @field_validator("manifest")
    @classmethod
    def _no_manifest(cls, value: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        if value is not None:
            raise ValueError("the checkpoint's safetensors headers describe its tensors (a manifest is not served)")
        return value


class UpdateWeightsFromTensorRequest(BaseModel):
    """POST /update_weights_from_tensor: SGLang's UpdateWeightsFromTensorReqInput. SGLang's
    ``serialized_named_tensors`` are its MultiprocessingSerializer's pickles, which hold CUDA IPC
    handles or shared-memory descriptors: only a process on the server's host can read them, and the
    pickles run code as they load. raydix takes the base64 of a safetensors blob instead
    (``safetensors.torch.save({hf_name: whole_tensor})``): plain data, readable on any host. A list,
    as SGLang's (one per TP rank), must hold one blob or copies of it: every rank takes its shard of
    the whole tensors."""

    model_config = FORBID

    serialized_named_tensors: Union[str, List[str]]
    load_format: Optional[str] = None  # (only the default: refused by the backend otherwise)
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = Field(None, min_length=1)
    torch_empty_cache: bool = False

    def named_tensors(self) -> Dict[str, Any]:
        """The tensors of the blob; ValueError when it is not base64 of safetensors or the list's
        blobs differ."""
        import base64
        import binascii

        from safetensors.torch import load

        blobs = self.serialized_named_tensors
        blobs = [blobs] if isinstance(blobs, str) else blobs
        if not blobs or any(blob != blobs[0] for blob in blobs):
            raise ValueError("one safetensors blob is read (a list holds it once, or once per TP rank)")
        try:
            return load(base64.b64decode(blobs[0], validate=True))
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"not the base64 of a safetensors blob ({exc})") from None
        except Exception as exc:  # (safetensors' own SafetensorError)
            raise ValueError(f"not a safetensors blob ({exc})") from None


def describe_validation_error(exc, skip: int = 0) -> tuple:
    """``(message, param)``: the first bad field by its dotted path, with pydantic's reason. ``exc``:
    pydantic's ValidationError, or FastAPI's RequestValidationError with ``skip=1`` (its paths start
    with where the value was: query, path)."""
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"][skip:] if not str(p).startswith(("function-", "union["))]
    # Union members add their own names to the path; keep the field name before them.
    param = ".".join(p for p in loc if not (p.startswith("list[") or p in ("str", "int")))
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    elif err["type"] == "missing":
        msg = "field required"
    if not param and ": " in msg:  # a model-level check names its field first
        param = msg.split(": ", 1)[0].split(" / ")[0]
        return msg, param
    return (f"{param}: {msg}" if param else msg), (param or None)
