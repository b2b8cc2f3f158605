"""GPT-OSS's Harmony output read as it streams: the ``gpt_oss`` reasoning parser's thinking and
answer (:class:`~cluster.reasoning.HarmonyFormat`; vLLM's ``openai_gptoss``, SGLang's ``gpt-oss``)
and the ``gpt_oss`` tool parser's calls (:data:`~cluster.tool_calls.TOOL_CALL_PARSERS`; vLLM's
``openai``), one :class:`HarmonyParser` for both.

The grammar (openai-harmony's): an output is messages ``HEADER<|message|>BODY``, each closed by
``<|end|>``, ``<|call|>`` (a tool call) or ``<|return|>`` (the answer, the output's last), the next
opened by ``<|start|>``. The prompt opens the first (a chat template ends with
``<|start|>assistant``, as vLLM renders it), so the output starts in its header. A header is the
author's role (``assistant``; the first message's is the prompt's), ``<|channel|>`` and the channel,
a recipient ``to=NAME`` before or after the channel, and a content type (``json``,
``<|constrain|>json``)::

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

Where a message goes (vLLM's ``parse_chat_output`` and ``openai`` tool parser):

* addressed ``to=functions.NAME`` (on any channel): a call of NAME, its body the arguments, as
  JSON re-serialized when it is JSON, else as written (vLLM's); named when its header closes, its
  arguments whole when its body does;
* channel ``analysis`` (a built-in tool's call, ``to=python``, too): the thinking;
* channel ``final``, and ``commentary`` with no recipient (a preamble shown to the user before
  calls): the answer;
* anything else (commentary to another recipient, another role's message, no channel): dropped.

Messages of one field are joined by a newline, as vLLM's whole message (its streamed deltas have
none: here they add up to the whole). A tag is never text: a body is closed by ``<|start|>`` or
``<|channel|>`` too (a message the model did not close; SGLang's implicit close), ``<|message|>``
and ``<|constrain|>`` in a body are dropped, so is text between messages and a header closed before
its ``<|message|>``. At the output's end an open body closes (the stop token that closed it,
``<|call|>`` or ``<|return|>``, is not in the text) and a header cut short is dropped; an output
with no tag at all (a model not writing Harmony) is the answer as written. The tags are special
tokens in GPT-OSS's tokenizer (o200k_harmony): the output is decoded with them.
"""

from __future__ import annotations

import json
import re
from typing import List, NamedTuple, Optional, Tuple

from cluster.json_stream import json_dumps
from cluster.streaming import partial_suffix_len
from cluster.tool_parsers import ToolCallParser

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
CLOSES = ("<|end|>", "<|call|>", "<|return|>")
TAGS = (START, MESSAGE, CHANNEL, CONSTRAIN) + CLOSES
FINAL_START = CHANNEL + "final" + MESSAGE  # where the answer's body opens (a grammar's start)
FUNCTIONS = "functions."  # a function tool's recipients' namespace

_ROLE = re.compile(r"\s*([^\s<]*)")
_CHANNEL = re.compile(r"<\|channel\|>([^\s<]*)")
_RECIPIENT = re.compile(r"(?:^|(?<=[\s>]))to=([^\s<]+)")


class Header(NamedTuple):
    role: str  # "" when the header does not say (the first message's, the prompt's)
    channel: Optional[str]
    recipient: Optional[str]


def parse_header(text: str) -> Header:
    """A message's header, its tags as written (``assistant<|channel|>commentary to=functions.f json``)."""
    role = _ROLE.match(text).group(1)
    channel, recipient = _CHANNEL.search(text), _RECIPIENT.search(text)
    return Header("" if role.startswith("to=") else role, channel and channel.group(1),
                  recipient and recipient.group(1))


def message_field(header: Header) -> Optional[str]:
    """Where a message goes: "call", "reasoning", "content", or None (dropped)."""
    if header.role not in ("", "assistant"):
        return None
    if header.recipient is not None and header.recipient.startswith(FUNCTIONS):
        return "call"
    if header.channel == "analysis":
        return "reasoning"
    if header.channel == "final" or (header.channel == "commentary" and header.recipient is None):
        return "content"
    return None


def call_arguments(body: str) -> str:
    """A call's body as its arguments: JSON re-serialized (a surrogate its escapes name written so,
    raw it is no UTF-8, :func:`~cluster.json_stream.json_dumps`), other text as written (vLLM's)."""
    try:
        return json_dumps(json.loads(body))
    except ValueError:
        return body


class HarmonyParser(ToolCallParser):
    """One choice's Harmony output, fed in any pieces: :meth:`split` gives each step's thinking and
    answer (the reasoning parser's), :meth:`feed` / :meth:`finish` its answer with the calls in
    :attr:`calls` (the tool parser's). A tail that may grow into a tag is held until the next
    piece says, so the pieces' parts join to the whole output's."""

    special_tokens = True
    whole_output = True

    def __init__(self):
        super().__init__()
        self.state = "header"  # in a message's "header", its "body", or "between" messages
        self.header = ""  # the open message's header so far
        self.field: Optional[str] = None  # the open message's (message_field)
        self.arguments: List[str] = []  # the open call's body so far, its pieces (joined once, at its end)
        self.pending = ""  # text not read yet: a tail that may start a tag
        self.tagged = False  # a tag was read
        self.written = {"reasoning": False, "content": False}  # a message gave the field text
        self.opened = False  # the open message gave its field text
        self.out = {"reasoning": "", "content": ""}  # this piece's

    def split(self, text: str, final: bool) -> Tuple[str, str]:
        """A piece's thinking and answer (``final``: the output's last piece)."""
        self._read(text, final)
        out, self.out = self.out, {"reasoning": "", "content": ""}
        return out["reasoning"], out["content"]

    def feed(self, text: str) -> str:
        return self.split(text, False)[1]

    def finish(self) -> str:
        return self.split("", True)[1]

    def _read(self, text: str, final: bool) -> None:
        text, self.pending = self.pending + text, ""
        at = 0
        while True:
            i = text.find("<|", at)
            if i < 0:
                keep = 0 if final else max(partial_suffix_len(text, tag) for tag in TAGS)
                self._text(text[:len(text) - keep])
                self.pending = text[len(text) - keep:]
                break
            tag = next((t for t in TAGS if text.startswith(t, i)), None)
            if tag is None:  # ("<|" that starts no tag: text)
                at = i + 2
                continue
            self._text(text[:i])
            self._tag(tag)
            text, at = text[i + len(tag):], 0
        if final:
            self._end()

    def _text(self, text: str) -> None:
        if not text:
            return
        if self.state == "header":
            self.header += text
        elif self.state == "body":
            if self.field == "call":
                self.arguments.append(text)
            elif self.field is not None:
                if not self.opened and self.written[self.field]:
                    self.out[self.field] += "\n"  # (a message of the field before it)
                self.opened = self.written[self.field] = True
                self.out[self.field] += text

    def _tag(self, tag: str) -> None:
        self.tagged = True
        if self.state == "header":
            if tag == MESSAGE:
                self._open()
            elif tag in CLOSES or tag == START:  # (no body: no message)
                self.header, self.state = "", "header" if tag == START else "between"
            else:
                self.header += tag
            return
        if self.state == "body" and tag in (START, CHANNEL) + CLOSES:
            self._close()
        if tag in (START, CHANNEL):
            self.state, self.header = "header", "" if tag == START else tag

    def _open(self) -> None:
        header = parse_header(self.header)
        self.field = message_field(header)
        self.state, self.header, self.opened = "body", "", False
        if self.field == "call":
            self.calls.append([header.recipient[len(FUNCTIONS):], ""])

    def _close(self) -> None:
        if self.field == "call":
            self.calls[-1][1] = call_arguments("".join(self.arguments))
        self.field, self.arguments, self.state = None, [], "between"

    def _end(self) -> None:
        """The output ended: an open body closes; a header cut short is dropped (one with no tag in
        an output that had none: not Harmony, the answer as written)."""
        if self.state == "body":
            self._close()
        elif self.state == "header" and not self.tagged and self.header:
            self.out["content"] += self.header
        self.header, self.state = "", "between"
