"""The body of POST /v1/chat/completions (:class:`ChatCompletionRequest`: the sampling fields of
:class:`~cluster.openai_protocol.OpenAISampling` over :class:`ChatTemplateFields`, what makes a chat
prompt, which /tokenize's chat body shares), its messages and its tools.

vLLM's chat-template fields (``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``) are accepted at the top level, as vLLM accepts them. ``tools``,
``tool_choice`` and ``parallel_tool_calls`` are OpenAI's tool calling (see ``cluster.tool_calls``):
a named function or ``"required"`` is the request's grammar, as structured output's. SGLang's
``separate_reasoning: false`` turns the server's reasoning parser off for one request. OpenAI
fields that never change the output (``metadata``, ``store``, ``service_tier``) are accepted and
ignored.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from cluster.openai_protocol import FORBID, NullIsDefault, OpenAISampling, describe_validation_error
from cluster.tool_calls import named_schema, required_schema

RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
                            "return_dict", "chat_template", "tools", "documents"}


class FunctionCall(BaseModel):
    model_config = FORBID

    name: str
    arguments: Union[str, Dict[str, Any]] = Field("{}", description="OpenAI's JSON text (or its object)")


class MessageToolCall(BaseModel):
    """A call an assistant message made, as the template renders it (``cluster.tool_calls.template_message``)."""

    model_config = FORBID

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... pass through to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[Dict[str, Any]], None] = None
    tool_calls: Optional[List[MessageToolCall]] = None

    def image_urls(self) -> List[str]:
        """The URLs of the content's ``image_url`` parts (OpenAI's ``{"type": "image_url", "image_url":
        {"url": ...}}``), in order; ValueError (a 400) for a part of another shape (a bare string for
        ``image_url``, a ``url`` not a string), which the request's model does not type."""
        return self._part_urls("image_url")

    def video_urls(self) -> List[Union[str, List[str]]]:
        """The videos of the content's ``video_url`` parts (vLLM's ``{"type": "video_url", "video_url": {"url":
        ...}}``), in order: a video file's URL, or a list of its frames' image URLs; ValueError (a 400) for a part
        of another shape."""
        return self._part_urls("video_url")

    def _part_urls(self, part_type: str) -> list:
        if not isinstance(self.content, list):
            return []
        urls = []
        for part in self.content:
            if part.get("type") != part_type:
                continue
            media = part.get(part_type)
            url = media.get("url") if isinstance(media, dict) else None
            frames = part_type == "video_url" and isinstance(url, list) and url and all(isinstance(u, str) for u in url)
            if not (isinstance(url, str) or frames):
                shape = ("a url string ({\"url\": \"data:image/...;base64,...\"})" if part_type == "image_url" else
                         "a url, a video's URL or a list of its frames' image URLs")
                raise ValueError(f"an {part_type} part's {part_type} is an object with {shape}, not {media!r:.80}")
            urls.append(url)
        return urls

    def template_content(self) -> Union[str, List[Dict[str, Any]]]:
        """The content as the template takes it: :meth:`text`, or with images (videos) its text and ``image_url``
        parts as they came and each ``video_url`` part as ``{"type": "video"}`` (vLLM's: Qwen-VL's templates know
        an ``image_url`` part but write a video's tokens for a ``video`` part only); a vision-language template
        writes an image's (a video's) tokens for each."""
        if not self.image_urls() and not self.video_urls():
            return self.text()
        refused = [part.get("type") for part in self.content if part.get("type") not in ("text", "image_url",
                                                                                         "video_url")]
        if refused:
            raise ValueError(f"content part type {refused[0]!r} is not supported (text, image_url and video_url "
                             "only)")
        return [{"type": "video"} if part.get("type") == "video_url" else part for part in self.content]

    def text(self) -> str:
        """The content as one string: text parts one per line, as vLLM joins them for a template
        that takes string content (``"Hello"`` and ``"world"`` are not ``"Helloworld"``)."""
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(f"content part type {part.get('type')!r} is not supported (text only)")
                parts.append(part.get("text", ""))
            return "\n".join(parts)
        return self.content or ""


class FunctionDefinition(BaseModel):
    model_config = FORBID

    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = Field(None, description="a JSON schema; None: no arguments")
    strict: Optional[bool] = None


class ChatTool(BaseModel):
    model_config = FORBID

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = FORBID

    name: str


class NamedToolChoice(BaseModel):
    model_config = FORBID

    type: Literal["function"]
    function: FunctionName


class ChatTemplateFields(NullIsDefault):
    """What makes a chat prompt (``GenerationService.chat_prompt``): /v1/chat/completions' fields and
    /tokenize's, so that /tokenize answers with the very tokens a chat request runs."""

    messages: List[ChatMessage] = Field(min_length=1)
    continue_final_message: bool = Field(False, description="continue the last (assistant) message, not answer it")
    add_generation_prompt: Optional[bool] = Field(None, description="None: true unless continue_final_message")
    chat_template_kwargs: Dict[str, Any] = Field(default_factory=dict, description="extra template variables")
    add_special_tokens: bool = Field(False, description="vLLM's: add the tokenizer's special tokens on top of "
                                     "what the template wrote (off: the template writes BOS)")
    tools: Optional[List[ChatTool]] = Field(None, description="functions the model may call (in the prompt)")

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v):
        names = [tool.function.name for tool in v or ()]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"function names must be unique; {', '.join(map(repr, twice))} appears more than once")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _free_names(cls, v):
        taken = sorted(set(v) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by the request's own fields, not here")
        return v

    @model_validator(mode="after")
    def _continue_final(self):
        if not self.continue_final_message:
            return self
        if self.add_generation_prompt:
            raise ValueError("add_generation_prompt: cannot be true with continue_final_message (the final "
                             "message is continued, not answered)")
        if self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be the assistant's")
        return self

    @property
    def generation_prompt(self) -> bool:
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt


class ChatCompletionRequest(OpenAISampling, ChatTemplateFields):
    """POST /v1/chat/completions; the prompt is the tokenizer's chat template over ``messages``."""

    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    separate_reasoning: bool = Field(True, description="SGLang's: with the server's reasoning_parser, the thinking "
                                     "apart in reasoning_content; false: all of it in content, as with no parser")
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = Field(
        None, description="None: auto with the server's tool_call_parser, else none")
    parallel_tool_calls: Optional[bool] = Field(None, description="false: \"required\" makes one call at most")
    # OpenAI fields that change nothing here
    metadata: Optional[Dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, v):
        """The union's errors name one member's problem only, the one this value is meant for."""
        if isinstance(v, dict):
            try:
                return NamedToolChoice.model_validate(v)
            except ValidationError as exc:
                raise ValueError(describe_validation_error(exc)[0]) from None
        if v is not None and v not in ("none", "auto", "required"):
            raise ValueError(f"{v!r} is not one of none, auto, required or a named function")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v, info: ValidationInfo):
        names = [tool.function.name for tool in info.data.get("tools") or ()]
        if v == "required" and not names:
            raise ValueError('"required" needs tools')
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise ValueError(f"function {v.function.name!r} is not among the tools ({', '.join(names) or 'none'})")
        return v

    def _tool_grammar(self) -> List[Tuple[str, str, str]]:
        if self.tool_choice == "required":
            schema = required_schema(self.tools, self.parallel_tool_calls)
        elif isinstance(self.tool_choice, NamedToolChoice):
            schema = named_schema(self.tools, self.tool_choice.function.name)
        else:
            return []
        return [("tool_choice", "json_schema", json.dumps(schema))]

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return self

    @property
    def top_logprobs_num(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens
