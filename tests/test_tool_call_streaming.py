"""Streamed tool-call arguments (hypothesis): :class:`JsonStream` writes any JSON text as
``json.dumps`` writes its value, refuses what ``json.loads`` refuses, and no piece it wrote is
ever wrong for a longer text; each registered parser, fed random calls in its format whole, a
character at a time and in random pieces, gives the same content and calls, its arguments
``json.dumps``'s text of the value written (whatever the spacing and escapes), and for the JSON
formats they grow over more than one step (Qwen3-Coder's by a parameter at a time). The pythonic
formats' :class:`PythonLiteral` does the same for Python literals (as ``ast.literal_eval`` reads
them), their calls stream once named, and ToolCalls' deltas add up to the message. Through the
server: tests/test_tool_calls.py; the Responses API: tests/test_responses.py."""

import ast
import json
import keyword
import re
import warnings

import hypothesis.strategies as st
import pytest
from hypothesis import example, given, settings

from cluster.chat_protocol import ChatTool
from cluster.json_stream import JSON_SPACE, JsonStream, json_text
from cluster.python_stream import PythonLiteral
from cluster.tool_calls import TOOL_CALL_PARSERS, ToolCalls
from cluster.tool_parsers import RequiredParser

SETTINGS = settings(max_examples=60, deadline=None)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)
ARGUMENTS = st.dictionaries(st.text(max_size=6), VALUES, max_size=4)
NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True).filter(lambda k: not keyword.iskeyword(k))
IDENTIFIERS = st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True).filter(lambda k: not keyword.iskeyword(k))
STYLES = st.tuples(st.booleans(), st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")]))


def dumped(value):
    """``json.dumps(value, ensure_ascii=False)``, a surrogate written as its escape (raw, no UTF-8)."""
    return re.sub("[\ud800-\udfff]", lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False))


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
    want = dumped(value)
    assert canonical(text) == want
    takes_nothing_back(JsonStream(), text, want)


def takes_nothing_back(stream, text, want):
    """``text`` through ``stream`` a character at a time: at each prefix, what it wrote is ``want``'s start."""
    out = ""
    for c in text:
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
        assert out == dumped(value)


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


def python_source(value, rng):
    """``value`` as Python source, one of the ways a model may write it: either quote, strings joined
    (``'a' "b"``), hex integers, a sign spaced, tuples for lists, trailing commas, newlines."""
    space, comma = rng.choice(["", " ", "\n  "]), rng.choice(["", ","])
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        sign = "-" if value < 0 else rng.choice(["", "+ "])
        return rng.choice([repr(value), sign + hex(abs(value)), sign + str(abs(value))])
    if isinstance(value, str):
        cut = rng.randint(0, len(value))
        joined = repr(value[:cut]) + (space or " ") + repr(value[cut:])  # (not '''': a triple quote)
        return rng.choice([repr(value), json.dumps(value, ensure_ascii=False), joined])
    if isinstance(value, dict):
        items = [f"{python_source(k, rng)}:{space}{python_source(v, rng)}" for k, v in value.items()]
        return "{" + space + f",{space}".join(items) + (comma if items else "") + "}"
    items = [python_source(v, rng) for v in value]
    opening, closing = rng.choice(["[]", "()"])
    comma = "," if len(items) == 1 and opening == "(" else comma if items else ""  # ((x) is x)
    return opening + space + f",{space}".join(items) + comma + closing


def python_json(text):
    """``text`` through a PythonLiteral a character at a time; ValueError where it refuses it."""
    literal, out = PythonLiteral(), ""
    for c in text:
        if not literal.takes(c):
            raise ValueError("more after the value")
        out += literal.step(c)
    return out + literal.end()


@given(VALUES, st.randoms(use_true_random=False))
@SETTINGS
def test_python_literal_writes_what_json_dumps_writes_and_takes_nothing_back(value, rng):
    text = python_source(value, rng)
    want = json.dumps(value, ensure_ascii=False)
    assert python_json(text) == want
    takes_nothing_back(PythonLiteral(), text, want)


PYTHON_LITERALS = [  # Python's own ways to write a literal, read as ast.literal_eval reads them
    "'''a''b\"c\r\nd\re'''",
    r'''r"a\q\"" U'\N{LATIN SMALL LETTER E WITH ACUTE}\101\18\x41\U0001F600\q' "\ud83d\ude00 \
"''',
    "[0x_1F, 0o17, 0b1, 1_000, 00, 1., .5e-3, -0.0, - 7, +0, 1E+2]", "{1: None, 2.5: '', -3: ()}",
    '{True: (1), "k": ((1, 2),), None: [{}, ()]}', "(\n  'a'\n  'b',\n)",
]


def literal_eval(text):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (an escape Python does not know)
        return ast.literal_eval(text)


@pytest.mark.parametrize("text", PYTHON_LITERALS)
def test_python_literal_reads_pythons_spellings(text):
    assert python_json(text) == dumped(literal_eval(text))


@pytest.mark.parametrize("name,text", [
    ("pythonic", "[f(a='\\ud83d\\ude00 \\U0000dc00')]"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "\\ud83d\\ude00 \\udc00"}}</tool_call>'),
    ("gpt_oss", '<|channel|>commentary to=functions.f<|message|>{"a": "\\ud83d\\ude00 \\udc00"}<|call|>'),
    ("qwen3_coder", '<tool_call><function=f><parameter=a>"\\ud83d\\ude00 \\udc00"</parameter></function></tool_call>')])
def test_escaped_surrogates_are_written_as_escapes(name, text):
    """A surrogate an escape names (Python's escapes write a pair apart, JSON's may leave one alone)
    is written as its escape: raw, the arguments are no UTF-8 and their response could not be sent.
    Harmony's and Qwen3-Coder's JSON is loaded and dumped whole (``a`` typed no string: read as JSON)."""
    tools = [ChatTool.model_validate({"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "object"}}}}})]
    calls = ToolCalls(lambda: TOOL_CALL_PARSERS[name](tools), calls_finish=True).message(0, text)[1]
    assert json.loads(calls[0]["function"]["arguments"].encode("utf-8")) == {"a": "\U0001F600 \udc00"}


def _object_sizes(value):
    """The numbers of keys of ``value``'s dicts, inner ones first (json.loads' order of its objects)."""
    inner = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    sizes = [n for v in inner for n in _object_sizes(v)]
    return sizes + [len(value)] if isinstance(value, dict) else sizes


PYTHONISH = st.lists(st.sampled_from(["[", "]", "(", ")", "{", "}", ",", ":", " ", "\n", "\r", "#", "'", '"', "'a'",
                                      '"b"', "'''", "r", "u", "b", "\\", "\\x4", "\\N{BULLET}", "0", "1", "-", "+", ".",
                                      "e", "x", "j", "_", "True", "None"]), max_size=12).map("".join)


@given(PYTHONISH)
@SETTINGS
@example("{1: 'a', True: 'b', 1.0: 'c'}")
@example("('a' b'c', {1, 2}, 1j, 1e999, x, # c\n)")
def test_python_literal_reads_only_what_literal_eval_reads(text):
    """What it reads, ``ast.literal_eval`` reads to the same JSON (where a dict has no key twice:
    it writes both); it may refuse more (comments, a key in parentheses)."""
    try:
        out = python_json(text)
    except ValueError:
        return
    value = literal_eval(f"({text}\n)")  # (inside brackets, as a call's argument: newlines are space)
    pairs = []
    json.loads(out, object_pairs_hook=lambda items: pairs.append(len(items)))
    if pairs == _object_sizes(value):
        assert out == json_text(value)


def stream_calls(name, text, cuts):
    """``text`` through :class:`ToolCalls`' deltas in pieces ending at ``cuts``: the content, and per
    call the names its deltas sent and its arguments' deltas joined; then the same of the message."""
    made = [ToolCalls(lambda: TOOL_CALL_PARSERS[name](()), calls_finish=True) for _ in range(2)]
    content, names, arguments, start = "", {}, {}, 0
    for end in cuts + [len(text)]:
        shown, deltas = made[0].delta(0, text[start:end], end == len(text))
        content, start = content + shown, end
        for delta in deltas:
            function = delta["function"]
            names.setdefault(delta["index"], []).extend([function["name"]] if "name" in function else [])
            arguments[delta["index"]] = arguments.get(delta["index"], "") + function["arguments"]
    whole, calls = made[1].message(0, text)
    return ((content, [[names[i], arguments[i]] for i in sorted(arguments)]),
            (whole, [[[call["function"]["name"]], call["function"]["arguments"]] for call in calls]))


PYTHON_ARGUMENTS = st.dictionaries(IDENTIFIERS, VALUES, max_size=3)
PLAIN = st.text(st.characters(blacklist_characters="<", blacklist_categories=["Cs"]), max_size=8).filter(
    lambda v: v.lower() != "null")


@pytest.mark.parametrize("name,opening,closing", [("pythonic", "", ""),
                                                  ("llama4_pythonic", "<|python_start|>", "<|python_end|>")])
@given(calls=st.lists(st.tuples(NAMES, PYTHON_ARGUMENTS), min_size=1, max_size=3), after=st.sampled_from(["", " ok"]),
       rng=st.randoms(use_true_random=False), data=st.data())
@SETTINGS
def test_pythonic_formats_stream_the_arguments_json_dumps_writes(name, opening, closing, calls, after, rng, data):
    """Random calls in Python's spellings, whole, a character at a time and in random pieces: the
    same content and calls, each call's arguments ``json.dumps`` of its keyword arguments, growing
    at least at the call's "(", each keyword's "=" and its ")"; through ToolCalls' deltas a call's
    name is sent once and its arguments' deltas add up to the message's."""
    text = opening + "[" + ", ".join(f"{n}({', '.join(f'{k}={python_source(v, rng)}' for k, v in a.items())})"
                                     for n, a in calls) + "]" + closing + after
    want = [[n, json.dumps(a, ensure_ascii=False)] for n, a in calls]
    grew = check_pieces(name, text, after, want, data)
    assert all(g >= len(a) + 2 for g, (_, a) in zip(grew, calls)), grew
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    streamed, message = stream_calls(name, text, cuts)
    assert streamed == message == (after, [[[n], a] for n, a in want])


CALL = '[get_weather(city="Pa\\u00e9ris" ", F", days=1_2 , hot=True, tags=(1, 2,)), noop()]'
HELD_BACK = [  # (the output so far, the call's arguments): what cannot change is sent, no more
    ("[get_weather", None),  # (the name may still grow)
    ("[get_weather(", "{"),
    ('[get_weather(city="Pa\\u00', '{"city": "Pa'),  # (an escape until it is whole)
    ('[get_weather(city="Pa\\u00e9ris"', '{"city": "Paéris'),  # (a string may be joined to it)
    ('[get_weather(city="Pa\\u00e9ris" ", F', '{"city": "Paéris, F'),
    ('[get_weather(city="Pa\\u00e9ris" ", F", days=1', '{"city": "Paéris, F", "days": '),  # (a number until it ends)
    ('[get_weather(city="Pa\\u00e9ris" ", F", days=1_2 ', '{"city": "Paéris, F", "days": 12'),
    ('[get_weather(city="Pa\\u00e9ris" ", F", days=1_2 , hot=Tru', '{"city": "Paéris, F", "days": 12, "hot": '),
    ('[get_weather(city="Pa\\u00e9ris" ", F", days=1_2 , hot=True, tags=(1',  # ((1) or a tuple)
     '{"city": "Paéris, F", "days": 12, "hot": true, "tags": '),
    ('[get_weather(city="Pa\\u00e9ris" ", F", days=1_2 , hot=True, tags=(1,',
     '{"city": "Paéris, F", "days": 12, "hot": true, "tags": [1'),
    (CALL[:-9], '{"city": "Paéris, F", "days": 12, "hot": true, "tags": [1, 2]}'),
]


def test_pythonic_calls_are_sent_once_named_and_their_arguments_as_sure():
    parser, arguments = TOOL_CALL_PARSERS["pythonic"](()), {}
    for i, c in enumerate(CALL):
        parser.feed(c)
        arguments[CALL[:i + 1]] = parser.calls[0][1] if parser.calls else None
    assert [(text, arguments[text]) for text, _ in HELD_BACK] == HELD_BACK
    assert parser.finish() == "" and [name for name, _ in parser.calls] == ["get_weather", "noop"]


LONG = "x" * 1000
WRITE = '{"path": "a", "text": "%s"}' % LONG
DEEPSEEK_V3_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"
DEEPSEEK_V31_CALL = "<｜tool▁call▁begin｜>{}<｜tool▁sep｜>{}<｜tool▁call▁end｜>"


@pytest.mark.parametrize("name,text", [
    ("pythonic", f'[write(path="a", text="{LONG}"), noop()]'),
    ("hermes", f'<tool_call>{{"name": "write", "arguments": {WRITE}}}</tool_call>\n'
               '<tool_call>{"name": "noop", "arguments": {}}</tool_call>'),
    ("llama3_json", f'{{"name": "write", "parameters": {WRITE}}}; {{"name": "noop", "parameters": {{}}}}'),
    ("mistral", f'[TOOL_CALLS] [{{"name": "write", "arguments": {WRITE}}}, {{"name": "noop", "arguments": {{}}}}]'),
    ("mistral", f"[TOOL_CALLS]write[ARGS]{WRITE}[TOOL_CALLS]noop[ARGS]{{}}"),
    ("deepseek_v3", DEEPSEEK_V3_CALL.format("write", WRITE) + DEEPSEEK_V3_CALL.format("noop", "{}")),
    ("deepseek_v31", DEEPSEEK_V31_CALL.format("write", WRITE) + DEEPSEEK_V31_CALL.format("noop", "{}")),
    ("required", f'[{{"name": "write", "parameters": {WRITE}}}, {{"name": "noop", "parameters": {{}}}}]')])
def test_arguments_are_built_once_a_piece_fed(name, text):
    """A call's arguments string grows once a piece fed, not once a character: each growth copies it
    whole, so that was O(n²) in a long argument's length (a 100 KB one took ~0.7 s to read, hermes'
    200 KB ~1 s)."""
    grown = []

    class Call(list):
        def __setitem__(self, i, value):
            grown.append(i)
            super().__setitem__(i, value)

    class Calls(list):
        def append(self, call):
            super().append(Call(call))
    parser = RequiredParser() if name == "required" else TOOL_CALL_PARSERS[name](())
    parser.calls = Calls()
    assert parser.feed(text) + parser.finish() == ""
    assert parser.calls == [["write", WRITE], ["noop", "{}"]]
    assert grown.count(1) == 2  # (each call's arguments once, past what it was committed with)


HARMONY_CALL = "<|channel|>commentary to=functions.write<|message|>{}<|call|>"


@pytest.mark.parametrize("name,text,held,pieces", [
    ("mistral", '[TOOL_CALLS] {"a": "%s"}', "held", 1),  # (an object no call: content)
    ("llama3_json", '{"parameters": {"text": "%s"}, "name": "write"}', "held", 1),  # (no call before its name)
    ("gpt_oss", HARMONY_CALL.format('{"text": "%s"}'), "arguments", 0)])  # (0: a character a piece)
def test_text_held_grows_once_a_piece_fed(name, text, held, pieces):
    """The text a parser holds (Mistral's object that is no call, Llama 3's call before its name comes,
    Harmony's call body) is assigned as often whatever its length: held in a list and joined once,
    not grown a character (or a streamed piece) at a time, each growth copying it whole (O(n²))."""
    def assignments(length):
        count, parser_class = [0], type(TOOL_CALL_PARSERS[name](()))

        class Counted(parser_class):
            def __setattr__(self, attribute, value):
                count[0] += attribute == held
                super().__setattr__(attribute, value)
        parser, output = Counted(), text % ("x" * length)
        out = "".join(parser.feed(c) for c in output) if not pieces else parser.feed(output)
        out += parser.finish()
        assert (out, parser.calls) == ((output, []) if name == "mistral" else ("", [["write", '{"text": "%s"}' % (
            "x" * length)]]))
        return count[0]

    assert assignments(1000) == assignments(1)


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
