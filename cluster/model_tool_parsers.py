"""Tool-call parsers of more models' formats, as vLLM and SGLang read them: Mistral's
(:class:`MistralParser`), Qwen3-Coder's XML (:class:`Qwen3CoderParser`), and DeepSeek-V3's and
V3.1's (:class:`DeepSeekV3Parser`, :class:`DeepSeekV31Parser`); the pythonic ones in
:mod:`cluster.pythonic_tool_parsers`; by name in :data:`cluster.tool_calls.TOOL_CALL_PARSERS`. The
contract is :class:`cluster.tool_parsers.ToolCallParser`'s: fed in any pieces, what they give fed
whole. The JSON formats (Mistral's, DeepSeek's) stream a call's arguments as they come, from the
moment it is named (a call malformed before that stays content as written); Qwen3-Coder's, no JSON
text, a parameter at a time.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Dict, List, Optional

from cluster.json_stream import JSON_SPACE, CallObject, JsonStream, json_dumps, json_text
from cluster.streaming import partial_suffix_len
from cluster.tool_parsers import BlockParser, JsonCallsParser, JsonLexer, SpacedContent


_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralParser(JsonCallsParser):
    """Mistral's calls after its ``[TOOL_CALLS]`` token, in either form vLLM reads: a JSON array of
    ``{"name", "arguments"}`` (tokenizers before v11, ``[TOOL_CALLS] [{...}, ...]``), each element
    read as :class:`~cluster.json_stream.CallObject` reads it, or one call per token,
    ``[TOOL_CALLS]name[ARGS]{...}`` (v11 and later; ``name{...}`` without ``[ARGS]``, and a
    ``[CALL_ID]id`` before it, read too), committed at its ``{`` when the name is one. Arguments
    stream as they come. An array or object that breaks (an element not a call, a name that is
    none) before a call of its own is committed is content as written from the token on; after,
    the text from the character that broke it is read afresh (not streamed, the whole output is
    content then, as vLLM's ``json.loads`` of the array fails; so when it is cut short). Text
    before and after is content (:class:`~cluster.tool_parsers.SpacedContent`). The tags are
    special tokens in Mistral's HF tokenizers: the output is decoded with them."""

    TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    SPECIAL_TAGS = (TAG, ARGS, CALL_ID)
    special_tokens = True

    def __init__(self):
        super().__init__()
        self.state = "text"  # then "calls" past the tag: the "array", a call's "arguments", or an "object" no call
        self.held: List[str] = []  # since the tag, or a tail that may start it (joined when read: O(n) held)
        self.first = 0  # the first of the calls since the tag
        self.lexer = JsonLexer()  # (an object no call: read to its end)
        self.arguments = JsonStream()
        self.written: List[str] = []  # the arguments read, not in the call's yet (added once a piece fed)
        self.element: Optional[CallObject] = None  # the array's element being read
        self.expect = "first"  # in the array: "first" element (or "]"), "element", "comma" (or "]")
        self.content = SpacedContent()

    def feed(self, text: str) -> str:
        out, i = [], 0
        while i < len(text):
            if self.state == "text":
                i = self._text(text, i, out)
                continue
            shown = self._step(text[i])
            if shown is not None:  # (None: it broke the calls, read again as text)
                out.append(shown)
                i += 1
        self._flush()
        return "".join(out)

    def _flush(self) -> None:
        """What the last call's arguments grew by onto its string, once a piece, not once a character
        (each growth copies the string whole: O(n²) in a long argument's length)."""
        if self.written:
            self.calls[-1][1] += "".join(self.written)
            self.written = []
        if self.element is not None:
            self.element.flush()

    def _text(self, text: str, i: int, out: List[str]) -> int:
        """Content up to the tag (or a tail that may start it, held); where to go on from."""
        held = "".join(self.held) + text[i:]
        tag = held.find(self.TAG)
        if tag < 0:
            keep = len(held) - partial_suffix_len(held, self.TAG)
            out.append(self.content.text(held[:keep]))
            self.held = [held[keep:]]
            return len(text)
        out.append(self.content.text(held[:tag]))
        rest = len(held) - tag - len(self.TAG)  # (of this text: fed again, a character at a time)
        self.held, self.state, self.first = [self.TAG], "calls", len(self.calls)
        return len(text) - rest

    def _step(self, c: str) -> Optional[str]:
        if len(self.calls) == self.first:  # (the text since the tag is content only if it calls nothing)
            self.held.append(c)
        if self.state == "calls":
            if c not in "[{":
                return ""  # (a name's characters: taken when the object opens)
            head = "".join(self.held)[len(self.TAG):-1]
            if c == "[" and not head.strip(JSON_SPACE):
                self.state, self.expect = "array", "first"
                return ""
            if c != "{":
                return ""  # ([ARGS])
            name = self._name(head)
            if name is None:
                self.state, self.lexer = "object", JsonLexer()
            else:
                self.state, self.arguments = "arguments", JsonStream()
                self.calls.append([name, ""])
        if self.state == "object":
            self.lexer.step(c)
            return self._end(called=False) if self.lexer.depth == 0 else ""
        if self.state == "arguments":
            try:
                self.written.append(self.arguments.step(c))
            except ValueError:
                return self._end(called=False)
            return self._end(called=True) if self.arguments.done else ""
        return self._element(c)

    def _element(self, c: str) -> Optional[str]:
        """The array's next character: its elements' calls, its commas and its end."""
        if self.element is not None:
            self.element.step(c)
            if self.element.broken or (self.element.done and self.element.call is None):
                return self._end(called=False)
            if self.element.done:
                self.element, self.expect = None, "comma"
            return ""
        if c in JSON_SPACE:
            return ""
        if c == "{" and self.expect in ("first", "element"):
            self.element = CallObject(self.calls)
            self.element.step(c)
        elif c == "," and self.expect == "comma":
            self.expect = "element"
        else:
            return self._end(called=c == "]" and self.expect in ("first", "comma"))
        return ""

    def _end(self, called: bool) -> Optional[str]:
        """The calls since the tag end (``called``: whole, at their last character): their text as
        content if none was committed; None if some were and they broke at this character."""
        self._flush()
        text, self.held, self.state, self.element = "".join(self.held), [], "text", None
        if len(self.calls) == self.first:
            return self.content.text(text)
        self.content.call()
        self.calls_broken |= not called
        return "" if called else None

    def _name(self, head: str) -> Optional[str]:
        """The function named before an object's ``{`` (``name[ARGS]``, ``name[CALL_ID]id[ARGS]`` or
        ``name``); None if none."""
        name = head.strip(JSON_SPACE)
        if name.endswith(self.ARGS):
            name = name[:-len(self.ARGS)]
        name = name.split(self.CALL_ID)[0]
        return name if _MISTRAL_NAME.fullmatch(name) else None

    def finish(self) -> str:
        uncalled = self.state == "text" or len(self.calls) == self.first
        self.calls_broken |= not uncalled  # (cut short once called)
        out = self.content.text("".join(self.held)) if uncalled else ""
        self.held, self.state = [], "text"
        return out + self.content.end(bool(self.calls))


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
    return value if json_text(value) is not None else text


class Qwen3CoderParser(BlockParser):
    """Qwen3-Coder's XML calls (vLLM's ``qwen3_coder``): ``<tool_call><function=NAME><parameter=P>
    value</parameter>...</function></tool_call>``, a parameter's value raw text (one newline each
    side trimmed) typed by the request's tool's schema (:func:`_schema_value`), so the parser is
    made per request with its ``tools``. The arguments are no JSON text in the output: a call is
    committed once its ``<function=NAME>`` closes, its arguments ``{`` then one ``"P": value`` per
    parameter once the next tag ends it, and ``}`` at the function's end (vLLM streams them per
    parameter too). A block with no ``<function=NAME>`` stays content (and a ``<function=``
    outside a block, which vLLM reads when the output has no block); a parameter with no ``>`` is
    read past; a function or parameter the output cut short is read as far as it goes (vLLM's)."""

    START, END = "<tool_call>", "</tool_call>"
    FUNCTION, FUNCTION_END, PARAMETER, PARAMETER_END = "<function=", "</function>", "<parameter=", "</parameter>"

    def __init__(self, tools):
        super().__init__()
        self.properties: Dict[str, Dict[str, Any]] = {}  # per function: its parameters' schemas
        for tool in tools or ():
            properties = (tool.function.parameters or {}).get("properties")
            self.properties[tool.function.name] = properties if isinstance(properties, dict) else {}

    def _open(self) -> None:
        self.body, self.pos, self.first = "", 0, len(self.calls)  # pos: where the body is read to
        self.function: Optional[Dict[str, Any]] = None  # the open function's parameters' schemas
        self.written = 0  # its parameters written

    def _read(self, text: str) -> None:
        self.body += text
        while self._function() if self.function is None else self._parameter():
            pass

    def _close(self) -> bool:
        if self.function is not None:  # (cut short, or no </function>: read as far as it goes)
            start = self.body.find(self.PARAMETER, self.pos)
            if start >= 0:
                self._write(self.body[start + len(self.PARAMETER):])
            self.calls[-1][1] += "}"
        return len(self.calls) > self.first

    def _function(self) -> bool:
        """The next function's start: its call committed once its name's ``>`` comes; whether read."""
        start = self.body.find(self.FUNCTION, self.pos)
        close = self.body.find(">", start) if start >= 0 else -1
        if close < 0:
            return False
        end = self.body.find(self.FUNCTION_END, start)
        if 0 <= end < close:  # (no name: read past)
            self.pos = end + len(self.FUNCTION_END)
            return True
        name = self.body[start + len(self.FUNCTION):close]
        self.calls.append([name, "{"])
        self.function, self.written, self.pos = self.properties.get(name, {}), 0, close + 1
        return True

    def _parameter(self) -> bool:
        """The open function's next parameter once a tag ends it, or its end; whether read."""
        start, end = self.body.find(self.PARAMETER, self.pos), self.body.find(self.FUNCTION_END, self.pos)
        if start < 0 or 0 <= end < start:
            if end < 0:
                return False
            self.calls[-1][1] += "}"
            self.function, self.pos = None, end + len(self.FUNCTION_END)
            return True
        start += len(self.PARAMETER)
        ends = [i for i in (self.body.find(tag, start) for tag in (self.PARAMETER_END, self.PARAMETER,
                                                                    self.FUNCTION_END)) if i >= 0]
        if not ends:
            return False
        self._write(self.body[start:min(ends)])
        self.pos = min(ends) + (len(self.PARAMETER_END) if self.body.startswith(self.PARAMETER_END, min(ends)) else 0)
        return True

    def _write(self, parameter: str) -> None:
        """A parameter's ``"P": value`` in the open call's arguments (none if it has no ``>``)."""
        if ">" not in parameter:
            return
        key, value = parameter.split(">", 1)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        value = _schema_value(value, self.function.get(key))
        pair = json_dumps({key: value})[1:-1]  # (as the whole object's json.dumps writes it)
        self.calls[-1][1] += (", " if self.written else "") + pair
        self.written += 1


class DeepSeekV3Parser(BlockParser):
    """DeepSeek-V3's calls (vLLM's ``deepseek_v3``): ``<｜tool▁calls▁begin｜>``, then per call
    ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``,
    then ``<｜tool▁calls▁end｜>``. Each call is a block of its own; the section's tags are no
    content, dropped. The call is committed at its arguments' ``{`` (the name known), which then
    stream as :class:`~cluster.json_stream.JsonStream` writes them; a block without a name before
    them, or whose arguments are no JSON object, stays content; the rest of a block whose arguments
    broke after the ``{`` (or follow the object) is dropped."""

    START, END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    SEP, FENCE = "<｜tool▁sep｜>", "\n```json\n"

    def _name(self, head: str) -> Optional[str]:
        """The name in a block's text before its arguments, once that is whole ("" if it names none); None before."""
        if not head.endswith(self.FENCE) or self.SEP not in head[:-len(self.FENCE)]:
            return None
        return head[:-len(self.FENCE)].split(self.SEP, 1)[1].strip(JSON_SPACE)

    def _open(self) -> None:
        self.head, self.name, self.arguments, self.broken = "", None, None, False

    def _read(self, text: str) -> None:
        written = []  # (added to the call's string once: grown a character at a time, O(n²))
        for c in text:
            if self.broken or (self.arguments is not None and self.arguments.done):
                break
            if self.name is None:
                self.head += c
                self.name = self._name(self.head)
                self.broken = self.name == ""
                continue
            if self.arguments is None:
                if c in JSON_SPACE:
                    continue
                if c != "{":
                    self.broken = True
                    break
                self.arguments = JsonStream()
                self.calls.append([self.name, ""])
            try:
                written.append(self.arguments.step(c))
            except ValueError:
                self.broken = True
        if written:
            self.calls[-1][1] += "".join(written)

    def _close(self) -> bool:
        return self.arguments is not None


class DeepSeekV31Parser(DeepSeekV3Parser):
    """DeepSeek-V3.1's calls (vLLM's ``deepseek_v31``): V3's tags, and per call
    ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``, no type and no fence."""

    def _name(self, head: str) -> Optional[str]:
        return head[:-len(self.SEP)].strip(JSON_SPACE) if head.endswith(self.SEP) else None
