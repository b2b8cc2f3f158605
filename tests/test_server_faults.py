"""Faults through HTTP (one Ray session and one server for the module): a decode
worker killed mid-stream ends the streams it served with an error event within
10 s while the other streams finish and the worker leaves /workers; a prefill
worker killed under a non-streaming request answers 500; workers are added
(POST /workers) and removed with a drain (DELETE /workers/{id}), and the server
keeps serving throughout; a second cluster in the same Ray session, its decode side autoscaled,
grows to two decode workers under a burst and drains back to one after it."""

import threading
import time

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

import cluster.pd
from tests.server_helpers import client, http  # noqa: F401 (fixtures)
from tests.server_helpers import (API_KEY, raydix_home, server_config, served_cluster, serving, wait_idle,
                                  wait_until)

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    config = server_config(num_prefill=1, num_decode=2, waiting_timeout_s=5.0, bootstrap_timeout_s=5.0)
    with raydix_home(tmp_path_factory.mktemp("raydix-home")), served_cluster(config) as (cluster, server, app):
        yield cluster, server, app


def ok(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ok"}], max_tokens=3,
                                         temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")


def worker_ids(http, role=None):
    return [w["id"] for w in http.get("/workers").json()["workers"] if role in (None, w["role"])]


def test_decode_killed_mid_stream(served, client, http):
    cluster = served[0]
    results, first_chunk = {}, threading.Barrier(5)

    def stream(i):
        try:
            s = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"stream {i}"}],
                                               max_tokens=400, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            it = iter(s)
            next(it)
            first_chunk.wait(30)
            reason = None
            for chunk in it:
                if chunk.choices:
                    reason = chunk.choices[0].finish_reason or reason
            results[i] = ("done", reason, time.monotonic())
        except openai.APIError as exc:
            results[i] = ("error", str(exc), time.monotonic())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    first_chunk.wait(30)
    victim = max(cluster.decode, key=lambda w: w.inflight)
    on_victim = victim.inflight
    assert 0 < on_victim < 4
    ray.kill(victim.handle)
    killed_at = time.monotonic()
    for t in threads:
        t.join(60)
    errors = [r for r in results.values() if r[0] == "error"]
    assert len(errors) == on_victim and all(r[2] - killed_at < 10 for r in errors)
    assert all("worker" in r[1] for r in errors)
    assert sorted(r[1] for r in results.values() if r[0] == "done") == ["length"] * (4 - on_victim)
    assert wait_until(lambda: victim.worker_id not in worker_ids(http), 10)
    dead = [w for w in http.get("/workers", params={"include_dead": "true"}).json()["workers"] if not w["alive"]]
    assert [w["id"] for w in dead] == [victim.worker_id]
    assert http.delete(f"/workers/{victim.worker_id}").status_code == 200  # a dead one is cleared out
    ok(client)


def test_prefill_killed_under_a_request_answers_500_then_a_new_one_serves(served, client, http):
    cluster = served[0]
    prefill = cluster.prefill[0]
    ray.get(prefill.handle.pause_generation.remote())
    answer = {}

    def call():
        try:
            ok(client)
            answer["status"] = 200
        except openai.APIStatusError as exc:
            answer["status"], answer["body"] = exc.status_code, exc.body

    t = threading.Thread(target=call)
    t.start()
    assert wait_until(lambda: ray.get(prefill.handle.load.remote())["waiting"] > 0)
    ray.kill(prefill.handle)
    killed_at = time.monotonic()
    t.join(15)
    assert answer["status"] == 500 and answer["body"]["type"] == "server_error"
    assert time.monotonic() - killed_at < 10
    assert wait_until(lambda: not worker_ids(http, "prefill"), 10)
    assert http.get("/health").status_code == 503  # no prefill worker in the rotation

    added = http.post("/workers", json={"role": "prefill"})
    assert added.status_code == 200 and added.json()["role"] == "prefill"
    assert worker_ids(http, "prefill") == [added.json()["id"]]
    assert http.get("/health").status_code == 200
    ok(client)


def test_workers_add_and_remove_with_drain(served, client, http):
    cluster = served[0]
    assert http.post("/workers", json={"role": "cook"}).status_code == 400
    assert http.delete("/workers/nobody").status_code == 404
    old = worker_ids(http, "decode")
    new = http.post("/workers", json={"role": "decode"}).json()["id"]
    listed = {w["id"]: w for w in http.get("/workers").json()["workers"]}
    assert set(listed) >= set(old) | {new}
    assert {"role", "node", "alive", "load"} <= set(listed[new])
    for worker_id in old:
        removed = http.delete(f"/workers/{worker_id}")
        assert removed.status_code == 200 and removed.json()["removed"]
    assert worker_ids(http, "decode") == [new]
    for _ in range(3):
        ok(client)
    wait_idle(cluster)


# decode scaled on ongoing requests, 1 per worker, between 1 and 2 workers, with test-short delays
AUTOSCALED_DECODE = {"min_workers": 1, "max_workers": 2, "target_ongoing_requests": 1, "metrics_interval_s": 0.2,
                     "look_back_period_s": 1.0, "upscale_delay_s": 0.5, "downscale_delay_s": 1.0}


def _routed(http, worker_id):
    """Decode routing decisions the server counted for ``worker_id``."""
    families = text_string_to_metric_families(http.get("/metrics").text)
    return sum(s.value for f in families if f.name == "raydix_routing_decisions" for s in f.samples
               if s.name.endswith("_total") and s.labels["worker"] == worker_id)


def test_decode_autoscales_up_under_a_burst_and_drains_back_down(served, monkeypatch):
    config = server_config().with_updates({"decode.autoscaling": AUTOSCALED_DECODE})
    drained = {}

    def stop_checked(worker, graceful=True):  # the drained worker is idle and leak-free before it stops
        if graceful and worker.role == "decode":
            drained[worker.worker_id] = ray.get(worker.handle.check_integrity.remote())
        stop_worker(worker, graceful)

    stop_worker = cluster.pd.stop_worker
    monkeypatch.setattr(cluster.pd, "stop_worker", stop_checked)
    with serving(config) as (scaled, server, _), httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        first = scaled.decode[0].worker_id
        done, failed, stops = [], [], [threading.Event() for _ in range(3)]

        def load(i):
            while not stops[i].is_set():
                r = http.post("/generate", json={"input_ids": [3 + i, 7, 11 + len(done)], "sampling_params": {
                    "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}})
                (done if r.status_code == 200 and len(r.json()["output_ids"]) == 24 else failed).append(r)
                stops[i].wait(0.05)  # (a request's end and the next one's start never overlap on a worker)

        threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        try:  # three requests at a time want three workers: two, the most
            assert wait_until(lambda: len(scaled.decode) == 2, 30)
            new = next(w.worker_id for w in scaled.decode if w.worker_id != first)
            assert wait_until(lambda: _routed(http, new) > 0, 15)  # it joined the rotation and serves
            state = http.get("/get_server_info").json()["autoscaler"]
            for stop in stops[1:]:  # one request at a time wants one worker: the other drains while it runs
                stop.set()
            assert wait_until(lambda: len(scaled.decode) == 1 and drained, 20)
            served_before = len(done)
            assert wait_until(lambda: len(done) > served_before + 1, 15)  # serving on through the last one
        finally:
            for stop in stops:
                stop.set()
            for t in threads:
                t.join(60)
        assert set(state) == {"decode"}  # (prefill has no autoscaling)
        # (the change's target, not the desired count: that follows each second's load, which may dip meanwhile)
        assert (state["decode"]["last_change"]["action"], state["decode"]["last_change"]["to"]) == ("up", 2)
        assert done and not failed  # every request completed, through both changes
        assert set(drained) <= {first, new} and len(drained) == 1
        state = http.get("/workers").json()["autoscaler"]["decode"]
        assert state["desired"] == 1 and state["min_workers"] == 1
        assert (state["last_change"]["action"], state["last_change"]["result"]) == ("down", "done")
        gauge = [s.value for f in text_string_to_metric_families(http.get("/metrics").text)
                 if f.name == "raydix_autoscaler_desired_workers" for s in f.samples]
        assert gauge == [1.0]
        wait_idle(scaled)
