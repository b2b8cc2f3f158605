"""Tensor-parallel workers in the PD cluster (Ray actors, gloo between ranks):
the 2P + 2D layout of configs/cpu_2p2d_tp2.yaml (decode TP 2, prefill TP 1:
each decode rank receives its half of the KV heads by head slicing), and
prefill TP 2 → decode TP 1 (one decode rank gathers both prefill halves; the
completion notice goes out as soon as the follower's push ends, during rank 0's
next forward), and prefill PP 2 → decode TP 2 (a rank actor per stage, each
pushing its layers).
Tokens equal HF transformers'; a hybrid model whose Mamba states cannot be
sliced across different TP sizes is refused with a clear error, leaking nothing."""

import asyncio
import random
import threading
import time

import pytest
import ray

from actors.pd_scheduler import PDRequestError
from cluster.config import load_config, parse_config
from actors.rank import TPFollower
from cluster.pd import PDCluster, WorkerStartError
from tests.parity import assert_greedy_parity
from tests.pd_helpers import prompts

GREEDY = {"max_new_tokens": 8, "temperature": 0}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_session(tmp_path_factory):
    home = tmp_path_factory.mktemp("raydix-home")
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="raydix-tp",
             runtime_env={"env_vars": {"RAYDIX_HOME": str(home)}})
    yield home
    ray.shutdown()


def _generate_all(cluster, batch):
    client = cluster.client()

    async def go():
        return await asyncio.gather(*(client.generate(ids, GREEDY) for ids in batch))

    return asyncio.run(go())


def test_two_prefill_two_decode_with_decode_tp2(ray_session, monkeypatch):
    monkeypatch.setenv("RAYDIX_HOME", str(ray_session))
    config = load_config("configs/cpu_2p2d_tp2.yaml").with_updates(
        {"prefill.engine.skip_tokenizer_init": True, "decode.engine.skip_tokenizer_init": True,
         "prefill.engine.max_total_tokens": 2048, "decode.engine.max_total_tokens": 2048})
    cluster = PDCluster(config).start()
    assert [len(w.followers) for w in cluster.prefill + cluster.decode] == [0, 0, 1, 1]
    batch = prompts(4, 5, 40, seed=1)
    outs = _generate_all(cluster, batch)
    assert {o["meta_info"]["decode_worker"] for o in outs} == {w.worker_id for w in cluster.decode}
    assert_greedy_parity(cluster.model_path, batch, [o["output_ids"] for o in outs], 8, [2])
    cluster.check_integrity()  # includes every follower's index tables

    # one rank of a TP worker dies: the heartbeat takes the whole worker out of rotation
    broken, healthy = cluster.decode
    ray.kill(broken.followers[0])
    assert "follower" in ray.get(broken.watcher, timeout=30)  # rank 0 now reports itself broken
    with pytest.raises(ray.exceptions.RayTaskError, match="broken"):
        ray.get(broken.handle.load.remote())
    client = cluster.client()
    asyncio.run(client.heartbeat_once())
    assert not broken.alive and healthy.alive
    outs = asyncio.run(asyncio.wait_for(client.generate(batch[0], GREEDY), timeout=60))
    assert outs["meta_info"]["decode_worker"] == healthy.worker_id
    cluster.shutdown()


def _config(family, prefill_tp, decode_tp, page_size, **prefill_engine):
    engine = {"page_size": page_size, "max_total_tokens": 2048, "skip_tokenizer_init": True}
    return parse_config({
        "model": {"builtin": family},
        "prefill": {"tp_size": prefill_tp, "num_cpus_per_rank": 0.5, "engine": {**engine, **prefill_engine}},
        "decode": {"tp_size": decode_tp, "num_cpus_per_rank": 0.5, "engine": engine},
        "transfer": {"backend": "shm"},
    })


class _SlowableFollower(TPFollower):
    """A prefill rank whose forwards (and so rank 0's: it waits in their all-reduces) can be
    held; it records when each forward ran and when each push ended. Held for a request of
    ``short_len`` slots (``hold``): every forward after the next one waits (5 s at most) until
    ``notice_came``, and that request's push begins only while such a forward runs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hold(None)
        runner, agent = self.host.runner, self.host.agents["shm"]
        real_forward, real_push = runner.forward, agent.push

        def forward(batch):
            span = [time.monotonic(), None]
            self.forwards.append(span)
            if self.short_len is not None and len(self.forwards) > 1:
                self._notice.wait(5.0)
            out = real_forward(batch)
            span[1] = time.monotonic()
            return out

        def push(handoff, *args, **kwargs):
            if len(handoff.dst_slots) == self.short_len:  # inside a held forward
                deadline = time.monotonic() + 10.0
                while not (len(self.forwards) > 1 and self.forwards[-1][1] is None) and time.monotonic() < deadline:
                    time.sleep(0.002)
            moved = real_push(handoff, *args, **kwargs)
            self.pushes.append((len(handoff.dst_slots), time.monotonic()))
            return moved

        runner.forward, agent.push = forward, push

    def hold(self, short_len):
        self.short_len, self._notice = short_len, threading.Event()
        self.forwards, self.pushes = [], []  # [start, end]; (decode slots of the request, end)

    def notice_came(self):
        self._notice.set()

    def timings(self):
        return [tuple(span) for span in self.forwards], list(self.pushes)


def test_prefill_tp2_to_decode_tp1(ray_session, monkeypatch):
    """With 8-token chunks: both prefill ranks push each chunk's half of the heads from
    their own transfer threads; the one decode rank lands every part of both halves.
    Then the completion notice does not wait for rank 0's forward in progress."""
    monkeypatch.setenv("RAYDIX_HOME", str(ray_session))
    cluster = PDCluster(_config("qwen3", 2, 1, 4, chunked_prefill_size=8))
    cluster.follower_cls = _SlowableFollower
    cluster.start()
    batch = prompts(3, 5, 30, seed=2) + prompts(2, 40, 50, seed=3)
    outs = _generate_all(cluster, batch)
    assert_greedy_parity(cluster.model_path, batch, [o["output_ids"] for o in outs], 8, [2])
    assert all(o["meta_info"]["transfer_bytes"] for o in outs)
    cluster.check_integrity()
    _check_notice_comes_while_the_next_forward_runs(cluster)
    cluster.shutdown()


def test_prefill_pp2_to_decode_tp2_over_torch_dist(ray_session, monkeypatch):
    """A prefill worker of two pipeline stages (a rank actor each, placed as a TP group's) and a
    decode worker of TP 2: each prefill stage pushes its layer's KV, both halves of its heads, to
    both decode ranks over torch_dist pairs, whose landings complete once both stages' layers came."""
    monkeypatch.setenv("RAYDIX_HOME", str(ray_session))
    config = _config("qwen3", 1, 2, 4, pp_size=2, chunked_prefill_size=8).with_updates(
        {"transfer.backend": "torch_dist"})
    cluster = PDCluster(config).start()
    assert [len(w.followers) for w in cluster.prefill + cluster.decode] == [1, 1]
    batch = prompts(3, 5, 30, seed=4)
    outs = _generate_all(cluster, batch)
    assert_greedy_parity(cluster.model_path, batch, [o["output_ids"] for o in outs], 8, [2])
    assert ray.get(cluster.decode[0].handle.backends_used.remote()) == {"torch_dist": 3}
    cluster.check_integrity()
    cluster.shutdown()


def _check_notice_comes_while_the_next_forward_runs(cluster):
    """Prefill TP 2: when the follower's push of a request ends during rank 0's next forward
    (another request's chunk; held here until the notice came, 5 s at most), the follower's
    transfer thread reports it to rank 0 at once, and the completion notice arrives before
    that forward ends (it used to wait for the forward, rank 0 learning of the push in the
    reply of its next call to the follower)."""
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    follower = prefill.followers[0]
    short, long = prompts(1, 6, 6, seed=51)[0], prompts(1, 24, 24, seed=52)[0]
    ray.get(follower.hold.remote(len(short)))

    async def notice_then_tokens(rid, ids, handoffs, arrived):
        notice = await prefill.handle.prefill.remote(rid, ids, GREEDY, handoffs)
        arrived[rid] = time.monotonic()
        if rid == "early-short":
            await follower.notice_came.remote()
        final = None
        async for ref in decode.handle.stream.options(num_returns="streaming").remote(rid, notice):
            final = await ref
        return final["output_ids"]

    async def go():
        handoffs = [await decode.handle.reserve.remote(rid, ids, GREEDY, "shm")
                    for rid, ids in (("early-short", short), ("early-long", long))]
        arrived = {}
        first = asyncio.ensure_future(notice_then_tokens("early-short", short, handoffs[0], arrived))
        while not (await follower.timings.remote())[0]:  # the short one's forward runs: the long one
            await asyncio.sleep(0.01)                      # comes after it, chunk by chunk
        second = asyncio.ensure_future(notice_then_tokens("early-long", long, handoffs[1], arrived))
        return arrived, await asyncio.gather(first, second)

    try:
        arrived, outs = asyncio.run(go())
        forwards, pushes = ray.get(follower.timings.remote())
    finally:
        ray.get(follower.hold.remote(None))
    short_pushed = [end for num_slots, end in pushes if num_slots == len(short)]
    running = [(start, end) for start, end in forwards if start <= short_pushed[0] <= end]
    assert running, (short_pushed, forwards)
    assert arrived["early-short"] < running[0][1], (arrived, short_pushed, forwards)  # before that forward ended
    assert_greedy_parity(cluster.model_path, [short, long], outs, 8, [2])
    cluster.check_integrity()


def test_hybrid_with_different_tp_sizes_is_refused_before_any_actor_starts(ray_session, monkeypatch):
    """A hybrid model's state moves whole between ranks of the same index: prefill TP 1 → decode
    TP 2 could serve no request (the hand-off refuses it, tests/test_transfer.py), so the cluster
    refuses to start, naming the field, with no actor or placement group made."""
    monkeypatch.setenv("RAYDIX_HOME", str(ray_session))
    groups = len(ray.util.placement_group_table())
    cluster = PDCluster(_config("qwen3_next", 1, 2, 1))
    with pytest.raises(ValueError, match=r"decode.tp_size: a hybrid \(Mamba\) model needs the same TP size"):
        cluster.start()
    assert cluster.prefill == [] and cluster.decode == [] and len(ray.util.placement_group_table()) == groups


class _FollowerWithoutShard(TPFollower):
    """A TP rank whose start fails (as a missing shard or an OOM would)."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("rank shard could not be loaded")


class _FollowerLosingOneTransfer(TPFollower):
    """A decode rank whose share of the first request never lands and whose share of the
    second arrives ``LATE_S`` after rank 0's (its agent says the bytes are not there yet)."""

    LATE_S = 3.0

    def _land(self, rids):
        if not getattr(self, "_lost_one", False):
            self._lost_one = True
            self._cancel(rids[0])
            return {rids[0]: "injected: rank 1 lost its share"}
        if not hasattr(self, "_late"):
            self._late = (rids[0], time.monotonic() + self.LATE_S)
            for agent in self.host.agents.values():
                landed = agent.landed
                agent.landed = lambda handoff, landed=landed: (
                    landed(handoff) and (handoff.rid != self._late[0] or time.monotonic() >= self._late[1]))
        return super()._land(rids)


class _FollowerFailingOnDemand(_FollowerLosingOneTransfer):
    """... and whose next forward raises once asked to (as a failed host-tier load or an OOM would)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        runner, self._fail = self.host.runner, False
        real_forward = runner.forward

        def forward(batch):
            if self._fail:
                raise RuntimeError("injected: this rank's forward failed")
            return real_forward(batch)

        runner.forward = forward

    def fail_next_forward(self) -> None:
        self._fail = True


def test_rank_failures_at_start_up_and_at_landing(ray_session, monkeypatch):
    """Rank 0 would sit in the TP rendezvous until its 10-minute timeout; start-up
    instead ends as soon as the follower's actor dies, naming it, and leaves no
    placement group behind. Then a follower that reports its bytes did not land
    fails that request (it used to start decoding without that rank's KV), and one
    whose bytes are late holds up only their request. Last, a follower whose forward
    fails takes its process down: rank 0's all-reduce ends at once (not at its 10-minute
    timeout), the request with an error, and the worker leaves the rotation."""
    monkeypatch.setenv("RAYDIX_HOME", str(ray_session))
    cluster = PDCluster(_config("qwen3", 1, 2, 4))
    cluster.follower_cls = _FollowerWithoutShard
    began = time.monotonic()
    with pytest.raises(WorkerStartError, match=r"decode-0-\w+ rank 1 failed to start: .*rank shard could not be loaded"):
        cluster.start()
    assert time.monotonic() - began < 60
    assert cluster.prefill == [] and cluster.decode == []
    deadline = time.monotonic() + 10
    while any(pg["state"] != "REMOVED" for pg in ray.util.placement_group_table().values()):
        assert time.monotonic() < deadline, ray.util.placement_group_table()
        time.sleep(0.2)

    # a good cluster starts afterwards; there a follower's share of one request fails to land
    cluster = PDCluster(_config("qwen3", 1, 2, 4))
    cluster.follower_cls = _FollowerFailingOnDemand
    cluster.start()
    batch = prompts(2, 5, 10, seed=4)
    with pytest.raises(PDRequestError, match="injected: rank 1 lost its share"):
        _generate_all(cluster, batch[:1])
    cluster.check_integrity()  # the notice had come, so the slots are free at once (no quarantine)

    # the follower's share of the next request is late: rank 0 decodes the other one meanwhile
    # (its loop used to wait for that share, so both ended together)
    client, ended = cluster.client(), {}

    async def timed(i):
        out = await client.generate(batch[i], GREEDY)
        ended[i] = time.monotonic()
        return out

    async def go():
        return await asyncio.gather(*(timed(i) for i in range(len(batch))))

    outs = asyncio.run(go())
    assert_greedy_parity(cluster.model_path, batch, [o["output_ids"] for o in outs], 8, [2])
    first, last = sorted(ended.values())
    assert last - first > _FollowerLosingOneTransfer.LATE_S / 2, ended
    cluster.check_integrity()

    decode = cluster.decode[0]
    ray.get(decode.followers[0].fail_next_forward.remote())
    began = time.monotonic()
    with pytest.raises(PDRequestError) as failed:
        _generate_all(cluster, batch[:1])
    assert time.monotonic() - began < 30, failed.value
    with pytest.raises(ray.exceptions.RayActorError):  # (its process went with its loop)
        ray.get(decode.followers[0].alive.remote())
    deadline = time.monotonic() + 15
    while True:  # the worker's watch of its ranks marks it broken: health fails from then on
        try:
            ray.get(decode.handle.health.remote())
        except Exception as exc:
            assert "broken" in str(exc), exc
            break
        assert time.monotonic() < deadline, "the worker never noticed its rank was gone"
        time.sleep(0.2)
    cluster.shutdown()


def test_gemma3_prefill_tp1_to_decode_tp2(ray_session, monkeypatch):
    """Sliding-window layers are head-sharded like the full ones: each decode rank takes its
    half of both, the window's SWA rows landing in the SWA slots rank 0 reserved (its follower
    learns them in the "expect" call and mirrors rank 0's full→SWA map)."""
    monkeypatch.setenv("RAYDIX_HOME", str(ray_session))
    cluster = PDCluster(_config("gemma3", 1, 2, 1)).start()
    batch = prompts(3, 20, 40, seed=4)  # past the 16-token window
    outs = _generate_all(cluster, batch)
    assert_greedy_parity(cluster.model_path, batch, [o["output_ids"] for o in outs], 8, [2])
    cluster.check_integrity()
    cluster.shutdown()


def test_host_tier_on_tp2_workers_of_both_sides(ray_session, monkeypatch, tmp_path):
    """Prefill TP 2 → decode TP 2, each with the hierarchical cache: a conversation's first turn
    leaves both small device pools for host memory, and its next turn comes back from there on
    every rank — the prefill side reloads instead of recomputing, the decode side reloads so only
    the new rows move — with tokens still equal to HF's. Both sides share one file tier, in
    which every rank of either keeps its own shard's pages."""
    monkeypatch.setenv("RAYDIX_HOME", str(ray_session))
    engine = {"page_size": 4, "max_total_tokens": 256, "skip_tokenizer_init": True,
              "enable_hierarchical_cache": True, "hicache_ratio": 4.0, "hicache_storage_dir": str(tmp_path)}
    side = {"tp_size": 2, "num_cpus_per_rank": 0.5, "engine": engine}
    # decode: write_back — a prefix backed up as it is evicted, its slots then reserved for a new prompt
    # whose KV the prefill ranks write straight into the followers (the backups land on them first)
    decode = dict(side, engine=dict(engine, hicache_write_policy="write_back"))
    cluster = PDCluster(parse_config({"model": {"builtin": "llama"}, "prefill": side, "decode": decode,
                                      "transfer": {"backend": "shm"}})).start()
    client = cluster.client()
    rng = random.Random(7)
    first = [rng.randrange(5, 250) for _ in range(96)]

    async def go():
        answer = await client.generate(first, GREEDY)
        turn = first + answer["output_ids"] + [rng.randrange(5, 250) for _ in range(5)]
        for ids in prompts(3, 120, 120, seed=93):  # neither 256-slot device pool keeps the first turn
            await client.generate(ids, GREEDY)
        return answer, turn, await client.generate(turn, GREEDY)

    answer, turn, out = asyncio.run(go())
    assert out["meta_info"]["prefill_cached_tokens"] >= 96 and out["meta_info"]["decode_cached_tokens"] >= 96
    assert_greedy_parity(cluster.model_path, [first, turn], [answer["output_ids"], out["output_ids"]], 8, [2])
    cluster.check_integrity()
    cluster.shutdown()
    pages = [{f.name for f in (tmp_path / f"tp2-rank{r}").glob("*.bin")} for r in (0, 1)]
    assert pages[0] == pages[1] and len(pages[0]) >= (len(turn) - 5) // 4
