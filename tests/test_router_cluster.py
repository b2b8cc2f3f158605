"""The router actor over real workers on Ray (2 prefill + 2 decode of the tiny llama, one Ray
session): groups of requests sharing long prefixes land on the worker holding their prefix, the
hit rate is near a single cache's and the load is even — on the prefill side and, through the
decode workers' own radix caches, on the decode side (the prefix's KV does not move again);
round-robin on the same workload hits measurably less; a new router rebuilt from the workers routes with affinity at once; a killed
prefill worker leaves the rotation and the index by heartbeat."""

import asyncio
import random
import time

import pytest
import ray

from cluster.config import parse_config
from cluster.pd import PDCluster
from tests.router_helpers import group_prompts

pytestmark = pytest.mark.slow
PAGE, PREFIX, SUFFIX, GROUPS, PER_GROUP = 16, 192, 16, 4, 5
PARAMS = {"max_new_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import os

    old = os.environ.get("RAYDIX_HOME")
    os.environ["RAYDIX_HOME"] = str(tmp_path_factory.mktemp("raydix-home"))
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="raydix-router-tests")
    engine = {"page_size": PAGE, "max_total_tokens": 4096, "skip_tokenizer_init": True}
    group = {"num_cpus_per_rank": 0.5, "engine": engine}
    config = parse_config({
        "model": {"builtin": "llama"},
        "prefill": dict(group, num_workers=2), "decode": dict(group, num_workers=2),
        "transfer": {"backend": "shm", "heartbeat_interval_s": 0.5},
        "router": {"decode_policy": "cache_aware", "event_interval_s": 0.02},
    })
    pd = PDCluster(config).start()
    yield pd
    pd.shutdown()
    ray.shutdown()
    if old is None:
        os.environ.pop("RAYDIX_HOME", None)
    else:
        os.environ["RAYDIX_HOME"] = old


def run_rounds(client, groups, seed):
    """Round 0: every group's first request at once; then each round one request per group, in a
    shuffled order, at once. Returns ``[(group, meta_info)]``."""
    rng = random.Random(seed)
    results = []

    async def one_round(pairs):
        outs = await asyncio.gather(*(client.generate(ids, PARAMS) for _, ids in pairs))
        results.extend((g, out["meta_info"]) for (g, _), out in zip(pairs, outs))

    for r in range(PER_GROUP):
        pairs = [(g, groups[g][r]) for g in range(len(groups))]
        rng.shuffle(pairs)
        asyncio.run(one_round(pairs))
    return results


def hit_rate(results, side="prefill"):
    return sum(m[f"{side}_cached_tokens"] for _, m in results) / sum(m["prompt_tokens"] for _, m in results)


def oracle_hit_rate(groups):
    """One cache holding everything: every request after its group's first reuses the prefix."""
    hits = sum((len(g) - 1) * (PREFIX - PREFIX % PAGE) for g in groups)
    return hits / sum(len(ids) for g in groups for ids in g)


def test_affinity_hit_rate_balance_restart_and_a_dead_worker(cluster):
    started = time.perf_counter()
    groups = group_prompts(GROUPS, PER_GROUP, PREFIX, SUFFIX, seed=11)
    router = cluster.start_router()
    aware = run_rounds(cluster.client(router=router), groups, seed=1)

    homes = {}
    for g, meta in aware:
        homes.setdefault(g, set()).add(meta["prefill_worker"])
    assert all(len(h) == 1 for h in homes.values()), homes  # each group stays on one worker
    per_worker = [sum(1 for _, m in aware if m["prefill_worker"] == w.worker_id) for w in cluster.prefill]
    assert max(per_worker) <= 1.5 * min(per_worker), per_worker  # and the groups are spread evenly
    oracle, aware_hit = oracle_hit_rate(groups), hit_rate(aware)
    assert aware_hit >= 0.95 * oracle, (aware_hit, oracle)
    decode_homes = {}
    for g, meta in aware:
        decode_homes.setdefault(g, set()).add(meta["decode_worker"])
    assert all(len(h) == 1 for h in decode_homes.values()), decode_homes  # a group's turns return to its decoder
    assert len(set.union(*decode_homes.values())) == 2  # and the groups use both decode workers
    aware_decode_hit = hit_rate(aware, "decode")
    assert aware_decode_hit >= 0.95 * oracle, (aware_decode_hit, oracle)
    stats = ray.get(router.stats.remote())
    assert stats["routed"] == GROUPS * PER_GROUP and stats["inflight"] == 0

    # a restart: the new router knows only what the workers report, and routes with affinity again
    ray.kill(router)
    router = cluster.start_router()
    assert ray.get(router.stats.remote())["indexed_pages"] >= GROUPS * PREFIX // PAGE
    again = [g[0][:PREFIX] + [5] * SUFFIX for g in groups]
    client = cluster.client(router=router)

    async def send_again():
        return await asyncio.gather(*(client.generate(ids, PARAMS) for ids in again))

    outs = asyncio.run(send_again())
    for g, out in enumerate(outs):
        assert out["meta_info"]["prefill_worker"] in homes[g]
        assert out["meta_info"]["prefill_cached_tokens"] == PREFIX

    # round-robin beside it, on the same workload from empty caches
    ray.get([w.handle.flush_cache.remote() for w in cluster.prefill + cluster.decode])
    blind = run_rounds(cluster.client(), groups, seed=1)
    assert hit_rate(blind) <= aware_hit - 0.1, (hit_rate(blind), aware_hit)
    assert hit_rate(blind, "decode") <= aware_decode_hit - 0.1, (hit_rate(blind, "decode"), aware_decode_hit)

    # a prefill worker dies: out of rotation and out of the index by heartbeat
    victim, survivor = cluster.prefill
    ray.kill(victim.handle)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = {w["worker_id"]: w for w in ray.get(router.list_workers.remote())}
        if not rows[victim.worker_id]["alive"]:
            break
        time.sleep(0.2)
    assert not rows[victim.worker_id]["alive"] and rows[victim.worker_id]["cached_pages"] == 0
    victim.alive = False
    decisions = ray.get([router.route.remote(f"after-{g}", groups[g][0]) for g in range(GROUPS)])
    assert {d.prefill_id for d in decisions} == {survivor.worker_id}
    ray.get([router.release.remote(f"after-{g}") for g in range(GROUPS)])
    ray.get([w.handle.check_integrity.remote() for w in (survivor, *cluster.decode)])
    print(f"hit rate: cache_aware {aware_hit:.3f} (decode {aware_decode_hit:.3f}), round_robin {hit_rate(blind):.3f} "
          f"(decode {hit_rate(blind, 'decode'):.3f}), oracle {oracle:.3f}; "
          f"requests per prefill worker {per_worker}; {time.perf_counter() - started:.1f}s")
