"""JSON text read a character at a time, as ``json.loads`` reads it, and written back as
``json.dumps(value, ensure_ascii=False)`` writes it (:class:`JsonStream`), and a tool call's JSON
object read so (:class:`CallObject`): how the JSON tool-call formats (:mod:`cluster.tool_parsers`)
stream a call's arguments while the model writes them, each piece sent once it can no longer
change, and the pieces adding up to what the whole text, parsed and dumped, gives (OpenAI's
arguments are that text; vLLM streams the diff of partial parses).
"""

from __future__ import annotations

import json
import re
from typing import Any, List, Optional, Tuple

JSON_SPACE = " \t\n\r"  # JSON's whitespace
_SCALAR_END = JSON_SPACE + ',:[]{}"'  # what ends a number or literal
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = "0123456789abcdefABCDEF"
_SURROGATE = re.compile("[\ud800-\udfff]")


def json_text(value: Any) -> Optional[str]:
    """``value`` as JSON text; None if it has no JSON form (a set, bytes, NaN: a literal of Python's)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return None


def json_chars(text: str) -> str:
    """A string's characters as ``json.dumps`` writes them inside the quotes."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def json_escaped(code: int) -> str:
    """The character an escape names, as :func:`json_chars` writes it; a surrogate (lone, or half of
    a pair Python's escapes write apart: ``'\\ud83d\\ude00'``) as its escape, as ``ensure_ascii``
    writes it: raw it is no UTF-8, and the response carrying it could not be encoded (a 500)."""
    return f"\\u{code:04x}" if 0xD800 <= code <= 0xDFFF else json_chars(chr(code))


def json_dumps(value: Any) -> str:
    """``json.dumps(value, ensure_ascii=False)`` with :func:`json_escaped`'s rule: a surrogate in a
    string (a lone one ``json.loads`` read from its escape) written as its escape, not raw."""
    return _SURROGATE.sub(lambda m: json_escaped(ord(m.group())), json.dumps(value, ensure_ascii=False))


class JsonStream:
    """One JSON value, a character at a time. ``step`` takes the next character and returns the
    text ``json.dumps`` writes for it, "" while that could still change: a number or literal until
    a character ends it (``end`` at the value's end), an escape until it is whole, a high surrogate
    until the next escape shows whether it pairs (``json.loads`` joins a pair; one alone is written
    as its escape, :func:`json_escaped`). Whitespace is dropped, ``,`` and ``:`` written ", " and
    ": ". A character ``json.loads`` refuses there raises ValueError (strict: no raw control
    character in a string; NaN and Infinity as it reads them).
    An object's key written twice is written twice (``json.loads`` keeps the last).

    ``done``: the value is whole (a number or literal at the top only once ``end`` is called);
    ``takes(c)``: ``c`` is still this value's (a top-level number ends at the character after it)."""

    def __init__(self):
        self.stack: List[str] = []  # the open containers' closing brackets
        self.expect = "value"  # "value", "first" (value or "]"), "key", "first_key" (or "}"), "colon", "comma", "done"
        self.escape: Optional[str] = None  # in a string: its undecided escape ("" none); None outside strings
        self.is_key = False  # the string being read is a key
        self.scalar = ""  # a number or literal so far

    @property
    def done(self) -> bool:
        return self.expect == "done"

    def takes(self, c: str) -> bool:
        return not self.done and not (self.scalar and not self.stack and c in _SCALAR_END)

    def end(self) -> str:
        """The value ends here: its last number or literal's text; ValueError if it is not whole."""
        out = self._end_scalar() if self.scalar and not self.stack else ""
        if not self.done:
            raise ValueError("the JSON value is not whole")
        return out

    def step(self, c: str) -> str:
        if self.escape is not None:
            return self._string(c)
        out = ""
        if self.scalar:
            if c not in _SCALAR_END:
                self.scalar += c
                return ""
            out = self._end_scalar()
        if c in JSON_SPACE:
            return out
        expect = self.expect
        if c == '"' and expect in ("value", "first", "key", "first_key"):
            self.escape, self.is_key = "", expect in ("key", "first_key")
        elif c in "[{" and expect in ("value", "first"):
            self.stack.append("]" if c == "[" else "}")
            self.expect = "first" if c == "[" else "first_key"
        elif expect in ("value", "first") and c not in _SCALAR_END:
            self.scalar = c
            return out
        elif self.stack and c == self.stack[-1] and expect in ("comma", "first", "first_key"):
            self.stack.pop()
            self._value_ended()
        elif expect == "comma" and c == ",":
            self.expect = "key" if self.stack[-1] == "}" else "value"
            return out + ", "
        elif expect == "colon" and c == ":":
            self.expect = "value"
            return out + ": "
        else:
            raise ValueError(f"JSON cannot go on with {c!r}")
        return out + c

    def _value_ended(self) -> None:
        self.expect = "comma" if self.stack else "done"

    def _end_scalar(self) -> str:
        value = json.loads(self.scalar)  # (ValueError if it is no number or literal: "01", "tru")
        self.scalar = ""
        self._value_ended()
        return json.dumps(value)

    def _string(self, c: str) -> str:
        """A string's next character (``self.escape`` "" outside an escape, else its text so far)."""
        if not self.escape:
            if c == '"':
                self.escape = None
                if self.is_key:
                    self.expect = "colon"
                else:
                    self._value_ended()
                return c
            if c == "\\":
                self.escape = c
                return ""
            if c < " ":
                raise ValueError("a raw control character in a JSON string")
            return c
        escape = self.escape + c
        if len(escape) == 2 and c != "u":
            if c not in _ESCAPES:
                raise ValueError(f"no JSON escape \\{c}")
            self.escape = ""
            return json_chars(_ESCAPES[c])
        if len(escape) <= 6 or len(escape) >= 9:  # (\uXXXX, or the \uXXXX after a high surrogate)
            if len(escape) > 2 and c not in _HEX:
                raise ValueError("a \\u escape without 4 hex digits")
            self.escape = escape
            if len(escape) == 12:
                return self._pair(escape)
            if len(escape) == 6 and not 0xD800 <= int(escape[2:], 16) <= 0xDBFF:
                self.escape = ""
                return json_escaped(int(escape[2:], 16))
            return ""
        if escape[6:] in ("\\", "\\u"):  # (a high surrogate's pair may follow)
            self.escape = escape
            return ""
        return self._lone(escape)

    def _pair(self, escape: str) -> str:
        """A high surrogate's escape and the escape after it: one character if that is a low surrogate."""
        high, low = int(escape[2:6], 16), int(escape[8:], 16)
        if not 0xDC00 <= low <= 0xDFFF:
            return self._lone(escape)
        self.escape = ""
        return json_chars(chr(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00)))

    def _lone(self, escape: str) -> str:
        """A high surrogate alone, then what followed its escape read afresh (json.loads' reading)."""
        self.escape = ""
        return json_escaped(int(escape[2:6], 16)) + "".join(self._string(c) for c in escape[6:])


class CallObject:
    """A call's JSON object, ``{"name": NAME, "arguments": ARGUMENTS}`` (``argument_keys``: the
    keys the arguments may come under, the first to come taken), read a character at a time. The
    call is committed, ``[name, arguments]`` appended to ``calls``, once its name is known and its
    arguments have begun (or, at the object's end, with ``default`` arguments when it names no
    arguments; ``default`` None: no call); its arguments then grow as :class:`JsonStream` writes
    them. Other keys are read past. ``broken``: a character JSON refuses came; a committed call
    keeps the arguments it had (so does one the output cuts short: vLLM streams them so too).
    What the arguments grow by is held until ``flush`` (the caller's, at the end of each piece fed;
    its own at the object's end): the call's string copied once a piece, not once a character (a
    long argument read so was O(n²) in its length)."""

    def __init__(self, calls: List[List[str]], argument_keys: Tuple[str, ...] = ("arguments",),
                 default: Optional[str] = "{}"):
        self.calls, self.argument_keys, self.default = calls, argument_keys, default
        self.expect = "{"  # then "first_key" (or "}"), "colon", "value", "comma" (or "}"), "key", "done"
        self.member: Optional[JsonStream] = None  # the key or value being read
        self.reading = ""  # what the member is: "key", "name", "arguments" or "other"
        self.text: List[str] = []  # the member's text so far (a key's or the name's)
        self.key: Optional[str] = None
        self.name: Optional[str] = None
        self.arguments: Optional[List[str]] = None  # the arguments' text not in the call's yet; None before they begin
        self.call: Optional[List[str]] = None  # committed, in calls
        self.broken = False

    @property
    def done(self) -> bool:
        return self.expect == "done"

    def step(self, c: str) -> None:
        if self.broken or (self.done and c in JSON_SPACE):
            return
        try:
            self._step(c)
        except ValueError:
            self.broken = True
        if self.broken or self.done:
            self.flush()

    def flush(self) -> None:
        """The arguments read since the last flush onto the committed call's."""
        if self.call is not None and self.arguments:
            self.call[1] += "".join(self.arguments)
            self.arguments = []

    def _step(self, c: str) -> None:
        if self.member is not None:
            if self.member.takes(c):
                self._read(self.member.step(c))
                if self.member.done:
                    self._member_ended()
                return
            self._read(self.member.end())
            self._member_ended()
        if c in JSON_SPACE:
            return
        expect = self.expect
        if expect == "{" and c == "{":
            self.expect = "first_key"
        elif expect in ("first_key", "key") and c == '"':
            self._member("key", c)
        elif expect == "colon" and c == ":":
            self.expect = "value"
        elif expect == "value":
            new_arguments = self.key in self.argument_keys and self.arguments is None and self.call is None
            self._member("arguments" if new_arguments else "name" if self.key == "name" else "other", c)
        elif expect == "comma" and c == ",":
            self.expect = "key"
        elif expect in ("first_key", "comma") and c == "}":
            self.expect = "done"
            if self.call is None and self.arguments is None and self.name is not None and self.default is not None:
                self.arguments = [self.default]
                self._commit()
        else:
            raise ValueError(f"no call object goes on with {c!r}")

    def _member(self, reading: str, c: str) -> None:
        self.member, self.reading, self.text = JsonStream(), reading, []
        if reading == "arguments":
            self.arguments = []
            self._commit()
        self._read(self.member.step(c))

    def _read(self, text: str) -> None:
        (self.arguments if self.reading == "arguments" else self.text).append(text)

    def _member_ended(self) -> None:
        self.member = None
        if self.reading == "key":
            self.key, self.expect = json.loads("".join(self.text)), "colon"
            return
        self.expect = "comma"
        if self.reading == "name" and self.name is None:
            name = json.loads("".join(self.text))
            self.name = name if isinstance(name, str) else None
            self._commit()

    def _commit(self) -> None:
        if self.call is None and self.name is not None and self.arguments is not None:
            self.calls.append([self.name, ""])
            self.call = self.calls[-1]
