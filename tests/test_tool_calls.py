"""OpenAI tool calling on the chat endpoint: the parsers fed a text in any pieces give what they
give it whole (hermes' blocks, llama3_json's objects, "required"'s JSON array), invalid blocks
stay content; the built-in template lists tools and renders calls, and without tools is plain
ChatML to the byte; through the official openai client over an in-process engine (the tiny
llama): a named function's and "required"'s constrained calls follow their schemas, streamed
equals non-streamed (n = 2, logprobs), "auto" with the hermes, llama3_json, qwen3_coder (its
parameters typed by the request's tools) or mistral (decoded with special tokens) parser reads the
calls the output holds, a call's arguments streamed in many deltas as the model writes them
(hermes, deepseek_v31), and the 400s and defaults of tools, tool_choice and parallel_tool_calls.
With a reasoning parser, calls and a ``response_format``'s grammar are the answer's, after the
(forced) thinking."""

import json

import httpx
import jsonschema
import openai
import pytest
from jinja2 import Environment
from transformers import AutoTokenizer

from actors.engine import Engine
from actors.engine.tiny import build_tiny_checkpoint
from actors.engine.tokenizer import CHAT_TEMPLATE
from cluster.config import ServerConfig
from cluster.http_server import BackgroundServer
from cluster.server import build_app
from cluster.tool_calls import ToolCalls
from cluster.tool_parsers import HermesParser, Llama3JsonParser, RequiredParser
from tests.forced_output import forced_tokens
from tests.test_openai_compat import MODEL, EngineBackend, bad_request

PLAIN_CHATML = (  # the built-in template before tools (what a conversation without them must still render)
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
HERMES_TEXTS = [
    "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Rome") + "\n",
    "no calls here, <tool but not a call>  \n",
    "<tool_call>{oops}</tool_call> then " + CALL + " done",
    "before " + CALL[:-3],  # unclosed block (the output ran out): still a call
    "ends in a tag's start <tool_ca",
]


def parse_whole(parser, text):
    content = parser.feed(text) + parser.finish()
    return content, parser.calls


def parse_pieces(parser, pieces):
    content = "".join(parser.feed(piece) for piece in pieces) + parser.finish()
    return content, parser.calls


def parse_characters(parser, text, content):
    """``text`` fed a character at a time: no content sent that is not ``content``'s start (none a
    later character makes a call's), a call's arguments only growing; the content and calls."""
    sent, arguments = "", []
    for c in text:
        sent += parser.feed(c)
        assert content.startswith(sent), sent
        assert all(now.startswith(before) for (_, before), (_, now) in zip(arguments, parser.calls))
        arguments = [list(call) for call in parser.calls]
    return sent + parser.finish(), parser.calls


def test_hermes_reads_calls_and_keeps_the_rest_as_content():
    content, calls = parse_whole(HermesParser(), HERMES_TEXTS[0])
    assert content == "Let me check." and calls == [["get_weather", '{"city": "Paris", "unit": "c"}'],
                                                     ["get_weather", '{"city": "Rome", "unit": "c"}']]
    assert parse_whole(HermesParser(), HERMES_TEXTS[1]) == (HERMES_TEXTS[1], [])  # no calls: the text as it is
    content, calls = parse_whole(HermesParser(), HERMES_TEXTS[2])  # invalid JSON: the block stays content
    assert content == "<tool_call>{oops}</tool_call> then done" and [name for name, _ in calls] == ["get_weather"]
    assert parse_whole(HermesParser(), HERMES_TEXTS[3]) == ("before", calls[:1])
    assert parse_whole(HermesParser(), HERMES_TEXTS[4]) == (HERMES_TEXTS[4], [])


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_hermes_fed_in_pieces_gives_what_it_gives_whole(text):
    """Split at every position, and a character at a time: the same content and calls, and no
    content sent while a tail may still be ``<tool_call>``'s start."""
    whole = parse_whole(HermesParser(), text)
    for cut in range(len(text) + 1):
        assert parse_pieces(HermesParser(), [text[:cut], text[cut:]]) == whole, cut
    parser, sent = HermesParser(), ""
    for c in text:
        sent += parser.feed(c)
        assert "<tool_call" not in sent or "<tool_call>{oops}" in sent
    assert (sent + parser.finish(), parser.calls) == whole


WEATHER_JSON = '{"name": "get_weather", "parameters": {"city": "a;b}", "unit": "c"}}'
LLAMA3_TEXTS = [  # (text, content, calls)
    ('<|python_tag|>' + WEATHER_JSON + '; {"name": "add", "arguments": {"a": 1}} \n', "",
     [["get_weather", '{"city": "a;b}", "unit": "c"}'], ["add", '{"a": 1}']]),
    (' \n{"name": "add", "parameters": {}, "arguments": {"a": 2}}', "", [["add", "{}"]]),  # (the first: streamed)
    ('{"arguments": {"a": 2}, "name": "add"}', "", [["add", '{"a": 2}']]),  # (held until named)
    ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),  # JSON without parameters: an answer
    ("Sure: " + WEATHER_JSON, "Sure: " + WEATHER_JSON, []),  # a call opens the output or is none
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ('{"name": "add", "parameters": {}} ; then text', "then text", [["add", "{}"]]),
    ('{"name": "add", "parameters": {}}; {oops}; ' + WEATHER_JSON, "{oops}; " + WEATHER_JSON, [["add", "{}"]]),
    ('{"name": "add", "parameters": {"a": 1', "", [["add", '{"a": ']]),  # cut short: as far as it is sure
    ('{"name": "add", "param', '{"name": "add", "param', []),  # (before its arguments)
    ('{"name": "add", "parameters": {"a": 1]} ok', "]} ok", [["add", '{"a": ']]),  # broken once called
    (" <|python_ta", " <|python_ta", []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA3_TEXTS)
def test_llama3_json_reads_the_calls_an_output_opens_with_fed_in_any_pieces(text, content, calls):
    """vLLM's llama3_json format, whole, split at every position, and a character at a time, when
    no content is sent that a later character turns into a call."""
    assert parse_whole(Llama3JsonParser(), text) == (content, calls)
    for cut in range(len(text) + 1):
        assert parse_pieces(Llama3JsonParser(), [text[:cut], text[cut:]]) == (content, calls), cut
    parser, sent = Llama3JsonParser(), ""
    for c in text:
        sent += parser.feed(c)
        assert content.startswith(sent), sent
    assert (sent + parser.finish(), parser.calls) == (content, calls)


REQUIRED_TEXT = ('[{"name": "add", "parameters": {"a": [1, {"b": "}\\"]"}], "c": true}} , '
                 '{"name":"get_weather","parameters":{}},{"name": "s", "parameters": "x,}"}, {"name": "n", '
                 '"parameters": 12 }]')


def test_required_array_gives_each_element_as_a_call_its_parameters_as_written():
    content, calls = parse_whole(RequiredParser(), REQUIRED_TEXT)
    assert content == "" and calls == [["add", '{"a": [1, {"b": "}\\"]"}], "c": true}'], ["get_weather", "{}"],
                                       ["s", '"x,}"'], ["n", "12"]]
    for name, arguments in calls:
        assert {"name": name, "parameters": json.loads(arguments)} in json.loads(REQUIRED_TEXT)
    for cut in range(len(REQUIRED_TEXT) + 1):
        assert parse_pieces(RequiredParser(), [REQUIRED_TEXT[:cut], REQUIRED_TEXT[cut:]]) == (content, calls), cut


@pytest.mark.parametrize("make,text", [(RequiredParser, REQUIRED_TEXT), (HermesParser, HERMES_TEXTS[0]),
                                       (Llama3JsonParser, LLAMA3_TEXTS[0][0])])
def test_streamed_tool_call_deltas_add_up_to_the_message(make, text):
    """A call's first delta has its id, type and name; the arguments' fragments, joined, are the
    message's arguments; content too. A call that stopped ends with "tool_calls"."""
    streamed, calls = ToolCalls(make, calls_finish=True), {}
    content = ""
    for i, c in enumerate(text):
        piece, deltas = streamed.delta(0, c, finished=i == len(text) - 1)
        content += piece
        for d in deltas:
            if d["index"] not in calls:
                assert d["id"].startswith("call_") and d["type"] == "function", d
                calls[d["index"]] = dict(d["function"])
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    whole = ToolCalls(make, calls_finish=True)
    want_content, want_calls = whole.message(0, text)
    assert content == want_content and [calls[i] for i in sorted(calls)] == [c["function"] for c in want_calls]
    assert len(want_calls) >= 2 and len({c["id"] for c in want_calls}) == len(want_calls)
    assert streamed.finish_reason(0, "stop") == whole.finish_reason(0, "stop") == "tool_calls"
    assert whole.finish_reason(0, "length") == "length"


def test_invalid_hermes_json_is_content_and_the_choice_just_stops():
    calls = ToolCalls(HermesParser, calls_finish=True)
    text = '<tool_call>{"name": 3}</tool_call>'
    assert calls.message(0, text) == (text, []) and calls.finish_reason(0, "stop") == "stop"


@pytest.fixture(scope="module")
def tokenizer(engine):
    return AutoTokenizer.from_pretrained(engine.config.model_path, local_files_only=True)


def test_the_template_without_tools_is_plain_chatml_to_the_byte(tokenizer):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb <tool_call>"},
                    {"role": "assistant", "content": "c"}, {"role": "tool", "content": "{}"}]
    old = Environment().from_string(PLAIN_CHATML)
    for messages in (conversation, conversation[1:], conversation[:1]):
        for prompt in (True, False):
            assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == \
                old.render(messages=messages, add_generation_prompt=prompt)


def test_the_template_lists_tools_and_renders_calls_and_results(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}] + USER + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    listed = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in listed.split("\n")] == TOOLS
    assert "Be brief." not in rest and "<|im_start|>user\nWeather in Paris?<|im_end|>\n" in rest
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n') in rest


# ---- through the server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"), seed=0)
    # (a random model writes JSON's optional whitespace until max_tokens: here it writes none)
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=8192, attention_backend="torch",
                 context_length=2048, constrained_json_disable_any_whitespace=True)
    yield eng
    eng.check_integrity()
    eng.shutdown()


def served_client(engine, tokenizer, parser):
    app = build_app(EngineBackend(engine, 2048), tokenizer, ServerConfig(tool_call_parser=parser))
    return BackgroundServer(app, "127.0.0.1", 0)


@pytest.fixture(scope="module")
def client(engine, tokenizer):
    with served_client(engine, tokenizer, "hermes") as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def no_parser(engine, tokenizer):
    with served_client(engine, tokenizer, None) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def chat(client, **fields):
    return client.chat.completions.create(**dict(dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=128,
                                                      seed=3), **fields))


def streamed(client, **fields):
    """The streamed choices as the whole response would hold them: (content, calls, finish, logprobs)."""
    choices = {}
    for chunk in chat(client, stream=True, **fields):
        for c in chunk.choices:
            content, calls, finish, logprobs = choices.setdefault(c.index, ["", {}, None, []])
            choices[c.index][0] += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                if d.index not in calls:
                    calls[d.index] = {"name": d.function.name, "arguments": "", "id": d.id}
                calls[d.index]["arguments"] += d.function.arguments or ""
            choices[c.index][2] = c.finish_reason or finish
            logprobs += [t.token for t in (c.logprobs.content if c.logprobs else ())]
    return [(content or None, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish, logprobs)
            for _, (content, calls, finish, logprobs) in sorted(choices.items())]


def whole(response):
    return [(c.message.content, [(t.function.name, t.function.arguments) for t in c.message.tool_calls or ()],
             c.finish_reason, [t.token for t in (c.logprobs.content if c.logprobs else ())]) for c in response.choices]


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(client):
    for seed in range(3):
        choice = chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                      seed=seed).choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None, choice  # (vLLM's "stop")
        [call] = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments, strict=False), WEATHER)


@pytest.mark.parametrize("parallel", [None, False])
def test_required_calls_one_or_more_tools_by_their_schemas(client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    finished = 0
    for seed in range(3):
        choice = chat(client, tool_choice="required", seed=seed, max_tokens=200, **extra).choices[0]
        calls = choice.message.tool_calls
        assert calls and choice.message.content is None, choice
        if choice.finish_reason == "length":  # (a random model may call on and on without parallel false)
            continue
        finished += 1
        assert choice.finish_reason == "tool_calls"
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments, strict=False), SCHEMAS[call.function.name])
        assert parallel is None or len(calls) == 1
    assert finished >= 1 if parallel is None else finished == 3


HERMES_OUTPUT = (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
                 r'"unit": "c"\}\}\n</tool_call>')


@pytest.mark.parametrize("fields", [
    {"tool_choice": {"type": "function", "function": {"name": "add"}}},
    {"tool_choice": "required", "parallel_tool_calls": False},
    {"tool_choice": "auto", "extra_body": {"guided_regex": HERMES_OUTPUT}},
    {"extra_body": {"guided_regex": HERMES_OUTPUT[:HERMES_OUTPUT.index("<")] + "<tool_cal"}},  # no call
], ids=["named", "required", "auto", "auto-no-call"])
def test_streamed_equals_non_streamed(client, fields):
    """Same seed, n = 2 (each choice parsed on its own), logprobs on: the streamed content and
    argument fragments add up to the whole response's message, its finish reason too."""
    want = whole(chat(client, n=2, logprobs=True, **fields))
    assert streamed(client, n=2, logprobs=True, **fields) == want
    assert len(want) == 2 and all(logprobs for *_, logprobs in want)
    if "extra_body" in fields:  # the hermes parser read the call the output holds (or found none)
        called = "auto" in fields.get("tool_choice", "")
        for content, calls, finish, _ in want:
            assert (content, finish) == (("Sure.", "tool_calls") if called else ("Sure.\n<tool_cal", "stop"))
            assert [json.loads(args)["city"] in ("Paris", "Rome") for _, args in calls] == ([True] if called else [])


def test_llama3_json_reads_the_calls_through_the_server(engine, tokenizer):
    """"auto" with the llama3_json parser: the calls an output opens with (forced by a regex), two
    separated by ``;``, each by its schema; streamed equals non-streamed (n = 2, logprobs)."""
    output = (r'<\|python_tag\|>\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome)", "unit": "c"\}\}; '
              r'\{"name": "add", "arguments": \{"a": [1-9]\}\}')
    fields = {"n": 2, "logprobs": True, "extra_body": {"guided_regex": output}}
    with served_client(engine, tokenizer, "llama3_json") as server:
        llama = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        want = whole(chat(llama, **fields))
        assert streamed(llama, **fields) == want
    for content, calls, finish, logprobs in want:
        assert content is None and finish == "tool_calls" and logprobs, (content, finish)
        assert [name for name, _ in calls] == ["get_weather", "add"]
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def forced_choices(engine, tokenizer, parser, text):
    """Through a server with ``parser``, chat choices (n = 2, logprobs) that write ``text`` and
    stop (forced), as the whole response holds them; streamed, they add up to the same."""
    tokens = engine.tokenizer.encode(text, add_special_tokens=False) + [engine.tokenizer.eos_token_id]
    fields = {"n": 2, "logprobs": True, "max_tokens": len(tokens) + 8}  # (a byte tokenizer)
    with served_client(engine, tokenizer, parser) as server, forced_tokens(engine.scheduler, lambda req: tokens):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        want = whole(chat(client, **fields))
        assert streamed(client, **fields) == want
    assert len(want) == 2 and all(logprobs for *_, logprobs in want)
    return want


LONG_ARGUMENTS = {"city": "Paris, the capital of France \u00e9", "unit": "c", "days": [1, 2.50, 3]}
LONG_OUTPUTS = {  # the model writes the arguments compact, é escaped: the message holds json.dumps's text
    "hermes": "Sure.\n<tool_call>\n{}\n</tool_call>",
    "deepseek_v31": "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
                    "<｜tool▁calls▁end｜>",
}


@pytest.mark.parametrize("parser", sorted(LONG_OUTPUTS))
def test_streamed_arguments_grow_as_the_model_writes_them(engine, tokenizer, parser):
    """As vLLM streams them: a call's first delta has its index, id, type and name, then the
    arguments come in many deltas as the model writes them, each extending the ones before, adding
    up to the non-streamed message's arguments (n = 2: per choice)."""
    call = {"name": "get_weather", "arguments": LONG_ARGUMENTS} if parser == "hermes" else LONG_ARGUMENTS
    text = LONG_OUTPUTS[parser].format(json.dumps(call, separators=(",", ":")))
    tokens = engine.tokenizer.encode(text, add_special_tokens=False) + [engine.tokenizer.eos_token_id]
    fields = {"n": 2, "max_tokens": len(tokens) + 8}
    with served_client(engine, tokenizer, parser) as server, forced_tokens(engine.scheduler, lambda req: tokens):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        response = chat(client, **fields)
        chunks = list(chat(client, stream=True, **fields))
    want = json.dumps(LONG_ARGUMENTS, ensure_ascii=False)
    for choice in response.choices:
        assert [(t.function.name, t.function.arguments) for t in choice.message.tool_calls] == [("get_weather", want)]
    for index in range(2):
        deltas = [d for chunk in chunks for c in chunk.choices if c.index == index for d in c.delta.tool_calls or ()]
        first = deltas[0]
        assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
        assert first.function.name == "get_weather" and isinstance(first.function.arguments, str)
        arguments, grew = "", 0
        for delta in deltas:
            assert delta.index == 0 and (delta is first or (delta.id, delta.function.name) == (None, None))
            grew += bool(delta.function.arguments)
            arguments += delta.function.arguments or ""
            assert want.startswith(arguments)
        assert arguments == want and grew > 5, (arguments, grew)


def test_qwen3_coder_reads_the_calls_through_the_server(engine, tokenizer):
    """"auto" with the qwen3_coder parser, made per request from its tools: the output's two XML
    calls, each parameter typed by its tool's schema (``add``'s integer a number), the text before
    them content."""
    parameter = "<parameter={}>\n{}\n</parameter>\n"
    text = ("Sure.\n<tool_call>\n<function=get_weather>\n" + parameter.format("city", "Paris")
            + parameter.format("unit", "c") + "</function>\n</tool_call>\n<tool_call>\n<function=add>\n"
            + parameter.format("a", "7") + "</function>\n</tool_call>")
    for content, calls, finish, _ in forced_choices(engine, tokenizer, "qwen3_coder", text):
        assert (content, finish) == ("Sure.", "tool_calls")
        assert calls == [("get_weather", '{"city": "Paris", "unit": "c"}'), ("add", '{"a": 7}')]


def test_mistral_output_is_decoded_with_its_special_tokens(engine, tokenizer):
    """"auto" with the mistral parser decodes the output with special tokens (``[TOOL_CALLS]`` is
    one in Mistral's HF tokenizers, as vLLM's parser asks): one in the output stays in the content;
    the calls after ``[TOOL_CALLS]`` are read."""
    text = 'Hi.<|im_start|>\n[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {}}]'
    for content, calls, finish, _ in forced_choices(engine, tokenizer, "mistral", text):
        assert (content, finish) == ("Hi.<|im_start|>", "tool_calls")
        assert calls == [("add", '{"a": 1}'), ("add", "{}")]


def test_tool_messages_in_the_conversation_reach_the_template(client, tokenizer):
    """An assistant's calls (arguments a JSON string, as OpenAI sends them) and a tool's result:
    the prompt is the template's over the arguments' object."""
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    usage = chat(client, messages=messages, max_tokens=1, tool_choice="none").usage
    rendered = [dict(m, content=m["content"] or "") for m in messages]
    rendered[1]["tool_calls"] = [dict(rendered[1]["tool_calls"][0], function={"name": "get_weather",
                                                                              "arguments": {"city": "Paris"}})]
    text = tokenizer.apply_chat_template(rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    tokenized = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"),
                           json={"model": MODEL, "messages": messages, "tools": TOOLS}).json()
    assert tokenized["count"] == usage.prompt_tokens  # (/tokenize renders the tools too)


def test_without_a_parser_auto_is_refused_and_no_tool_choice_answers_in_content(no_parser):
    body = bad_request(lambda: chat(no_parser, tool_choice="auto"))
    assert body["param"] == "tool_choice" and "tool_call_parser" in body["message"], body
    plain = chat(no_parser, extra_body={"guided_regex": HERMES_OUTPUT}).choices[0]
    assert plain.message.tool_calls is None and plain.message.content.startswith("Sure.\n<tool"), plain
    with_tools = chat(no_parser, max_tokens=1).usage.prompt_tokens
    assert with_tools > chat(no_parser, max_tokens=1, tools=openai.NOT_GIVEN).usage.prompt_tokens  # tools in the prompt
    assert chat(no_parser, tool_choice="required").choices[0].message.tool_calls  # (constrained: no parser needed)


@pytest.mark.parametrize("fields,param,says", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope' is not among"),
    ({"tool_choice": "sometimes"}, "tool_choice", "not one of none, auto, required"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "'get_weather' appears more than once"),
    ({"tools": [{"type": "fn", "function": {"name": "f"}}]}, "tools.0.type", "'function'"),
    ({"tools": openai.NOT_GIVEN, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "one structured output per request"),
    ({"tool_choice": "required", "tools": [  # (one $defs for all: each tool's X cannot hold)
        {"type": "function", "function": {"name": name, "parameters": {"$defs": {"X": {"type": kind}}}}}
        for name, kind in (("f", "string"), ("g", "integer"))]}, "tools", "'X' has different schemas"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "$defs": ["X"]}}}]}, "tools", "$defs must be an object"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "call_1"}]}]},
     "messages.1.tool_calls.0.function", "field required"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": "get_weather"}]}, "messages.1.tool_calls", "list"),
])
def test_bad_tools_or_tool_choice_are_400_naming_the_field(client, fields, param, says):
    body = bad_request(lambda: chat(client, **fields))
    assert body["param"] == param and says in body["message"] and body["type"] == "invalid_request_error", body


def test_tokenize_refuses_a_malformed_assistant_call_as_chat_does(client):
    messages = USER + [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]
    response = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"), json={"model": MODEL, "messages": messages})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages.1.tool_calls.0.function.name"


@pytest.fixture(scope="module")
def thinking(engine, tokenizer):
    app = build_app(EngineBackend(engine, 2048), tokenizer,
                    ServerConfig(tool_call_parser="hermes", reasoning_parser="qwen3"))
    with BackgroundServer(app, "127.0.0.1", 0) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def thinks(engine, text: str):
    """The engine's chat choices think ``text`` first (forced: a grammar would leave it free)."""
    tokens = engine.tokenizer.encode(text, add_special_tokens=False)
    return forced_tokens(engine.scheduler, lambda req: tokens)


def test_with_a_reasoning_parser_the_calls_are_read_from_the_answer_only(thinking, engine):
    """As vLLM: the reasoning parser first, the tool parser on the answer after ``</think>`` (a
    call-shaped block inside the thinking stays thinking); a named function's constrained output
    has no thinking to split. Streamed equals non-streamed, reasoning included."""
    inner = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    fields = {"max_tokens": 256, "extra_body": {"guided_regex": r"\n" + HERMES_OUTPUT}}  # (the answer's)
    with thinks(engine, "<think>maybe " + inner + "</think>"):
        response = chat(thinking, **fields)
        chunks = list(chat(thinking, stream=True, **fields))
    choice = response.choices[0]
    reasoning = choice.message.model_extra["reasoning_content"]
    assert reasoning.startswith("maybe <tool_call>") and '"add"' in reasoning
    assert choice.message.content.strip() == "Sure." and choice.finish_reason == "tool_calls"
    assert [t.function.name for t in choice.message.tool_calls] == ["get_weather"]
    parts = {"reasoning": "", "content": "", "args": ""}
    for chunk in chunks:
        for c in chunk.choices:
            parts["reasoning"] += (c.delta.model_extra or {}).get("reasoning_content") or ""
            parts["content"] += c.delta.content or ""
            parts["args"] += "".join(d.function.arguments or "" for d in c.delta.tool_calls or ())
    assert parts == {"reasoning": reasoning, "content": choice.message.content,
                     "args": choice.message.tool_calls[0].function.arguments}
    named = chat(thinking, tool_choice={"type": "function", "function": {"name": "add"}}).choices[0]
    assert named.message.model_extra.get("reasoning_content") is None and named.message.content is None
    jsonschema.validate(json.loads(named.message.tool_calls[0].function.arguments), ADD)


def test_with_a_reasoning_parser_a_response_format_constrains_the_answer_only(thinking, engine):
    """As SGLang and vLLM: the thinking (forced: text no JSON schema allows) is free, the grammar
    holds from the token after ``</think>``: the content follows the schema; streamed equals
    non-streamed. With the thinking off the grammar holds from the start: no thinking."""
    fields = dict(max_tokens=128, tools=openai.NOT_GIVEN, logprobs=True, response_format={
        "type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}})
    with thinks(engine, "The weather? {city}</think>"):
        choice = chat(thinking, **fields).choices[0]
        chunks = list(chat(thinking, stream=True, **fields))
    assert choice.message.model_extra["reasoning_content"] == "The weather? {city}"
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content, strict=False), WEATHER)
    streamed = {"reasoning_content": "", "content": "", "logprobs": []}
    for c in (chunk.choices[0] for chunk in chunks if chunk.choices):
        streamed["reasoning_content"] += (c.delta.model_extra or {}).get("reasoning_content") or ""
        streamed["content"] += c.delta.content or ""
        streamed["logprobs"] += [t.token for t in (c.logprobs.content if c.logprobs else ())]
    assert streamed == {"reasoning_content": choice.message.model_extra["reasoning_content"],
                        "content": choice.message.content, "logprobs": [t.token for t in choice.logprobs.content]}
    off = chat(thinking, extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **fields).choices[0]
    assert off.message.model_extra.get("reasoning_content") is None
    jsonschema.validate(json.loads(off.message.content, strict=False), WEATHER)
