"""Streamed tool-call arguments (hypothesis): :class:`JsonStream` writes any JSON text as
``json.dumps`` writes its value, refuses what ``json.loads`` refuses, and no piece it wrote is
ever wrong for a longer text; each registered parser, fed random calls in its format whole, a
character at a time and in random pieces, gives the same content and calls, its arguments
``json.dumps``'s text of the value written (whatever the spacing and escapes), and for the JSON
formats they grow over more than one step (Qwen3-Coder's by a parameter at a time). Through the
server: tests/test_tool_calls.py."""

import json
import keyword

import hypothesis.strategies as st
import pytest
from hypothesis import example, given, settings

from cluster.json_stream import JSON_SPACE, JsonStream
from cluster.tool_calls import TOOL_CALL_PARSERS

SETTINGS = settings(max_examples=60, deadline=None)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)
ARGUMENTS = st.dictionaries(st.text(max_size=6), VALUES, max_size=4)
NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True).filter(lambda k: not keyword.iskeyword(k))
IDENTIFIERS = st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True).filter(lambda k: not keyword.iskeyword(k))
STYLES = st.tuples(st.booleans(), st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")]))


def canonical(text):
    """``text`` through a JsonStream a character at a time (whitespace after the value read past);
    ValueError where json.loads would raise."""
    stream, out = JsonStream(), ""
    for c in text:
        if stream.takes(c):
            out += stream.step(c)
            continue
        out += stream.end()
        if c not in JSON_SPACE:
            raise ValueError("more after the value")
    return out + stream.end()


@given(VALUES, STYLES)
@SETTINGS
@example(json.loads('"\\ud83d\\ude00 \\ud83d \\udc00 \\ud83d\\u0041 \\ud83d\\n \\u00e9"'), (True, (",", ":")))
def test_json_stream_writes_what_json_dumps_writes_and_takes_nothing_back(value, style):
    ascii_only, separators = style
    text = json.dumps(value, ensure_ascii=ascii_only, separators=separators)
    want = json.dumps(value, ensure_ascii=False)
    assert canonical(text) == want
    stream, out = JsonStream(), ""
    for c in text:  # (each prefix: what it wrote is the start of the whole's)
        out += stream.step(c)
        assert want.startswith(out)


JSONISH = st.text(alphabet='{}[]",: 01-.eEtrunlfasNIy\\u', max_size=14)


def _loads(text):
    """json.loads' value and whether an object in it had a key twice; None if it refuses the text."""
    pairs_seen = []

    def pairs(items):
        pairs_seen.append(len({k for k, _ in items}) < len(items))
        return dict(items)
    try:
        return json.loads(text, object_pairs_hook=pairs), any(pairs_seen)
    except (ValueError, RecursionError):
        return None


@given(JSONISH)
@SETTINGS
@example('{"a": 1, "a": 2}')
@example('[1.5e3, -0, NaN, -Infinity, "\\ud800\\"]')
@example("[01]")
def test_json_stream_refuses_what_json_loads_refuses(text):
    loaded = _loads(text)
    try:
        out = canonical(text)
    except ValueError:
        assert loaded is None, text
        return
    assert loaded is not None, (text, out)
    value, twice = loaded
    if twice:  # (both written, where json.loads keeps the last)
        assert len(out) > len(json.dumps(value, ensure_ascii=False))
    else:
        assert out == json.dumps(value, ensure_ascii=False)


# ---- each format's calls ------------------------------------------------------------------------------
def render(value, style):
    ascii_only, separators = style
    return json.dumps(value, ensure_ascii=ascii_only, separators=separators)


DEEPSEEK_V3 = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"
DEEPSEEK_V31 = "<｜tool▁call▁begin｜>{}<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
DEEPSEEK_SECTION = "<｜tool▁calls▁begin｜>{}<｜tool▁calls▁end｜>"
JSON_FORMATS = {  # name: (content allowed before the calls, the output of calls [(name, arguments)] in a style)
    "hermes": (True, lambda calls, style: "".join(
        f"<tool_call>\n{render({'name': n, 'arguments': a}, style)}\n</tool_call>\n" for n, a in calls)),
    "llama3_json": (False, lambda calls, style: "<|python_tag|>" + "; ".join(
        render({"name": n, "parameters": a}, style) for n, a in calls)),
    "mistral": (True, lambda calls, style: "[TOOL_CALLS]" + render(
        [{"name": n, "arguments": a} for n, a in calls], style)),
    "mistral_v11": (True, lambda calls, style: "".join(f"[TOOL_CALLS]{n}[ARGS]{render(a, style)}" for n, a in calls)),
    "deepseek_v3": (True, lambda calls, style: DEEPSEEK_SECTION.format(
        "".join(DEEPSEEK_V3.format(n, render(a, style)) for n, a in calls))),
    "deepseek_v31": (True, lambda calls, style: DEEPSEEK_SECTION.format(
        "".join(DEEPSEEK_V31.format(n, render(a, style)) for n, a in calls))),
}


def feed(name, text, pieces):
    """The content and calls of ``text`` fed to a new ``name`` parser in ``pieces`` (their ends), and
    per call how many times its arguments grew; each step's arguments extend the last step's."""
    parser = TOOL_CALL_PARSERS[name.split("_v11")[0]](())
    content, before, grew, start = "", [], [], 0
    for end in pieces + [len(text)]:
        content += parser.feed(text[start:end])
        start = end
        now = [arguments for _, arguments in parser.calls]
        assert all(a.startswith(b) for a, b in zip(now, before))
        grew = [g + (a != b) for g, a, b in zip(grew + [0] * len(now), now, before + [""] * len(now))]
        before = now
    return content + parser.finish(), [list(call) for call in parser.calls], grew


def check_pieces(name, text, content, calls, data):
    """Whole, a character at a time and in random pieces: ``content`` and ``calls``; the calls'
    arguments, fed a character at a time, grew more than once if ``streams``."""
    assert feed(name, text, [])[:2] == (content, calls)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    assert feed(name, text, cuts)[:2] == (content, calls)
    by_character = feed(name, text, list(range(1, len(text))))
    assert by_character[:2] == (content, calls)
    return by_character[2]


@pytest.mark.parametrize("name", sorted(JSON_FORMATS))
@given(calls=st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3), style=STYLES,
       before=st.text(alphabet="ab .\n", max_size=6), data=st.data())
@SETTINGS
def test_json_formats_stream_the_arguments_json_dumps_writes(name, calls, style, before, data):
    content_first, output = JSON_FORMATS[name]
    before = before if content_first else ""
    text = before + output(calls, style)
    want = [[n, json.dumps(a, ensure_ascii=False)] for n, a in calls]
    grew = check_pieces(name, text, before.rstrip(JSON_SPACE), want, data)
    assert all(g > 1 for g in grew), grew  # ("{" at the call's start, then the rest as it comes)


def python_call(name, arguments):
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"


PYTHON_ARGUMENTS = st.dictionaries(IDENTIFIERS, VALUES.filter(lambda v: json.dumps(v) == json.dumps(
    json.loads(json.dumps(v)))), max_size=3)
PLAIN = st.text(st.characters(blacklist_characters="<", blacklist_categories=["Cs"]), max_size=8).filter(
    lambda v: v.lower() != "null")


@pytest.mark.parametrize("name,opening,closing", [("pythonic", "", ""),
                                                  ("llama4_pythonic", "<|python_start|>", "<|python_end|>")])
@given(calls=st.lists(st.tuples(NAMES, PYTHON_ARGUMENTS), min_size=1, max_size=3), after=st.sampled_from(["", " ok"]),
       data=st.data())
@SETTINGS
def test_pythonic_formats_read_their_lists_in_any_pieces(name, opening, closing, calls, after, data):
    text = opening + "[" + ", ".join(python_call(n, a) for n, a in calls) + "]" + closing + after
    want = [[n, json.dumps(a, ensure_ascii=False)] for n, a in calls]
    check_pieces(name, text, after, want, data)


@given(calls=st.lists(st.tuples(NAMES, st.dictionaries(IDENTIFIERS, PLAIN, max_size=3)), min_size=1, max_size=2),
       before=st.text(alphabet="ab .\n", max_size=6), data=st.data())
@SETTINGS
def test_qwen3_coder_reads_its_calls_in_any_pieces(calls, before, data):
    """Parameters the request's tools do not type are strings, as written; the arguments grow by
    ``{``, then a parameter at a time, then ``}``."""
    text = before + "".join("<tool_call>\n<function={}>\n{}</function>\n</tool_call>\n".format(
        n, "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in a.items())) for n, a in calls)
    grew = check_pieces("qwen3_coder", text, before.rstrip(JSON_SPACE),
                        [[n, json.dumps(a, ensure_ascii=False)] for n, a in calls], data)
    assert grew == [len(a) + 2 for _, a in calls]
