"""The HTTP server over a PD cluster on Ray (one Ray session and one server for the
module), driven by the official openai client: completions and chat, streaming
and not, greedy tokens equal to the in-process engine's, cached_tokens on a
repeated prefix, n / stop / logprobs, SGLang's /generate; every error status
followed by a successful request; /metrics parses and moves; 64 concurrent
streams against a decode pool too small for them all finish (retraction) and
leave nothing behind."""

import asyncio
import json
import threading

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.http_server import BackgroundServer
from cluster.server import build_app
from tests.server_helpers import client, http  # noqa: F401 (fixtures)
from tests.server_helpers import API_KEY, raydix_home, server_config, served_cluster, wait_idle, wait_until

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"
# a decode pool too small for 64 requests at once: admission waits, running requests retract
SMALL_DECODE = {"max_total_tokens": 512, "max_running_requests": 64, "init_new_token_ratio": 0.02,
                "min_new_token_ratio": 0.02}
SERVER = {"max_concurrent_requests": 64, "max_queue_size": 64, "allow_weight_updates": True, "enable_sleep_mode": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    config = server_config(decode_engine=SMALL_DECODE, server=SERVER, num_reserved_decode_tokens=4)
    with raydix_home(tmp_path_factory.mktemp("raydix-home")), served_cluster(config) as (cluster, server, app):
        yield cluster, server, app


def ok(client, **kw):
    """A request that must succeed (after each error case)."""
    out = client.completions.create(model=MODEL, prompt="ok", max_tokens=2, temperature=0, **kw)
    assert out.choices[0].finish_reason in ("length", "stop")
    return out


def test_models_and_health(served, client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    # the decode pool (512 slots) holds less than the 512-token context for one request: that is the limit
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == served[0].context_len() < 512
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["ready"]
    # /get_server_info: each worker's sizes as its runner chose them (asked over Ray), the top level the
    # decode worker's; the prefill worker's rows are its default (the configuration's null)
    info = http.get("/get_server_info").json()
    assert (info["max_total_num_tokens"], info["max_running_requests"], info["page_size"]) == (512, 64, 4)
    sizes = {w["role"]: (w["max_total_num_tokens"], w["max_running_requests"]) for w in info["internal_states"]}
    assert sizes == {"prefill": (2048, 256), "decode": (512, 64)}
    assert info["prefill"]["engine"]["max_running_requests"] is None


def test_greedy_tokens_equal_the_engines(served, client, http):
    """Greedy tokens (native, completions, streamed) equal the in-process engine's; vLLM's prompt_logprobs,
    computed on the prefill side, carry its logprobs and ranks."""
    from actors.engine import Engine

    cluster = served[0]
    prompt_ids = [[10 + (i * 7) % 200 for i in range(30)], [50 + (i * 3) % 100 for i in range(17)]]
    scored = {"max_new_tokens": 1, "temperature": 0, "return_logprob": True, "logprob_start_len": 0}
    engine = Engine(model_path=cluster.model_path, page_size=4, max_total_tokens=2048, attention_backend="torch")
    try:
        want = [engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 12, "temperature": 0})
                for ids in prompt_ids]
        want_scored = engine.generate(input_ids=prompt_ids[0], sampling_params=scored)["meta_info"]
    finally:
        engine.shutdown()
    out = client.completions.create(model=MODEL, prompt=prompt_ids[0], max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 0})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt_ids[0])
    for entry, (logprob, token), rank in zip(entries[1:], want_scored["input_token_logprobs"][1:],
                                             want_scored["input_token_ranks"][1:]):
        assert list(entry) == [str(token)] and entry[str(token)]["rank"] == rank
        assert entry[str(token)]["logprob"] == pytest.approx(logprob, abs=1e-4)
    for ids, ref in zip(prompt_ids, want):
        native = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 12,
                                                                                    "temperature": 0}}).json()
        assert native["output_ids"] == ref["output_ids"]
        completion = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
        assert completion.choices[0].text == ref["text"]
        streamed = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == ref["text"]


def test_chat_streaming_matches_non_streaming_and_reports_cached_tokens(client):
    system = "You are a terse assistant who answers questions about radix trees and KV caches. " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is a page?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 10 and whole.choices[0].finish_reason == "length"

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    # the same system prompt, another question: the shared prefix comes from a cache
    messages[1]["content"] = "And a radix tree?"
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= len(system) - 8
    assert usage.prompt_tokens_details.cached_tokens >= len(system)


def test_n_stop_seed_and_logprobs(client):
    base = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0).choices[0].text
    two = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1] and {c.text for c in two.choices} == {base}
    assert two.usage.completion_tokens == 16
    stop = next(ch for ch in base[3:] if ch.isprintable() and ch != "\ufffd")
    cut = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == base[:base.index(stop)]

    seeded = [client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=1.0, seed=7)
              .choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]

    lp = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0, logprobs=2)
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert all(len(top) <= 2 for top in logprobs.top_logprobs) and all(x <= 0 for x in logprobs.token_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                              max_tokens=4, temperature=0, stream=True)
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1]


def test_generate_native_text_and_stream(http):
    out = http.post("/generate", json={"text": "The radix tree", "sampling_params": {"max_new_tokens": 6,
                                                                                   "temperature": 0}}).json()
    assert len(out["output_ids"]) == 6 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert {"prompt_tokens", "completion_tokens", "cached_tokens"} <= set(out["meta_info"])
    with http.stream("POST", "/generate", json={"text": "The radix tree", "stream": True,
                                                "sampling_params": {"max_new_tokens": 6, "temperature": 0}}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert last["output_ids"] == out["output_ids"] and last["meta_info"]["cached_tokens"] > 0


def _error(call):
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value


def test_every_error_status_then_success(served, client, http):
    cluster, server, app = served
    # malformed JSON / bad field / unknown field: 400 naming the field
    r = http.post("/v1/completions", content=b'{"model": "tiny-llama", "prompt": ',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    ok(client)
    err = _error(lambda: client.completions.create(model=MODEL, prompt="x", temperature=5))
    assert err.status_code == 400 and err.body["param"] == "temperature" and "temperature" in err.body["message"]
    ok(client)
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                "max_tokenz": 3})
    assert r.status_code == 400 and "max_tokenz" in r.json()["error"]["message"]
    r = http.post("/generate", json={"text": "x", "sampling_params": {"top_k": -2}})
    assert r.status_code == 400 and "sampling_params.top_k" in r.json()["error"]["message"]
    ok(client)
    # a grammar the workers cannot compile: their ValueError (through Ray) names the request's field
    err = _error(lambda: client.completions.create(model=MODEL, prompt="x", extra_body={"guided_regex": "(a"}))
    assert err.status_code == 400 and err.body["param"] == "guided_regex", err.body
    assert err.body["message"].startswith("guided_regex: the regex does not compile"), err.body
    choice = client.completions.create(model=MODEL, prompt="x", max_tokens=8,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].finish_reason == "stop" and choice.choices[0].text in ("yes", "no")  # both sides masked
    # prompt longer than the context (512)
    err = _error(lambda: client.completions.create(model=MODEL, prompt="y" * 600, max_tokens=2))
    assert err.status_code == 400 and err.body["code"] == "context_length_exceeded"
    ok(client)
    # unknown model
    err = _error(lambda: client.completions.create(model="gpt-5", prompt="x", max_tokens=2))
    assert isinstance(err, openai.NotFoundError) and err.body["code"] == "model_not_found"
    ok(client)
    # API key
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    assert isinstance(_error(lambda: bad.models.list()), openai.AuthenticationError)
    assert httpx.get(server.url + "/v1/models").status_code == 401
    ok(client)
    # body size limit
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "z" * (5 * 1024 * 1024)})
    assert r.status_code == 413
    ok(client)
    # drain: 503, then back
    backend = app.state.backend
    backend.client.draining = True
    try:
        err = _error(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2))
        assert err.status_code == 503
        assert http.get("/health").status_code == 503
    finally:
        backend.client.draining = False
    ok(client)
    assert http.post("/flush_cache").json() == {"flushed": True}
    ok(client)


def test_queue_full_429_and_queue_timeout_408(served):
    cluster, _, _ = served
    config = server_config(server={"max_concurrent_requests": 1, "max_queue_size": 1, "queue_timeout_s": 2.5})
    app = build_app(cluster, served[2].state.backend.client.tokenizer, config)
    decode = cluster.decode[0]
    with BackgroundServer(app, "127.0.0.1", 0) as small:
        client = openai.OpenAI(base_url=small.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        ray.get(decode.handle.pause_generation.remote())
        held = {}
        holder = threading.Thread(target=lambda: held.setdefault("out", ok(client)))
        try:
            holder.start()
            assert wait_until(lambda: app.state.admission.running == 1)
            queued = {}
            waiter = threading.Thread(target=lambda: queued.setdefault(
                "err", _error(lambda: client.completions.create(model=MODEL, prompt="q", max_tokens=2))))
            waiter.start()
            assert wait_until(lambda: app.state.admission.waiting == 1)
            full = _error(lambda: client.completions.create(model=MODEL, prompt="f", max_tokens=2))
            assert isinstance(full, openai.RateLimitError) and full.body["code"] == "queue_full"
            waiter.join(10)
            assert queued["err"].status_code == 408
        finally:
            ray.get(decode.handle.continue_generation.remote())
        holder.join(30)
        assert "out" in held
        ok(client)


def _samples(http):
    text = http.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _total(samples, name, **labels):
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def test_metrics_parse_and_move(client, http):
    before = _samples(http)
    ok(client)
    for _ in range(2):  # the second one finds the prompt in the prefill worker's cache
        client.completions.create(model=MODEL, prompt="metrics " * 8, max_tokens=2, temperature=0)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "m"}], max_tokens=3,
                                   temperature=0, stream=True).response.read()
    after = _samples(http)
    assert _total(after, "raydix_requests_total", endpoint="/v1/completions", status="200") == \
        _total(before, "raydix_requests_total", endpoint="/v1/completions", status="200") + 3
    for name in ("raydix_generation_tokens_total", "raydix_prompt_tokens_total",
                 "raydix_time_to_first_token_seconds_count", "raydix_e2e_request_latency_seconds_count",
                 "raydix_prefill_leg_seconds_count", "raydix_kv_transfer_seconds_count",
                 "raydix_kv_transfer_bytes_total", "raydix_routing_decisions_total"):
        assert _total(after, name) > _total(before, name), name
    assert _total(after, "raydix_time_per_output_token_seconds_count") > 0
    assert _total(after, "raydix_cached_tokens_total") > 0
    assert _total(after, "raydix_prefill_cached_tokens_total") > _total(before, "raydix_prefill_cached_tokens_total")
    roles = {dict(ls)["role"] for (n, ls), _ in after.items() if n == "raydix_worker_kv_cache_usage_ratio"}
    assert roles == {"prefill", "decode"}
    queues = {dict(ls)["queue"] for (n, ls), _ in after.items() if n == "raydix_worker_queue_requests"}
    assert {"waiting", "prealloc", "transfer", "running"} <= queues


def test_64_concurrent_streams_on_a_small_decode_pool_all_finish(served, http):
    cluster, server, _ = served
    decode = cluster.decode[0]
    before = ray.get(decode.handle.load.remote())["retractions"]

    async def one(client, i):
        stream = await client.completions.create(model=MODEL, prompt=f"request {i}: " + "x" * (i % 9), max_tokens=16,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return reason

    async def go():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    assert asyncio.run(go()) == ["length"] * 64
    assert ray.get(decode.handle.load.remote())["retractions"] > before
    wait_idle(cluster)
    assert http.get("/v1/models").status_code == 200


def test_a_client_gone_mid_stream_frees_its_slot_and_its_request(served, http):
    cluster, server, app = served
    body = {"model": MODEL, "prompt": "going away", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert next(r.iter_lines()).startswith("data: ")
    assert wait_until(lambda: app.state.admission.running == 0, 10)
    wait_idle(cluster)
    assert http.get("/health").status_code == 200


def test_abort_request_and_pause_generation_on_the_pd_workers(served, http):
    """/abort_request ends a PD request as its client's leaving does (prefill, transfer and decode
    side freed, the route released); /pause_generation "retract" sends the decode worker's running
    request back to waiting, its KV freed, and after /continue_generation it ends with the tokens
    of an unpaused run."""
    cluster, _, _ = served
    prompt = [10 + (i * 7) % 200 for i in range(12)]

    def body(rid, max_new_tokens):
        return {"input_ids": prompt, "stream": True, "rid": rid,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}

    def results(lines):
        return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]

    with http.stream("POST", "/generate", json=body("pd-abort", 400)) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        assert http.post("/abort_request", json={"rid": "pd-abort"}).status_code == 200
        last = results(lines)[-1]["meta_info"]
    assert last["finish_reason"]["type"] == "abort" and last["completion_tokens"] < 400
    wait_idle(cluster)
    want = results(http.post("/generate", json=body("pd-unpaused", 120)).text.splitlines())[-1]["output_ids"]
    (decode,) = cluster.decode
    with http.stream("POST", "/generate", json=body("pd-pause", 120)) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        assert http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
        load = ray.get(decode.handle.load.remote())
        assert (load["running"], load["waiting"]) == (0, 1) and load["free_slots"] == load["total_slots"]
        assert http.post("/continue_generation").status_code == 200
        last = results(lines)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length" and last["output_ids"] == want
    wait_idle(cluster)


def test_update_weights_from_disk_on_every_worker(served, http, tmp_path):
    """SGLang's /update_weights_from_disk (last in this module: it changes the weights): a checkpoint
    that does not fit is a 400 naming why, and the old weights serve; the new checkpoint reaches
    the prefill and the decode worker, /generate's tokens are then HF's on it, a prompt cached
    before is not a hit any more, and the router re-indexed the workers' (flushed) caches."""
    from actors.engine.tiny import build_tiny_checkpoint
    from cluster.cli import builtin_model
    from tests.parity import assert_greedy_parity

    cluster, _, app = served
    old, new = cluster.model_path, builtin_model("llama", seed=1)
    wider = str(build_tiny_checkpoint("llama", tmp_path / "wider", seed=1, hidden_size=32))
    prompt = [10 + (i * 11) % 200 for i in range(24)]

    def generate():
        params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
        r = http.post("/generate", json={"input_ids": prompt, "sampling_params": params})
        assert r.status_code == 200, r.text
        return r.json()

    assert http.get("/get_weight_version").json() == {"weight_version": "default"}
    generate()
    r = http.post("/update_weights_from_disk", json={"model_path": wider, "weight_version": "v1"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert "hidden_size=32 (served 64)" in r.json()["error"]["message"] == r.json()["message"]
    out = generate()
    assert out["meta_info"]["weight_version"] == "default" and out["meta_info"]["cached_tokens"] > 0
    assert_greedy_parity(old, [prompt], [out["output_ids"]], 8, ())
    resyncs = ray.get(app.state.backend.client.router.stats.remote())["resyncs"]
    r = http.post("/update_weights_from_disk", json={"model_path": new, "weight_version": "v1",
                                                     "abort_all_requests": False, "flush_cache": True})
    assert r.status_code == 200 and r.json() == {"success": True, "message": "Succeeded to update model weights.",
                                                 "num_paused_requests": 0}
    assert http.get("/get_weight_version").json() == {"weight_version": "v1"}
    workers = cluster.prefill + cluster.decode
    assert ray.get([w.handle.get_weight_version.remote() for w in workers]) == ["v1"] * len(workers)
    assert ray.get(app.state.backend.client.router.stats.remote())["resyncs"] >= resyncs + len(workers)
    out = generate()
    assert out["meta_info"]["weight_version"] == "v1" and out["meta_info"]["cached_tokens"] == 0
    assert_greedy_parity(new, [prompt], [out["output_ids"]], 8, ())
    wait_idle(cluster)


def test_update_weights_from_tensor_on_every_worker(served, http):
    """SGLang's /update_weights_from_tensor (after the update from disk: it changes the weights), its
    tensors the base64 of a safetensors blob put in Ray's object store for both workers: a body that
    is not one, or tensors that do not fit, are a 400 naming serialized_named_tensors (nothing
    changed); then /generate's tokens are HF's on the checkpoint the tensors are of."""
    import base64

    import torch
    from safetensors.torch import load_file, save

    from cluster.cli import builtin_model
    from tests.parity import assert_greedy_parity

    cluster, _, _ = served
    pushed = builtin_model("llama", seed=2)
    tensors = load_file(f"{pushed}/model.safetensors")
    blob = base64.b64encode(save(tensors)).decode()
    bad_shape = base64.b64encode(save({"model.norm.weight": torch.ones(3)})).decode()
    prompt = [10 + (i * 7) % 200 for i in range(20)]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    for body, why in (({"serialized_named_tensors": "not base64!"}, "not the base64 of a safetensors blob"),
                      ({"serialized_named_tensors": [bad_shape]}, "tensor shapes differ: model.norm.weight [3]"),
                      ({"serialized_named_tensors": [blob, bad_shape]}, "one safetensors blob is read")):
        r = http.post("/update_weights_from_tensor", json={**body, "weight_version": "bad"})
        assert r.status_code == 400 and why in r.json()["message"], r.text
        assert r.json()["error"]["param"] == "serialized_named_tensors"
    assert http.get("/get_weight_version").json()["weight_version"] != "bad"
    r = http.post("/update_weights_from_tensor",
                  json={"serialized_named_tensors": [blob, blob], "weight_version": "t1"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    workers = cluster.prefill + cluster.decode
    assert ray.get([w.handle.get_weight_version.remote() for w in workers]) == ["t1"] * len(workers)
    out = http.post("/generate", json={"input_ids": prompt, "sampling_params": params}).json()
    assert out["meta_info"]["weight_version"] == "t1"
    assert_greedy_parity(pushed, [prompt], [out["output_ids"]], 8, ())
    wait_idle(cluster)


def test_sleep_level_2_then_a_weight_update_on_every_worker(served, http):
    """The RL flow over the Ray cluster (last: it changes the weights): /sleep?level=2 releases every
    worker (the router re-indexes their dropped caches), requests are a 503; /wake_up of the weights
    alone still refuses them (discarded); an update from disk writes them, /wake_up of the KV cache,
    and /generate's tokens are HF's on that checkpoint, pushed into the decode worker's new pools."""
    from cluster.cli import builtin_model
    from tests.parity import assert_greedy_parity

    cluster, _, app = served
    checkpoint, workers = builtin_model("llama", seed=0), cluster.prefill + cluster.decode
    body = {"input_ids": [10 + (i * 5) % 200 for i in range(20)],
            "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    wait_idle(cluster)
    resyncs = ray.get(app.state.backend.client.router.stats.remote())["resyncs"]
    assert http.post("/sleep", params={"level": 2}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True} and http.get("/get_server_info").json()["is_sleeping"]
    assert ray.get([w.handle.is_sleeping.remote() for w in workers]) == [True] * len(workers)
    assert ray.get(app.state.backend.client.router.stats.remote())["resyncs"] >= resyncs + len(workers)
    assert http.post("/generate", json=body).json()["error"]["code"] == "sleeping"
    assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
    r = http.post("/update_weights_from_disk", json={"model_path": checkpoint, "weight_version": "rl-1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert http.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    out = http.post("/generate", json=body).json()
    assert out["meta_info"]["weight_version"] == "rl-1"
    assert_greedy_parity(checkpoint, [body["input_ids"]], [out["output_ids"]], 8, ())
    wait_idle(cluster)
