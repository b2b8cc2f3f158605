"""GPT-OSS's Harmony output (``cluster.harmony``): the ``gpt_oss`` reasoning and tool parsers read
analysis messages as the thinking, final ones and commentary preambles as the answer, messages to
``functions.NAME`` as calls; malformed and cut-short messages, tags never in a field; fed split at
every position and a character at a time, each gives what it gives whole. Through the server, over
a tiny model whose tokenizer has Harmony's tags as special tokens (as o200k_harmony): forced
outputs, streamed equal to non-streamed, the Responses API's items, and a ``response_format`` held
to the final channel's body."""

import json

import jsonschema
import openai
import pytest
from transformers import GenerationConfig, PreTrainedTokenizerFast

from actors.engine import Engine
from actors.engine.tiny import build_tiny_checkpoint
from actors.engine.tokenizer import BOS, EOS, EOS_ID, IM_END, IM_START, PAD, TOKENIZER_VOCAB_SIZE, build_byte_tokenizer
from cluster.config import ServerConfig
from cluster.harmony import TAGS, HarmonyParser, parse_header
from cluster.http_server import BackgroundServer
from cluster.reasoning import REASONING_FORMATS
from cluster.server import build_app
from tests.forced_output import forced_tokens
from tests.test_openai_compat import MODEL, EngineBackend
from tests.test_tool_calls import TOOLS, USER, WEATHER, parse_characters

ANALYSIS = "<|channel|>analysis<|message|>{}<|end|>"
NEXT = "<|start|>assistant"
FINAL = NEXT + "<|channel|>final<|message|>{}"
PREAMBLE = NEXT + "<|channel|>commentary<|message|>{}<|end|>"
WEATHER_CALL = (NEXT + "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city":"Paris"}<|call|>')
ADD_CALL = NEXT + ' to=functions.add<|channel|>commentary json<|message|>{"a": 1}<|call|>'  # (the recipient first)
CALLS = [["get_weather", '{"city": "Paris"}'], ["add", '{"a": 1}']]
TEXTS = [  # (output, reasoning, content, calls)
    (ANALYSIS.format("Think.") + FINAL.format("Hi <b>there</b>."), "Think.", "Hi <b>there</b>.", []),
    (ANALYSIS.format("a") + FINAL.format("b") + "<|return|>", "a", "b", []),
    (ANALYSIS.format("Weather?") + WEATHER_CALL + ADD_CALL, "Weather?", "", CALLS),
    (ANALYSIS.format("a") + PREAMBLE.format("Checking.") + WEATHER_CALL, "a", "Checking.", CALLS[:1]),
    # messages of one field are joined by newlines
    (ANALYSIS.format("a") + NEXT + ANALYSIS.format("b") + PREAMBLE.format("c") + FINAL.format("d"), "a\nb", "c\nd", []),
    # cut short: a body as far as it goes, a call's text as written; a header is dropped
    (ANALYSIS.format("a")[:-7] + "<|en", "a<|en", "", []),
    (ANALYSIS.format("a") + NEXT + "<|chan", "a", "", []),
    ('<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": ', "", "", [["add", '{"a": ']]),
    # another recipient, another role, no channel: no one's; a built-in tool's analysis call is thinking
    ("<|channel|>commentary to=browser.search<|message|>{}<|end|><|start|>functions.add<|channel|>commentary"
     "<|message|>2<|end|><|start|>assistant<|message|>x<|end|>" + NEXT + "<|channel|>analysis to=python<|message|>1+1",
     "1+1", "", []),
    # not closed before the next header (SGLang's implicit close); tags inside a body and text between messages dropped
    ("<|channel|>analysis<|message|>a<|channel|>final<|message|>b<|constrain|>c<|end|>junk" + FINAL.format("d"),
     "a", "bc\nd", []),
    ("<|channel|>final<|message|>x <|y|> <|end", "", "x <|y|> <|end", []),  # "<|" that starts no tag is text
    ("<|channel|>analysis<|end|>" + FINAL.format("b"), "", "b", []),  # a header closed with no body: no message
    ("plain text, no Harmony", "", "plain text, no Harmony", []),
    ("", "", "", []),
]


def split_pieces(pieces):
    """``pieces`` through one parser's ``split`` (the last final): its thinking, answer and calls."""
    parser, reasoning, content = HarmonyParser(), "", ""
    for i, piece in enumerate(pieces):
        r, c = parser.split(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content, parser.calls


@pytest.mark.parametrize("text,reasoning,content,calls", TEXTS)
def test_harmony_splits_alike_whole_and_in_any_pieces(text, reasoning, content, calls):
    want = (reasoning, content, calls)
    assert split_pieces([text]) == want
    for cut in range(len(text) + 1):
        assert split_pieces([text[:cut], text[cut:]]) == want, cut
    assert split_pieces(list(text) + [""]) == want
    assert parse_characters(HarmonyParser(), text, content) == (content, calls)  # the tool parser's side


@pytest.mark.parametrize("header,role,channel,recipient", [
    ("assistant<|channel|>commentary to=functions.f <|constrain|>json", "assistant", "commentary", "functions.f"),
    ("assistant to=functions.f<|channel|>commentary json", "assistant", "commentary", "functions.f"),
    ("<|channel|>final", "", "final", None),
    (" to=functions.f<|channel|>analysis", "", "analysis", "functions.f"),
    ("functions.f to=assistant<|channel|>commentary", "functions.f", "commentary", "assistant"),
])
def test_a_header_names_its_role_channel_and_recipient(header, role, channel, recipient):
    assert parse_header(header) == (role, channel, recipient)


# ---- through the server ------------------------------------------------------------------------------
HARMONY_TEMPLATE = ("{% for m in messages %}{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}"
                    "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The tiny llama with Harmony's tags as special tokens after the byte tokenizer's ids, its
    template's prompts ending in ``<|start|>assistant``, ``<|return|>`` and ``<|call|>`` its EOS."""
    path = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-harmony"), seed=0,
                                 vocab_size=TOKENIZER_VOCAB_SIZE + len(TAGS))
    raw = build_byte_tokenizer()
    raw.add_special_tokens(list(TAGS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                        additional_special_tokens=[IM_START, IM_END, *TAGS])
    tokenizer.chat_template = HARMONY_TEMPLATE
    tokenizer.save_pretrained(str(path))
    GenerationConfig(eos_token_id=[EOS_ID] + tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
                     ).save_pretrained(str(path))
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=4096, attention_backend="torch",
                 context_length=512, constrained_json_disable_any_whitespace=True)
    yield eng
    eng.check_integrity()
    eng.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    config = ServerConfig(reasoning_parser="gpt_oss", tool_call_parser="gpt_oss")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(engine.config.model_path, local_files_only=True)
    with BackgroundServer(build_app(EngineBackend(engine, 512), tokenizer, config), "127.0.0.1", 0) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def writes(engine, text):
    """The engine's choices write ``text`` (its last tag a stop token: it ends them)."""
    tokens = engine.tokenizer.encode(text, add_special_tokens=False)
    return forced_tokens(engine.scheduler, lambda req: tokens)


def chat_both_ways(client, **fields):
    """A chat request's choices, whole and streamed (their deltas joined), as
    ``(reasoning, content, calls, finish_reason)``; the same both ways."""
    fields = dict(dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=256, n=2, logprobs=True, seed=3), **fields)
    whole = [(c.message.model_extra.get("reasoning_content"), c.message.content,
              [(t.function.name, t.function.arguments) for t in c.message.tool_calls or ()], c.finish_reason)
             for c in client.chat.completions.create(**fields).choices]
    joined = {}
    for chunk in client.chat.completions.create(stream=True, **fields):
        for c in chunk.choices:
            parts = joined.setdefault(c.index, {"reasoning": "", "content": "", "calls": {}, "finish": None})
            parts["reasoning"] += (c.delta.model_extra or {}).get("reasoning_content") or ""
            parts["content"] += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                call = parts["calls"].setdefault(d.index, [d.function.name, ""])
                call[1] += d.function.arguments or ""
            parts["finish"] = c.finish_reason or parts["finish"]
    streamed = [(p["reasoning"] or None, p["content"] or None, [tuple(c) for _, c in sorted(p["calls"].items())],
                 p["finish"]) for _, p in sorted(joined.items())]
    assert streamed == whole
    return whole


def test_thinking_and_answer_through_the_server(engine, client):
    """Decoded with its special tokens (skipped, the tags would be gone and the text one answer):
    the analysis channel in reasoning_content, the final channel in content; SGLang's
    ``separate_reasoning: false`` leaves the text whole, its tags too (the stop token not in it)."""
    text = ANALYSIS.format("The user greets.") + FINAL.format("Hello!")
    with writes(engine, text + "<|return|>"):
        choices = chat_both_ways(client, tools=openai.NOT_GIVEN)
        whole = chat_both_ways(client, tools=openai.NOT_GIVEN, extra_body={"separate_reasoning": False})
    assert choices == [("The user greets.", "Hello!", [], "stop")] * 2
    assert whole == [(None, text, [], "stop")] * 2


def test_a_preamble_and_calls_through_the_server(engine, client):
    """A preamble is content, a commentary message to functions.NAME a call; the output stops at
    ``<|call|>`` (an EOS): finish_reason "tool_calls"."""
    with writes(engine, ANALYSIS.format("Need the weather.") + PREAMBLE.format("Checking.") + WEATHER_CALL):
        choices = chat_both_ways(client)
    assert choices == [("Need the weather.", "Checking.", [("get_weather", '{"city": "Paris"}')], "tool_calls")] * 2


def test_the_responses_api_gets_reasoning_a_message_and_a_function_call(engine, client):
    with writes(engine, ANALYSIS.format("Need the weather.") + PREAMBLE.format("Checking.") + WEATHER_CALL):
        response = client.responses.create(model=MODEL, input="Weather in Paris?", max_output_tokens=256,
                                           tools=[dict(t["function"], type="function") for t in TOOLS])
    items = [(i.type, i.content[0].text if i.type != "function_call" else (i.name, i.arguments))
             for i in response.output]
    assert items == [("reasoning", "Need the weather."), ("message", "Checking."),
                     ("function_call", ("get_weather", '{"city": "Paris"}'))]


def test_a_response_format_holds_the_final_channel_only(engine, client):
    """The grammar holds from the token after ``<|channel|>final<|message|>`` (the forced thinking,
    no JSON, is free: masked, it would end the request); the answer follows the schema."""
    assert REASONING_FORMATS["gpt_oss"].answer_start == "<|channel|>final<|message|>"
    fields = dict(tools=openai.NOT_GIVEN, response_format={"type": "json_schema", "json_schema": {
        "name": "weather", "schema": WEATHER}})
    with writes(engine, ANALYSIS.format("{city}") + FINAL.format("")):
        choices = chat_both_ways(client, **fields)
    for reasoning, content, calls, finish in choices:
        assert (reasoning, calls, finish) == ("{city}", [], "stop")
        jsonschema.validate(json.loads(content, strict=False), WEATHER)


def test_a_required_or_named_tool_choice_is_refused_naming_it(engine, client):
    """A required or named tool choice's JSON grammar would hold from the header the prompt opened
    (``<|start|>assistant``), before the model writes a channel: no Harmony, no call to read. It
    is a 400 naming tool_choice (vLLM's Harmony path refuses it too), through chat and Responses."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=8)
        assert refused.value.body["param"] == "tool_choice" and "Harmony" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="Weather in Paris?", max_output_tokens=8, tool_choice="required",
                                tools=[dict(t["function"], type="function") for t in TOOLS])
    assert refused.value.body["param"] == "tool_choice"
    assert not engine.loop.held_reqs()
