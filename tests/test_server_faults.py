"""Faults through HTTP (one Ray session and one server for the module): a decode
worker killed mid-stream ends the streams it served with an error event within
10 s while the other streams finish and the worker leaves /workers; a prefill
worker killed under a non-streaming request answers 500; workers are added
(POST /workers) and removed with a drain (DELETE /workers/{id}), and the server
keeps serving throughout."""

import threading
import time

import openai
import pytest
import ray

from tests.server_helpers import client, http  # noqa: F401 (fixtures)
from tests.server_helpers import raydix_home, server_config, served_cluster, wait_idle, wait_until

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
