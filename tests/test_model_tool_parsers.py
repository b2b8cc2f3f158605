"""The mistral, pythonic, llama4_pythonic, qwen3_coder, deepseek_v3 and deepseek_v31 tool-call
parsers (vLLM's formats): each reads its calls and keeps the content around them, several calls in
one output; a call malformed before its arguments begin stays content as written, one broken or
cut short after keeps its arguments as far as they went (``CUT``; an output whose calls so broken
are no JSON, or no Python, is, not streamed, content: vLLM's); fed split at every position, and a character at a time (no content sent
that a later character makes a call's, arguments only growing), each gives what it gives whole. Random calls: tests/test_tool_call_streaming.py; through
the server (qwen3_coder, mistral, deepseek_v31): tests/test_tool_calls.py; gpt_oss's Harmony:
tests/test_harmony.py."""

import json

import pytest

from cluster.chat_protocol import ChatTool
from cluster.model_tool_parsers import DeepSeekV3Parser, DeepSeekV31Parser, MistralParser, Qwen3CoderParser
from cluster.pythonic_tool_parsers import Llama4PythonicParser, PythonicParser
from cluster.tool_calls import TOOL_CALL_PARSERS, ToolCalls
from tests.test_harmony import TEXTS as HARMONY_TEXTS
from tests.test_tool_calls import TOOLS, parse_characters, parse_pieces, parse_whole

WEATHER_ARGS = '{"city": "a]b}", "unit": "c"}'
CUT = set()  # the texts whose call broke or was cut short once committed: its arguments as far as they went


def cut(text):
    CUT.add(text)
    return text


MISTRAL_TEXTS = [  # (text, content, calls)
    ('Hi.\n[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + WEATHER_ARGS + '}, {"name": "add", '
     '"arguments": {"a": 1}}]\n', "Hi.", [["get_weather", WEATHER_ARGS], ["add", '{"a": 1}']]),
    ('[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]get_weather[ARGS]' + WEATHER_ARGS, "",  # (v11+ tokenizers)
     [["add", '{"a": 1}'], ["get_weather", WEATHER_ARGS]]),
    ('[TOOL_CALLS]add[CALL_ID]a1B2c3D4e[ARGS]{"a": 2} and [TOOL_CALLS]add{} done', " and done",
     [["add", '{"a": 2}'], ["add", "{}"]]),
    ('[TOOL_CALLS] [{"name": 3}] after', '[TOOL_CALLS] [{"name": 3}] after', []),  # no name: content
    (cut('ok [TOOL_CALLS]add[ARGS]{"a": 12'), "ok", [["add", '{"a": ']]),  # cut short: as far as it is sure
    ('ok [TOOL_CALLS] [{"name": "add", "a', 'ok [TOOL_CALLS] [{"name": "add", "a', []),  # (no arguments yet)
    (cut('[TOOL_CALLS]two words{"a": 1}; [TOOL_CALLS]add[ARGS]{"a": [1} ok'),  # broken once called: read afresh
     '[TOOL_CALLS]two words{"a": 1};} ok', [["add", '{"a": [']]),
    ('[TOOL_CALLS] [{"name": "add", "arguments": {}}, 3] ok', "3] ok", [["add", "{}"]]),
    ("no calls, [TOOL_CALLS [x]  \n", "no calls, [TOOL_CALLS [x]  \n", []),
    ("ends in a tag's start [TOOL_CA", "ends in a tag's start [TOOL_CA", []),
]
PYTHONIC_TEXTS = [
    ('[get_weather(city="a]b}", unit=\'c\'), add(a=-1, b=[1.5, None, True], c={"k": (1, "x")})]', "",
     [["get_weather", WEATHER_ARGS], ["add", '{"a": -1, "b": [1.5, null, true], "c": {"k": [1, "x"]}}']]),
    ("\n [add()]\n", "", [["add", "{}"]]),
    ("[add(a=1)] then text", " then text", [["add", '{"a": 1}']]),  # (vLLM: all content)
    ("[1, 2] is a list", "[1, 2] is a list", []),
    *[(text, text, []) for text in (  # none, no plain name, a keyword, cut short before "(", not opening
        "[]", "[math.add(a=1)]", "[if(a=1)]", "[add ", "Sure: [add(a=1)]")],
    *[(cut(text), content, calls) for text, content, calls in (  # broken once called: content from there
        ("[add(1)]", "1)]", [["add", "{"]]),  # (positional)
        ("[add(a=x)] ok", ")] ok", [["add", '{"a": ']]),  # (a name for a value)
        ("[add(**k)]", "**k)]", [["add", "{"]]),
        ("[add(a={1})]", "})]", [["add", '{"a": {']]),  # (a set)
        ("[add(a=1), g(b='x", "", [["add", '{"a": 1}'], ["g", '{"b": "x']]))],  # (cut short)
]
CODER = '<tool_call>\n<function={}>\n{}</function>\n</tool_call>'


def coder_call(name, **parameters):
    return CODER.format(name, "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters.items()))


CODER_TOOLS = [ChatTool.model_validate(t) for t in TOOLS + [{"type": "function", "function": {
    "name": "typed", "parameters": {"type": "object", "properties": {
        "n": {"type": "number"}, "x": {"type": "number"}, "b": {"type": "boolean"}, "o": {"type": "object"},
        "s": {"type": "string"}, "i": {"type": ["integer", "null"]}, "bad": {"type": "integer"}}}}}]]
QWEN3_CODER_TEXTS = [
    ("Let me check.\n" + coder_call("get_weather", city="a]b}", unit="c") + "\n" + coder_call("add", a=" 7") + "\n",
     "Let me check.", [["get_weather", WEATHER_ARGS], ["add", '{"a": 7}']]),
    (coder_call("typed", n="2.0", x="2.5", b="True", o='{"k": [1]}', s="12", i="null", bad="x1", extra="3"), "",
     [["typed", '{"n": 2, "x": 2.5, "b": true, "o": {"k": [1]}, "s": "12", "i": null, "bad": "x1", "extra": "3"}']]),
    ("<tool_call>\n<function=add>\n<parameter=a>\n1", "", [["add", '{"a": 1}']]),  # cut short: as far as it goes
    ("<tool_call>no function</tool_call> then " + coder_call("add", a="2"),
     "<tool_call>no function</tool_call> then", [["add", '{"a": 2}']]),
    ("a <tool_call><function=add</tool_call>", "a <tool_call><function=add</tool_call>", []),  # (no ">")
    ("ends in a tag's start <tool_ca", "ends in a tag's start <tool_ca", []),
]
DEEPSEEK = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"
DEEPSEEK_CALLS = DEEPSEEK.format("get_weather", WEATHER_ARGS) + DEEPSEEK.format("add", '{"a": 1}')
DEEPSEEK_TEXTS = [
    ("Sure.\n<｜tool▁calls▁begin｜>" + DEEPSEEK_CALLS + "<｜tool▁calls▁end｜>", "Sure.",
     [["get_weather", WEATHER_ARGS], ["add", '{"a": 1}']]),
    ("<｜tool▁calls▁begin｜>" + DEEPSEEK.format("add", "[1]") + DEEPSEEK.format("add", '{"a": 2}'),
     DEEPSEEK.format("add", "[1]"), [["add", '{"a": 2}']]),  # (unended section: the calls still count)
    (cut("<｜tool▁calls▁begin｜>" + DEEPSEEK.format("add", '{"a": x}') + " ok"), " ok", [["add", '{"a": ']]),  # broken
    ("<｜tool▁calls▁begin｜>" + DEEPSEEK.format("add", '{"a": 3}')[:-5], "", [["add", '{"a": 3}']]),  # cut short
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add {}<｜tool▁call▁end｜>",  # no separator: content
     "<｜tool▁call▁begin｜>add {}<｜tool▁call▁end｜>", []),
    ("plain <｜tool▁call", "plain <｜tool▁call", []),
]
DEEPSEEK_V31 = "<｜tool▁call▁begin｜>{}<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
DEEPSEEK_V31_TEXTS = [
    ("Sure.\n<｜tool▁calls▁begin｜>" + DEEPSEEK_V31.format("get_weather", WEATHER_ARGS)
     + DEEPSEEK_V31.format(" add ", '{"a":1}') + "<｜tool▁calls▁end｜>", "Sure.",
     [["get_weather", WEATHER_ARGS], ["add", '{"a": 1}']]),
    (DEEPSEEK_V31.format("add", "[1]") + DEEPSEEK_V31.format("", "{}") + " " + DEEPSEEK_V31.format("add", "{}"),
     DEEPSEEK_V31.format("add", "[1]") + DEEPSEEK_V31.format("", "{}"), [["add", "{}"]]),  # no object, no name
    ("<｜tool▁calls▁begin｜>" + DEEPSEEK.format("add", "{}"), DEEPSEEK.format("add", "{}"), []),  # V3's: no call
    ("<｜tool▁calls▁begin｜>" + DEEPSEEK_V31.format("add", '{"a": 3}')[:-5], "", [["add", '{"a": 3}']]),  # cut short
]
LLAMA4_TEXTS = [
    ('<|python_start|>[get_weather(city="a]b}", unit=\'c\'), add(a=1)]<|python_end|>', "",
     [["get_weather", WEATHER_ARGS], ["add", '{"a": 1}']]),
    ("[add(a=1)] <|python_end|> ok", " ok", [["add", '{"a": 1}']]),  # (its tags skipped in decoding, or not)
    (" <|python_start|> no list", " <|python_start|> no list", []),
    ("<|python_sta", "<|python_sta", []),
]
CASES = ([(MistralParser, case) for case in MISTRAL_TEXTS] + [(PythonicParser, case) for case in PYTHONIC_TEXTS]
         + [(lambda: Qwen3CoderParser(CODER_TOOLS), case) for case in QWEN3_CODER_TEXTS]
         + [(DeepSeekV3Parser, case) for case in DEEPSEEK_TEXTS]
         + [(DeepSeekV31Parser, case) for case in DEEPSEEK_V31_TEXTS]
         + [(Llama4PythonicParser, case) for case in LLAMA4_TEXTS])
IDS = ([f"mistral{i}" for i in range(len(MISTRAL_TEXTS))] + [f"pythonic{i}" for i in range(len(PYTHONIC_TEXTS))]
       + [f"qwen3_coder{i}" for i in range(len(QWEN3_CODER_TEXTS))]
       + [f"deepseek_v3_{i}" for i in range(len(DEEPSEEK_TEXTS))]
       + [f"deepseek_v31_{i}" for i in range(len(DEEPSEEK_V31_TEXTS))]
       + [f"llama4_pythonic{i}" for i in range(len(LLAMA4_TEXTS))])


@pytest.mark.parametrize("make,case", CASES, ids=IDS)
def test_parser_reads_its_format_whole_and_in_any_pieces(make, case):
    text, content, calls = case
    assert parse_whole(make(), text) == (content, calls)
    for cut in range(len(text) + 1):
        assert parse_pieces(make(), [text[:cut], text[cut:]]) == (content, calls), cut
    assert parse_characters(make(), text, content) == (content, calls)
    for _, arguments in calls if text not in CUT else ():
        json.loads(arguments)


@pytest.mark.parametrize("name,text", [("mistral", MISTRAL_TEXTS[0][0]), ("pythonic", PYTHONIC_TEXTS[0][0]),
                                       ("qwen3_coder", QWEN3_CODER_TEXTS[0][0]), ("deepseek_v3", DEEPSEEK_TEXTS[0][0]),
                                       ("deepseek_v31", DEEPSEEK_V31_TEXTS[0][0]),
                                       ("llama4_pythonic", LLAMA4_TEXTS[0][0]),
                                       ("gpt_oss", HARMONY_TEXTS[2][0])])
def test_registered_parsers_stream_what_the_message_holds(name, text):
    """By name, made from the request's tools: a character at a time, the deltas add up to the
    whole message's content and calls; a choice that called ends with "tool_calls"."""
    make = TOOL_CALL_PARSERS[name]
    streamed, content, calls = ToolCalls(lambda: make(CODER_TOOLS), calls_finish=True), "", []
    for i, c in enumerate(text):
        piece, deltas = streamed.delta(0, c, finished=i == len(text) - 1)
        content += piece
        for d in deltas:
            if d["index"] == len(calls):
                calls.append([d["function"]["name"], ""])
            calls[d["index"]][1] += d["function"]["arguments"]
    whole = ToolCalls(lambda: make(CODER_TOOLS), calls_finish=True)
    want_content, want_calls = whole.message(0, text)
    assert (content, calls) == (want_content, [[c["function"]["name"], c["function"]["arguments"]] for c in want_calls])
    assert len(calls) == 2 and streamed.finish_reason(0, "stop") == "tool_calls"


@pytest.mark.parametrize("name,text,content", [
    ("pythonic", "[add(a=1), g(1)] ok", "[add(a=1), g(1)] ok"),  # (positional: broken after a call)
    ("pythonic", "[add(a=1), g(b='x", "[add(a=1), g(b='x"),  # (cut short)
    ("llama4_pythonic", "<|python_start|>[add(a=x)]<|python_end|>", "[add(a=x)]"),
    *[(name, text, text) for name, text in [
        ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
                   '<tool_call>{"name": "add", "arguments": {"a": [1}}</tool_call>'),  # (one broken: all content)
        ("hermes", 'Sure. <tool_call>{"name": "add", "arguments": {"a": "x'),  # (cut short)
        ("llama3_json", '{"name": "add", "parameters": {"a": 1'),
        # the arguments whole, their object (or array) then broken or cut short: vLLM's json.loads fails
        ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>'),
        ("hermes", 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1}} x</tool_call>'),
        ("llama3_json", '{"name": "add", "parameters": {"a": 1} ok'),
        ("deepseek_v3", DEEPSEEK_TEXTS[2][0]), ("deepseek_v31", DEEPSEEK_V31.format("add", '{"a": [3')[:-5])]],
    ("mistral", MISTRAL_TEXTS[4][0], 'ok add{"a": 12'),  # (the special tokens dropped)
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": x}}]', ' [{"name": "add", "arguments": {"a": x}}]'),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {', ' [{"name": "add", "arguments": {"a": 1}}, {'),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}} x', ' [{"name": "add", "arguments": {"a": 1}} x'),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}]', ' [{"name": "add", "arguments": {"a": 1}]')])
def test_calls_that_do_not_parse_are_content_when_not_streamed(name, text, content):
    """vLLM's non-streamed reading: the output as content, its tags dropped where they are special
    tokens, no calls and the finish reason as it was (the calls as far as they went have arguments
    that are no JSON, or whole arguments in an object or array that is not); streamed, the calls committed were sent, and the choice ends with "tool_calls"."""
    whole = ToolCalls(lambda: TOOL_CALL_PARSERS[name](()), calls_finish=True)
    assert whole.message(0, text) == (content, []) and whole.finish_reason(0, "stop") == "stop"
    streamed = ToolCalls(lambda: TOOL_CALL_PARSERS[name](()), calls_finish=True)
    assert streamed.delta(0, text, finished=True)[1][0]["function"]["name"] == "add"
    assert streamed.finish_reason(0, "stop") == "tool_calls"


@pytest.mark.parametrize("last, content", [('{"name": "g", "parameters": {}', ""),  # (cut short, its arguments whole)
                                           ('{"name": "g", "parameters": {"a": 2', ""),  # (cut in its arguments)
                                           ('{"name": "g", "parameters": {"a": 2}, x', "x")])  # (broken)
def test_llama3_json_keeps_the_whole_calls_before_one_broken_or_cut_short(last, content):
    """vLLM's llama3_json takes the run of whole objects the output opens with (its regex, then json.loads of
    each): not streamed, a call after them that breaks or is cut short is left out and they stand; streamed,
    it was sent too."""
    text = '{"name": "add", "parameters": {"a": 1}}; ' + last
    whole = ToolCalls(lambda: TOOL_CALL_PARSERS["llama3_json"](()), calls_finish=True)
    message_content, calls = whole.message(0, text)
    assert (message_content, [[c["function"]["name"], c["function"]["arguments"]] for c in calls]) == \
        (content, [["add", '{"a": 1}']])
    assert whole.finish_reason(0, "length") == "length" and whole.finish_reason(0, "stop") == "tool_calls"
    streamed = ToolCalls(lambda: TOOL_CALL_PARSERS["llama3_json"](()), calls_finish=True)
    assert [d["function"]["name"] for d in streamed.delta(0, text, finished=True)[1] if "name" in d["function"]] \
        == ["add", "g"]
