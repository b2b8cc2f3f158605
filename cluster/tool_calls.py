"""OpenAI tool calling on the chat endpoint, as vLLM serves it.

How a request's ``tool_choice`` is served (:func:`tool_calls_for`):

* a named function (``{"type": "function", "function": {"name"}}``): the output is constrained to
  the function's ``parameters`` schema (:func:`named_schema`, the request's grammar) and the whole
  text is that call's arguments; ``finish_reason`` stays "stop" (vLLM's).
* ``"required"``: constrained to vLLM's JSON array of ``{"name", "parameters"}`` objects
  (:func:`required_schema`; ``maxItems`` 1 when ``parallel_tool_calls`` is false); each element is
  a call; ``finish_reason`` "tool_calls".
* ``"auto"`` (OpenAI's default with tools) with the server's ``tool_call_parser``: unconstrained,
  the text parsed for calls in the model's own format (:data:`TOOL_CALL_PARSERS`); without a
  parser an explicit ``"auto"`` is a 400, as vLLM without ``--enable-auto-tool-choice``, and no
  ``tool_choice`` (or ``"none"``) answers in plain content, the tools still in the prompt.

This module is the request's side: the grammars of the constrained modes, the template's view of
an assistant's calls (:func:`template_message`) and :class:`ToolCalls`, which reads each choice
through a parser of :mod:`cluster.tool_parsers` into OpenAI's shapes; as a parser fed in pieces
gives what it gives fed whole, a streamed choice's fragments add up to its non-streamed message.
Arguments of the constrained modes are the model's own text, not re-serialized: they stream as the
value grows, and what streamed is what the message holds; the "auto" formats' arguments stream as
they grow too, written as ``json.dumps`` writes them (:mod:`cluster.json_stream`; the pythonic
formats' Python literals, :mod:`cluster.python_stream`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from cluster.harmony import HarmonyParser
from cluster.model_tool_parsers import DeepSeekV3Parser, DeepSeekV31Parser, MistralParser, Qwen3CoderParser
from cluster.pythonic_tool_parsers import Llama4PythonicParser, PythonicParser
from cluster.tool_parsers import HermesParser, Llama3JsonParser, NamedParser, RequiredParser, ToolCallParser


def _parameters(function) -> Dict[str, Any]:
    """A function's ``parameters`` schema; none: an object with no properties (vLLM's)."""
    return function.parameters if function.parameters is not None else {"type": "object", "properties": {}}


def named_schema(tools, name: str) -> Dict[str, Any]:
    """The grammar of a named ``tool_choice``: the function's parameters."""
    return _parameters(next(t.function for t in tools if t.function.name == name))


def required_schema(tools, parallel_tool_calls: Optional[bool]) -> Dict[str, Any]:
    """vLLM's grammar of ``tool_choice`` "required": an array of one or more
    ``{"name": <a tool's name>, "parameters": <its schema>}``, at most one without parallel calls;
    the tools' ``$defs`` lifted to the root, where their ``$ref`` s point (a name two tools define
    differently: ValueError, as vLLM's, not one tool's arguments held to the other's definition)."""
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _parameters(t.function)},
         "required": ["name", "parameters"]} for t in tools]}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    defs: Dict[str, Any] = {}
    for tool in tools:
        tool_defs = _parameters(tool.function).get("$defs", {})
        if not isinstance(tool_defs, dict):
            raise ValueError(f"tools: {tool.function.name}'s parameters.$defs must be an object")
        for name, definition in tool_defs.items():
            if defs.setdefault(name, definition) != definition:
                raise ValueError(f"tools: $defs {name!r} has different schemas in two tools (they share one $defs)")
    if defs:
        schema["$defs"] = defs
    return schema


def template_message(message: Dict[str, Any]) -> Dict[str, Any]:
    """``message`` as chat templates take it (vLLM's): an assistant's tool-call arguments, a JSON
    string in OpenAI's shape, as the object they encode (templates write them with ``tojson``)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call.get("function") or {})
        try:
            function["arguments"] = json.loads(function.get("arguments") or "{}")
        except (TypeError, ValueError):  # not JSON text: the template gets it as it came
            pass
        calls.append(dict(call, function=function))
    return dict(message, tool_calls=calls)


TOOL_CALL_PARSERS: Dict[str, Callable[[Sequence], ToolCallParser]] = {
    "hermes": lambda tools: HermesParser(),
    "llama3_json": lambda tools: Llama3JsonParser(),
    "mistral": lambda tools: MistralParser(),
    "pythonic": lambda tools: PythonicParser(),
    "llama4_pythonic": lambda tools: Llama4PythonicParser(),
    "qwen3_coder": Qwen3CoderParser,
    "deepseek_v3": lambda tools: DeepSeekV3Parser(),
    "deepseek_v31": lambda tools: DeepSeekV31Parser(),
    "gpt_oss": lambda tools: HarmonyParser(),
}
"""``server.tool_call_parser``'s names: the formats ``tool_choice`` "auto" reads calls in, each a
parser made from the request's ``tools`` (Qwen3-Coder's types its arguments by their schemas)."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCalls:
    """The tool calls of one request's choices in OpenAI's shapes, each choice's text through a
    parser of its own (``make_parser``). ``calls_finish``: a choice that called and stopped
    ends with ``finish_reason`` "tool_calls" (a named function's stays "stop", as vLLM's).
    ``special_tokens``, ``whole_output``: the parser's (the output is to be decoded with special
    tokens; the parser reads it whole, thinking included)."""

    def __init__(self, make_parser: Callable[[], ToolCallParser], calls_finish: bool):
        self.make_parser, self.calls_finish = make_parser, calls_finish
        parser = make_parser()
        self.special_tokens, self.whole_output = parser.special_tokens, parser.whole_output
        self.parsers: Dict[int, ToolCallParser] = {}
        self.sent: Dict[int, List[int]] = {}  # per choice: the arguments' length streamed, per call

    def _parser(self, index: int) -> ToolCallParser:
        if index not in self.parsers:
            self.parsers[index] = self.make_parser()
        return self.parsers[index]

    def delta(self, index: int, text: str, finished: bool) -> Tuple[str, List[Dict[str, Any]]]:
        """A streamed step's content and ``delta.tool_calls``: a call's first chunk carries its id,
        type and name (once known) and the arguments so far, later ones the arguments' growth."""
        parser = self._parser(index)
        content = parser.feed(text) + (parser.finish() if finished else "")
        sent = self.sent.setdefault(index, [])
        out = []
        for i, (name, arguments) in enumerate(parser.calls):
            if name is None:  # (calls stream in order, each once named)
                break
            if i == len(sent):
                sent.append(0)
                out.append({"index": i, "id": new_call_id(), "type": "function",
                            "function": {"name": name, "arguments": arguments}})
            elif len(arguments) > sent[i]:
                out.append({"index": i, "function": {"arguments": arguments[sent[i]:]}})
            sent[i] = len(arguments)
        return content, out

    def message(self, index: int, text: str) -> Tuple[str, List[Dict[str, Any]]]:
        """A whole choice's content and ``message.tool_calls``; an output whose calls do not parse
        whole is content, no calls, where the parser's format says so (its ``unparsed``)."""
        parser = self._parser(index)
        content = parser.feed(text) + parser.finish()
        unparsed = parser.unparsed(text)
        if unparsed is not None:
            self.parsers[index] = self.make_parser()  # (no calls: the finish reason stays)
            return unparsed, []
        return content, [{"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
                         for name, arguments in parser.whole_calls() if name is not None]

    def finish_reason(self, index: int, reason: Optional[str]) -> Optional[str]:
        called = index in self.parsers and any(name is not None for name, _ in self.parsers[index].calls)
        return "tool_calls" if reason == "stop" and called and self.calls_finish else reason


def tool_calls_for(req, parser: Optional[str]) -> Optional[ToolCalls]:
    """How a chat request's output is read for calls (see the module's docstring); None: plain content.
    ``parser``: the server's ``tool_call_parser`` (the caller refuses an explicit "auto" without one)."""
    choice = req.tool_choice
    if not req.tools or choice == "none":
        return None
    if choice == "required":
        return ToolCalls(RequiredParser, calls_finish=True)
    if choice not in (None, "auto"):
        return ToolCalls(lambda: NamedParser(choice.function.name), calls_finish=False)
    if parser is None:
        return None
    make = TOOL_CALL_PARSERS[parser]
    return ToolCalls(lambda: make(req.tools), calls_finish=True)
