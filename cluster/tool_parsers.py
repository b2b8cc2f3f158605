"""Tool-call parsers: one choice's text into content and calls, for each way ``tool_choice`` is
served (see :mod:`cluster.tool_calls`): a named function's (:class:`NamedParser`), "required"'s
JSON array (:class:`RequiredParser`), and the model formats "auto" reads calls in
(:class:`HermesParser`, :class:`Llama3JsonParser`, more in :mod:`cluster.model_tool_parsers` and
:mod:`cluster.pythonic_tool_parsers`; by name in :data:`cluster.tool_calls.TOOL_CALL_PARSERS`),
with what they share: calls in tagged blocks (:class:`BlockParser`) and the content around calls
(:class:`SpacedContent`).

A parser is fed a choice's text in any pieces and gives the same calls and content as when fed
it whole (non-streamed is one piece through the same code), so a streamed choice's fragments
add up to its non-streamed message. A call's arguments grow as the model writes them (vLLM's
streaming): the JSON formats commit a call once it is named and its arguments begin, and write
the arguments as ``json.dumps`` writes their value (:class:`cluster.json_stream.CallObject`), what
could still change held back; the pythonic ones commit a call at its ``(`` and write its Python
literals so (:class:`cluster.python_stream.PythonLiteral`); a committed call stays one, so a call
the output breaks or cuts short keeps the arguments it had (not JSON), as a vLLM stream does; not
streamed, such an output is content (:meth:`ToolCallParser.unparsed`, vLLM's non-streamed reading),
as is one whose call's arguments are whole but its object then breaks or is cut short.
"""

from __future__ import annotations

import json
from typing import List, Optional, Tuple

from cluster.json_stream import JSON_SPACE, CallObject
from cluster.streaming import partial_suffix_len


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

    def unparsed(self, text: str) -> Optional[str]:
        """After ``finish``: ``text``, the whole output read, as a non-streamed message's content, no
        calls, where its calls do not parse whole and the format's non-streamed reading then has
        none (vLLM's pythonic parsers': a stream has sent them); None: the calls stand."""
        return None

    def whole_calls(self) -> List[List[Optional[str]]]:
        """After ``finish``: the calls a non-streamed message holds, where they stand (``unparsed``)."""
        return self.calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # (JsonStream reads any depth, json.loads not)
        return False
    return True


class JsonCallsParser(ToolCallParser):
    """A format whose calls are JSON text, read as vLLM's non-streamed parsers read them: a call
    that does not ``json.loads`` makes the whole output content, no calls. A call the output
    broke or cut short once committed has arguments as far as they went, no JSON, which a stream
    has sent (as vLLM's) but which OpenAI clients ``json.loads`` from a message; so does one whose
    arguments are whole but whose object (or the array holding it) then broke or was cut short
    (``calls_broken``, set by the subclass): vLLM loads the object, and it fails. ``SPECIAL_TAGS``:
    tags the output shows only as it is decoded with special tokens for the parser, dropped then."""

    SPECIAL_TAGS: Tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self.calls_broken = False

    def unparsed(self, text: str) -> Optional[str]:
        if not self.calls_broken and all(_is_json(arguments) for _, arguments in self.whole_calls()):
            return None
        for tag in self.SPECIAL_TAGS:
            text = text.replace(tag, "")
        return text

    def object_ended(self, call: CallObject) -> None:
        """``call``'s object read as far as the output goes: a committed call whose object is not
        whole (broken, or cut short) breaks the calls."""
        if call.call is not None and (call.broken or not call.done):
            self.calls_broken = True


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
        self.captured: List[str] = []  # the parameters' characters not in the call's yet

    def feed(self, text: str) -> str:
        for c in text:
            self._step(c)
        self._flush()
        return ""

    def _flush(self) -> None:
        """The parameters captured onto the last call's arguments, once a piece (or before the next
        call): its string grown a character at a time was copied whole each time, O(n²)."""
        if self.captured:
            self.calls[-1][1] += "".join(self.captured)
            self.captured = []

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
            self.captured.append(c)
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
            self._flush()
            self.calls.append([None, ""])
            self.expect, self.key = "key", None
        elif c == ",":
            self.expect = "key"
        elif c == ":":
            self.expect = "value"


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


class BlockParser(JsonCallsParser):
    """Calls in tagged blocks, ``START body END``, in the text (subclasses give the tags). A
    subclass reads a block's body as it comes: ``_open`` at its start, ``_read`` each piece (a
    tail that may be ``END``'s start held back), committing calls to ``calls`` as they come, and
    ``_close`` at its end (or, unclosed, at the output's) says whether it held calls. A block that
    holds none stays in the content as written (vLLM's). ``MARKERS``: tags around the blocks that
    are no content (DeepSeek-V3's section's), dropped. Text outside blocks is content
    (:class:`SpacedContent`); a tail that may still grow into ``START`` or a marker is held back,
    never sent as content."""

    START = END = ""
    MARKERS: Tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self.pending = ""  # text not decided yet: a tail that may start (or in a block, end) a tag
        self.in_block = False
        self.block = ""  # the open block's text so far, its tag included
        self.content = SpacedContent()

    def _open(self) -> None:
        raise NotImplementedError

    def _read(self, text: str) -> None:
        raise NotImplementedError

    def _close(self) -> bool:
        raise NotImplementedError

    def feed(self, text: str) -> str:
        self.pending += text
        out = []
        while True:
            if self.in_block:
                end = self.pending.find(self.END)
                if end < 0:
                    self._body(len(self.pending) - partial_suffix_len(self.pending, self.END))
                    return "".join(out)
                self._body(end)
                self.pending = self.pending[len(self.END):]
                out.append(self._block_end(self.END))
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
            self.pending = self.pending[start + len(tag):]
            if tag == self.START:
                self.in_block, self.block = True, tag
                self._open()

    def finish(self) -> str:
        if self.in_block:  # (cut short: its body may still be whole, before a tail of the end tag)
            self._body(len(self.pending) - partial_suffix_len(self.pending, self.END))
            out = self._block_end(self.pending)
        else:
            out = self.content.text(self.pending)
        self.pending = ""
        return out + self.content.end(bool(self.calls))

    def _body(self, size: int) -> None:
        """The open block's next ``size`` characters of ``pending``, to its body."""
        text, self.pending = self.pending[:size], self.pending[size:]
        self.block += text
        self._read(text)

    def _block_end(self, end: str) -> str:
        """The block ends (``end``: its tag, or what the output had of it): "" if it held calls, else
        its text as content."""
        called, text = self._close(), self.block + end
        self.block, self.in_block = "", False
        if not called:
            return self.content.text(text)
        self.content.call()
        return ""


class HermesParser(BlockParser):
    """Hermes' and Qwen 2.5's format: a call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    in the text, read as :class:`CallObject` reads it: its arguments stream from the moment the
    call is named and they begin. A block whose object breaks before that (or names no function)
    stays content; the rest of a block whose call broke after it is dropped."""

    START, END = "<tool_call>", "</tool_call>"

    def _open(self) -> None:
        self.call = CallObject(self.calls)

    def _read(self, text: str) -> None:
        for c in text:
            self.call.step(c)
        self.call.flush()

    def _close(self) -> bool:
        self.object_ended(self.call)
        return self.call.call is not None


class Llama3JsonParser(JsonCallsParser):
    """Llama 3.x's JSON calls (vLLM's ``llama3_json``): an output that opens, past whitespace, with
    ``{`` or ``<|python_tag|>`` is calls, JSON objects ``{"name": ..., "parameters": {...}}`` (or
    ``"arguments"``: the first of the two to come) separated by ``;``, each read as
    :class:`CallObject` reads it, its arguments streaming; one that opens otherwise is content. The
    first object that is not a call (vLLM decides the whole output at once, all calls or all
    content), or text other than ``;`` and whitespace between them, is content as written from
    there on, the calls before it kept; so is the text from the character that broke a call once
    committed. An object the output cut short is content, or the call as far as it went. Not streamed, a call
    that breaks or is cut short after whole ones is left out and they stand (vLLM's regex takes the run of
    whole objects the output opens with); the first one so makes the output content."""

    TAG = "<|python_tag|>"

    def __init__(self):
        super().__init__()
        self.state = "opening"  # then "between" calls, in an "object", or "content" for good
        self.held: List[str] = []  # the opening's text until it is decided, or the object's so far (joined once read)
        self.call: Optional[CallObject] = None
        self.last_dropped = False  # the last call broke or was cut short after whole ones

    def object_ended(self, call: CallObject) -> None:
        if len(self.calls) > 1 and call.call is not None and (call.broken or not call.done):
            self.last_dropped = True  # (the last call: no call follows one that broke or was cut)
        else:
            super().object_ended(call)

    def whole_calls(self) -> List[List[Optional[str]]]:
        return self.calls[:-1] if self.last_dropped else self.calls

    def feed(self, text: str) -> str:
        if self.state == "opening":
            text = self._open("".join(self.held) + text)
        out = []
        for i, c in enumerate(text):
            if self.state == "content":
                out.append(text[i:])
                break
            out.append(self._step(c))
        if self.call is not None:
            self.call.flush()
        return "".join(out)

    def finish(self) -> str:
        if self.state == "object":  # (cut short)
            self.object_ended(self.call)
        uncalled = self.state == "opening" or (self.state == "object" and self.call.call is None)
        out, self.held = "".join(self.held) if uncalled else "", []
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
            self.held = [text]
            return ""
        self.held = []
        self.state = "between" if opening.startswith("{") else "content"
        return opening if self.state == "between" else text

    def _step(self, c: str) -> str:
        if self.state == "between":
            if c in JSON_SPACE or c == ";":
                return ""
            if c != "{":
                self.state = "content"
                return c
            self.state, self.call = "object", CallObject(self.calls, ("arguments", "parameters"), default=None)
        if self.call.call is None:  # (the object's text is content only if it calls nothing)
            self.held.append(c)
        self.call.step(c)
        if not (self.call.done or self.call.broken):
            return ""
        body, self.held = "".join(self.held), []
        self.object_ended(self.call)
        if self.call.call is None:
            self.state = "content"
            return body
        self.state = "content" if self.call.broken else "between"
        return c if self.call.broken else ""
