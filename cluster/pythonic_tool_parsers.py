"""The pythonic tool-call formats (vLLM's ``pythonic`` and ``llama4_pythonic``): calls written as a
Python list, ``[get_weather(city="Paris"), add(a=1)]``, read by ``ast`` (never run). The contract
is :class:`cluster.tool_parsers.ToolCallParser`'s; the arguments are Python literals, not JSON
text, so a call comes whole, once its list closes.
"""

from __future__ import annotations

import ast
from typing import List, Optional

from cluster.json_stream import JSON_SPACE, json_text
from cluster.tool_parsers import SpacedContent, ToolCallParser


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
        arguments_text = json_text(arguments)
        if arguments_text is None:
            return None
        calls.append([node.func.id, arguments_text])
    return calls


def _past_tag(text: str, tag: str) -> Optional[str]:
    """``text`` past ``tag`` and the whitespace before it if it opens with them, else as it is; None
    while that may still change (whitespace only, or it may still grow into the tag)."""
    rest = text.lstrip(JSON_SPACE)
    if tag and rest.startswith(tag):
        return rest[len(tag):]
    return None if tag.startswith(rest) else text


class PythonicParser(ToolCallParser):
    """The pythonic calls of Llama 3.2 and others (vLLM's ``pythonic``): an output that opens, past
    whitespace, with ``[`` is held until a ``]`` closes a Python list; a list of calls with keyword
    arguments, literals only (``[get_weather(city="Paris"), add(a=1)]``), is the calls, any other
    text (or a list cut short) content as written. vLLM needs the whole output to be the list; here
    text after it is content. The arguments are Python, not JSON text: the calls come whole, at the
    list's end. ``START``, ``END``: tags around the list (Llama 4's), dropped."""

    START = END = ""

    def __init__(self):
        super().__init__()
        self.state = "opening"  # then the "list" held, "closing" (its END tag), "after" it (or with none): content
        self.held = ""
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
            else:
                self.state = "list" if past.lstrip(JSON_SPACE).startswith("[") else "after"
                text = past if self.state == "list" else text
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
                self.state = "closing" if self.END else "after"
                return self.feed(rest)
            end = self.held.find("]", end + 1)
        return ""

    def finish(self) -> str:
        held = self.held if self.state == "list" else self.held.replace(self.START, "").replace(self.END, "")
        out = self.content.text(held)
        self.held = ""
        return out + self.content.end(bool(self.calls))


class Llama4PythonicParser(PythonicParser):
    """Llama 4's pythonic calls (vLLM's ``llama4_pythonic``): the list between ``<|python_start|>``
    and ``<|python_end|>`` (special tokens: with them skipped, the list alone, read so too)."""

    START, END = "<|python_start|>", "<|python_end|>"
