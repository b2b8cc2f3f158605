"""The operator endpoints (cluster.admin_routes) over an in-process engine (the tiny llama, no
Ray): /abort_request by a /generate rid or an X-Request-Id, streamed and not, and abort_all, of
requests running, held by a pause or queued for an admission slot; /pause_generation in each mode,
then /continue_generation (the requests queued meanwhile run, tokens as unpaused), all workers or
none (PDBackend); a paused engine's weight update; /health_generate's 200 and 503 (paused: at once);
the info routes (/get_server_info: the sizes the workers' engines chose, PDBackend asking each worker
once). The engine leaks nothing afterwards."""

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from actors.engine.spec_decode import SpecStats
from cluster.admin_routes import cluster_limits
from cluster.backend import PDBackend
from cluster.config import ServerConfig
from tests.server_helpers import wait_until
from tests.test_openai_compat import MODEL, EngineBackend, engine, serving  # noqa: F401 (engine: the module's fixture)

PROMPT = [1, 15, 27, 200, 8]
LONG = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}  # (~1 s on a CPU: stopped long before)


@pytest.fixture(scope="module")
def served(engine):
    with serving(engine, ServerConfig(health_generate_timeout_s=1.0)) as server:
        yield server


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(4) as executor:
        yield executor


@pytest.fixture
def idle_after(engine):
    """Whatever a test left paused steps again; then the engine is idle and leaks nothing."""
    yield
    engine.continue_generation()
    assert wait_until(lambda: not engine.loop.held_rids() and not engine.scheduler.has_work())
    engine.check_integrity()


def post(served, path, body=None, headers=None):
    return httpx.post(served.url + path, json=body, headers=headers, timeout=60)


def generate_body(rid=None, stream=False, params=LONG):
    return {"input_ids": PROMPT, "sampling_params": params, "stream": stream, **({"rid": rid} if rid else {})}


def idle_while(engine, monkeypatch, predicate):
    """The engine takes no step while ``predicate()`` holds (5 ms idle instead, its requests left as
    they are): requests a test aborts once they have output cannot end on their own first, however
    slow the host is between their first output and the abort."""
    step = engine.scheduler.step

    def held():
        if predicate():
            time.sleep(0.005)
            return []
        return step()
    monkeypatch.setattr(engine.scheduler, "step", held)


def decoding(engine, *prefixes) -> bool:
    """Each of ``prefixes`` starts the id of a request of the engine that has output and is not finished."""
    reqs = engine.loop.held_reqs()
    return all(any(r.rid.startswith(prefix) and r.output_ids and not r.finished for r in reqs) for prefix in prefixes)


def holds(engine, prefix) -> bool:
    """The engine holds a request whose id starts with ``prefix``."""
    return any(r.rid.startswith(prefix) for r in engine.loop.held_reqs())


def events_of(lines) -> list:
    """The JSON events of SSE ``lines`` up to ``data: [DONE]`` (which must come)."""
    events = []
    for line in lines:
        if line == "data: [DONE]":
            return events
        if line.startswith("data: "):
            events.append(json.loads(line[len("data: "):]))
    raise AssertionError(f"the stream ended without [DONE] after {events}")


def first_event(lines) -> dict:
    return next(json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {"))


def streamed(server, path, body, headers=None) -> list:
    """The JSON events of ``body`` sent streamed (up to its ``data: [DONE]``)."""
    with httpx.stream("POST", server.url + path, json=dict(body, stream=True), headers=headers, timeout=60) as r:
        return events_of(r.iter_lines())


def load(server) -> int:
    """vLLM's /load: the requests the server holds (running, queued for a slot, or held by a pause)."""
    return httpx.get(server.url + "/load").json()["server_load"]


def test_abort_request_ends_a_generate_stream_with_a_last_chunk(engine, served, idle_after, monkeypatch):
    idle_while(engine, monkeypatch, lambda: decoding(engine, "gen-stream"))
    with httpx.stream("POST", served.url + "/generate", json=generate_body("gen-stream", stream=True)) as r:
        lines = r.iter_lines()
        first = first_event(lines)
        engine.pause_generation("in_place")  # (held where it is: the abort ends it, not its length)
        assert post(served, "/abort_request", {"rid": "gen-stream"}).status_code == 200
        rest = events_of(lines)
    last = rest[-1]["meta_info"]
    assert first["meta_info"]["finish_reason"] is None and last["finish_reason"]["type"] == "abort"
    assert [e["meta_info"]["finish_reason"] for e in rest[:-1]] == [None] * (len(rest) - 1)
    assert 1 <= last["completion_tokens"] < LONG["max_new_tokens"] and last["id"] == "gen-stream"
    assert all(r.finished for r in engine.loop.held_reqs())  # aborted on the engine (released at its next step)


def test_abort_request_answers_a_whole_generate_and_a_duplicate_rid_is_a_400(engine, served, pool, idle_after,
                                                                             monkeypatch):
    idle_while(engine, monkeypatch, lambda: decoding(engine, "gen-whole"))
    whole = pool.submit(post, served, "/generate", generate_body("gen-whole"))
    assert wait_until(lambda: decoding(engine, "gen-whole"))
    engine.pause_generation("in_place")
    duplicate = post(served, "/generate", generate_body("gen-whole"))
    assert duplicate.status_code == 400 and duplicate.json()["error"]["param"] == "rid"
    assert post(served, "/abort_request", {"rid": "gen-whole"}).status_code == 200
    r = whole.result(timeout=30)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and 1 <= meta["completion_tokens"] < LONG["max_new_tokens"]
    assert len(r.json()["output_ids"]) == meta["completion_tokens"]


def test_abort_request_names_an_openai_request_by_its_x_request_id(engine, served, pool, idle_after, monkeypatch):
    """vLLM's X-Request-Id names a completion (its response id ``cmpl-{id}``), streamed or not."""
    streamed = threading.Event()  # (a completion's first chunk may come some tokens after its first output)
    both = ("cmpl-xr-whole", "cmpl-xr-stream")
    idle_while(engine, monkeypatch, lambda: streamed.is_set() and decoding(engine, *both))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    whole = pool.submit(post, served, "/v1/completions", body, {"X-Request-Id": "xr-whole"})
    with httpx.stream("POST", served.url + "/v1/completions", json=dict(body, stream=True),
                      headers={"X-Request-Id": "xr-stream"}) as r:
        lines = r.iter_lines()
        first_event(lines)
        streamed.set()
        assert wait_until(lambda: decoding(engine, *both))
        engine.pause_generation("in_place")
        for rid in ("xr-stream", "xr-whole"):
            assert post(served, "/abort_request", {"rid": rid}).status_code == 200
        chunks = events_of(lines)
    assert chunks[-1]["id"] == "cmpl-xr-stream" and chunks[-1]["choices"][0]["finish_reason"] == "abort"
    answer = whole.result(timeout=30).json()
    assert answer["id"] == "cmpl-xr-whole" and answer["choices"][0]["finish_reason"] == "abort"
    assert answer["usage"]["completion_tokens"] < 200


def test_abort_all_ends_every_request_in_flight(engine, served, pool, idle_after):
    engine.pause_generation("in_place")
    futures = [pool.submit(post, served, "/generate", generate_body(f"all-{i}")) for i in range(2)]
    assert wait_until(lambda: holds(engine, "all-0") and holds(engine, "all-1"))
    for nobody in ("nobody", None, ""):  # (an unknown id, none: nothing, as SGLang's)
        assert post(served, "/abort_request", {"rid": nobody}).status_code == 200
    assert not any(f.done() for f in futures)
    assert post(served, "/abort_request", {"abort_all": True}).status_code == 200
    for f in futures:
        meta = f.result(timeout=30).json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] == 0


def test_abort_request_reaches_the_requests_a_pause_holds(engine, served, pool, idle_after):
    """Requests waiting in the server for /continue_generation are aborted there, by a rid, an
    X-Request-Id (streamed too) or all: each answered as a request aborted before its first output
    (finish_reason "abort", no output), none sent to the engine, none left in the server."""
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5}
    assert post(served, "/pause_generation", {}).json()["status"] == "ok"  # ("abort": nothing runs to abort)
    try:
        by_rid = pool.submit(post, served, "/generate", generate_body("held-rid"))
        by_header = pool.submit(post, served, "/v1/completions", completion, {"X-Request-Id": "held-xr"})
        by_stream = pool.submit(streamed, served, "/generate", generate_body(), {"X-Request-Id": "held-stream"})
        by_all = pool.submit(post, served, "/generate", generate_body("held-all"))
        assert wait_until(lambda: load(served) == 4)
        for name in ("held-rid", "held-xr", "held-stream"):
            assert post(served, "/abort_request", {"rid": name}).status_code == 200
        assert post(served, "/abort_request", {"abort_all": True}).status_code == 200
        metas = [by_rid.result(timeout=10).json()["meta_info"], by_stream.result(timeout=10)[-1]["meta_info"],
                 by_all.result(timeout=10).json()["meta_info"]]
        answer = by_header.result(timeout=10).json()
        assert load(served) == 0 and not engine.loop.held_reqs()
    finally:
        post(served, "/continue_generation")
    assert [(m["finish_reason"]["type"], m["completion_tokens"]) for m in metas] == [("abort", 0)] * 3
    assert by_rid.result().json()["output_ids"] == []
    assert answer["id"] == "cmpl-held-xr" and answer["choices"][0]["finish_reason"] == "abort"
    assert answer["usage"]["completion_tokens"] == 0


def test_abort_request_reaches_a_request_queued_for_a_slot(engine, pool, idle_after):
    """One admission slot, taken: a request queued for it is aborted in the queue by its X-Request-Id,
    answered aborted at once while the slot's holder runs on; once the holder is aborted too, the
    slot is free for the next request."""
    engine.pause_generation("in_place")  # (the slot's holder stays where it is)
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5}
    with serving(engine, ServerConfig(max_concurrent_requests=1)) as server:
        holder = pool.submit(post, server, "/generate", generate_body("slot-holder"))
        assert wait_until(lambda: holds(engine, "slot-holder"))
        queued = pool.submit(post, server, "/v1/completions", completion, {"X-Request-Id": "queued-xr"})
        assert wait_until(lambda: load(server) == 2)
        assert post(server, "/abort_request", {"rid": "queued-xr"}).status_code == 200
        answer = queued.result(timeout=10).json()
        assert answer["choices"][0]["finish_reason"] == "abort" and answer["usage"]["completion_tokens"] == 0
        assert load(server) == 1 and not holder.done() and not holds(engine, "cmpl-queued-xr")
        assert post(server, "/abort_request", {"rid": "slot-holder"}).status_code == 200
        assert holder.result(timeout=30).json()["meta_info"]["finish_reason"]["type"] == "abort"
        engine.continue_generation()
        after = post(server, "/generate", generate_body(params={"max_new_tokens": 2})).json()
        assert after["meta_info"]["finish_reason"]["type"] == "length" and load(server) == 0


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_paused_request_resumes_with_the_tokens_of_an_unpaused_run(engine, served, pool, idle_after, monkeypatch,
                                                                      mode):
    """SGLang's pause: "retract" sends the running request back to waiting with its KV freed,
    "in_place" keeps it running with its KV; a request that comes meanwhile waits in the server,
    and after /continue_generation both end with the unpaused run's tokens."""
    params = dict(LONG, max_new_tokens=120)
    want = post(served, "/generate", generate_body(params=params)).json()["output_ids"]
    held = [f"pause-{mode}"]  # (until paused: then the loop steps no more until /continue_generation)
    idle_while(engine, monkeypatch, lambda: any(decoding(engine, rid) for rid in held))
    with httpx.stream("POST", served.url + "/generate", json=generate_body(f"pause-{mode}", True, params)) as r:
        lines = r.iter_lines()
        first_event(lines)
        assert post(served, "/pause_generation", {"mode": mode}).json()["status"] == "ok"
        held.clear()
        (req,) = [r for r in engine.loop.held_reqs() if r.rid == f"pause-{mode}"]
        assert not req.finished
        if mode == "retract":
            assert engine.scheduler.running == [] and req in engine.scheduler.waiting and req.req_pool_idx is None
        else:
            assert engine.scheduler.running == [req] and req.req_pool_idx is not None
        queued = pool.submit(post, served, "/generate", generate_body(f"queued-{mode}", params=params))
        time.sleep(0.3)
        assert not queued.done() and not holds(engine, f"queued-{mode}")  # (held in the server, not failed)
        assert post(served, "/continue_generation").json()["status"] == "ok"
        last = events_of(lines)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length" and last["output_ids"] == want
    assert queued.result(timeout=30).json()["output_ids"] == want


def test_pause_in_abort_mode_aborts_what_runs_and_holds_what_comes(engine, served, pool, idle_after, monkeypatch):
    idle_while(engine, monkeypatch, lambda: decoding(engine, "pause-abort"))
    running = pool.submit(post, served, "/generate", generate_body("pause-abort"))
    assert wait_until(lambda: decoding(engine, "pause-abort"))
    assert post(served, "/pause_generation", {}).json()["status"] == "ok"  # (SGLang's default mode: abort)
    assert running.result(timeout=30).json()["meta_info"]["finish_reason"]["type"] == "abort"
    queued = pool.submit(post, served, "/generate", generate_body("after-abort", params=dict(LONG, max_new_tokens=4)))
    time.sleep(0.3)
    assert not queued.done()
    assert httpx.get(served.url + "/load").json() == {"server_load": 1}  # (vLLM's: every request in the server)
    post(served, "/continue_generation")
    assert queued.result(timeout=30).json()["meta_info"]["finish_reason"]["type"] == "length"
    assert post(served, "/pause_generation", {"mode": "later"}).status_code == 400


def test_a_paused_engine_updates_its_weights_at_once(engine, pool, idle_after, monkeypatch):
    """SGLang updates a paused engine's weights without waiting: paused "retract", a request in
    flight holds no KV and the update applies; paused "in_place", its KV cannot be flushed, so the
    update is refused and nothing changes. The request then ends as unpaused."""
    path, params = engine.config.model_path, dict(LONG, max_new_tokens=64)
    want = engine.generate(input_ids=PROMPT, sampling_params=params)["output_ids"]
    held = []  # (until paused: then the loop steps no more until continue_generation)
    idle_while(engine, monkeypatch, lambda: any(decoding(engine, rid) for rid in held))
    for mode in ("in_place", "retract"):
        held.append(f"weights-{mode}")
        running = pool.submit(engine.generate, input_ids=PROMPT, sampling_params=params, rid=f"weights-{mode}")
        assert wait_until(lambda: decoding(engine, f"weights-{mode}"))
        engine.pause_generation(mode)
        held.clear()
        if mode == "in_place":
            with pytest.raises(RuntimeError, match="paused with requests holding KV"):
                engine.update_weights_from_disk(path, "never")
            assert engine.get_weight_version() == "default"
        else:
            assert engine.update_weights_from_disk(path, "same-weights").success
        engine.continue_generation()
        out = running.result(timeout=30)
        assert out["output_ids"] == want
    assert out["meta_info"]["weight_version"] == "same-weights"


def test_health_generate_is_200_and_503_when_no_token_comes_in_time(engine, served, idle_after):
    assert httpx.get(served.url + "/health_generate").status_code == 200
    engine.pause_generation("in_place")  # (a stuck worker)
    start = time.monotonic()
    assert httpx.get(served.url + "/health_generate").status_code == 503
    assert time.monotonic() - start < 10
    assert not any(r.rid.startswith("HEALTH_CHECK") and not r.finished for r in engine.loop.held_reqs())


@pytest.mark.parametrize("mode", ["abort", "in_place"])
def test_health_generate_is_503_at_once_while_paused(engine, served, idle_after, mode):
    """SGLang's health check waits behind its pause as any request does and fails at its timeout: a
    paused server is a 503, in every mode (an "abort" pause leaves the workers stepping: they would
    answer 200), at once, nothing sent to a worker (one paused would hold it); 200 once continued."""
    assert post(served, "/pause_generation", {"mode": mode}).json()["status"] == "ok"
    try:
        assert httpx.get(served.url + "/health_generate").status_code == 503
        assert not any(r.rid.startswith("HEALTH_CHECK") for r in engine.loop.held_reqs())
    finally:
        post(served, "/continue_generation")
    assert httpx.get(served.url + "/health_generate").status_code == 200


class _Worker:
    """A worker behind a Ray-like handle, as PDBackend calls it (``handle.<method>.remote(*args)``):
    ``paused``, its pause mode (None: stepping); ``fails``: its pause raises, as a dead actor's call."""

    def __init__(self, worker_id, fails=False):
        self.worker_id, self.alive, self.fails, self.paused = worker_id, True, fails, None
        self.handle = SimpleNamespace(pause_generation=SimpleNamespace(remote=self.pause),
                                      continue_generation=SimpleNamespace(remote=self.resume))

    async def pause(self, mode):
        if self.fails:
            raise RuntimeError("the actor died")
        self.paused = mode

    async def resume(self):
        self.paused = None


def test_a_pause_a_worker_fails_leaves_no_worker_paused():
    """PDBackend's pause is all or nothing: a worker failing it, those it paused step again and the
    error names the worker; with the failed worker out of the rotation every worker pauses."""
    prefill, decode, dead = _Worker("p-0"), _Worker("d-0"), _Worker("d-1", fails=True)
    backend = PDBackend(SimpleNamespace(prefill=[prefill], decode=[decode, dead]))
    with pytest.raises(RuntimeError, match=r"not paused .*: d-1: the actor died$"):
        asyncio.run(backend.pause_generation("retract"))
    assert (prefill.paused, decode.paused, backend.paused_mode) == (None, None, None)
    dead.alive = False
    asyncio.run(backend.pause_generation("in_place"))
    assert (prefill.paused, decode.paused, backend.paused_mode) == ("in_place", "in_place", "in_place")


def test_a_failed_pause_of_a_paused_cluster_leaves_it_paused():
    """A pause that fails on a cluster paused already undoes nothing the earlier pause did: its
    workers stay paused (none continued: they hold what the earlier pause held), in its mode."""
    prefill, decode = _Worker("p-0"), _Worker("d-0")
    backend = PDBackend(SimpleNamespace(prefill=[prefill], decode=[decode]))
    asyncio.run(backend.pause_generation("in_place"))
    decode.fails = True
    with pytest.raises(RuntimeError, match=r"paused as before \(in_place\).*: d-0: the actor died$"):
        asyncio.run(backend.pause_generation("retract"))
    assert (prefill.paused, decode.paused, backend.paused_mode) == ("retract", "in_place", "in_place")


class _FailingPause(EngineBackend):
    async def pause_generation(self, mode):
        raise RuntimeError("generation not paused (the workers paused step again): d-1: the actor died")


def test_a_failed_pause_is_a_500_naming_the_worker_and_the_server_serves_on(engine, idle_after):
    with serving(engine, ServerConfig(), _FailingPause) as server:
        r = post(server, "/pause_generation", {"mode": "retract"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "pause_failed", r.text
        assert r.json()["error"]["message"].endswith("d-1: the actor died")
        assert httpx.get(server.url + "/get_server_info").json()["paused"] is False
        after = post(server, "/generate", generate_body(params={"max_new_tokens": 2})).json()
        assert after["meta_info"]["finish_reason"]["type"] == "length"


def test_a_failed_pause_of_a_paused_server_leaves_it_paused(engine, pool, idle_after):
    """Paused ("abort" mode), a pause that fails leaves the server paused: a request that comes
    waits for /continue_generation, as before the failed call."""
    with serving(engine, ServerConfig(), _FailingPause) as server:
        assert post(server, "/pause_generation", {}).json()["status"] == "ok"
        assert post(server, "/pause_generation", {"mode": "in_place"}).status_code == 500
        assert httpx.get(server.url + "/get_server_info").json()["paused"] is True
        held = pool.submit(post, server, "/generate", generate_body(params={"max_new_tokens": 2}))
        assert wait_until(lambda: load(server) == 1)
        time.sleep(0.2)
        assert not held.done()
        post(server, "/continue_generation")
        assert held.result(timeout=30).json()["meta_info"]["finish_reason"]["type"] == "length"


def test_the_info_routes(engine, served, idle_after):
    info = httpx.get(served.url + "/get_model_info").json()
    assert info["model_path"] == engine.config.model_path and info["is_generation"] is True
    assert info["weight_version"] == "default" and info["architectures"] == ["LlamaForCausalLM"]  # (the backend's)
    assert info["tokenizer_path"] == engine.config.model_path and info["model_type"] == "llama"
    server = httpx.get(served.url + "/get_server_info").json()
    assert server["health_generate_timeout_s"] == 1.0 and server["api_key"] is None
    assert server["model_name"] == MODEL and server["context_len"] == 256 and server["paused"] is False
    assert server["internal_states"][0]["id"] == "p-0" and isinstance(server["version"], str)
    assert httpx.get(served.url + "/load").json() == {"server_load": 0}
    for method in ("GET", "POST"):
        r = httpx.request(method, served.url + "/ping")
        assert r.status_code == 200 and r.json()["ready"] is True
    post(served, "/generate", generate_body(params={"max_new_tokens": 2}))
    assert engine.scheduler.tree_cache.evictable_size() > 0
    assert post(served, "/reset_prefix_cache").status_code == 200
    assert engine.scheduler.tree_cache.evictable_size() == 0


class _PrefillAndDecode(EngineBackend):
    """The engine as a prefill and a decode worker, each listed with the sizes it chose, as PDBackend
    lists a PD worker once asked."""

    def workers(self, include_dead=False):
        return [{**self.engine.server_info(), "id": f"{role[0]}-0", "role": role, "node": "n", "alive": True,
                 "inflight": 0, "load": {}} for role in ("prefill", "decode")]


def test_get_server_info_reports_the_sizes_the_engine_chose(engine, idle_after):
    """SGLang's scheduler info at the top (sglang.bench_serving reads max_total_num_tokens) and per
    worker in ``internal_states``: what the runner chose, not the configuration's null
    max_running_requests (and the mem_fraction_static it took); /metrics exports the sizes per worker."""
    runner, sched = engine.runner, engine.scheduler
    assert engine.config.max_running_requests is None
    with serving(engine, ServerConfig(), _PrefillAndDecode) as server:
        info = httpx.get(server.url + "/get_server_info").json()
        metrics = httpx.get(server.url + "/metrics").text
    assert (info["max_running_requests"], info["max_total_num_tokens"], info["page_size"]) == (
        runner.max_running_requests, runner.max_total_num_tokens, 4)
    assert info["max_req_input_len"] == 255
    decode = info["internal_states"][1]
    assert (decode["id"], decode["role"], decode["context_len"]) == ("d-0", "decode", sched.context_len)
    assert decode["chunked_prefill_size"] == sched.chunked_prefill_size and decode["speculative_algorithm"] is None
    assert decode["mem_fraction_static"] == runner.mem_fraction_static == 0.5  # (unset: the CPU's default)
    labels = '{role="decode",worker="d-0"}'
    assert f"raydix_worker_max_total_num_tokens{labels} {float(runner.max_total_num_tokens)}" in metrics


def _sized_worker(worker_id, role, answers, asked):
    """A worker whose ``server_info`` answers ``answers[worker_id]`` (None: fails, as a dead actor's
    call), each call noted in ``asked``."""
    async def server_info():
        asked.append(worker_id)
        if answers[worker_id] is None:
            raise RuntimeError("the actor died")
        return answers[worker_id]

    return SimpleNamespace(worker_id=worker_id, role=role, node_id="n", alive=True, inflight=0, stats={},
                           handle=SimpleNamespace(server_info=SimpleNamespace(remote=server_info)))


def test_pd_backend_asks_each_worker_its_sizes_once_and_the_top_level_is_the_least_decode_workers():
    """PDBackend asks a live worker's sizes once (static: a worker that failed to answer is asked
    again, one that left drops them); the top level is the least over the live decode workers, the
    prefill workers' smaller pools left out (they hold no running request)."""
    def sizes(rows, tokens):
        return {"max_running_requests": rows, "max_total_num_tokens": tokens, "page_size": 4}

    async def heartbeat_once():
        pass

    asked, answers = [], {"p-0": sizes(8, 64), "d-0": sizes(256, 4096), "d-1": sizes(32, 8192), "d-2": None}
    prefill, big, small, late = (_sized_worker(i, "prefill" if i == "p-0" else "decode", answers, asked)
                                 for i in answers)
    client = SimpleNamespace(prefill=[prefill], decode=[big, small, late], heartbeat_once=heartbeat_once)
    backend = PDBackend(client)
    asyncio.run(backend.refresh_loads())
    workers = backend.workers()
    assert [w.get("max_total_num_tokens") for w in workers] == [64, 4096, 8192, None]
    assert cluster_limits(workers, 100) == {"max_running_requests": 32, "max_total_num_tokens": 4096,
                                            "page_size": 4, "max_req_input_len": 100}
    answers["d-2"], big.alive = sizes(16, 1024), False
    asyncio.run(backend.refresh_loads())
    assert sorted(asked) == ["d-0", "d-1", "d-2", "d-2", "p-0"]
    assert cluster_limits(backend.workers(), 100)["max_total_num_tokens"] == 1024
    client.decode.remove(small)
    asyncio.run(backend.refresh_loads())
    assert set(backend.engine_info) == {"p-0", "d-0", "d-2"} and len(asked) == 5
    assert cluster_limits([], 100)["max_total_num_tokens"] is None


def test_a_speculating_workers_avg_spec_accept_length_comes_with_each_load_refresh():
    """SGLang's ``avg_spec_accept_length`` in a speculating worker's entry: tokens per verify step, the
    bonus included (accepted drafts + 1 per drafted request-step), from the load each refresh fetches
    (it moves as the worker decodes, unlike the sizes asked once); none before the worker's first
    verify step, none on a worker that does not speculate."""
    stats, asked = SpecStats(), []
    prefill, decode = (_sized_worker(i, role, {i: {"page_size": 4}}, asked)
                       for i, role in (("p-0", "prefill"), ("d-0", "decode")))

    async def heartbeat_once():
        prefill.stats, decode.stats = {"waiting": 0}, {"running": 1, "spec_decode": stats.as_dict()}

    backend = PDBackend(SimpleNamespace(prefill=[prefill], decode=[decode], heartbeat_once=heartbeat_once))

    def entries():
        asyncio.run(backend.refresh_loads())
        return {w["id"]: w for w in backend.workers()}

    assert not any("avg_spec_accept_length" in w for w in entries().values())
    stats.observe(4, 4)
    stats.observe(4, 1)
    got = entries()
    assert got["d-0"]["avg_spec_accept_length"] == (5 + 2) / 2 and "avg_spec_accept_length" not in got["p-0"]
    stats.observe(3, 0)
    assert entries()["d-0"]["avg_spec_accept_length"] == (5 + 3) / 3
    assert sorted(asked) == ["d-0", "p-0"]  # (the sizes, asked once)


@pytest.mark.parametrize("path, body", [("/v1/embeddings", {"input": PROMPT}),
                                        ("/score", {"text_1": "a query", "text_2": ["one", "two"]})])
def test_abort_request_names_a_pooling_request_by_its_x_request_id(engine, served, pool, idle_after, path, body):
    """/v1/embeddings' and /score's X-Request-Id names them as a completion's does; aborted, they have
    no vectors to answer with: an OpenAI error body, not a 500 of a missing embedding."""
    engine.pause_generation("in_place")
    response_id = ("embd-" if path == "/v1/embeddings" else "score-") + "xr-pool"
    answer = pool.submit(post, served, path, dict(body, model=MODEL), {"X-Request-Id": "xr-pool"})
    assert wait_until(lambda: holds(engine, response_id))
    assert post(served, "/abort_request", {"rid": "xr-pool"}).status_code == 200
    r = answer.result(timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "aborted"


def test_a_weight_update_that_aborts_all_requests_answers_them_aborted(engine, pool, idle_after, monkeypatch):
    """SGLang's ``abort_all_requests``: the server aborts its requests (as /abort_request does), so
    each is answered with finish_reason "abort", not failed by the workers' own abort (a 500)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    both = ("weights-abort", "cmpl-weights-abort-cmpl")
    idle_while(engine, monkeypatch, lambda: decoding(engine, *both))
    with serving(engine, ServerConfig(allow_weight_updates=True)) as server:
        running = pool.submit(post, server, "/generate", generate_body("weights-abort"))
        completion = pool.submit(post, server, "/v1/completions", body, {"X-Request-Id": "weights-abort-cmpl"})
        assert wait_until(lambda: decoding(engine, *both))
        update = {"model_path": engine.config.model_path, "abort_all_requests": True}
        r = post(server, "/update_weights_from_disk", update)
        assert r.status_code == 200 and r.json()["success"], r.text
        meta = running.result(timeout=30).json()["meta_info"]
        answer = completion.result(timeout=30).json()
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < LONG["max_new_tokens"]
    assert answer["choices"][0]["finish_reason"] == "abort" and answer["usage"]["completion_tokens"] < 200


def test_a_paused_server_continues_after_a_weight_update_unless_keep_pause(engine, pool, idle_after):
    """SGLang's ``keep_pause``: a server paused ("retract") stays paused through an update that keeps
    the pause (a request sent meanwhile waits), and continues after one that does not (as
    /continue_generation): the request ends as unpaused. SGLang's other fields are taken as sent.
    (Paused before the request is sent: no race with a request that would finish first.)"""
    params = dict(LONG, max_new_tokens=100)
    want = engine.generate(input_ids=PROMPT, sampling_params=params)["output_ids"]
    update = {"model_path": engine.config.model_path, "keep_pause": True, "torch_empty_cache": True,
              "recapture_cuda_graph": True, "token_step": 3, "is_async": False, "manifest": None}
    with serving(engine, ServerConfig(allow_weight_updates=True)) as server:
        post(server, "/pause_generation", {"mode": "retract"})
        running = pool.submit(post, server, "/generate", generate_body("keep-pause", params=params))
        r = post(server, "/update_weights_from_disk", update)
        assert r.status_code == 200 and r.json()["success"], r.text
        assert engine.loop.paused and httpx.get(server.url + "/get_server_info").json()["paused"] is True
        assert not running.done(), running.result().text
        r = post(server, "/update_weights_from_disk", dict(update, keep_pause=False))
        assert r.status_code == 200 and r.json()["success"], r.text
        assert not engine.loop.paused and httpx.get(server.url + "/get_server_info").json()["paused"] is False
        assert running.result(timeout=30).json()["output_ids"] == want
        for field, value in (("is_async", True), ("manifest", {"weights": []})):
            r = post(server, "/update_weights_from_disk", dict(update, **{field: value}))
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_sleep_routes_refuse_requests_while_asleep_and_wake_up_to_the_same_tokens(engine, idle_after):
    """vLLM's /sleep, /wake_up (its tags), /is_sleeping, and SGLang's release / resume routes: asleep,
    a request is a 503 at once (generate and OpenAI's), /get_server_info says so; an unknown level or
    tag is a 400, nothing released; woken, the tokens of before. Without the flag the routes are not there."""
    want = post_generate_ids(engine)
    with serving(engine, ServerConfig(enable_sleep_mode=True)) as server:
        assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": False}
        assert post(server, "/sleep?level=3").json()["error"]["param"] == "level"
        r = post(server, "/sleep?level=1")
        assert r.status_code == 200 and r.content == b"" and engine.is_sleeping()
        assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": True}
        assert httpx.get(server.url + "/get_server_info").json()["is_sleeping"] is True
        for path, body in (("/generate", generate_body(params={"max_new_tokens": 2})),
                           ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})):
            r = post(server, path, body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "sleeping", r.text
        r = httpx.post(server.url + "/wake_up", params={"tags": ["weights", "kv"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tags" and engine.is_sleeping()
        assert httpx.post(server.url + "/wake_up", params={"tags": "weights"}).status_code == 200
        assert engine.memory.released == {"kv_cache", "cuda_graph"}  # (the graphs come back with the KV cache)
        assert post(server, "/wake_up").status_code == 200 and not engine.is_sleeping()
        assert post_generate_ids(engine, server) == want

        assert post(server, "/release_memory_occupation", {"tags": ["kv_cache", "bogus"]}).status_code == 400
        assert post(server, "/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
        assert engine.memory.released == {"kv_cache"} and not engine.memory.weights_discarded
        assert httpx.post(server.url + "/resume_memory_occupation").status_code == 200  # (no body: all)
        assert not engine.is_sleeping() and post_generate_ids(engine, server) == want
    with serving(engine, ServerConfig()) as server:
        assert post(server, "/sleep").status_code == 404 and httpx.get(server.url + "/is_sleeping").status_code == 404


def test_a_release_while_a_request_is_held_is_a_409_and_releases_nothing(engine, pool, idle_after):
    with serving(engine, ServerConfig(enable_sleep_mode=True)) as server:
        engine.pause_generation("in_place")
        held = pool.submit(post, server, "/generate", generate_body("held-by-sleep", params={"max_new_tokens": 2}))
        assert wait_until(lambda: holds(engine, "held-by-sleep"))
        r = post(server, "/release_memory_occupation", {})
        assert r.status_code == 409 and r.json()["error"]["code"] == "busy", r.text
        assert "held-by-sleep" in r.json()["error"]["message"] and not engine.is_sleeping()
        engine.continue_generation()
        assert held.result(timeout=30).json()["meta_info"]["finish_reason"]["type"] == "length"


def post_generate_ids(engine, server=None):
    """The greedy tokens of PROMPT: through ``server``'s /generate, or the engine's own."""
    params = {"max_new_tokens": 8, "temperature": 0}
    if server is None:
        return engine.generate(input_ids=PROMPT, sampling_params=params)["output_ids"]
    r = post(server, "/generate", generate_body(params=params))
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]
