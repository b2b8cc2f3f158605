"""Tool-call parsers: one choice's text into content and calls, for each way ``tool_choice`` is
served (see :mod:`cluster.tool_calls`): a named function's (:class:`NamedParser`), "required"'s
JSON array (:class:`RequiredParser`), and the model formats "auto" reads calls in
(:class:`HermesParser`, :class:`Llama3JsonParser`, more in :mod:`cluster.model_tool_parsers`; by
name in :data:`cluster.tool_calls.TOOL_CALL_PARSERS`), with what they share: calls in tagged
blocks (:class:`BlockParser`) and the content around calls (:class:`SpacedContent`).

A parser is fed a choice's text in any pieces and gives the same calls and content as when fed
it whole (non-streamed is one piece through the same code), so a streamed choice's fragments
add up to its non-streamed message.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from cluster.streaming import partial_suffix_len

JSON_SPACE = " \t\n\r"  # JSON's whitespace


class ToolCallParser:
    """One choice's text into content and calls. ``feed`` takes the next piece of text and returns
    the content now known to lie outside calls; ``finish`` the rest, at the output's end.
    ``calls``: ``[name, arguments so far]`` per call found, the name None until known; a call's
    arguments only grow. ``special_tokens``: the format's tags are special tokens in some of its
    models' tokenizers (Mistral's ``[TOOL_CALLS]``), so the output it reads is decoded with special
    tokens (vLLM's parser's ``adjust_request``). ``whole_output``: it reads the whole output, not the
    answer a reasoning parser leaves, and its content is the choice's (Harmony's calls are messages
    beside the thinking and the answer, :mod:`cluster.harmony`; vLLM's ``openai`` parser reads all
    the output's tokens)."""

    special_tokens = False
    whole_output = False

    def __init__(self):
        self.calls: List[List[Optional[str]]] = []

    def feed(self, text: str) -> str:
        raise NotImplementedError

    def finish(self) -> str:
        return ""


class NamedParser(ToolCallParser):
    """A named ``tool_choice``: the whole output is the function's arguments."""

    def __init__(self, name: str):
        super().__init__()
        self.calls = [[name, ""]]

    def feed(self, text: str) -> str:
        self.calls[0][1] += text
        return ""


class JsonLexer:
    """Where a JSON text stands after each character: its container depth, in a string or not."""

    def __init__(self):
        self.depth, self.in_string, self.escaped = 0, False, False

    def step(self, c: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
        elif c == '"':
            self.in_string = True
        elif c in "[{":
            self.depth += 1
        elif c in "]}":
            self.depth -= 1


_ELEMENT = 2  # the depth inside one of the array's objects


class RequiredParser(ToolCallParser):
    """``tool_choice`` "required"'s output, ``[{"name": ..., "parameters": ...}, ...]`` (its grammar's),
    scanned a character at a time: an object in the array opens a call, its "name" string names
    it, and its "parameters" value's text, as written, is the call's arguments."""

    def __init__(self):
        super().__init__()
        self.lexer = JsonLexer()
        self.expect: Optional[str] = None  # at the element's level: "key" or "value" next
        self.key: Optional[str] = None  # the key whose value comes or came last
        self.capture: Optional[str] = None  # the parameters' value being taken: container, string or scalar
        self.token, self.token_is_key = "", False  # an element-level string as written

    def feed(self, text: str) -> str:
        for c in text:
            self._step(c)
        return ""

    def _step(self, c: str) -> None:
        lexer, space = self.lexer, c in JSON_SPACE
        if self.capture == "scalar" and (space or c in ",}]"):
            self.capture = None
        opens_value = self.expect == "value" and not space
        opens_key = self.expect == "key" and c == '"'
        if opens_value or opens_key:
            self.expect = None
        if opens_value and self.key == "parameters":
            self.capture = "container" if c in "[{" else "string" if c == '"' else "scalar"
        in_string = lexer.in_string
        lexer.step(c)
        if self.capture:
            self.calls[-1][1] += c
            if self.capture != "scalar" and lexer.depth == _ELEMENT and not lexer.in_string:
                self.capture = None  # its container closed, or its string
            return
        if lexer.depth != _ELEMENT:
            return
        if in_string or c == '"':  # a key, or a value (the name)
            if opens_key or opens_value:
                self.token, self.token_is_key = "", opens_key
            self.token += c
            if not lexer.in_string:
                value = json.loads(self.token, strict=False)  # (xgrammar's strings take raw control characters)
                if self.token_is_key:
                    self.key = value
                elif self.key == "name":
                    self.calls[-1][0] = value
        elif c == "{":  # (at the element's depth after it: it opened an element)
            self.calls.append([None, ""])
            self.expect, self.key = "key", None
        elif c == ",":
            self.expect = "key"
        elif c == ":":
            self.expect = "value"


def _named_object(body: str) -> Optional[Dict[str, Any]]:
    """``body`` as a JSON object with a string "name" (a call's); None if it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) and isinstance(value.get("name"), str) else None


def named_call(value: Any) -> Optional[List[str]]:
    """``[name, arguments]`` of a parsed ``{"name": ..., "arguments": {...}}`` (Hermes' and Mistral's;
    none: ``{}``); None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return [value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False)]


class SpacedContent:
    """Text outside calls as content, less the whitespace before a call and, when the output has
    calls, at its end (the newlines around calls): trailing whitespace is held until text follows."""

    def __init__(self):
        self.space = ""

    def text(self, text: str) -> str:
        text = self.space + text
        shown = text.rstrip(JSON_SPACE)
        self.space = text[len(shown):]
        return shown

    def call(self) -> None:
        self.space = ""

    def end(self, called: bool) -> str:
        out, self.space = "" if called else self.space, ""
        return out


class BlockParser(ToolCallParser):
    """Calls in tagged blocks, ``START body END``, in the text (subclasses give the tags and read a
    body's calls in ``_calls``). A block is decided when it closes (or, unclosed, at the output's
    end), so its arguments come whole; a block that holds no call stays in the content as written
    (vLLM's). ``MARKERS``: tags around the blocks that are no content (DeepSeek-V3's section's),
    dropped. Text outside blocks is content (:class:`SpacedContent`); a tail that may still grow
    into ``START`` or a marker is held back, never sent as content."""

    START = END = ""
    MARKERS: Tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self.pending = ""  # text not decided yet: an open block's, or a tail that may start a tag
        self.in_block = False
        self.content = SpacedContent()

    def _calls(self, body: str) -> Optional[List[List[str]]]:
        """A body's ``[name, arguments]`` calls; None (or none) if it holds none."""
        raise NotImplementedError

    def feed(self, text: str) -> str:
        self.pending += text
        out = []
        while True:
            if self.in_block:
                end = self.pending.find(self.END)
                if end < 0:
                    return "".join(out)
                out.append(self._block(self.pending[:end], self.START + self.pending[:end + len(self.END)]))
                self.pending, self.in_block = self.pending[end + len(self.END):], False
                continue
            tags = (self.START,) + self.MARKERS
            found = [(start, tag) for start, tag in ((self.pending.find(tag), tag) for tag in tags) if start >= 0]
            if not found:
                held = max(partial_suffix_len(self.pending, tag) for tag in tags)
                out.append(self.content.text(self.pending[:len(self.pending) - held]))
                self.pending = self.pending[len(self.pending) - held:]
                return "".join(out)
            start, tag = min(found)
            out.append(self.content.text(self.pending[:start]))
            self.pending, self.in_block = self.pending[start + len(tag):], tag == self.START

    def finish(self) -> str:
        if self.in_block:  # (cut short: its body may still be whole, before a tail of the end tag)
            body = self.pending[:len(self.pending) - partial_suffix_len(self.pending, self.END)]
            out = self._block(body, self.START + self.pending)
        else:
            out = self.content.text(self.pending)
        self.pending = ""
        return out + self.content.end(bool(self.calls))

    def _block(self, body: str, text: str) -> str:
        """A block's calls, or its ``text`` as content."""
        calls = self._calls(body)
        if not calls:
            return self.content.text(text)
        self.calls.extend(calls)
        self.content.call()
        return ""


class HermesParser(BlockParser):
    """Hermes' and Qwen 2.5's format: a call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    in the text; a block that is not such JSON stays content."""

    START, END = "<tool_call>", "</tool_call>"

    def _calls(self, body: str) -> Optional[List[List[str]]]:
        call = named_call(_named_object(body))
        return None if call is None else [call]


def _llama3_call(body: str) -> Optional[List[str]]:
    """``[name, arguments]`` of ``{"name": ..., "parameters": ...}`` (or ``"arguments"``, first if
    both: vLLM's); None for any other JSON, one without either key too (an answer that is JSON)."""
    value = _named_object(body)
    key = next((k for k in ("arguments", "parameters") if k in value), None) if value is not None else None
    return None if key is None else [value["name"], json.dumps(value[key], ensure_ascii=False)]


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x's JSON calls (vLLM's ``llama3_json``): an output that opens, past whitespace, with
    ``{`` or ``<|python_tag|>`` is calls, JSON objects ``{"name": ..., "parameters": {...}}`` (or
    ``"arguments"``) separated by ``;``; one that opens otherwise is content. Each object is
    decided when its braces close, so its arguments come whole (vLLM streams an object's by its
    partial JSON, and decides the whole output at once, all calls or all content); the first that
    is not a call, or text other than ``;`` and whitespace between them, is content as written
    from there on, the calls before it kept. An object the output cut short is content."""

    TAG = "<|python_tag|>"

    def __init__(self):
        super().__init__()
        self.state = "opening"  # then "between" calls, in an "object", or "content" for good
        self.held = ""  # the opening's text until it is decided, or the object's so far
        self.lexer = JsonLexer()

    def feed(self, text: str) -> str:
        if self.state == "opening":
            text = self._open(self.held + text)
        out = []
        for i, c in enumerate(text):
            if self.state == "content":
                out.append(text[i:])
                break
            out.append(self._step(c))
        return "".join(out)

    def finish(self) -> str:
        out = self.held if self.state in ("opening", "object") else ""
        self.held = ""
        return out

    def _open(self, text: str) -> str:
        """What to go on with once the opening is decided: the calls from their ``{``, or the whole
        text as content; "" while it is held (whitespace, the tag or its start)."""
        opening = text.lstrip(JSON_SPACE)
        if opening.startswith(self.TAG):
            opening = opening[len(self.TAG):].lstrip(JSON_SPACE)
        elif len(opening) < len(self.TAG) and self.TAG.startswith(opening):
            opening = ""
        if not opening:
            self.held = text
            return ""
        self.held = ""
        self.state = "between" if opening.startswith("{") else "content"
        return opening if self.state == "between" else text

    def _step(self, c: str) -> str:
        if self.state == "between":
            if c in JSON_SPACE or c == ";":
                return ""
            if c != "{":
                self.state = "content"
                return c
            self.state, self.lexer = "object", JsonLexer()
        self.held += c
        self.lexer.step(c)
        if self.lexer.depth > 0:
            return ""
        call, body = _llama3_call(self.held), self.held
        self.held = ""
        if call is None:
            self.state = "content"
            return body
        self.calls.append(call)
        self.state = "between"
        return ""
