"""OpenAI's Responses API (POST /v1/responses) through the official openai client over an in-process
engine (the tiny llama, the built-in template): a text response is the chat completion's, streamed
events come in the order the client's stream helpers take and add up to the whole response, text
formats, function tools and their outputs in the input, reasoning items, output_text logprobs,
previous_response_id and the stored responses (an LRU) with their input items, max_output_tokens, and
the 400s of what the server does not serve."""

import json
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from actors.engine.sampling_params import ANY_JSON
from cluster.config import ServerConfig
from cluster.http_server import BackgroundServer
from cluster.openai_responses import ResponsesRequest, chat_request
from cluster.responses_format import OutputTokens, ResponsesFormatter
from cluster.responses_store import ResponseStore, StoredResponse
from cluster.server import build_app
from cluster.tool_calls import TOOL_CALL_PARSERS, ToolCalls
from tests.test_openai_compat import MODEL, EngineBackend, bad_request
from tests.test_tool_calls import ADD, TOOLS, USER, WEATHER, engine, thinks, tokenizer  # noqa: F401 (fixtures)

FUNCTIONS = [dict(tool["function"], type="function") for tool in TOOLS]  # the Responses API's tool shape
GREEDY = {"temperature": 0, "max_output_tokens": 6}


def serve(engine, tokenizer, **config):
    app = build_app(EngineBackend(engine, 2048), tokenizer, ServerConfig(**config))
    return BackgroundServer(app, "127.0.0.1", 0)


@pytest.fixture(scope="module")
def client(engine, tokenizer):
    with serve(engine, tokenizer, responses_store_size=8) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def create(client, **fields):
    return client.responses.create(**dict(dict(model=MODEL, input="Weather in Paris?"), **fields))


def events_of(client, **fields):
    return list(create(client, stream=True, **fields))


def test_a_text_response_is_the_chat_completions_answer(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."}] + USER,
                                          max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    response = create(client, instructions="Be brief.", extra_body={"ignore_eos": True}, **GREEDY)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].annotations == []
    assert response.output_text == message.content[0].text == chat.choices[0].message.content
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == chat.usage.total_tokens and usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens_details.cached_tokens > 0  # (the same prompt as the chat request's, cached)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert message.status == "incomplete" and response.instructions == "Be brief."


LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": 2, "extra_body": {"ignore_eos": True},
            **GREEDY}


def assert_logprobs_close(got, want):
    """Logprob entries (the openai client's objects or dicts): the same tokens, alternatives and fields,
    the values within float noise (a prefix-cache hit runs the prompt through other kernels)."""
    got = [g if isinstance(g, dict) else g.model_dump() for g in got]
    assert [_without_values(g) for g in got] == [_without_values(w) for w in want]
    assert [v for g in got for v in _values(g)] == pytest.approx([v for w in want for v in _values(w)], abs=1e-4)


def _values(entry):
    return [entry["logprob"]] + [top["logprob"] for top in entry["top_logprobs"]]


def _without_values(entry):
    return dict(entry, logprob=None, top_logprobs=[dict(top, logprob=None) for top in entry["top_logprobs"]])


def test_output_text_logprobs_are_the_chat_answers_and_stream_with_their_deltas(client):
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True})
    want = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    assert len(want) == 6 and all(len(entry["top_logprobs"]) == 2 for entry in want)
    response = create(client, **LOGPROBS)
    assert_logprobs_close(response.output[0].content[0].logprobs, want)
    assert response.output_text == chat.choices[0].message.content and response.top_logprobs == 2
    events = events_of(client, **LOGPROBS)
    streamed = [entry for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    without_bytes = [{"token": e["token"], "logprob": e["logprob"],  # (OpenAI's text events: no bytes)
                      "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
                     for e in want]
    assert len(streamed) >= 5  # (a step whose text is held back gives its token to the next delta, or the done)
    assert_logprobs_close(streamed, without_bytes[:len(streamed)])
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert_logprobs_close(done.logprobs, without_bytes)
    assert_logprobs_close(events[-1].response.output[0].content[0].logprobs, want)
    alone = create(client, top_logprobs=2, extra_body={"ignore_eos": True}, **GREEDY)  # (no include: none, as OpenAI's)
    assert alone.output[0].content[0].logprobs == [] and alone.output_text == response.output_text


def test_fields_vllm_accepts_map_onto_the_chat_request_or_come_back(client):
    regex = {"guided_regex": "Sunny, 2[0-9] degrees\\.", "stop": [","]}
    kept = create(client, temperature=0, extra_body=dict(regex, include_stop_str_in_output=True),
                  max_tool_calls=3, prompt_cache_key="k", safety_identifier="u1", service_tier="auto",
                  stream_options={"include_obfuscation": False})
    assert kept.output_text == "Sunny," and create(client, temperature=0, extra_body=regex).output_text == "Sunny"
    assert (kept.max_tool_calls, kept.prompt_cache_key, kept.safety_identifier) == (3, "k", "u1")


EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


def collapsed(events):
    """The events' types, repeated deltas as one."""
    kinds = [e.type for e in events]
    return [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1] or not k.endswith(".delta")]


@pytest.mark.parametrize("fields,end", [
    (dict(GREEDY, extra_body={"ignore_eos": True}), "response.incomplete"),
    ({"temperature": 0, "extra_body": {"guided_regex": "Sunny, 2[0-9] degrees\\."}}, "response.completed"),
], ids=["cut", "completed"])
def test_streamed_events_come_in_order_and_add_up_to_the_response(client, fields, end):
    whole = create(client, **fields)
    events = events_of(client, **fields)
    assert collapsed(events) == EVENT_ORDER + [end]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text and len(text) > 0
    assert events[-4].text == events[-3].part.text == events[-2].item.content[0].text == text
    last = events[-1].response
    assert last.output_text == text and last.status == whole.status
    assert (last.usage.input_tokens, last.usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)
    assert len({e.item_id for e in events if hasattr(e, "item_id")}) == 1 and last.output[0].id == events[2].item.id
    if end == "response.completed":  # (the client's helper wants response.completed to end the stream)
        with client.responses.stream(model=MODEL, input="Weather in Paris?", **fields) as stream:
            final = stream.get_final_response()
        assert final.output_text == text and final.status == "completed"


def test_each_streamed_event_names_its_type_in_an_event_line(client):
    """Raw SSE, as a client without the SDK reads it: each message is ``event: <type>`` over the
    ``data:`` JSON of that type, and no ``[DONE]`` follows the last."""
    body = dict(model=MODEL, input="Weather in Paris?", stream=True, **GREEDY)
    raw = httpx.post(str(client.base_url) + "responses", json=body, timeout=60).text
    messages = [m.split("\n") for m in raw.strip().split("\n\n")]
    assert len(messages) > len(EVENT_ORDER)
    for event, data in messages:
        assert event == "event: " + json.loads(data.removeprefix("data: "))["type"]
    assert messages[-1][0] == "event: response.incomplete"


def test_a_json_schema_format_holds_the_text_to_its_schema(client):
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    response = create(client, text={"format": fmt}, max_output_tokens=64)
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text, strict=False), WEATHER)  # (raw control characters)
    json_object = chat_request(ResponsesRequest(input="x", text={"format": {"type": "json_object"}}), USER)
    assert json_object.grammar == ("response_format", "json_schema", ANY_JSON)


def test_a_named_function_is_a_function_call_item_streamed_as_its_arguments_grow(client):
    fields = {"tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "add"}, "max_output_tokens": 64,
              "temperature": 0}
    response = create(client, **fields)
    [call] = response.output
    assert call.type == "function_call" and call.name == "add" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), ADD)
    assert response.tools[1].name == "add" and response.tool_choice.name == "add"
    events = events_of(client, **fields)
    assert collapsed(events) == ["response.created", "response.in_progress", "response.output_item.added",
                                 "response.function_call_arguments.delta", "response.function_call_arguments.done",
                                 "response.output_item.done", "response.completed"]
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == events[-3].arguments == events[-1].response.output[0].arguments == call.arguments


def test_function_calls_and_their_outputs_in_the_input_render_as_chat_messages(client):
    """A turn's text and its calls are one assistant message, an output a tool message: the prompt is
    the chat request's for the same conversation."""
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]}
    items = USER + [said, {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                           "arguments": '{"city": "Paris"}'},
                    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    response = create(client, input=items, tools=FUNCTIONS, tool_choice="none", max_output_tokens=1)
    messages = USER + [{"role": "assistant", "content": "Let me see.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    alone = create(client, input=USER, tools=FUNCTIONS, tool_choice="none", max_output_tokens=1)
    assert response.usage.input_tokens > alone.usage.input_tokens + 10


def test_previous_response_id_continues_the_conversation_and_stored_responses_come_back(client):
    first = create(client, instructions="Be brief.", extra_body={"guided_regex": "Sunny\\."})
    second = create(client, input="And Rome?", previous_response_id=first.id, max_output_tokens=1)
    chat = client.chat.completions.create(model=MODEL, max_tokens=1, messages=USER + [
        {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Rome?"}])  # (no instructions)
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id) == first
    streamed = events_of(client, input="Hi", extra_body={"guided_regex": "Hello"})[-1].response
    assert client.responses.retrieve(streamed.id) == streamed
    unstored = create(client, store=False, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    body = bad_request(lambda: create(client, previous_response_id=unstored.id))
    assert body["param"] == "previous_response_id" and body["code"] == "previous_response_not_found", body
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_input_items_list_the_requests_input_with_ids_in_pages(client):
    """This request's input (not the earlier turns'), as sent with an id each; desc by default;
    pages after an id, as the client's auto-pagination walks them."""
    items = USER + [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "call_1", "output": "sunny", "id": "fco_mine"}]
    first = create(client, max_output_tokens=1)
    response = create(client, input=items, previous_response_id=first.id, max_output_tokens=1)
    [said] = client.responses.input_items.list(first.id).data
    assert said.type == "message" and said.role == "user" and said.content[0].text == "Weather in Paris?"
    asc = client.responses.input_items.list(response.id, order="asc")
    assert [item.type for item in asc.data] == ["message", "function_call", "function_call_output"]
    assert asc.data[1].name == "get_weather" and asc.data[2].id == "fco_mine" and asc.has_more is False
    ids = [item.id for item in asc.data]
    assert ids[0].startswith("msg_") and ids[1].startswith("fc_") and len(set(ids)) == 3
    page = client.responses.input_items.list(response.id, limit=2)
    assert [item.id for item in page.data] == ids[:0:-1] and page.has_more is True
    assert (page.first_id, page.last_id) == (ids[2], ids[1])
    assert [item.id for item in page] == ids[::-1]  # (the client fetches the next page after the last id)
    assert client.responses.input_items.list(response.id, after=ids[0], order="asc").data[0].id == ids[1]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


@pytest.mark.parametrize("query,param", [
    ({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"), ({"after": "nope"}, "after"),
    ({"include": ["message.input_image.image_url"]}, "include")])
def test_input_items_refuse_what_they_cannot_page_or_fill(client, query, param):
    response = create(client, max_output_tokens=1)
    body = bad_request(lambda: client.responses.input_items.list(response.id, **query))
    assert body["param"] == param and body["type"] == "invalid_request_error", body


def test_the_store_evicts_the_least_recently_used():
    store = ResponseStore(2)
    for name in "abc":
        store.put(StoredResponse({"id": name}, [], []))
        store.get("a")  # (a stays recent)
    assert store.get("b") is None and [store.get(name).response["id"] for name in "ac"] == ["a", "c"]
    none_kept = ResponseStore(0)
    none_kept.put(StoredResponse({"id": "a"}, [], []))
    assert len(none_kept) == 0 and len(store) == 2


@pytest.mark.parametrize("fields,param,says", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "built-in tool 'web_search'"),
    ({"background": True}, "background", "not supported"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "not supported"),
    ({"truncation": "auto"}, "truncation", "not supported"),
    ({"extra_body": {"n": 2}}, "n", "unknown field"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]}, "input",
     "not a vision-language model"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input.0.content.0",
     "file_id is not served"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "input.0.output.0", "'input_image' is not supported"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type", "'item_reference' is not supported"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id", "field required"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "needs its schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format", ""),
    ({"tools": [dict(FUNCTIONS[0], bogus=1)]}, "tools.0.bogus", "unknown field"),
    ({"tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
    ({"max_output_tokens": 4096}, "input", "maximum context length"),
])
def test_what_the_server_does_not_serve_is_a_400_naming_the_field(client, fields, param, says):
    body = bad_request(lambda: create(client, **fields))
    assert body["param"] == param and says in body["message"] and body["type"] == "invalid_request_error", body


def summary(output):
    """Output items without their ids: (type, text or (name, arguments))."""
    return [(item.type, item.content[0].text if item.type != "function_call" else (item.name, item.arguments))
            for item in output]


def test_a_text_has_the_tokens_it_overlaps_after_the_last_texts():
    """OutputTokens: each text is found after the one before, past the tags and whitespace between;
    its tokens are those it overlaps that no text before took; a text not found (a token's text is a
    piece of a character) takes every token not taken yet."""
    tokens = OutputTokens()
    tokens.add([{"token": t} for t in ["<think>", "hm", "</think>", "\n", "Hi", " the", "re", "\n<tool", "_call>"]])
    taken = [[e["token"] for e in tokens.take(text)] for text in ("hm", "Hi th", "ere")]
    assert taken == [["hm"], ["Hi", " the"], ["re"]]
    tokens.add([{"token": "\ufffd"}])
    assert [e["token"] for e in tokens.take("é")] == ["\n<tool", "_call>", "\ufffd"]


class _ChatSteps:
    """A chat formatter's streamed steps as ResponsesFormatter reads them: each step's delta of
    choice 0, from a ToolCalls of the ``parser`` fed ``pieces`` (a piece: a step's text, maybe
    several tokens')."""

    req = SimpleNamespace(model=MODEL)

    def __init__(self, pieces, parser="hermes"):
        calls = ToolCalls(lambda: TOOL_CALL_PARSERS[parser](()), calls_finish=True)
        self.deltas = []
        for i, piece in enumerate(pieces):
            content, tool_calls = calls.delta(0, piece, i == len(pieces) - 1)
            self.deltas.append(dict({"content": content} if content else {},
                                    **({"tool_calls": tool_calls} if tool_calls else {})))

    def chunks(self, event):
        return [{"choices": [{"delta": self.deltas.pop(0), "finish_reason": None, "logprobs": None}]}]

    def usage(self):
        return {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2, "prompt_tokens_details": None}


def _stream_events(steps):
    """The Responses events of ``steps``, each a step, then the stream's end."""
    formatter = ResponsesFormatter(steps, {}, SimpleNamespace(encode=lambda text, add_special_tokens: list(text)),
                                   lambda response: None)
    return [e for _ in range(len(steps.deltas)) for e in formatter.chunks(object())] + formatter.chunks(None)


def test_a_calls_last_arguments_and_the_text_after_it_in_one_step_stream_in_their_order():
    """A step whose text ends a call and goes on past it (several tokens at once): the call's item
    takes the rest of its arguments before it is done, then the message item opens (not a
    function_call item of no call with the arguments' tail, the call's own done without it)."""
    events = _stream_events(_ChatSteps(['Sure.<tool_call>\n{"name": "add", "arguments": {"a": ',
                                        '7}}\n</tool_call>\nDone.']))
    output = events[-1]["response"]["output"]
    assert [(item["type"], item.get("name"), item.get("arguments")) for item in output] == [
        ("message", None, None), ("function_call", "add", '{"a": 7}'), ("message", None, None)]
    assert [e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done"] == ['{"a": 7}']
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == '{"a": 7}'


def test_pythonic_calls_are_function_call_items_whose_arguments_stream_as_they_grow():
    """A pythonic list of two calls, a few characters a step: each call an item opened once named,
    its arguments' deltas (more than one) adding up to its done arguments, done before the next
    call's opens."""
    text = "[get_weather(city='Paris', unit='c'), add(a=1, b=[2, 3])]"
    events = _stream_events(_ChatSteps([text[i:i + 4] for i in range(0, len(text), 4)], parser="pythonic"))
    output = events[-1]["response"]["output"]
    assert [(item["type"], item["name"], item["arguments"]) for item in output] == [
        ("function_call", "get_weather", '{"city": "Paris", "unit": "c"}'),
        ("function_call", "add", '{"a": 1, "b": [2, 3]}')]
    for index, item in enumerate(output):
        deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                  and e["output_index"] == index]
        assert len(deltas) > 1 and "".join(deltas) == item["arguments"]
    places = [[i for i, e in enumerate(events) if e.get("output_index") == index] for index in range(2)]
    assert max(places[0]) < min(places[1])  # (the first call's item done before the second's opens)


def test_reasoning_then_text_then_a_call_are_three_items_streamed_or_not(engine, tokenizer):
    """With the server's reasoning and tool-call parsers (as chat reads them): the thinking is a
    reasoning item, the answer a message, a hermes call a function_call item, each streamed in turn;
    the answer's output_text logprobs are its own tokens', whole and streamed alike."""
    call = '<tool_call>\\n\\{"name": "add", "arguments": \\{"a": 7\\}\\}\\n</tool_call>'
    fields = {"tools": FUNCTIONS, "max_output_tokens": 128, "extra_body": {"guided_regex": "Sure\\.\\n" + call},
              "include": ["message.output_text.logprobs"]}
    with serve(engine, tokenizer, reasoning_parser="qwen3", tool_call_parser="hermes") as server, \
            thinks(engine, "<think>Paris is in France.</think>"):  # (the grammar is the answer's)
        thinking = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        response = create(thinking, **fields)
        events = events_of(thinking, **fields)
        with thinking.responses.stream(model=MODEL, input="Weather in Paris?", **fields) as stream:
            final = stream.get_final_response()
    want = [("reasoning", "Paris is in France."), ("message", "Sure."), ("function_call", ("add", '{"a": 7}'))]
    assert summary(response.output) == summary(events[-1].response.output) == summary(final.output) == want
    assert response.output[0].summary == [] and response.output[0].content[0].type == "reasoning_text"
    assert response.output[2].call_id.startswith("call_") and response.output_text == "Sure."
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    assert events[-1].response.usage.output_tokens_details == response.usage.output_tokens_details
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Paris is in France."
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1, 2]
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "message",
                                                                                      "function_call"]
    whole = response.output[1].content[0].logprobs  # the answer's tokens, not the thinking's nor the call's
    assert "".join(e.token for e in whole) == "Sure." and len(whole) < response.usage.output_tokens
    [done] = [e for e in events if e.type == "response.output_text.done"]
    deltas = [entry for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    assert [e.token for e in done.logprobs] == [e.token for e in deltas] == [e.token for e in whole]
    assert [e.logprob for e in done.logprobs] == pytest.approx([e.logprob for e in whole], abs=1e-4)
    assert [e.token for e in final.output[1].content[0].logprobs] == [e.token for e in whole]
    engine.check_integrity()
