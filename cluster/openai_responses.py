"""OpenAI's Responses API, ``POST /v1/responses`` (vLLM's and SGLang's), over the chat path.

A Responses request becomes the chat request it means (:func:`chat_request`) and runs through
``GenerationService.chat`` — the chat template, sampling params, grammar, tool-call and reasoning
parsers — its chat answer reshaped into a response (:mod:`cluster.responses_format`):

* ``input``: a string (a user message) or items: messages (role user, system, developer or
  assistant; content a string or ``input_text`` / ``output_text`` parts, and ``input_image`` parts:
  chat's ``image_url`` parts: data, http(s) or file:// URLs), ``function_call`` items
  (an assistant's ``tool_calls``; calls right after an assistant message join it, as one turn's
  output) and ``function_call_output`` items (``tool`` messages). ``reasoning`` items (a client
  sends a response's output back whole) stay out of the prompt, as in vLLM: templates drop a past
  turn's thinking. ``instructions``: a system message first.
* ``tools``: functions, ``name`` / ``description`` / ``parameters`` at the tool's top level;
  ``tool_choice``: none, auto, required or ``{"type": "function", "name"}``; ``text.format``:
  chat's ``response_format`` (text, json_object, or json_schema with its ``schema`` at the top level).
* ``max_output_tokens``, ``temperature``, ``top_p``, ``parallel_tool_calls`` and SGLang's and vLLM's
  extras (:data:`CHAT_EXTRAS`, the openai client's ``extra_body``) as chat takes them; ``metadata``,
  ``user`` and ``reasoning`` (its effort changes nothing here) come back on the response;
  ``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ``max_tool_calls`` (built-in tools'
  calls) and ``stream_options`` change nothing.
* ``include: ["message.output_text.logprobs"]`` is chat's ``logprobs``, ``top_logprobs`` (0-20) chat's
  too: each output_text, and each streamed text delta, carries its tokens' logprobs. Without the
  include, ``top_logprobs`` fills nothing, as OpenAI's and vLLM's.
* 400 naming the field for what would be ignored though asked for: built-in tools (web_search,
  file_search, ...), ``background``, other ``include`` entries (it fills none), ``truncation: "auto"``;
  an unknown field (``n``: the Responses API has none) too. A chat error is renamed after the
  Responses field that caused it (``response_format`` → ``text.format``, ``messages`` → ``input``).

``store`` (true unless false, as OpenAI's): the response and its conversation are kept in a
:class:`ResponseStore`, an LRU of ``server.responses_store_size`` responses in this HTTP server's
process memory — not shared between replicas, lost on restart — so that ``previous_response_id``
continues the conversation (without the earlier ``instructions``, as OpenAI) and
``GET /v1/responses/{id}`` returns the response (``DELETE`` drops it), and
``GET /v1/responses/{id}/input_items`` its request's ``input`` items, each with an ``id``, in OpenAI's
list pages (``limit``, ``order``, ``after``). An id not stored, or evicted since, is OpenAI's 400
``previous_response_not_found``, or a 404.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import ConfigDict, Field, ValidationError, model_validator

from cluster.api_errors import APIError
from cluster.chat_protocol import ChatCompletionRequest
from cluster.openai_protocol import NullIsDefault, describe_validation_error
from cluster.responses_format import ResponsesFormatter
from cluster.responses_store import ResponseStore, StoredResponse, item_list, stored_input_items

CHAT_EXTRAS = frozenset({
    "seed", "stop", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "ignore_eos",
    "stop_token_ids", "min_tokens", "logit_bias", "skip_special_tokens", "priority", "chat_template_kwargs",
    "separate_reasoning", "json_schema", "regex", "ebnf", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "include_stop_str_in_output", "allowed_token_ids", "bad_words"})
"""Chat fields a Responses request takes as they are (SGLang's and vLLM's extras)."""

TEXT_PARTS = ("input_text", "output_text")
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one ``include`` entry this server fills


class ResponsesRequest(NullIsDefault):
    """POST /v1/responses (see the module's docstring)."""

    model_config = ConfigDict(extra="allow")  # CHAT_EXTRAS only: see _known_extras

    model: Optional[str] = Field(None, min_length=1, description="None: the served model")
    input: Union[str, List[Dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1, description="None: up to the context length")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    tools: List[Dict[str, Any]] = Field(default_factory=list)
    tool_choice: Union[Literal["none", "auto", "required"], Dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    text: Optional[Dict[str, Any]] = None
    store: bool = True
    previous_response_id: Optional[str] = None
    metadata: Optional[Dict[str, str]] = None
    user: Optional[str] = None
    reasoning: Optional[Dict[str, Any]] = Field(None, description="accepted and echoed; its effort changes nothing")
    background: bool = False
    include: List[str] = Field(default_factory=list)
    top_logprobs: int = Field(0, ge=0, le=20, description="with include message.output_text.logprobs: the most "
                              "likely alternatives at each token (without it, as OpenAI's: no logprobs)")
    max_tool_calls: Optional[int] = Field(None, ge=1, description="accepted and echoed: it bounds built-in tool "
                                          "calls, and this server runs none")
    truncation: Literal["auto", "disabled"] = "disabled"
    # OpenAI fields that change nothing here
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    stream_options: Optional[Dict[str, Any]] = None

    @model_validator(mode="after")
    def _known_extras(self):
        unknown = sorted(set(self.model_extra or ()) - CHAT_EXTRAS)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown field")
        return self

    @model_validator(mode="after")
    def _nothing_unserved(self):
        """What would be silently ignored though asked for."""
        if self.background:
            raise ValueError("background: background responses are not supported by this server")
        for entry in self.include:
            if entry != OUTPUT_LOGPROBS:
                raise ValueError(f"include: {entry!r} is not supported by this server (only {OUTPUT_LOGPROBS!r})")
        if self.truncation == "auto":
            raise ValueError('truncation: "auto" is not supported by this server (an input too long is a 400)')
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise ValueError(f"tools.{i}.type: built-in tool {tool.get('type')!r} is not supported by this "
                                 "server (function tools only)")
        return self

    @property
    def output_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in self.include

    def echo(self) -> Dict[str, Any]:
        """The request's settings as a response carries them."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls,
                "previous_response_id": self.previous_response_id,
                "reasoning": self.reasoning or {"effort": None, "summary": None}, "store": self.store,
                "temperature": self.temperature, "text": self.text or {"format": {"type": "text"}},
                "tool_choice": self.tool_choice or "auto", "tools": self.tools, "top_p": self.top_p,
                "truncation": self.truncation, "user": self.user, "background": False,
                "top_logprobs": self.top_logprobs, "max_tool_calls": self.max_tool_calls,
                "prompt_cache_key": self.prompt_cache_key, "safety_identifier": self.safety_identifier}


def _bad(param: str, what: str) -> APIError:
    return APIError(400, f"{param}: {what}", param=param)


def _content_of(parts: Any, param: str, images: bool = False) -> Union[str, List[Dict[str, Any]]]:
    """A message's content for chat: a string as it is, text parts as chat's text parts and, with
    ``images`` (a message's content), ``input_image`` parts as chat's ``image_url`` parts and chat's
    ``video_url`` parts as they are (OpenAI's Responses API has no video part; vLLM's takes chat's, its
    Responses and chat content parts being parsed alike)."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise _bad(param, "must be a string or a list of input_text parts")
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if images and kind == "input_image":
            out.append(_image_part(part, f"{param}.{j}"))
        elif images and kind == "video_url":  # (its shape checked as chat's: ChatMessage.video_urls)
            out.append({"type": "video_url", "video_url": part.get("video_url")})
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        else:
            served = "input_text, output_text, input_image or video_url" if images else "input_text or output_text"
            raise _bad(f"{param}.{j}", f"content part {kind!r} is not supported ({served})")
    return out


def _image_part(part: Dict[str, Any], param: str) -> Dict[str, Any]:
    """OpenAI's ``{"type": "input_image", "image_url": "data:...", "detail": ...}`` as chat's image_url
    part (its URL fetched as chat's: :mod:`cluster.media_fetch`; ``detail`` changes nothing: the checkpoint's
    image processor sizes the image)."""
    if not isinstance(part.get("image_url"), str):
        raise _bad(param, "an input_image is taken by its image_url, a URL string (file_id is not served)")
    return {"type": "image_url", "image_url": {"url": part["image_url"]}}


def _field(item: Dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise _bad(f"{param}.{name}", "field required (a string)")
    return value


def input_messages(items: Union[str, List[Dict[str, Any]]], param: str = "input") -> List[Dict[str, Any]]:
    """Chat messages of a Responses ``input`` (or of a response's ``output``: the same item shapes)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: List[Dict[str, Any]] = []
    for i, item in enumerate(items):
        where, kind = f"{param}.{i}", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role", f"{role!r} is not one of user, system, developer, assistant")
            messages.append({"role": role, "content": _content_of(item.get("content"), f"{where}.content", True)})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
            if not messages or messages[-1]["role"] != "assistant":  # (else: the same turn's text, then its calls)
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                             "content": _content_of(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":
            raise _bad(f"{where}.type", f"item type {kind!r} is not supported (message, function_call, "
                       "function_call_output, reasoning)")
    return messages


def _chat_tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _bad("tool_choice", f"{choice!r} is not none, auto, required or {{'type': 'function', 'name'}}")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Chat's ``response_format`` of ``text.format`` (the json_schema's fields at its top level)."""
    fmt = (text or {}).get("format")
    if fmt is None or not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    if not isinstance(fmt.get("schema"), (dict, bool)):
        raise _bad("text.format", "a json_schema format needs its schema (a JSON schema)")
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def chat_request(req: ResponsesRequest, messages: List[Dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request of ``req`` over ``messages`` (the conversation, ``instructions`` not yet in)."""
    if req.instructions:
        messages = [{"role": "system", "content": req.instructions}] + messages
    tools = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in req.tools]
    body = dict(req.model_extra or {}, model=req.model, messages=messages, max_tokens=req.max_output_tokens,
                temperature=req.temperature, top_p=req.top_p, stream=req.stream, user=req.user,
                tools=tools or None, tool_choice=_chat_tool_choice(req.tool_choice),
                parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req.text),
                logprobs=req.output_logprobs, top_logprobs=req.top_logprobs if req.output_logprobs else None)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        raise APIError(400, message, param=param) from None


CHAT_FIELDS = (("messages", "input"), ("response_format", "text.format"), ("max_tokens", "max_output_tokens"),
               ("tool_choice.function", "tool_choice"))


def _renamed(param: str) -> str:
    """A chat field's name as the Responses request spells it."""
    parts = param.split(".")
    if len(parts) >= 3 and parts[0] == "tools" and parts[2] == "function":  # (a function tool's fields are its own)
        return ".".join(parts[:2] + parts[3:])
    for chat, ours in CHAT_FIELDS:
        if param == chat or param.startswith(chat + "."):
            return ours
    return param


@contextmanager
def responses_errors():
    """A chat 400 under the Responses field that caused it."""
    try:
        yield
    except APIError as exc:
        if exc.status != 400 or not exc.param or _renamed(exc.param) == exc.param:
            raise
        param = _renamed(exc.param)
        message = param + exc.message[len(exc.param):] if exc.message.startswith(exc.param) else exc.message
        raise APIError(400, message, exc.type, param, exc.code) from None


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id '{response_id}' (never stored, or evicted since)",
                    "not_found_error", "response_id", "response_not_found")


class ResponsesService:
    """The /v1/responses routes over a ``GenerationService`` and this server's :class:`ResponseStore`."""

    def __init__(self, generation, store_size: int):
        self.generation, self.store = generation, ResponseStore(store_size)

    async def create(self, req: ResponsesRequest, arrival: float, request_id: str):
        history: List[Dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise APIError(400, f"Previous response with id '{req.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
            history = previous.messages
        conversation = history + input_messages(req.input)

        def store(response: Dict[str, Any]) -> None:
            if req.store:
                self.store.put(StoredResponse(response, conversation + input_messages(response["output"], "output"),
                                              stored_input_items(req.input)))

        def reshape(chat_formatter):
            return ResponsesFormatter(chat_formatter, req.echo(), self.generation.tokenizer, store)

        with responses_errors():
            return await self.generation.chat(chat_request(req, conversation), arrival, request_id, reshape)

    def _stored(self, response_id: str) -> StoredResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored

    def retrieve(self, response_id: str) -> Dict[str, Any]:
        return self._stored(response_id).response

    def input_items(self, response_id: str, limit: int, order: str, after: Optional[str],
                    include: List[str]) -> Dict[str, Any]:
        """The response's input items (this request's ``input``, not the earlier turns'), a page of them."""
        if include:  # (none applies to text input items)
            raise _bad("include", f"{include[0]!r} is not supported by this server (it fills none)")
        return item_list(self._stored(response_id).input_items, limit, order, after)

    def delete(self, response_id: str) -> Dict[str, Any]:
        if self.store.pop(response_id) is None:
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
