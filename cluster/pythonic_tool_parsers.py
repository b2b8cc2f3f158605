"""The pythonic tool-call formats (vLLM's ``pythonic`` and ``llama4_pythonic``): calls written as a
Python list, ``[get_weather(city="Paris"), add(a=1)]``, read a character at a time (never run). The
contract is :class:`cluster.tool_parsers.ToolCallParser`'s; as vLLM streams them, a call is sent
once named (at its ``(``) and its arguments grow as the model writes them, the Python literals
written as JSON (:class:`cluster.python_stream.PythonLiteral`).
"""

from __future__ import annotations

import json
import keyword
import unicodedata
from typing import List, Optional

from cluster.json_stream import JSON_SPACE
from cluster.python_stream import PYTHON_SPACE, PythonLiteral
from cluster.tool_parsers import SpacedContent, ToolCallParser


def _identifier(name: str) -> str:
    """A name as Python reads it (NFKC-normalized); ValueError for a keyword (``if(a=1)``)."""
    name = unicodedata.normalize("NFKC", name)
    if keyword.iskeyword(name):
        raise ValueError(f"a keyword for a name: {name}")
    return name


class CallList:
    """A list of calls, ``[f(a=1), g()]``, read a character at a time; ``calls`` takes them. A call
    is committed, ``[name, "{"]`` appended to ``calls``, at its ``(``; each keyword argument then
    adds ``"key": `` at its ``=`` and its value as :class:`PythonLiteral` writes it, and the call's
    ``)`` its ``}``, so a call's arguments add up to ``json.dumps`` of its keyword arguments' values.
    ``broken``: a character the list cannot go on with came (a positional argument, ``**kwargs``, a
    name for a value, an empty list...); the calls committed keep the arguments they had (so do
    those the output cuts short), as a vLLM stream does. A keyword given twice is written twice.
    What a call's arguments grow by is held in ``written`` until ``flush`` (their string copied once
    a piece fed, not once a character: a long argument read so was O(n²) in its length)."""

    def __init__(self, calls: List[List[str]]):
        self.calls, self.first = calls, len(calls)
        self.expect = "["  # then "call" (a name or "]"), "name", "(", "argument" (a keyword or ")"),
        # "keyword", "=", "value", "comma" ("," or ")"), "next" ("," or "]"), "done"
        self.name = ""  # the name being read, a call's or a keyword's
        self.value: Optional[PythonLiteral] = None  # the keyword's value; None before the call's first
        self.written: List[str] = []  # the last call's arguments' growth since ``flush``
        self.broken = False

    @property
    def done(self) -> bool:
        return self.expect == "done"

    @property
    def called(self) -> bool:
        return len(self.calls) > self.first

    def step(self, c: str) -> None:
        try:
            self._step(c)
        except ValueError:
            self.broken = True

    def flush(self) -> None:
        """The arguments ``written`` onto the last call's."""
        if self.written:
            self.calls[-1][1] += "".join(self.written)
            self.written = []

    def _step(self, c: str) -> None:
        expect = self.expect
        if expect == "value":
            if self.value.takes(c):
                self.written.append(self.value.step(c))
                self.expect = "comma" if self.value.done else "value"
                return
            self.written.append(self.value.end())
            expect = self.expect = "comma"
        if expect in ("name", "keyword") and (self.name + c).isidentifier():
            self.name += c
        elif c in PYTHON_SPACE:
            self.expect = {"name": "(", "keyword": "="}.get(expect, expect)
        elif expect in ("call", "argument") and c.isidentifier():
            self.name, self.expect = c, "name" if expect == "call" else "keyword"
        elif expect == "[" and c == "[":
            self.expect = "call"
        elif expect == "call" and c == "]" and self.called:  # (after a trailing comma; [] is no calls)
            self.expect = "done"
        elif expect in ("name", "(") and c == "(":
            name = _identifier(self.name)
            self.flush()
            self.calls.append([name, "{"])
            self.value, self.expect = None, "argument"
        elif expect in ("keyword", "=") and c == "=":
            key = json.dumps(_identifier(self.name), ensure_ascii=False)
            self.written.append((", " if self.value else "") + key + ": ")
            self.value, self.expect = PythonLiteral(), "value"
        elif expect == "comma" and c == ",":
            self.expect = "argument"
        elif expect in ("argument", "comma") and c == ")":
            self.written.append("}")
            self.expect = "next"
        elif expect == "next" and c in ",]":
            self.expect = "call" if c == "," else "done"
        else:
            raise ValueError(f"a call list cannot go on with {c!r}")


def _past_tag(text: str, tag: str) -> Optional[str]:
    """``text`` past ``tag`` and the whitespace before it if it opens with them, else as it is; None
    while that may still change (whitespace only, or it may still grow into the tag)."""
    rest = text.lstrip(JSON_SPACE)
    if tag and rest.startswith(tag):
        return rest[len(tag):]
    return None if tag.startswith(rest) else text


class PythonicParser(ToolCallParser):
    """The pythonic calls of Llama 3.2 and others (vLLM's ``pythonic``): an output that opens, past
    whitespace, with ``[`` is read as a list of calls with keyword arguments, literals only
    (``[get_weather(city="Paris"), add(a=1)]``, :class:`CallList`), any other text content as
    written. Until a call is committed the list is held: one that breaks (``[1, 2]``) or that the
    output cuts short is content as written; after, the text from the character that broke it is
    content. vLLM needs the whole output to be the list; here text after it is content. ``START``,
    ``END``: tags around the list (Llama 4's), dropped."""

    START = END = ""

    def __init__(self):
        super().__init__()
        self.state = "opening"  # then the "list" read, "closing" (its END tag), "after" it (or with none): content
        self.held = ""  # the opening's or closing's text while undecided; the list's until it has a call
        self.list: Optional[CallList] = None
        self.content = SpacedContent()

    def feed(self, text: str) -> str:
        if self.state in ("opening", "closing"):
            text, self.held = self.held + text, ""
            past = _past_tag(text, self.START if self.state == "opening" else self.END)
            if past is None or (self.state == "opening" and not past.strip(JSON_SPACE)):
                self.held = text
                return ""
            if self.state == "closing":
                self.state, text = "after", past
            elif past.lstrip(JSON_SPACE).startswith("["):
                self.state, self.list, text = "list", CallList(self.calls), past
            else:
                self.state = "after"
        if self.state == "after":
            return self.content.text(text)
        for i, c in enumerate(text):
            self.list.step(c)
            if self.list.broken or self.list.done:
                self.list.flush()
            if self.list.broken:  # (content: the list as written if it had no call, else from here)
                body, self.held, self.state = self.held + text if not self.list.called else text[i:], "", "after"
                return self.content.text(body)
            if self.list.done:
                self.held, self.state = "", "closing" if self.END else "after"
                return self.feed(text[i + 1:])
        self.list.flush()
        self.held = self.held + text if not self.list.called else ""
        return ""

    def finish(self) -> str:
        held = self.held if self.state == "list" else self.held.replace(self.START, "").replace(self.END, "")
        out = self.content.text(held)
        self.held = ""
        return out + self.content.end(bool(self.calls))

    def unparsed(self, text: str) -> Optional[str]:
        """The output, its tags dropped, if a call was committed but the list broke or the output cut
        it short: vLLM reads a whole pythonic output with ``ast`` and one that does not parse is
        content, where the calls as far as they went would give clients arguments that are no JSON."""
        if self.list is None or not self.list.called or self.list.done:
            return None
        return text.replace(self.START, "").replace(self.END, "")


class Llama4PythonicParser(PythonicParser):
    """Llama 4's pythonic calls (vLLM's ``llama4_pythonic``): the list between ``<|python_start|>``
    and ``<|python_end|>`` (special tokens: with them skipped, the list alone, read so too)."""

    START, END = "<|python_start|>", "<|python_end|>"
