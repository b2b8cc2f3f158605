"""Reasoning parsers: a reasoning model's thinking apart from its answer in chat responses.

vLLM's and SGLang's ``--reasoning-parser`` (here ``server.reasoning_parser``): a chat choice's
text up to the end tag (``</think>``) goes to ``message.reasoning_content`` (and vLLM's newer
name for it, ``reasoning``; vLLM sends both), the rest to ``message.content``; streamed, as
``delta.reasoning_content`` chunks, then ``delta.content``. Completions are never split (vLLM
parses chat only); logprobs stay one entry per token, the tags' tokens included.

Where the output starts (in the thinking or in the answer) is read from the prompt first, as
chat templates put the tags there: a prompt that ends with the start tag (DeepSeek-R1's and
Qwen3-Thinking's templates write ``<think>\\n``) opens in the thinking, one that ends with the end
tag (Qwen3's with ``enable_thinking: false`` writes ``<think>\\n\\n</think>\\n\\n``) in the answer;
else the family's own default decides (:class:`ReasoningFormat`). A start tag that opens the
output is dropped and opens the thinking (models that write it themselves: DeepSeek-R1-0528, Qwen3
before 2507); the first end tag after it closes the thinking; every tag after that is content.
An output that never closes its thinking (cut by ``max_tokens``) is all reasoning, as in vLLM's
and SGLang's current parsers (vLLM's older qwen3 parser took it all as content).

The tags are matched in the decoded text: a format whose tags are special tokens
(``special_tokens``) has the chat endpoint decode with them (Qwen3's and DeepSeek-R1's are not).
GPT-OSS's Harmony (``gpt_oss``, :class:`HarmonyFormat`) is messages on channels rather than tags
around a thinking: its analysis channel is the thinking, its final channel the answer
(:mod:`cluster.harmony`).

A grammar (``response_format`` & co.) of an output that opens in the thinking constrains only the
answer, as SGLang's and vLLM's structured outputs with a reasoning parser: the chat endpoint sends
where the answer starts (``answer_start``: the end tag; Harmony's ``<|channel|>final<|message|>``,
vLLM's end of reasoning for gpt-oss) as the request's ``grammar_after``, and the engine holds the
grammar back until the output has written it (:class:`~actors.engine.grammar.ReasonerGrammar`); the
thinking is free (Harmony's analysis and commentary messages, its calls, too). An output that opens
in the answer is constrained whole, as is a named or required tool choice's (no thinking to split).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, NamedTuple, Optional, Sequence

from cluster.harmony import FINAL_START, HarmonyParser
from cluster.streaming import partial_suffix_len

PROMPT_TAIL_TOKENS = 32  # the prompt's last tokens read for a start or end tag (with whitespace after it)


@dataclass(frozen=True)
class ReasoningFormat:
    """One model family's tags, and whether its output opens in the thinking when the prompt
    does not say: always (``thinking_switch`` None: DeepSeek-R1, whose early template left
    ``<think>`` out of both prompt and output), or unless the request's ``chat_template_kwargs``
    turn ``thinking_switch`` off (Qwen3's ``enable_thinking``, on by default).

    What the chat endpoint asks of a format (:class:`HarmonyFormat` answers it too):
    ``thinks_first``, ``answer_start`` (a grammar's ``grammar_after``), ``special_tokens`` and
    ``splitter(thinking)``, a new splitter of one choice's output."""

    start: str
    end: str
    thinking_switch: Optional[str] = None
    special_tokens = False

    @property
    def answer_start(self) -> str:
        return self.end

    def splitter(self, thinking: bool) -> ReasoningSplitter:
        return ReasoningSplitter(self, thinking)

    def thinks_first(self, prompt_tail: str, template_kwargs: Dict[str, Any]) -> bool:
        tail = prompt_tail.rstrip()
        if tail.endswith(self.start):
            return True
        if tail.endswith(self.end):
            return False
        return self.thinking_switch is None or template_kwargs.get(self.thinking_switch, True) is not False


class HarmonyFormat:
    """GPT-OSS's Harmony (:mod:`cluster.harmony`): the output opens in the header of the message
    the prompt opened (``<|start|>assistant``), before any channel, so it thinks first for a grammar,
    which holds from the final channel's body; its tags are special tokens."""

    answer_start = FINAL_START
    special_tokens = True

    def thinks_first(self, prompt_tail: str, template_kwargs: Dict[str, Any]) -> bool:
        return True

    def splitter(self, thinking: bool) -> HarmonySplitter:
        return HarmonySplitter()


REASONING_FORMATS = {
    "deepseek_r1": ReasoningFormat("<think>", "</think>"),
    "qwen3": ReasoningFormat("<think>", "</think>", thinking_switch="enable_thinking"),
    "gpt_oss": HarmonyFormat(),
}


class ReasoningSplit(NamedTuple):
    """A step's (or a whole output's) text, split: the thinking's part and the answer's."""

    reasoning: str
    content: str

    def delta(self) -> Dict[str, str]:
        """A streamed delta's fields: only those with text."""
        fields = {"reasoning_content": self.reasoning, "reasoning": self.reasoning} if self.reasoning else {}
        return dict(fields, content=self.content) if self.content else fields

    def message(self) -> Dict[str, Optional[str]]:
        """A whole message's fields, None for an empty one (as vLLM's)."""
        return {"content": self.content or None, "reasoning_content": self.reasoning or None,
                "reasoning": self.reasoning or None}


class ReasoningSplitter:
    """One choice's output split as it streams. A tail that may still grow into the tag looked for
    next (the start tag before any text, then the end tag while thinking) is held until the next
    step tells, or the last one (``final``) gives it as text: steps joined split as the whole does."""

    def __init__(self, fmt: ReasoningFormat, thinking: bool):
        self.fmt, self.thinking = fmt, thinking
        self.opening = True  # no text yet: a start tag may still open the output
        self.held = ""

    def step(self, text: str, final: bool) -> ReasoningSplit:
        text, self.held = self.held + text, ""
        if self.opening:
            if not final and len(text) < len(self.fmt.start) and self.fmt.start.startswith(text):
                self.held = text
                return ReasoningSplit("", "")
            self.opening = False
            if text.startswith(self.fmt.start):
                text, self.thinking = text[len(self.fmt.start):], True
        if not self.thinking:
            return ReasoningSplit("", text)
        reasoning, end, content = text.partition(self.fmt.end)
        if end:
            self.thinking = False
            return ReasoningSplit(reasoning, content)
        keep = 0 if final else partial_suffix_len(text, self.fmt.end)
        self.held = text[len(text) - keep:]
        return ReasoningSplit(text[:len(text) - keep], "")


class HarmonySplitter:
    """The ``gpt_oss`` splitter: a :class:`~cluster.harmony.HarmonyParser`'s analysis channel as the
    thinking, its final channel and preambles as the answer (its calls are the tool parser's)."""

    def __init__(self):
        self.parser = HarmonyParser()

    def step(self, text: str, final: bool) -> ReasoningSplit:
        return ReasoningSplit(*self.parser.split(text, final))


def prompt_tail(tokenizer, prompt_ids: Sequence[int]) -> str:
    """The text of a prompt's last tokens, where chat templates write the tags
    (:meth:`ReasoningFormat.thinks_first` reads it)."""
    return tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
