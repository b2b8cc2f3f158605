"""A Python literal read a character at a time, as ``ast.literal_eval`` reads it, and written as the
JSON ``json.dumps(value, ensure_ascii=False)`` writes for its value (:class:`PythonLiteral`): how the
pythonic tool-call formats (:mod:`cluster.pythonic_tool_parsers`) stream a call's arguments while
the model writes them, each piece sent once it can no longer change. vLLM re-parses the partial
call list with its brackets closed at each delta and sends the growth of the arguments' JSON,
holding back a tail that may change; read a character at a time, the pieces are the same without
the re-parse, and they add up to what the whole literal, evaluated and dumped, gives.
"""

from __future__ import annotations

import re
import unicodedata
from typing import List, Optional, Union

from cluster.json_stream import json_chars, json_escaped, json_text

PYTHON_SPACE = " \t\n\r\f"  # Python's whitespace inside brackets
_QUOTES = "'\""
_STRING_PREFIXES = ("r", "R", "u", "U")  # (b'' is bytes, f'' no literal: no JSON either way)
_KEYWORDS = {"True": "true", "False": "false", "None": "null"}
_ESCAPES = {"\\": "\\", "'": "'", '"': '"', "a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t",
            "v": "\v", "\n": ""}
_OCTAL = "01234567"
_HEX = "0123456789abcdefABCDEF"
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
_DIGITS = r"[0-9](?:_?[0-9])*"
_EXPONENT = rf"[eE][+-]?{_DIGITS}"
_INTEGER = re.compile(r"[1-9](?:_?[0-9])*|0(?:_?0)*|0[xX](?:_?[0-9a-fA-F])+|0[oO](?:_?[0-7])+|0[bB](?:_?[01])+")
_FLOAT = re.compile(rf"(?:{_DIGITS})?\.{_DIGITS}(?:{_EXPONENT})?|{_DIGITS}\.(?:{_EXPONENT})?|{_DIGITS}{_EXPONENT}")
_BASES = {"x": 16, "o": 8, "b": 2}


def _number(text: str) -> Union[int, float, None]:
    """A Python number literal's value; None if ``text`` is none (or imaginary: no JSON)."""
    if _INTEGER.fullmatch(text):
        digits = text.replace("_", "")
        base = _BASES.get(digits[1:2].lower(), 10)
        return int(digits if base == 10 else digits[2:], base)  # (ValueError past Python's 4300 digits)
    return float(text.replace("_", "")) if _FLOAT.fullmatch(text) else None


class _Open:
    """An open container: its closing bracket, and for a parenthesis not yet known to be a tuple
    (``(x)`` is ``x``; ``(x,)`` and ``()`` are tuples, JSON arrays) what its content wrote, held."""

    __slots__ = ("close", "held")

    def __init__(self, close: str):
        self.close = close
        self.held: Optional[List[str]] = [] if close == ")" else None


class PythonLiteral:
    """One Python literal, a character at a time (the value of a pythonic call's keyword argument).
    ``step`` takes the next character and returns the JSON ``json.dumps`` writes for it, "" while
    that could still change: a number or ``True`` / ``None`` until a character ends it (``end`` at
    the value's end), an escape until it is whole, a string's closing quote until what follows shows
    no string is joined to it (``'a' 'b'`` is ``"ab"``), a parenthesis' content until a comma or its
    end shows whether it is a tuple. Python's syntax: either quote, triple quotes, ``r`` and ``u``
    prefixes, Python's escapes (``\\x``, ``\\N{...}``, octal; one it does not know kept as written; a
    surrogate's, ``\\ud83d``, written as its JSON escape: :func:`~cluster.json_stream.json_escaped`),
    hex, octal and binary integers, ``_`` in numbers, a sign before one, tuples (JSON arrays), dict
    keys of strings, numbers, ``True`` and ``None`` (as ``json.dumps`` writes such keys), trailing
    commas, newlines inside brackets (``\\r\\n`` one, as Python reads source). A character
    ``ast.literal_eval`` (or ``json.dumps``: a set, bytes, a complex number, an infinite float) refuses
    raises ValueError, and so do comments, line continuations and a parenthesis around a key or
    after a sign. A dict's key given twice (or 1 and True) is written twice (Python keeps one).

    ``done``: the value is whole (a number, a keyword or a string at the top only once ``end`` is
    called); ``takes(c)``: ``c`` is still this value's (a top-level number ends at the character
    after it)."""

    def __init__(self):
        self.stack: List[_Open] = []
        self.expect = "value"  # "value", "item" (a value or the close), "key" (or "}"), "colon", "comma", "done"
        self.comma = False  # a comma came: ", " is written once the next item does
        self.token: Optional[str] = None  # the scalar being read: "number", "sign", "name", "quote" (its
        # opening quotes), "string", "string_end" (closed: another may join it)
        self.text = ""  # a number's or name's characters so far
        self.sign = ""
        self.is_key = False  # the scalar being read is a dict's key
        self.in_string = False  # a JSON string is open (its Python strings may go on)
        self.quote, self.quotes, self.triple, self.raw = "", 0, False, False
        self.escape = ""  # in a string: its undecided escape, "" outside one
        self.cr = False  # the last character was "\r" (a "\n" after it is no newline of its own)
        self.out: List[str] = []

    @property
    def done(self) -> bool:
        return self.expect == "done"

    def takes(self, c: str) -> bool:
        if self.done:
            return False
        if self.stack:
            return True
        token = self.token
        if token == "quote" and self.quotes == 2 and c != self.quote:  # ('': an empty string, closed)
            token = "string_end"
        if token == "number":
            return self._continues_number(c)
        if token == "name":
            return (self.text + c).isidentifier() or (c in _QUOTES and self.text in _STRING_PREFIXES)
        if token == "string_end":
            return c in PYTHON_SPACE or c in _QUOTES or c.isidentifier()
        return True

    def step(self, c: str) -> str:
        self.out = []
        if self.cr and c == "\n":
            self.cr = False
            return ""
        self.cr = c == "\r"
        self._step("\n" if self.cr else c)
        return "".join(self.out)

    def end(self) -> str:
        """The value ends here: its last scalar's text; ValueError if it is not whole."""
        self.out = []
        if self.token == "quote" and self.quotes == 2:  # ('': an empty string, closed)
            self.token = "string_end"
        if not self.stack and self.token == "number":
            self._end_number()
        elif not self.stack and self.token == "name":
            self._end_name()
        elif not self.stack and self.token == "string_end":
            self._end_string()
        if not self.done:
            raise ValueError("the Python literal is not whole")
        return "".join(self.out)

    def _write(self, text: str) -> None:
        """``text`` out, or held by the innermost parenthesis not known to be a tuple yet."""
        for container in reversed(self.stack):
            if container.held is not None:
                container.held.append(text)
                return
        self.out.append(text)

    def _step(self, c: str) -> None:
        token = self.token
        if token == "string":
            return self._string(c)
        if token == "quote":
            return self._opening(c)
        if token == "number":
            if self._continues_number(c):
                self.text += c
                return
            self._end_number()
        elif token == "name":
            if (self.text + c).isidentifier():
                self.text += c
                return
            if c in _QUOTES and self.text in _STRING_PREFIXES:
                return self._open_string(c, raw=self.text in "rR")
            self._end_name()
        elif token == "sign":
            if c in PYTHON_SPACE:
                return
            if c not in "0123456789.":
                raise ValueError("a sign before no number")
            self.token, self.text = "number", c
            return
        elif token == "string_end":
            if c in PYTHON_SPACE:
                return
            if c in _QUOTES:
                return self._open_string(c, raw=False)
            if c.isidentifier():  # (a prefix, r'...', of a string joined to it)
                self.token, self.text = "name", c
                return
            self._end_string()
        self._structure(c)

    def _structure(self, c: str) -> None:
        """A character outside scalars: brackets, commas, colons."""
        if c in PYTHON_SPACE:
            return
        expect = self.expect
        closes = bool(self.stack) and c == self.stack[-1].close
        if closes and expect in ("item", "key", "comma"):
            self._close()
        elif expect in ("value", "item", "key"):
            self._begin(c)
        elif expect == "colon" and c == ":":
            self._write(": ")
            self.expect = "value"
        elif expect == "comma" and c == ",":
            container = self.stack[-1]
            if container.held is not None:  # (a comma makes the parenthesis a tuple)
                held, container.held = container.held, None
                self._write("[" + "".join(held))
            self.comma, self.expect = True, "key" if container.close == "}" else "item"
        else:
            raise ValueError(f"a Python literal cannot go on with {c!r}")

    def _begin(self, c: str) -> None:
        """A value (or a dict's key) begins with ``c``."""
        if self.comma:
            self._write(", ")
            self.comma = False
        self.is_key = self.expect == "key"
        if c in _QUOTES:
            self._open_string(c, raw=False)
        elif c in "0123456789.":
            self.token, self.text, self.sign = "number", c, ""
        elif c in "+-":
            self.token, self.sign = "sign", c
        elif c.isidentifier():
            self.token, self.text = "name", c
        elif c in "[{(" and not self.is_key:
            self.stack.append(_Open({"[": "]", "{": "}", "(": ")"}[c]))
            self.expect = "key" if c == "{" else "item"
            if c != "(":
                self._write(c)
        else:
            raise ValueError(f"no Python literal begins with {c!r}")

    def _close(self) -> None:
        container = self.stack.pop()
        if container.held is None:
            text = "}" if container.close == "}" else "]"
        else:  # (x) is x; () an empty tuple
            text = "".join(container.held) if self.expect == "comma" else "[]"
        self.comma = False
        self._write(text)
        self._value_ended()

    def _value_ended(self) -> None:
        self.expect = "done" if not self.stack else "colon" if self.is_key else "comma"
        self.is_key = False

    def _scalar(self, text: str) -> None:
        self.token = None
        self._write(f'"{text}"' if self.is_key else text)  # (a key as json.dumps writes it: 1 as "1")
        self._value_ended()

    def _continues_number(self, c: str) -> bool:
        if c.isascii() and (c.isalnum() or c in "._"):
            return True
        return c in "+-" and self.text[-1] in "eE" and not self.text.lower().startswith("0x")

    def _end_number(self) -> None:
        value = _number(self.text)
        text = None if value is None else json_text(-value if self.sign == "-" else value)
        if text is None:
            raise ValueError(f"no JSON number: {self.sign}{self.text}")
        self._scalar(text)

    def _end_name(self) -> None:
        if self.in_string or self.text not in _KEYWORDS:
            raise ValueError(f"a name for a value: {self.text}")
        self._scalar(_KEYWORDS[self.text])

    def _open_string(self, c: str, raw: bool) -> None:
        if not self.in_string:
            self._write('"')
            self.in_string = True
        self.token, self.quote, self.quotes, self.raw = "quote", c, 1, raw

    def _end_string(self) -> None:
        self.token, self.in_string = None, False
        self._write('"')
        self._value_ended()

    def _opening(self, c: str) -> None:
        """The character after a string's first quote or two: a triple quote's third, or the string's."""
        if c == self.quote:
            if self.quotes == 1:
                self.quotes = 2
            else:
                self.token, self.triple, self.quotes = "string", True, 0
        elif self.quotes == 2:  # ('': an empty string)
            self.token = "string_end"
            self._step(c)
        else:
            self.token, self.triple, self.quotes = "string", False, 0
            self._string(c)

    def _string(self, c: str) -> None:
        """A string's next character (``quotes``: a triple-quoted string's quotes that may close it)."""
        if self.escape:
            return self._escaped(c)
        if c == self.quote:
            self.quotes += 1
            if not self.triple or self.quotes == 3:
                self.token, self.quotes = "string_end", 0
            return
        if self.quotes:
            self._write(json_chars(self.quote * self.quotes))
            self.quotes = 0
        if c == "\\":
            self.escape = c
        elif c == "\n" and not self.triple:
            raise ValueError("a newline in a one-line Python string")
        else:
            self._write(json_chars(c))

    def _escaped(self, c: str) -> None:
        """An escape's next character: its character written once it is whole."""
        escape, self.escape = self.escape + c, ""
        kind = escape[1]
        if self.raw:  # (the backslash stays, and what follows it: a quote, a newline)
            self._write(json_chars(escape))
        elif len(escape) == 2 and c in _ESCAPES:
            self._write(json_chars(_ESCAPES[c]))
        elif kind in _OCTAL:  # (one to three octal digits)
            if c in _OCTAL and len(escape) < 4:
                self.escape = escape
            elif c in _OCTAL:
                self._write(json_chars(chr(int(escape[1:], 8))))
            else:
                self._write(json_chars(chr(int(escape[1:-1], 8))))
                self._string(c)
        elif kind in _HEX_DIGITS:
            if len(escape) > 2 and c not in _HEX:
                raise ValueError(f"a \\{kind} escape without {_HEX_DIGITS[kind]} hex digits")
            if len(escape) < 2 + _HEX_DIGITS[kind]:
                self.escape = escape
            elif int(escape[2:], 16) > 0x10FFFF:
                raise ValueError("a \\U escape past Unicode")
            else:
                self._write(json_escaped(int(escape[2:], 16)))
        elif kind == "N":
            if (len(escape) == 3) != (c == "{"):
                raise ValueError("a \\N escape without {name}")
            if c != "}":
                self.escape = escape
                return
            try:
                character = unicodedata.lookup(escape[3:-1])
            except KeyError:
                raise ValueError(f"no Unicode character {escape[3:-1]}") from None
            if len(character) != 1:  # (a named sequence: Python's \N takes characters only)
                raise ValueError(f"no Unicode character {escape[3:-1]}")
            self._write(json_chars(character))
        else:  # (an escape Python does not know: the backslash kept)
            self._write(json_chars(escape))
