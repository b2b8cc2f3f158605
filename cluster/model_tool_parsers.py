"""Tool-call parsers of more models' formats, as vLLM and SGLang read them: Mistral's
(:class:`MistralParser`), the pythonic list of Llama 4 and others (:class:`PythonicParser`),
Qwen3-Coder's XML (:class:`Qwen3CoderParser`) and DeepSeek-V3's (:class:`DeepSeekV3Parser`); by
name in :data:`cluster.tool_calls.TOOL_CALL_PARSERS`. The contract is
:class:`cluster.tool_parsers.ToolCallParser`'s: fed in any pieces, what they give fed whole; a
call's arguments come whole once it is decided, and a malformed call stays content as written.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Dict, List, Optional

from cluster.streaming import partial_suffix_len
from cluster.tool_parsers import JSON_SPACE, BlockParser, JsonLexer, SpacedContent, ToolCallParser, named_call


def _json_text(value: Any) -> Optional[str]:
    """``value`` as JSON text; None if it has no JSON form (a set, bytes, NaN: a literal of Python's)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return None


_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralParser(ToolCallParser):
    """Mistral's calls after its ``[TOOL_CALLS]`` token, in either form vLLM reads: a JSON array of
    ``{"name", "arguments"}`` (tokenizers before v11, ``[TOOL_CALLS] [{...}, ...]``), or one call
    per token, ``[TOOL_CALLS]name[ARGS]{...}`` (v11 and later; ``name{...}`` without ``[ARGS]``,
    and a ``[CALL_ID]id`` before it, read too). The array or object is decided when its brackets
    close; one that is not calls, or a name that is none, is content as written from the token on.
    Text before and after is content (:class:`~cluster.tool_parsers.SpacedContent`). The tags are
    special tokens in Mistral's HF tokenizers: the output is decoded with them."""

    TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    special_tokens = True

    def __init__(self):
        super().__init__()
        self.state = "text"  # then "calls" just past the tag, the "array" or "object" being read
        self.held = ""  # since the tag, or a tail that may start it
        self.lexer = JsonLexer()
        self.content = SpacedContent()

    def feed(self, text: str) -> str:
        out, i = [], 0
        while i < len(text):
            if self.state == "text":
                i = self._text(text, i, out)
                continue
            c = text[i]
            i += 1
            self.held += c
            if self.state == "calls":
                if c == "[" and not self.held[len(self.TAG):-1].strip(JSON_SPACE):
                    self.state = "array"
                elif c == "{":
                    self.state = "object"
                else:
                    continue  # (a name's characters, [ARGS]: taken when the object opens)
                self.lexer = JsonLexer()
            self.lexer.step(c)
            if self.lexer.depth == 0:
                out.append(self._decide())
        return "".join(out)

    def _text(self, text: str, i: int, out: List[str]) -> int:
        """Content up to the tag (or a tail that may start it, held); where to go on from."""
        self.held += text[i:]
        tag = self.held.find(self.TAG)
        if tag < 0:
            keep = len(self.held) - partial_suffix_len(self.held, self.TAG)
            out.append(self.content.text(self.held[:keep]))
            self.held = self.held[keep:]
            return len(text)
        out.append(self.content.text(self.held[:tag]))
        rest = len(self.held) - tag - len(self.TAG)  # (of this text: fed again, a character at a time)
        self.held, self.state = self.TAG, "calls"
        return len(text) - rest

    def _decide(self) -> str:
        """The array's or object's calls, or the text since the tag as content."""
        body, text, array = self.held[len(self.TAG):], self.held, self.state == "array"
        self.held, self.state = "", "text"
        calls = self._array(body) if array else self._object(body)
        if not calls:
            return self.content.text(text)
        self.calls.extend(calls)
        self.content.call()
        return ""

    @staticmethod
    def _array(body: str) -> Optional[List[List[str]]]:
        """``[{"name": ..., "arguments": ...}, ...]``'s calls; None if any element is not one."""
        try:
            value = json.loads(body)
        except ValueError:
            return None
        calls = [named_call(v) for v in value] if isinstance(value, list) else []
        return calls if calls and all(calls) else None

    def _object(self, body: str) -> Optional[List[List[str]]]:
        """``name[ARGS]{...}``'s call (``[CALL_ID]id`` after the name, or no ``[ARGS]``: read too)."""
        start = body.index("{")
        name = body[:start].strip(JSON_SPACE)
        if name.endswith(self.ARGS):
            name = name[:-len(self.ARGS)]
        name = name.split(self.CALL_ID)[0]
        try:
            arguments = json.loads(body[start:])
        except ValueError:
            return None
        if not _MISTRAL_NAME.fullmatch(name) or not isinstance(arguments, dict):
            return None
        return [[name, json.dumps(arguments, ensure_ascii=False)]]

    def finish(self) -> str:
        out = self.content.text(self.held)
        self.held, self.state = "", "text"
        return out + self.content.end(bool(self.calls))


def _python_list(text: str) -> Optional[ast.List]:
    """``text`` as a whole Python list expression (read by ``ast``, never run); None if it is not one."""
    try:
        tree = ast.parse(text.lstrip(JSON_SPACE), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return tree if isinstance(tree, ast.List) else None


def _pythonic_calls(tree: ast.List) -> Optional[List[List[str]]]:
    """``[f(a=1), g()]``'s calls, each argument a literal as JSON; None if the list is not such
    calls (empty, positional arguments, a call's call, ``**kwargs``, a name for a value...)."""
    if not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                return None
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        arguments_text = _json_text(arguments)
        if arguments_text is None:
            return None
        calls.append([node.func.id, arguments_text])
    return calls


class PythonicParser(ToolCallParser):
    """The pythonic calls of Llama 4 and others (vLLM's ``pythonic``): an output that opens, past
    whitespace, with ``[`` is held until a ``]`` closes a Python list; a list of calls with keyword
    arguments, literals only (``[get_weather(city="Paris"), add(a=1)]``), is the calls, any other
    text (or a list cut short) content as written. vLLM needs the whole output to be the list; here
    text after it is content."""

    def __init__(self):
        super().__init__()
        self.state = "opening"  # then the "list" held, or "after" it (or with none): content
        self.held = ""
        self.content = SpacedContent()

    def feed(self, text: str) -> str:
        if self.state == "opening":
            text, self.held = self.held + text, ""
            opening = text.lstrip(JSON_SPACE)
            if not opening:
                self.held = text
                return ""
            self.state = "list" if opening.startswith("[") else "after"
        if self.state == "after":
            return self.content.text(text)
        start = len(self.held)
        self.held += text
        end = self.held.find("]", start)
        while end >= 0:
            tree = _python_list(self.held[:end + 1])
            if tree is not None:
                body, rest = self.held[:end + 1], self.held[end + 1:]
                self.held, self.state = "", "after"
                calls = _pythonic_calls(tree)
                if calls is None:
                    return self.content.text(body + rest)
                self.calls.extend(calls)
                return self.content.text(rest)
            end = self.held.find("]", end + 1)
        return ""

    def finish(self) -> str:
        out = self.content.text(self.held)
        self.held = ""
        return out + self.content.end(bool(self.calls))


_QWEN3_FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
_QWEN3_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def _schema_value(text: str, schema: Any) -> Any:
    """A Qwen3-Coder parameter's raw text as its JSON schema's ``type`` says (vLLM's): "null" is
    null; strings (and parameters the schema lacks, ``schema`` None) stay text; integers, numbers and booleans are
    read as such; anything else as JSON, or a Python literal; what does not read stays text."""
    if text.lower() == "null":
        return None
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    if isinstance(kind, list):  # (["integer", "null"]: the non-null type)
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind).strip().lower()
    if kind in _STRING_TYPES:
        return text
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            value = float(text)
        except ValueError:
            return text
        return text if not math.isfinite(value) else int(value) if value.is_integer() else value
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"  # (vLLM's: anything else false)
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return text
    return value if _json_text(value) is not None else text


class Qwen3CoderParser(BlockParser):
    """Qwen3-Coder's XML calls (vLLM's ``qwen3_coder``): ``<tool_call><function=NAME><parameter=P>
    value</parameter>...</function></tool_call>``, a parameter's value raw text (one newline each
    side trimmed) typed by the request's tool's schema (:func:`_schema_value`), so the parser is
    made per request with its ``tools``. A block with no ``<function=NAME>`` stays content (and a
    ``<function=`` outside a block, which vLLM reads when the output has no block); a function or
    parameter the output cut short is read as far as it goes (vLLM's)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tools):
        super().__init__()
        self.properties: Dict[str, Dict[str, Any]] = {}  # per function: its parameters' schemas
        for tool in tools or ():
            properties = (tool.function.parameters or {}).get("properties")
            self.properties[tool.function.name] = properties if isinstance(properties, dict) else {}

    def _calls(self, body: str) -> Optional[List[List[str]]]:
        calls = []
        for closed, cut in _QWEN3_FUNCTION.findall(body):
            function = closed or cut
            if ">" not in function:
                return None
            name, parameters = function.split(">", 1)
            properties, arguments = self.properties.get(name, {}), {}
            for parameter in _QWEN3_PARAMETER.findall(parameters):
                if ">" not in parameter:
                    return None
                key, value = parameter.split(">", 1)
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                arguments[key] = _schema_value(value, properties.get(key))
            calls.append([name, json.dumps(arguments, ensure_ascii=False)])
        return calls


_DEEPSEEK_CALL = re.compile(r"(.*?)<｜tool▁sep｜>(.*?)\n```json\n(.*)\n```\s*", re.DOTALL)


class DeepSeekV3Parser(BlockParser):
    """DeepSeek-V3's calls (vLLM's ``deepseek_v3``): ``<｜tool▁calls▁begin｜>``, then per call
    ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``,
    then ``<｜tool▁calls▁end｜>``. Each call is a block of its own (streamed once it closes); the
    section's tags are no content, dropped; a block that is not such a call (its arguments no JSON
    object) stays content."""

    START, END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")

    def _calls(self, body: str) -> Optional[List[List[str]]]:
        match = _DEEPSEEK_CALL.fullmatch(body)
        if match is None:
            return None
        try:
            arguments = json.loads(match.group(3))
        except ValueError:
            return None
        name = match.group(2).strip(JSON_SPACE)
        return [[name, json.dumps(arguments, ensure_ascii=False)]] if name and isinstance(arguments, dict) else None
