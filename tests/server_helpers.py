"""A PD cluster on Ray behind the HTTP server on a background thread, for the server tests."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
import ray

from cluster.config import parse_config
from cluster.http_server import BackgroundServer
from cluster.launch import load_tokenizer
from cluster.pd import PDCluster
from cluster.server import build_app

API_KEY = "test-key"


def server_config(num_prefill=1, num_decode=1, decode_engine=None, server=None, **transfer):
    engine = {"page_size": 4, "max_total_tokens": 2048, "context_length": 512, "attention_backend": "torch"}
    group = {"num_cpus_per_rank": 0.5}
    return parse_config({
        "model": {"builtin": "llama"},
        "prefill": dict(group, num_workers=num_prefill, engine=engine),
        "decode": dict(group, num_workers=num_decode, engine=dict(engine, **(decode_engine or {}))),
        "transfer": dict({"backend": "shm", "heartbeat_interval_s": 0.5}, **transfer),
        "server": dict({"api_key": API_KEY}, **(server or {})),
    })


@contextmanager
def raydix_home(path):
    old = os.environ.get("RAYDIX_HOME")
    os.environ["RAYDIX_HOME"] = str(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("RAYDIX_HOME", None)
        else:
            os.environ["RAYDIX_HOME"] = old


@contextmanager
def served_cluster(config):
    """``(cluster, server, app)``: the cluster's workers up, the app listening on a free loopback port."""
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="raydix-tests")
    try:
        with serving(config) as served:
            yield served
    finally:
        ray.shutdown()


@contextmanager
def serving(config):
    """:func:`served_cluster` in the Ray session already up (a second cluster beside a module's)."""
    cluster = PDCluster(config).start()
    tokenizer = load_tokenizer(config, cluster.model_path)
    app = build_app(cluster, tokenizer, config)
    server = BackgroundServer(app, "127.0.0.1", 0).start()
    try:
        yield cluster, server, app
    finally:
        server.stop()
        cluster.shutdown()


@pytest.fixture(scope="module")
def client(served):
    """The official openai client against the module's server (``served``: (cluster, server, app))."""
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[1].url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def wait_until(predicate, timeout_s=10.0, interval_s=0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


def wait_idle(cluster, timeout_s=20.0) -> None:
    """Every live worker idle, then leak-free."""
    def idle():
        loads = ray.get([w.handle.load.remote() for w in cluster.prefill + cluster.decode if w.alive])
        return all(not (x["waiting"] or x["running"] or x.get("prealloc") or x.get("transfer")) for x in loads)

    assert wait_until(idle, timeout_s)
    cluster.check_integrity()
