"""Reasoning parsers (``cluster.reasoning``): where an output opens, whole-text splits, and
streamed steps — cut anywhere, a tag's pieces across steps included — that join to the whole
text's split. Over HTTP: ``test_openai_compat``."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cluster.config import ServerConfig
from cluster.reasoning import REASONING_FORMATS, ReasoningSplit, ReasoningSplitter
from cluster.streaming import partial_suffix_len

R1, QWEN3 = REASONING_FORMATS["deepseek_r1"], REASONING_FORMATS["qwen3"]


@pytest.mark.parametrize("fmt,tail,kwargs,thinking", [
    (R1, "<|Assistant|>", {}, True),  # DeepSeek-R1 thinks first unless the prompt says otherwise
    (R1, "<|Assistant|><think>\n", {}, True),
    (R1, "<|Assistant|></think>", {}, False),  # a template that closed the thinking itself
    (QWEN3, "<|im_start|>assistant\n", {}, True),  # Qwen3 thinks by default
    (QWEN3, "<|im_start|>assistant\n", {"enable_thinking": True}, True),
    (QWEN3, "<|im_start|>assistant\n", {"enable_thinking": False}, False),
    (QWEN3, "<|im_start|>assistant\n<think>\n", {"enable_thinking": False}, True),  # the prompt says otherwise
    (QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n", {}, False),
])
def test_the_prompt_then_the_family_say_where_an_output_opens(fmt, tail, kwargs, thinking):
    assert fmt.thinks_first(tail, kwargs) is thinking


WHOLE = [
    # (thinking first, text, reasoning, content)
    (True, "abc</think>done", "abc", "done"),
    (True, "<think>abc</think>done", "abc", "done"),  # a start tag opening the output is dropped
    (True, "abc", "abc", ""),  # never closed (cut by max_tokens): all thinking
    (True, "</think>x", "", "x"),
    (True, "a</think>b</think>c<think>", "a", "b</think>c<think>"),  # after the first end tag: content
    (True, "x<think>y</think>z", "x<think>y", "z"),  # a start tag inside is text
    (True, "", "", ""),
    (True, "<thin", "<thin", ""),
    (False, "plain", "", "plain"),
    (False, "<think>r</think>c", "r", "c"),  # the model opened its thinking itself
    (False, "<think>r", "r", ""),
    (False, "a<think>b</think>", "", "a<think>b</think>"),
    (False, "</think>x", "", "</think>x"),
]


@pytest.mark.parametrize("thinking,text,reasoning,content", WHOLE)
def test_a_whole_output_splits_at_its_first_end_tag(thinking, text, reasoning, content):
    assert ReasoningSplitter(QWEN3, thinking).step(text, final=True) == (reasoning, content)


def streamed(thinking: bool, pieces) -> ReasoningSplit:
    """``pieces`` fed one step each (the last one final), the steps' splits joined."""
    splitter = ReasoningSplitter(QWEN3, thinking)
    steps = [splitter.step(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    return ReasoningSplit("".join(s.reasoning for s in steps), "".join(s.content for s in steps))


@pytest.mark.parametrize("thinking,text,reasoning,content", WHOLE)
def test_every_cut_into_steps_splits_as_the_whole(thinking, text, reasoning, content):
    """All cuts into up to three steps and one character a step, each with a last, empty step (a
    finishing token with no text) or without: a tag in pieces leaks into neither field."""
    cuts = [list(c) for k in range(3) for c in itertools.combinations(range(1, len(text)), k)]
    cuts.append(list(range(1, len(text))))
    for cut in cuts:
        pieces = [text[i:j] for i, j in zip([0] + cut, cut + [len(text)])]
        for last in ([], [""]):
            assert streamed(thinking, pieces + last) == (reasoning, content), pieces + last


@settings(max_examples=300, deadline=None)
@given(st.booleans(), st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "</th", "think>", ">", "a", " "]),
                               max_size=8), st.data())
def test_steps_join_to_the_whole_split_property(thinking, words, data):
    text = "".join(words)
    cut = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=6)))
    pieces = [text[i:j] for i, j in zip([0] + cut, cut + [len(text)])] if text else [""]
    assert streamed(thinking, pieces) == ReasoningSplitter(QWEN3, thinking).step(text, final=True)


def test_a_step_holds_only_what_may_still_be_a_tag():
    splitter = ReasoningSplitter(R1, thinking=True)
    assert splitter.step("<thi", final=False) == ("", "")  # may be the opening start tag
    assert splitter.step("nk>idea </", final=False) == ("idea ", "")
    assert splitter.step("b", final=False) == ("</b", "")  # it was not the end tag after all
    assert splitter.step("</think>", final=False) == ("", "")
    assert splitter.step("<think>", final=False) == ("", "<think>")  # content: nothing held


def test_delta_and_message_fields():
    assert ReasoningSplit("r", "").delta() == {"reasoning_content": "r", "reasoning": "r"}
    assert ReasoningSplit("", "c").delta() == {"content": "c"}
    assert ReasoningSplit("", "").delta() == {}
    assert ReasoningSplit("r", "").message() == {"content": None, "reasoning_content": "r", "reasoning": "r"}


def test_partial_suffix_len():
    assert [partial_suffix_len(t, "</think>") for t in ("a<", "a</thi", "a</think>", "</think", "", "x")] == \
        [1, 5, 0, 7, 0, 0]


def test_an_unknown_parser_is_refused_with_the_known_names():
    assert ServerConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValidationError, match="'deepseek_r1', 'qwen3' or 'gpt_oss'"):
        ServerConfig(reasoning_parser="deepseek-r2")
