"""Request bodies of the HTTP API (OpenAI's and SGLang's names), validated at the edge.

Every model rejects unknown fields, so a typo fails with a 400 that names it
instead of being ignored. ``to_sampling_params`` maps an OpenAI request onto
the engine's :class:`~actors.engine.sampling_params.SamplingParams` names;
SGLang's extra sampling fields (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``) are accepted at
the top level, as SGLang and vLLM accept them (the openai client's
``extra_body``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_FORBID = ConfigDict(extra="forbid")


class StreamOptions(BaseModel):
    model_config = _FORBID

    include_usage: bool = False


class _OpenAISampling(BaseModel):
    """The sampling fields completions and chat share."""

    model_config = _FORBID

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=64, description="choices; each runs as its own request")
    max_tokens: Optional[int] = Field(None, ge=1, description="None: up to the context length")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # SGLang / vLLM extras
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    ignore_eos: bool = False
    stop_token_ids: List[int] = Field(default_factory=list)
    skip_special_tokens: bool = True
    rid: Optional[str] = Field(None, description="request id (choice i runs as rid-i when n > 1)")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def _top_logprobs_num(self) -> Optional[int]:
        raise NotImplementedError

    def to_sampling_params(self, max_new_tokens: int) -> Dict[str, Any]:
        params = dict(
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
        )
        top = self._top_logprobs_num()
        if top is not None:
            params.update(return_logprob=True, top_logprobs_num=top)
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_OpenAISampling):
    """POST /v1/completions. ``prompt``: a string, or a list of token ids."""

    prompt: Union[str, List[int], List[str], List[List[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=20, description="top alternatives per token (legacy format)")
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (list, str)):
            if len(v) != 1:
                raise ValueError("one prompt per request (send a batch as separate requests)")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of not in (None, self.n):
            raise ValueError("best_of: only best_of == n is supported")
        return self

    def _top_logprobs_num(self) -> Optional[int]:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... pass through to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[Dict[str, Any]], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(f"content part type {part.get('type')!r} is not supported (text only)")
                parts.append(part.get("text", ""))
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_OpenAISampling):
    """POST /v1/chat/completions; the prompt is the tokenizer's chat template over ``messages``."""

    messages: List[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return self

    def _top_logprobs_num(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


class GenerateRequest(BaseModel):
    """POST /generate (SGLang native): ``text`` or ``input_ids``, engine sampling params."""

    model_config = _FORBID

    text: Optional[str] = None
    input_ids: Optional[List[int]] = None
    sampling_params: Dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: Optional[str] = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20)

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text / input_ids: set exactly one")
        if self.input_ids is not None and not self.input_ids:
            raise ValueError("input_ids: the prompt is empty")
        return self


class AddWorkerRequest(BaseModel):
    """POST /workers."""

    model_config = _FORBID

    role: Literal["prefill", "decode"]


def describe_validation_error(exc: ValidationError) -> tuple:
    """``(message, param)``: the first bad field by its dotted path, with pydantic's reason."""
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"] if not str(p).startswith(("function-", "union["))]
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
