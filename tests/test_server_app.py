"""The HTTP app over a scripted backend (no Ray, fast): text deltas never take back
what was sent, admission refuses and times out, a failure before the first token
gets its own status and one after it an error event then ``data: [DONE]``, n
streamed choices merge, and validation errors name their field."""

import asyncio
import json
import re
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from actors.pd_scheduler import PDRequestError
from cluster.admission import Admission, QueueFullError, QueueTimeoutError
from cluster.config import ServerConfig
from cluster.http_server import BackgroundServer
from cluster.server import build_app
from cluster.streaming import TextDelta
from tests.backend_stubs import StubBackend
from tests.parity import hf_classifier_score
from tests.server_helpers import wait_until


class ScriptedBackend(StubBackend):
    """Answers every request with tokens 0, 1, 2, ... as letters a, b, c, ..., ``delay_s`` apart;
    ``fail_at``: raise PDRequestError instead of yielding that many tokens. ``calls`` records the
    prompts and params it was given, ``rids`` their request ids, ``closed`` the rids whose stream
    ended (done or aborted). A request id still running is refused, as the router refuses one."""

    model_name, context_len, vocab_size = "scripted", 64, 1000

    def __init__(self):
        self.fail_at, self.delay_s = None, 0.0
        self.max_prompt_len = 63
        self.calls, self.rids, self.closed, self.priorities = [], [], [], []

    async def generate_stream(self, input_ids, sampling_params, rid, priority=0, lora_path=None, mm_inputs=None):
        if self.rids.count(rid) > self.closed.count(rid):
            raise ValueError(f"request {rid!r} is already routed")
        self.calls.append((list(input_ids), dict(sampling_params)))
        self.rids.append(rid)
        self.priorities.append(priority)
        n = sampling_params["max_new_tokens"]
        try:
            for i in range(1 if n else 0, n + 1):
                if self.fail_at is not None and i > self.fail_at:
                    raise PDRequestError("decode worker d-0 died while serving " + rid)
                await asyncio.sleep(self.delay_s)
                done = {"type": "length", "length": i} if i == n else None
                yield {"output_ids": list(range(i)), "text": "abcdefghijklmnop"[:i],
                       "meta_info": {"prompt_tokens": len(input_ids), "completion_tokens": i, "cached_tokens": 2,
                                     "finish_reason": done, "prefill_worker": "p-0", "decode_worker": "d-0"}}
        finally:
            self.closed.append(rid)


@pytest.fixture(scope="module")
def served():
    backend = ScriptedBackend()
    app = build_app(backend, None, ServerConfig())
    with BackgroundServer(app, "127.0.0.1", 0) as server:
        yield backend, server, app


@pytest.fixture
def backend(served):
    served[0].fail_at, served[0].max_prompt_len, served[0].delay_s = None, 63, 0.0
    served[0].calls.clear()
    served[0].rids.clear()
    served[0].closed.clear()
    served[0].priorities.clear()
    served[0].priority_scheduling = False
    return served[0]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="none", max_retries=0, timeout=30)


def test_text_delta_never_takes_back_what_was_sent():
    delta = TextDelta(None, stop=["STOP"])
    assert delta.update({"text": "ab\ufffd"}, False) == "ab"
    assert delta.update({"text": "abé ST"}, False) == "é "  # "ST" may grow into "STOP": held
    assert delta.update({"text": "abé STA"}, False) == "STA"
    assert delta.update({"text": "abé STA"}, True) == ""
    cut = TextDelta(None, stop=["xy"])
    assert cut.update({"text": "ax"}, False) == "a"
    assert cut.update({"text": "a"}, True) == ""  # the stop string was cut off: nothing new
    assert cut.sent == "a"


def test_text_delta_decodes_a_stop_token_only_with_include_stop_str_in_output():
    """Workers that skip the tokenizer send ids; the server decodes them as the engine would: the
    stop token that ended the output left out, or kept with vLLM's ``include_stop_str_in_output``."""
    from transformers import PreTrainedTokenizerFast

    from actors.engine.tokenizer import build_byte_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=build_byte_tokenizer())
    a, z = tok.encode("a")[0], tok.encode("z")[0]
    result = {"output_ids": [a, z], "meta_info": {"finish_reason": {"type": "stop", "matched": z}}}
    assert TextDelta(tok).update(result, True) == "a"
    assert TextDelta(tok, include_stop=True).update(result, True) == "az"


def test_admission_refuses_when_full_and_times_out():
    async def go():
        admission = Admission(max_concurrent=1, max_queue_size=1, queue_timeout_s=0.2)
        await admission.acquire()
        waiter = asyncio.ensure_future(admission.acquire())
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFullError):
            await admission.acquire()
        with pytest.raises(QueueTimeoutError):
            await waiter
        admission.release()
        async with admission.slot():
            assert admission.running == 1
        assert (admission.running, admission.waiting) == (0, 0)

    asyncio.run(go())


def test_a_cancelled_stop_still_gives_the_admission_slot_back():
    """Stopping a request's choices (their aborts) can itself be cancelled: at the server's
    shutdown timeout the task is cancelled again. The admission slot still comes back."""
    from cluster.openai_serving import GenerationService

    async def go():
        admission = Admission(max_concurrent=1, max_queue_size=1, queue_timeout_s=0.2)
        service = GenerationService(None, None, None, admission)
        await admission.acquire()

        async def choices():
            try:
                yield 1
            finally:
                await asyncio.sleep(10)  # the aborts on the workers take a while

        events = choices()
        await events.__anext__()
        closing = asyncio.ensure_future(service._close(events))
        await asyncio.sleep(0.01)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert admission.running == 0

    asyncio.run(go())


def test_prompt_and_request_limits_are_held_apart(backend, client):
    """A prefill pool smaller than the decode one bounds the prompt only: a short prompt may
    ask for what the context leaves; a longer prompt is refused."""
    backend.max_prompt_len = 10
    out = client.completions.create(model="scripted", prompt=list(range(10)), max_tokens=50)
    assert out.usage.completion_tokens == 50
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="scripted", prompt=list(range(11)), max_tokens=2)
    assert info.value.body["code"] == "context_length_exceeded"
    assert "a prompt of at most 10 tokens" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:  # a short prompt, too many completion tokens
        client.completions.create(model="scripted", prompt=[1, 2], max_tokens=63)
    message = info.value.body["message"]  # OpenAI's words: not "reduce the prompt" (2 tokens) alone
    assert "(2 in the prompt, 63 in the completion)" in message and message.endswith("prompt or completion.")


def test_failure_before_the_first_token_gets_a_500(backend, client):
    backend.fail_at = 0
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="scripted", prompt=[1, 2], max_tokens=4, stream=stream)
        assert info.value.body["code"] == "worker_failure" and "d-0" in info.value.body["message"]


def test_failure_mid_stream_sends_an_error_event_then_done(served, backend, client):
    backend.fail_at = 3
    body = {"model": "scripted", "prompt": [1, 2], "max_tokens": 8, "stream": True}
    with httpx.stream("POST", served[1].url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "died" in error["message"]
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2]) == "abc"
    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=8, stream=True))


def test_n_streamed_choices_merge(backend, client):
    texts = {}
    for chunk in client.completions.create(model="scripted", prompt=[1, 2, 3], max_tokens=5, n=3, stream=True,
                                           stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = chunk.usage
    assert texts == {0: "abcde", 1: "abcde", 2: "abcde"}
    assert (usage.completion_tokens, usage.prompt_tokens_details.cached_tokens) == (15, 2)


def test_a_client_gone_mid_stream_lets_each_choices_stop_finish(served):
    """A streamed client that goes away: starlette cancels the response in an anyio scope, which
    cancels again at every await of its clean-up. A choice still before its first token (in its
    prefill) stops its workers in its own clean-up (the PD client's prefill stop, then a safe abort
    of the decode reservation); cancelled again there, the reservation was left quarantined for
    the hand-off's whole deadline (300 s by default). The choices are cancelled once."""

    class PrefillingBackend(StubBackend):
        model_name, context_len, max_prompt_len, vocab_size = "prefilling", 64, 63, 1000
        stops = {}

        async def generate_stream(self, input_ids, sampling_params, rid, priority=0, lora_path=None, mm_inputs=None):
            if rid.endswith("-0"):  # choice 0 streams; choice 1 is still in its prefill
                yield {"output_ids": [0], "text": "a", "meta_info": {"prompt_tokens": 2, "completion_tokens": 1,
                                                                     "cached_tokens": 0, "finish_reason": None}}
            try:
                await asyncio.sleep(3600)
            finally:
                self.stops[rid] = "stopping"
                await asyncio.sleep(0.3)  # the prefill side's abort, then the decode side's
                self.stops[rid] = "stopped"

    backend = PrefillingBackend()
    app = build_app(backend, None, ServerConfig())
    body = {"model": "prefilling", "prompt": [1, 2], "max_tokens": 8, "n": 2, "stream": True}
    with BackgroundServer(app, "127.0.0.1", 0) as server:
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
            next(r.iter_lines())
        assert wait_until(lambda: len(backend.stops) == 2 and app.state.admission.running == 0, timeout_s=5.0)
        time.sleep(0.5)
    assert sorted(backend.stops.values()) == ["stopped", "stopped"]


def test_continuous_usage_stats_give_each_chunk_its_choices_usage_so_far(client):
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries its choice's usage so
    far (the scripted backend writes a letter a token), and the last chunk the request's total."""
    sent, last = {}, None
    for chunk in client.completions.create(model="scripted", prompt=[1, 2, 3], max_tokens=4, n=2, stream=True,
                                           stream_options={"include_usage": True, "continuous_usage_stats": True}):
        for choice in chunk.choices:
            sent[choice.index] = sent.get(choice.index, "") + choice.text
            assert chunk.usage.prompt_tokens == 3 and chunk.usage.completion_tokens == len(sent[choice.index])
            assert chunk.usage.total_tokens == 3 + len(sent[choice.index])
        last = chunk
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 8)


@pytest.mark.parametrize("body,field", [
    ({"model": "scripted", "prompt": [1], "top_k": -2}, "top_k"),
    ({"model": "scripted", "prompt": [1], "n": 0}, "n"),
    ({"model": "scripted"}, "prompt"),
    ({"model": "scripted", "prompt": [1], "stop": ["a", ""]}, "stop"),
    ({"model": "scripted", "prompt": [1], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "scripted", "prompt": [1], "logit_bias": {"x": 1}}, "logit_bias"),
    ({"model": "scripted", "prompt": [1], "logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"model": "scripted", "prompt": [1], "min_tokens": -1}, "min_tokens"),
])
def test_validation_errors_name_the_field(served, body, field):
    r = httpx.post(served[1].url + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.json()
    assert field in r.json()["error"]["message"]


def test_more_stop_strings_than_openai_allows_are_taken_as_in_vllm(served, backend):
    """OpenAI caps ``stop`` at 4; vLLM and SGLang take any number (lm-eval's ``until`` lists
    send more), and so does this server: all of them reach the engine."""
    stops = ["q", "r", "s", "t", "u", "v"]
    r = httpx.post(served[1].url + "/v1/completions", json={"model": "scripted", "prompt": [1], "max_tokens": 4,
                                                           "stop": stops})
    assert r.status_code == 200, r.text
    assert backend.calls[-1][1]["stop"] == stops


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": [1], "max_tokens": 2}),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}),
])
def test_top_k_0_is_disabled_as_in_vllm(served, backend, path, body):
    """vLLM reads ``top_k`` 0 (and -1) as "all tokens": accepted, and the engine gets its -1
    (chat shares the completions' sampling fields; this server has no chat template)."""
    from cluster.chat_protocol import ChatCompletionRequest

    chat = {"model": "scripted", "messages": [{"role": "user", "content": "x"}], "top_k": 0}
    assert ChatCompletionRequest.model_validate(chat).to_sampling_params(2)["top_k"] == -1
    for top_k in (0, -1):
        sent = dict(body, sampling_params=dict(body["sampling_params"], top_k=top_k)) if path == "/generate" \
            else dict(body, model="scripted", top_k=top_k)
        r = httpx.post(served[1].url + path, json=sent)
        assert r.status_code == 200, r.text
        assert backend.calls[-1][1]["top_k"] == -1


def test_every_response_carries_an_x_request_id_the_clients_own_echoed(served, client):
    """vLLM's request-id headers: ``X-Request-Id`` as the client sent it, or a new one per request
    (the openai client's ``_request_id``), on answers, streams and errors alike."""
    url = served[1].url
    raw = client.completions.with_raw_response.create(model="scripted", prompt=[1], max_tokens=2,
                                                      extra_headers={"X-Request-Id": "trace-7"})
    assert raw.headers["x-request-id"] == "trace-7"
    ids = {client.completions.create(model="scripted", prompt=[1], max_tokens=2)._request_id for _ in range(2)}
    assert len(ids) == 2 and None not in ids
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": [1], "max_tokens": 2, "stream": True},
                      headers={"X-Request-Id": "trace-8"}) as r:
        assert r.headers["x-request-id"] == "trace-8"
    r = httpx.post(url + "/v1/completions", json={"prompt": [1], "n": 0}, headers={"X-Request-Id": "trace-9"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "trace-9"


def test_the_clients_x_request_id_is_the_base_of_response_ids_and_worker_request_ids(served, backend, client):
    """vLLM's ``_base_request_id``: the client's ``X-Request-Id`` names the response
    (``cmpl-{id}``, every streamed chunk too) and starts the request each choice runs as on the
    workers (``cmpl-{id}-{8 hex}``, choice i then ``-{i}``), so an operator finds it in their logs
    and the router's state; /generate's request starts with it, unless the body names a ``rid``
    (SGLang's, taken as it is). Without a header the id is the new one the response echoes."""
    url, trace = served[1].url, {"X-Request-Id": "trace-42"}
    internal = r"cmpl-trace-42-[0-9a-f]{8}"
    completion = client.completions.create(model="scripted", prompt=[1], max_tokens=2, n=2, extra_headers=trace)
    assert completion.id == "cmpl-trace-42"
    assert re.fullmatch(internal + "-0", backend.rids[0]) and backend.rids[1] == backend.rids[0][:-1] + "1", \
        backend.rids
    chunks = list(client.completions.create(model="scripted", prompt=[1], max_tokens=3, stream=True,
                                            extra_headers=trace))
    assert len(chunks) >= 3 and {c.id for c in chunks} == {"cmpl-trace-42"}
    assert re.fullmatch(internal, backend.rids[2]), backend.rids
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(url + "/generate", json=body, headers=trace).status_code == 200
    assert httpx.post(url + "/generate", json=dict(body, rid="mine"), headers=trace).status_code == 200
    assert re.fullmatch(r"trace-42-[0-9a-f]{8}", backend.rids[3]) and backend.rids[4] == "mine", backend.rids
    raw = client.completions.with_raw_response.create(model="scripted", prompt=[1], max_tokens=2)
    fresh = raw.headers["x-request-id"]
    assert raw.parse().id == f"cmpl-{fresh}" and backend.rids[5].startswith(f"cmpl-{fresh}-")


def test_a_chat_completions_id_is_chatcmpl_and_the_clients_x_request_id():
    """Chat's response id and its choices' request ids carry the client's ``X-Request-Id`` too."""
    backend = ScriptedBackend()
    with BackgroundServer(build_app(backend, _llama_like_tokenizer(), ServerConfig()), "127.0.0.1", 0) as server:
        chat = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0).chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "Hi"}], max_tokens=1, n=2,
            extra_headers={"X-Request-Id": "trace-43"})
    assert chat.id == "chatcmpl-trace-43" and len(chat.choices) == 2
    assert [re.fullmatch(r"chatcmpl-trace-43-[0-9a-f]{8}-([01])", rid).group(1) for rid in backend.rids] == ["0", "1"]


def test_two_requests_in_flight_under_one_x_request_id_are_both_served(served, backend):
    """A client sends the same ``X-Request-Id`` again while the first request runs (a retry, a
    fan-out): both are served under the response id it names, each running as its own request
    (the router refuses a request id already routed)."""
    backend.delay_s = 0.05

    async def go():
        async with httpx.AsyncClient(base_url=served[1].url, timeout=30) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={"prompt": [1], "max_tokens": 4},
                                                    headers={"X-Request-Id": "twice"}) for _ in range(2)))

    answers = asyncio.run(go())
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    assert {r.json()["id"] for r in answers} == {"cmpl-twice"}
    assert len(set(backend.rids)) == 2 and all(rid.startswith("cmpl-twice-") for rid in backend.rids)


def test_a_bad_x_request_id_is_replaced_by_a_new_one(served, backend):
    """An ``X-Request-Id`` that cannot name a request (over 128 characters, whitespace, not ASCII)
    is ignored, not refused (vLLM refuses none): the request is served under a new id, echoed."""
    for bad in ["x" * 129, "two words", "caf\u00e9".encode(), ""]:
        r = httpx.post(served[1].url + "/v1/completions", json={"prompt": [1], "max_tokens": 1},
                       headers={"X-Request-Id": bad})
        fresh = r.headers["x-request-id"]
        assert r.status_code == 200 and fresh not in ("", bad) and re.fullmatch(r"[0-9a-f]{32}", fresh), (bad, r.text)
        assert r.json()["id"] == f"cmpl-{fresh}" and backend.rids[-1].startswith(f"cmpl-{fresh}-")
    ok = "x" * 128
    assert httpx.post(served[1].url + "/v1/completions", json={"prompt": [1], "max_tokens": 1},
                      headers={"X-Request-Id": ok}).json()["id"] == f"cmpl-{ok}"


def test_version_needs_no_api_key():
    """vLLM's ``GET /version``: the server's version, open as /health is (the API needs the key,
    /tokenize and /detokenize too)."""
    from importlib.metadata import version

    app = build_app(ScriptedBackend(), None, ServerConfig(api_key="k"))

    async def call(method, path, body=None):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            return await http.request(method, path, json=body)

    r = asyncio.run(call("GET", "/version"))
    assert r.status_code == 200 and r.json() == {"version": version("raydix")}
    assert asyncio.run(call("GET", "/v1/models")).status_code == 401
    assert asyncio.run(call("POST", "/tokenize", {"prompt": "x"})).status_code == 401
    assert asyncio.run(call("POST", "/detokenize", {"tokens": [1]})).status_code == 401


def test_health_checks_and_load_need_no_api_key_and_the_operator_routes_do():
    """SageMaker's /ping, SGLang's /health_generate and vLLM's /load are open as /health and /metrics
    are (a load balancer sends no key); aborts, pause and the server's configuration need the key."""
    app = build_app(ScriptedBackend(), None, ServerConfig(api_key="k"))

    async def call(method, path, body=None):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            return await http.request(method, path, json=body)

    for method, path in (("GET", "/ping"), ("POST", "/ping"), ("GET", "/health_generate"), ("GET", "/load")):
        assert asyncio.run(call(method, path)).status_code == 200, path
    for method, path, body in (("POST", "/abort_request", {"abort_all": True}), ("POST", "/pause_generation", {}),
                               ("POST", "/continue_generation", None), ("GET", "/get_model_info", None),
                               ("GET", "/get_server_info", None), ("POST", "/reset_prefix_cache", None)):
        assert asyncio.run(call(method, path, body)).status_code == 401, path


def test_weight_update_route_is_behind_its_flag():
    """/update_weights_from_disk exists only with ``allow_weight_updates`` (a field SGLang does not
    take is a 400 naming it); /get_weight_version always answers."""
    class Updating(ScriptedBackend):
        async def update_weights_from_disk(self, model_path, weight_version=None, abort_all_requests=False,
                                           flush_cache=True, torch_empty_cache=False):
            self.weight_version = weight_version
            return {"success": True, "message": model_path, "num_paused_requests": 0}

    for allow in (False, True):
        app = build_app(Updating(), None, ServerConfig(allow_weight_updates=allow))

        async def call(method, path, body=None):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
                return await http.request(method, path, json=body)

        r = asyncio.run(call("POST", "/update_weights_from_disk", {"model_path": "/ckpt", "weight_version": "v1"}))
        assert r.status_code == (200 if allow else 404), r.text
        version = asyncio.run(call("GET", "/get_weight_version")).json()
        assert version == {"weight_version": "v1" if allow else "default"}
    r = asyncio.run(call("POST", "/update_weights_from_disk", {"model_path": "/ckpt", "is_async": True}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "is_async"


def test_query_validation_errors_are_openai_400s(served):
    r = httpx.get(served[1].url + "/workers", params={"include_dead": "maybe"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "include_dead" and "include_dead" in error["message"]


def test_routes_without_a_cluster(served, client):
    url = served[1].url
    assert httpx.post(url + "/workers", json={"role": "decode"}).status_code == 501
    missing = httpx.get(url + "/nope")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert "/nope" not in httpx.get(url + "/metrics").text  # unknown paths share the label "other"
    assert client.completions.create(model="scripted", prompt=[1], max_tokens=2).choices[0].text == "ab"


def test_adding_a_worker_while_asleep_or_on_weights_from_tensors_is_a_409_naming_why():
    """POST /workers on a PD cluster whose workers sleep, or serve weights updated from tensors, is
    refused before any worker starts: a 409 whose code says which (not a 500 internal error)."""
    from cluster.backend import PDBackend

    started = []
    client = SimpleNamespace(prefill=[], decode=[], start_heartbeats=lambda: None, stop_heartbeats=lambda: None)
    backend = PDBackend(client, SimpleNamespace(add_worker=started.append), model_name="pd", context_len=64)
    with BackgroundServer(build_app(backend, None, ServerConfig()), "127.0.0.1", 0) as server:
        backend.memory.mark_released(frozenset({"kv_cache"}), keep_weights=True)
        r = httpx.post(server.url + "/workers", json={"role": "decode"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "sleeping", r.text
        assert "wake them up" in r.json()["error"]["message"]
        backend.memory.released.clear()
        backend.weights_from_tensors = True
        r = httpx.post(server.url + "/workers", json={"role": "prefill"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "weights_from_tensors", r.text
        assert "update the weights from disk" in r.json()["error"]["message"]
    assert started == []


class _StartingCluster:
    """A cluster whose ``add_worker`` (run in a thread) waits for ``go`` before its worker joins the
    rotation, as a real start takes its time; ``remove_worker`` takes one out."""

    def __init__(self, client):
        self.client, self.removed = client, []
        self.starting, self.go = threading.Event(), threading.Event()

    def add_worker(self, role):
        self.starting.set()
        assert self.go.wait(10)
        worker = SimpleNamespace(worker_id=f"{role}-new", role=role, node_id="n", alive=True, handle=None)
        self.client.decode.append(worker)
        return worker

    def remove_worker(self, worker_id, timeout_s=120.0):
        self.removed.append(worker_id)
        self.client.decode[:] = [w for w in self.client.decode if w.worker_id != worker_id]


@pytest.mark.parametrize("code", ["sleeping", "weights_from_tensors"])
def test_a_worker_whose_start_a_release_or_an_update_from_tensors_overtook_is_stopped(code):
    """A release of the workers' memory, or an update of their weights from tensors, that runs while a
    worker starts misses it (not in the rotation yet): once up, it would hold its memory while the
    cluster sleeps, or serve the config's checkpoint beside the updated workers. It is stopped and the
    add refused (409, ``code``), as one asked for in that state is. While it starts it counts in
    ``starting`` (the autoscaler's count), and no more once up."""
    from cluster.backend import PDBackend, WorkerNotAddedError

    client = SimpleNamespace(prefill=[], decode=[], lora_cache_keys={})
    cluster = _StartingCluster(client)
    backend = PDBackend(client, cluster, model_name="pd", context_len=64)

    async def add_while_starting():
        adding = asyncio.ensure_future(backend.add_worker("decode"))
        assert await asyncio.to_thread(cluster.starting.wait, 10)
        assert backend.starting["decode"] == 1  # (the autoscaler counts it)
        if code == "sleeping":
            backend.memory.mark_released(frozenset({"kv_cache"}), keep_weights=True)
        else:
            backend.weights_from_tensors = True
        cluster.go.set()
        with pytest.raises(WorkerNotAddedError) as refused:
            await adding
        return refused.value

    assert asyncio.run(add_while_starting()).code == code
    assert cluster.removed == ["decode-new"] and client.decode == [] and backend.starting["decode"] == 0


def test_worker_metrics_carry_the_hierarchical_cache_and_drop_workers_that_left():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from cluster.metrics import ServerMetrics

    def samples(metrics):
        text = generate_latest(metrics.registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    metrics = ServerMetrics("m")
    hicache = {"host_usage": 0.25, "device_to_host_tokens": 960, "host_to_device_tokens": 96,
               "device_to_host_failed_tokens": 32, "host_to_storage_pages": 24, "storage_to_host_pages": 8}
    swa_hicache = {**hicache, "swa_host_usage": 0.5, "swa_device_to_host_tokens": 480, "swa_host_to_device_tokens": 16,
                   "swa_host_to_storage_pages": 12, "swa_storage_to_host_pages": 4}
    workers = [{"id": "p0", "role": "prefill", "alive": True, "load": {"kv_usage": 0.5, "hicache": hicache}},
               {"id": "p1", "role": "prefill", "alive": True, "load": {"kv_usage": 0.5, "hicache": swa_hicache}},
               {"id": "d0", "role": "decode", "alive": True, "load": {"kv_usage": 0.1, "retractions": 3,
                                                                       "preemptions": 2}}]
    metrics.set_workers(workers, running=1, queued=0)
    got = samples(metrics)
    p0 = (("role", "prefill"), ("worker", "p0"))
    assert got[("raydix_worker_host_kv_cache_usage_ratio", p0)] == 0.25
    assert got[("raydix_worker_hicache_tokens_total", (("direction", "host_to_device"),) + p0)] == 96
    assert got[("raydix_worker_hicache_tokens_total", (("direction", "device_to_host"),) + p0)] == 960
    assert got[("raydix_worker_hicache_storage_pages_total", (("direction", "storage_to_host"),) + p0)] == 8
    assert got[("raydix_worker_hicache_backup_failed_tokens_total", p0)] == 32
    assert got[("raydix_worker_retractions_total", (("role", "decode"), ("worker", "d0")))] == 3
    assert got[("raydix_worker_preemptions_total", (("role", "decode"), ("worker", "d0")))] == 2
    assert not any(n.startswith("raydix_worker_hicache") and dict(ls)["worker"] == "d0" for n, ls in got)
    p1 = (("role", "prefill"), ("worker", "p1"))  # a sliding-window model's SWA host pool, apart
    assert got[("raydix_worker_host_swa_kv_cache_usage_ratio", p1)] == 0.5
    assert got[("raydix_worker_hicache_swa_tokens_total", (("direction", "device_to_host"),) + p1)] == 480
    assert got[("raydix_worker_hicache_swa_tokens_total", (("direction", "host_to_device"),) + p1)] == 16
    assert got[("raydix_worker_hicache_swa_storage_pages_total", (("direction", "storage_to_host"),) + p1)] == 4
    assert not any("swa" in n and dict(ls)["worker"] == "p0" for n, ls in got)
    text = generate_latest(metrics.registry).decode()  # running totals are counters: rate() applies
    assert "# TYPE raydix_worker_retractions_total counter" in text and "# TYPE raydix_worker_hicache_tokens_total counter" in text
    metrics.observe_request({"prefill_worker": "p0", "decode_worker": "d0"}, 0.0, 0.1, 0.2,
                            {"prefill": "cache_aware", "decode": "cache_aware"})
    assert samples(metrics)[("raydix_routing_decisions_total",
                             (("policy", "cache_aware"), ("role", "prefill"), ("worker", "p0")))] == 1
    metrics.set_workers(workers[2:], running=0, queued=0)
    got = samples(metrics)
    assert not any(n.startswith("raydix_worker_hicache") or "host_swa" in n for n, _ in got)
    routed = {dict(ls)["worker"] for n, ls in got if n == "raydix_routing_decisions_total"}
    assert routed == {"d0"}  # the routing series of a worker that left go with it


def test_inter_token_latency_is_timed_per_choice():
    """n streamed choices decode side by side, a token each every 50 ms: each choice's gaps are
    ~50 ms, never the ~0 between one choice's chunk and the next choice's (vLLM times ITL per
    sequence), and a choice's first token is its TTFT, not an inter-token gap."""
    from cluster.metrics import ServerMetrics
    from cluster.completion_protocol import CompletionRequest
    from cluster.openai_serving import GenerationService

    backend = ScriptedBackend()
    backend.delay_s = 0.05
    metrics = ServerMetrics(backend.model_name)
    service = GenerationService(backend, None, metrics, Admission(4, 4, 30.0))

    async def go():
        body = CompletionRequest.model_validate({"model": "scripted", "prompt": [1, 2], "max_tokens": 6, "n": 2,
                                                 "stream": True})
        response = await service.completions(body, time.perf_counter(), "itl")
        try:
            return [chunk async for chunk in response.body_iterator]
        finally:
            await response._on_close()

    chunks = asyncio.run(go())
    assert chunks[-1] == "data: [DONE]\n\n"
    itl = {"model": "scripted"}
    assert metrics.registry.get_sample_value("raydix_inter_token_latency_seconds_count", itl) == 2 * 5
    fast = metrics.registry.get_sample_value("raydix_inter_token_latency_seconds_bucket", dict(itl, le="0.025"))
    assert fast == 0, "gaps between two choices' chunks timed as inter-token latency"


def test_a_worker_out_of_the_rotation_scrapes_as_down():
    """A worker that died (or missed its heartbeats) shows ``raydix_worker_up 0`` until it is
    removed, so an alert on ``== 0`` fires; its last load is not exported as if current."""
    from prometheus_client.parser import text_string_to_metric_families

    class OneDown(ScriptedBackend):
        def workers(self, include_dead=False):
            sizes = {"max_running_requests": 48, "max_total_num_tokens": 4096}  # (its engine's, once asked)
            up = {**sizes, "id": "d-0", "role": "decode", "node": "n", "alive": True, "inflight": 0,
                  "load": {"running": 1}}
            down = {**sizes, "id": "d-1", "role": "decode", "node": "n", "alive": False, "inflight": 0,
                    "load": {"running": 7, "kv_usage": 0.9}}
            return [up, down] if include_dead else [up]

    app = build_app(OneDown(), None, ServerConfig())

    async def scrape():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            return (await http.get("/metrics")).text

    samples = {(s.name, s.labels.get("worker"), s.labels.get("queue")): s.value
               for family in text_string_to_metric_families(asyncio.run(scrape())) for s in family.samples}
    assert samples[("raydix_worker_up", "d-0", None)] == 1
    assert samples[("raydix_worker_up", "d-1", None)] == 0
    assert samples[("raydix_worker_queue_requests", "d-0", "running")] == 1
    assert samples[("raydix_worker_max_running_requests", "d-0", None)] == 48
    assert samples[("raydix_worker_max_total_num_tokens", "d-0", None)] == 4096
    assert not any(worker == "d-1" for name, worker, _ in samples if name != "raydix_worker_up")


def test_a_sigterm_just_before_uvicorn_listens_for_it_still_stops_the_server(monkeypatch):
    """serve_forever's own handlers are in place from before uvicorn installs its handlers until
    after it restores them: a SIGTERM in that window (the event loop starting) stops the server,
    not a swallowed signal and a server that then serves on."""
    import signal

    import uvicorn

    from cluster.http_server import serve_forever

    seen = []

    def run(server, sockets=None):  # the signal lands before uvicorn's capture_signals
        signal.raise_signal(signal.SIGTERM)
        time.sleep(0.01)  # (the Python-level handler runs here)
        seen.append(server.should_exit)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    before = signal.getsignal(signal.SIGTERM)
    serve_forever(build_app(ScriptedBackend(), None, ServerConfig()), "127.0.0.1", 0)
    assert seen == [True], "the SIGTERM was swallowed: uvicorn would serve on"
    assert signal.getsignal(signal.SIGTERM) is before


def test_token_ids_outside_the_vocabulary_are_400s_naming_the_field(served, backend):
    """vLLM refuses them; sent on, one would fail the whole batch it ran in (on CUDA with a
    device-side assert). The workers refuse them too (tests/test_openai_compat.py)."""
    url = served[1].url
    for path, body, field in [("/v1/completions", {"prompt": [1, 1000], "max_tokens": 2}, "prompt"),
                              ("/v1/completions", {"prompt": [[1], [-1]], "max_tokens": 2}, "prompt"),
                              ("/generate", {"input_ids": [-1, 2], "sampling_params": {"max_new_tokens": 2}},
                               "input_ids")]:
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and "out of the vocabulary" in r.json()["error"]["message"]
    assert backend.calls == []  # refused before any worker saw them
    assert httpx.post(url + "/v1/completions", json={"prompt": [0, 999], "max_tokens": 1}).status_code == 200


def test_logit_bias_and_min_tokens_reach_the_workers_in_the_engines_names(served, backend, client):
    """vLLM's ``logit_bias`` (string ids) and ``min_tokens`` on /v1/completions and chat, SGLang's
    ``min_new_tokens`` and ``logit_bias`` in /generate's sampling_params: the workers get int ids
    and ``min_new_tokens``. An id outside the vocabulary, or more ``min_tokens`` than ``max_tokens``
    (or than the context leaves), is a 400 naming the field before any worker sees it."""
    from cluster.chat_protocol import ChatCompletionRequest

    chat = {"model": "scripted", "messages": [{"role": "user", "content": "x"}], "min_tokens": 2,
            "logit_bias": {"7": -3}}
    assert {k: v for k, v in ChatCompletionRequest.model_validate(chat).to_sampling_params(4).items()
            if k in ("min_new_tokens", "logit_bias")} == {"min_new_tokens": 2, "logit_bias": {"7": -3}}
    url = served[1].url
    for path, body, param, says in [
        ("/v1/completions", {"prompt": [1], "max_tokens": 4, "logit_bias": {"7": 1, "1000": 2}}, "logit_bias",
         "token id 1000 is out of the vocabulary"),
        ("/v1/completions", {"prompt": [1], "max_tokens": 4, "min_tokens": 5}, "min_tokens",
         "min_tokens: 5 is more than max_tokens (4)"),
        ("/v1/completions", {"prompt": [1], "max_tokens": None, "min_tokens": 64}, "min_tokens", "context leaves"),
        ("/generate", {"input_ids": [1], "sampling_params": {"logit_bias": {"1000": 2}}}, "sampling_params.logit_bias",
         "token id 1000 is out of the vocabulary"),
        ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}},
         "sampling_params.min_new_tokens", "more than max_new_tokens"),
    ]:
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert says in r.json()["error"]["message"], r.text
    assert backend.calls == []
    client.completions.create(model="scripted", prompt=[1], max_tokens=3, logit_bias={"7": 5, "999": -100},
                              extra_body={"min_tokens": 2})
    r = httpx.post(url + "/generate", json={"input_ids": [1], "sampling_params": {
        "max_new_tokens": 3, "min_new_tokens": 3, "logit_bias": {"7": 5}}})
    assert r.status_code == 200, r.text
    (_, openai_params), (_, native_params) = backend.calls
    assert openai_params["min_new_tokens"] == 2 and openai_params["logit_bias"] == {7: 5.0, 999: -100.0}
    assert native_params["min_new_tokens"] == 3 and native_params["logit_bias"] == {7: 5.0}


def test_echo_without_a_tokenizer_is_a_400_naming_it(served, backend):
    """A server without a tokenizer cannot write a token-id prompt's text: echo is refused up
    front (it was a 500 from decoding with no tokenizer)."""
    r = httpx.post(served[1].url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
    assert backend.calls == []


def test_a_seed_outside_int64_is_a_400_naming_it(served, backend):
    """vLLM bounds ``seed`` to an int64; a larger one reached the workers' torch generator, which
    refused it with "Overflow when unpacking long long" and no param. The largest int64 still
    seeds every choice (``seed + i``)."""
    from actors.engine.sampling import make_generator

    url = served[1].url + "/v1/completions"
    for seed in (2 ** 64, -2 ** 63 - 1):
        r = httpx.post(url, json={"prompt": [1], "max_tokens": 1, "seed": seed})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    assert backend.calls == []
    assert httpx.post(url, json={"prompt": [1], "max_tokens": 1, "seed": 2 ** 63 - 1, "n": 2}).status_code == 200
    for _, params in backend.calls:
        make_generator(params["seed"])


def test_generate_max_new_tokens_zero_generates_nothing(served, backend):
    """SGLang's /generate: 0 new tokens is a prefill only (not "up to the context", as a falsy 0 made it)."""
    r = httpx.post(served[1].url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 200, r.text
    assert backend.calls[-1][1]["max_new_tokens"] == 0 and r.json()["output_ids"] == []


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 60}),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 60}}),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 60, "stream": True}),
])
def test_a_client_gone_before_its_answer_aborts_its_request(served, backend, path, body):
    """A client that times out (and retries) must not leave its request generating to the end,
    holding its admission slot and its KV: as vLLM's ``with_cancellation``, the request is aborted
    on the workers as soon as the client disconnects, streamed or not, before its first token or
    after."""
    _, server, app = served
    backend.delay_s = 1.0  # a token a second: the first at 1 s, the last at 40 s or more
    try:
        # gone before the first token; a non-streamed request also once it generates (a streamed
        # one is watched by its response from then on; its next chunk comes too soon to time out)
        for timeout_s in (0.5,) if body.get("stream") else (0.5, 1.5):
            backend.closed.clear()
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + path, json=body, timeout=timeout_s)
            # (well before its last token at 40 s or more; a loaded CI machine took over 3 s once)
            assert wait_until(lambda: backend.closed, timeout_s=10.0), \
                f"the request is still generating after a {timeout_s} s client timeout"
            assert wait_until(lambda: app.state.admission.running == 0, timeout_s=10.0)
    finally:
        backend.delay_s = 0.0
        wait_until(lambda: app.state.admission.running == 0, timeout_s=15.0)


def _llama_like_tokenizer():
    """The built-in byte tokenizer, adding BOS as Llama's does, with a chat template that writes BOS."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    from actors.engine.tokenizer import BOS, BOS_ID, EOS, PAD, build_byte_tokenizer

    raw = build_byte_tokenizer()
    raw.post_processor = TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tok


def test_text_prompts_get_the_tokenizers_special_tokens_and_chat_prompts_the_templates():
    """vLLM's completions and SGLang's /generate encode a text prompt with the tokenizer's special
    tokens (a Llama prompt starts with BOS); a chat template writes its own, so chat adds none
    (vLLM's ``add_special_tokens`` overrides either)."""
    from actors.engine.tokenizer import BOS_ID

    tok = _llama_like_tokenizer()
    plain = tok.encode("Hi", add_special_tokens=False)
    backend = ScriptedBackend()
    with BackgroundServer(build_app(backend, tok, ServerConfig()), "127.0.0.1", 0) as server:
        for path, body, want in [
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}, [BOS_ID] + plain),
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "add_special_tokens": False}, plain),
            ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}, [BOS_ID] + plain),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
             [BOS_ID] + plain),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                      "add_special_tokens": True}, [BOS_ID, BOS_ID] + plain),
        ]:
            r = httpx.post(server.url + path, json=body)
            assert r.status_code == 200, r.text
            assert backend.calls[-1][0] == want, (path, body)


def test_a_client_gone_while_queued_is_not_served_when_a_slot_frees_at_that_moment():
    """The client disconnects while its request waits for an admission slot, in the same instant
    as the request ahead of it ends (under load clients time out in the queue while slots free
    all the time): it is not admitted and served for nobody (``asyncio.wait_for`` before Python
    3.12 would keep the slot it got and swallow the cancellation); the slot goes to the next."""
    from cluster.metrics import ServerMetrics
    from cluster.completion_protocol import GenerateRequest
    from cluster.openai_serving import GenerationService
    from cluster.server import cancel_on_disconnect

    backend = ScriptedBackend()
    backend.delay_s = 0.01
    admission = Admission(1, 10, 30.0)
    service = GenerationService(backend, None, ServerMetrics(backend.model_name), admission)

    class GoneClient:  # what cancel_on_disconnect reads of a Request
        def __init__(self):
            self.gone = asyncio.Event()

        async def receive(self):
            await self.gone.wait()
            return {"type": "http.disconnect"}

    async def go():
        await admission.acquire()  # the request ahead holds the only slot
        client = GoneClient()
        body = GenerateRequest.model_validate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 40}})
        answer = asyncio.ensure_future(cancel_on_disconnect(client, service.generate(body, time.perf_counter(), "gone")))
        await asyncio.sleep(0.1)  # queued: waiting on the semaphore
        assert admission.waiting == 1
        client.gone.set()  # the client gives up while queued ...
        admission.release()  # ... as the request ahead of it ends
        started = time.monotonic()
        response = await asyncio.wait_for(answer, 10)
        return response.status_code, len(backend.calls), round(time.monotonic() - started, 1)

    status, calls, waited = asyncio.run(go())
    assert (status, calls) == (499, 0), f"served for nobody: status {status}, {calls} backend call(s), {waited}s"


def test_an_endpoint_cancelled_twice_lets_its_handlers_cleanup_finish():
    """Server shutdown cancels an endpoint waiting in ``cancel_on_disconnect``, and anyio cancels
    it again at its next await: the handler it cancelled still runs its cleanup to the end (its
    abort, its admission slot back) instead of being cut off by the second cancel."""
    from cluster.server import cancel_on_disconnect

    steps = []

    class StayingClient:  # what cancel_on_disconnect reads of a Request: a client that stays
        async def receive(self):
            await asyncio.Event().wait()

    async def handler():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            steps.append("stopping")
            await asyncio.sleep(0.05)  # (an abort sent to a worker, say)
            steps.append("stopped")
            raise

    async def go():
        endpoint = asyncio.ensure_future(cancel_on_disconnect(StayingClient(), handler()))
        await asyncio.sleep(0.01)
        endpoint.cancel()  # shutdown ...
        await asyncio.sleep(0.01)
        endpoint.cancel()  # ... and the scope's cancel again, while the handler cleans up
        await asyncio.wait((endpoint,))
        await asyncio.sleep(0.1)
        assert endpoint.cancelled()

    asyncio.run(go())
    assert steps == ["stopping", "stopped"], steps


class _RayLike:
    """``handle.method.remote(*args)`` as a Ray actor call: it runs to its end on the actor
    whoever awaits it (cancelling the awaiting task does not cancel the call)."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        method = getattr(self._obj, name)
        return type("Method", (), {"remote": staticmethod(
            lambda *args: asyncio.shield(asyncio.ensure_future(method(*args))))})()


def test_a_client_gone_while_its_request_is_routed_leaves_no_route_behind():
    """The PD backend with a router actor: the client disconnects while the router places its
    request. The router completes the route all the same (cancelling the await does not cancel
    an actor call), and the client releases it once made: no request id left routed (a retry
    under it would be refused) and no worker load counted for nobody."""
    from cluster.backend import PDBackend
    from cluster.pd_client import PDClient, WorkerRef

    class Router:
        def __init__(self):
            self.routed, self.made = {}, []

        async def route(self, rid, input_ids):
            await asyncio.sleep(0.5)  # the actor's queue, the network
            if rid in self.routed:
                raise ValueError(f"request {rid!r} is already routed")
            self.routed[rid] = ("p", "d")
            self.made.append(rid)
            return SimpleNamespace(prefill_id="p", decode_id="d")

        async def release(self, rid, role=None, attempt=None):
            if role is None:
                self.routed.pop(rid, None)

    class Worker:
        async def load(self):
            return {}

        async def reserve(self, *args):
            raise PDRequestError("stub decode worker: no reservations")

        async def abort(self, *args):
            return True

    router = Router()
    client = PDClient([WorkerRef("p", "prefill", _RayLike(Worker()), "n")],
                      [WorkerRef("d", "decode", _RayLike(Worker()), "n")], router=_RayLike(router))
    backend = PDBackend(client, model_name="pd", context_len=64)
    with BackgroundServer(build_app(backend, None, ServerConfig()), "127.0.0.1", 0) as server:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while its request is routed
            httpx.post(server.url + "/generate", json={"input_ids": [1, 2], "rid": "retry-me",
                                                       "sampling_params": {"max_new_tokens": 4}}, timeout=0.2)
        # the route call ends on the router, then the client releases it (10 s: a loaded host)
        assert wait_until(lambda: router.made and not router.routed), f"still routed after its client left: {router.routed}"


class _LocalWorker:
    """An in-process worker behind a Ray-like handle: ``.remote`` calls, and
    ``.options(num_returns="streaming").remote`` for an async generator (refs to await)."""

    def __init__(self, worker):
        self._worker = worker

    def __getattr__(self, name):
        method = getattr(self._worker, name)

        def call(*args):
            out = method(*args)
            if asyncio.iscoroutine(out):
                return asyncio.ensure_future(out)
            done = asyncio.get_running_loop().create_future()
            done.set_result(out)
            return done

        def streaming(*args):
            async def refs():
                async for item in method(*args):
                    ref = asyncio.get_running_loop().create_future()
                    ref.set_result(item)
                    yield ref
            return refs()

        handle = type("Method", (), {})()
        handle.remote = call
        handle.options = lambda **kwargs: type("Streaming", (), {"remote": staticmethod(streaming)})()
        return handle


def test_generate_max_new_tokens_zero_scores_the_prompt_on_the_pd_backend(tmp_path):
    """Over the PD serving path (in-process workers behind Ray-like handles): 0 new tokens is a
    prefill only (SGLang's), its prompt logprobs from the prefill worker, nothing generated; a
    rerank's pairs too, each scored by the reranker's two tokens as HF's logits give it."""
    from transformers import AutoTokenizer

    from actors.engine.tiny import build_tiny_checkpoint
    from actors.workers import DecodeWorker, PrefillWorker
    from cluster.backend import PDBackend
    from cluster.pd_client import PDClient, WorkerRef

    path = str(build_tiny_checkpoint("llama", tmp_path / "llama"))
    base = dict(max_total_tokens=512, page_size=1, skip_tokenizer_init=True)
    prefill, decode = PrefillWorker(path, dict(base)), DecodeWorker(path, dict(base))
    client = PDClient([WorkerRef("p", "prefill", _LocalWorker(prefill), "n")],
                      [WorkerRef("d", "decode", _LocalWorker(decode), "n")], backend="shm")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        app = build_app(PDBackend(client, model_name="pd", context_len=256), tokenizer,
                        ServerConfig(classifier_from_token=["n", "y"]))
        with BackgroundServer(app, "127.0.0.1", 0) as server:
            ok = httpx.post(server.url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
                "max_new_tokens": 2, "temperature": 0}}, timeout=60)
            assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2, ok.text  # the PD path serves
            r = httpx.post(server.url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
                "max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 1}, timeout=60)
            assert r.status_code == 200 and r.json()["output_ids"] == [], r.text
            meta = r.json()["meta_info"]
            assert meta["finish_reason"]["type"] == "length" and [t for _, t in meta["input_token_logprobs"]] == [6, 7]
            pushed = prefill.scheduler.bytes_pushed
            r = httpx.post(server.url + "/v1/rerank", json={"query": "q", "documents": ["ab", "cde"]}, timeout=60)
            assert r.status_code == 200 and prefill.scheduler.bytes_pushed == pushed, r.text
            tokens = tokenizer.convert_tokens_to_ids(["n", "y"])
            want = {i: hf_classifier_score(path, tokenizer(text="q", text_pair=d)["input_ids"], tokens)
                    for i, d in enumerate(["ab", "cde"])}
            assert {x["index"]: x["relevance_score"] for x in r.json()["results"]} == pytest.approx(want, abs=1e-5)
        prefill.check_integrity()
        decode.check_integrity()
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_priority_reaches_the_workers_only_with_priority_scheduling(served, backend, client):
    """vLLM's ``priority`` (an extra body field of completions, and of chat: the same model) and
    SGLang's (/generate): a
    400 naming it, before any worker sees the request, unless the workers schedule by priority
    (priority 0 always goes); with it, each choice's request carries it."""
    url = served[1].url
    bodies = [("/v1/completions", {"prompt": [1], "max_tokens": 2}),
              ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})]
    for path, body in bodies:
        r = httpx.post(url + path, json={**body, "priority": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
        assert "priority scheduling is not enabled" in r.json()["error"]["message"]
    assert backend.calls == []
    assert httpx.post(url + "/generate", json={**bodies[1][1], "priority": 0}).status_code == 200
    backend.priority_scheduling = True
    for path, body in bodies:
        assert httpx.post(url + path, json={**body, "priority": -4}).status_code == 200
    client.completions.create(model="scripted", prompt=[1], max_tokens=2, n=2, extra_body={"priority": 7})
    assert backend.priorities == [0, -4, -4, 7, 7]


@pytest.mark.parametrize("path,label", [
    ("/v1/responses/resp_1", "/v1/responses/{id}"),
    ("/v1/responses/resp_1/input_items", "/v1/responses/{id}/input_items"),
    ("/v1/models/org/model-7b", "/v1/models/{id}"),
    ("/workers/p0", "/workers/{id}"),
    ("/v1/chat/completions", "/v1/chat/completions"),
    ("/v1/responses", "/v1/responses"),
    ("/nowhere", "other"),
])
def test_the_request_counter_labels_each_route_with_ids_as_placeholders(path, label):
    from cluster.http_guard import endpoint_label

    assert endpoint_label(path) == label


def test_every_api_route_has_a_request_counter_label_of_its_own():
    """A route added to the app and not to the guard's labels would count as "other"."""
    from fastapi.routing import APIRoute

    from cluster.http_guard import endpoint_label

    paths = [r.path for r in build_app(ScriptedBackend(), None, ServerConfig()).routes if isinstance(r, APIRoute)]
    labels = {path: endpoint_label(re.sub(r"\{[^}]*\}", "x", path)) for path in paths}
    assert "/v1/embeddings" in labels
    assert labels == {path: re.sub(r"\{[^}]*\}", "{id}", path) for path in paths}  # (not "other")
