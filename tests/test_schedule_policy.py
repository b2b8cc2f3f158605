"""The order admission tries waiting requests in (``schedule_policy``, priority scheduling) and
priority preemption: each policy's order against a brute-force expectation on a constructed
queue and tree, the cache-aware policies' fcfs fallback, lpm's in-batch deprioritisation, and
engines whose high-priority request preempts a running one for a row, room in each KV pool or a
Mamba state slot, or retracts nothing when that cannot make room (greedy tokens still HF's)."""

import pytest

import actors.engine.schedule_order as schedule_order
from actors.engine import Engine
from actors.engine.config import EngineConfig
from actors.engine.req import Req
from actors.engine.sampling_params import SamplingParams
from actors.engine.schedule_order import SchedulePolicy
from actors.engine.tiny import build_tiny_checkpoint
from mem_cache.radix_cache import RadixCache
from mem_cache.radix_key import RadixKey
from tests.hicache_helpers import gated_backups
from tests.parity import assert_greedy_parity


def policy_over(cached, name, **config):
    """A policy over a tree caching the token lists ``cached`` (no pools: keys are their own values),
    matching as the scheduler does (all but the last token); ``calls`` counts the matches."""
    tree = RadixCache(None, None)
    for ids in cached:
        tree.insert(RadixKey(ids))
    calls = []

    def match(req):
        calls.append(req.rid)
        result = tree.match_prefix(RadixKey(req.all_ids()[:-1], req.extra_key))
        req.prefix_indices, req.last_node = result.device_indices, result.last_device_node

    cfg = EngineConfig(model_path="unused", schedule_policy=name, **config)
    return SchedulePolicy(cfg, tree, match), calls


def req(rid, ids, max_new_tokens=8, priority=0):
    return Req(rid, list(ids), SamplingParams(max_new_tokens=max_new_tokens), priority=priority)


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


SYSTEM, OTHER = list(range(100, 148)), list(range(200, 208))  # 48 and 8 cached tokens


def queue():
    """Requests matching 0, 8, 48 + 8 or 48 cached tokens, in no order of it."""
    return [req("none", [1, 2, 3], 4), req("other", OTHER + [9, 9], 16), req("deep", SYSTEM + OTHER + [5], 2),
            req("system", SYSTEM + [7, 7], 16), req("other2", OTHER + [8], 1)]


def test_fcfs_lof_and_random_orders():
    waiting = queue()
    assert SchedulePolicy(EngineConfig(model_path="unused"), None, None).order(waiting) == waiting
    lof = policy_over([], "lof")[0].order(waiting)
    # brute force: no request ahead of one with more max_new_tokens; ties keep their arrival order
    for i, a in enumerate(lof):
        for b in lof[i + 1:]:
            na, nb = a.sampling_params.max_new_tokens, b.sampling_params.max_new_tokens
            assert na > nb or (na == nb and waiting.index(a) < waiting.index(b))
    shuffles = [policy_over([], "random", random_seed=seed)[0].order(waiting) for seed in range(4)]
    assert all(sorted(map(id, s)) == sorted(map(id, waiting)) for s in shuffles)  # permutations,
    assert policy_over([], "random", random_seed=0)[0].order(waiting) == shuffles[0]  # seeded,
    assert any(s != waiting for s in shuffles)  # not the arrival order


def test_lpm_puts_the_longest_cached_prefix_first():
    cached = [SYSTEM + OTHER, OTHER]
    policy, _ = policy_over(cached, "lpm")
    order = policy.order(queue())
    hits = [max(lcp(r.all_ids()[:-1], ids) for ids in cached) for r in order]
    assert [r.rid for r in order][:3] == ["deep", "system", "other"]
    assert hits == sorted(hits, reverse=True) and [len(r.prefix_indices) for r in order] == hits


def test_dfs_weight_walks_the_subtree_with_the_most_waiting_requests_first():
    """The tree: SYSTEM → SYSTEM+OTHER, and OTHER. Three requests wait under SYSTEM (one at
    SYSTEM+OTHER), two at OTHER, one at the root: SYSTEM's subtree goes first, deepest node
    first; then OTHER's; the root's last."""
    policy, _ = policy_over([SYSTEM + OTHER, SYSTEM + [1], OTHER], "dfs-weight")
    waiting = queue() + [req("system2", SYSTEM + [6, 6])]
    assert [r.rid for r in policy.order(waiting)] == ["deep", "system", "system2", "other", "other2", "none"]
    # two at OTHER outweigh one under SYSTEM now
    assert [r.rid for r in policy.order(queue()[:2] + queue()[4:] + [queue()[3]])] == [
        "other", "other2", "system", "none"]


@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
def test_cache_aware_policies_order_as_fcfs_on_a_long_queue(name, monkeypatch):
    monkeypatch.setattr(schedule_order, "CACHE_AWARE_MAX_WAITING", 4)
    policy, calls = policy_over([SYSTEM + OTHER, OTHER], name)
    waiting = queue()  # five: over the limit, nothing is matched
    assert policy.order(waiting) == waiting and calls == []
    assert policy.order(waiting[:4]) != waiting[:4] and len(calls) == 4


def test_lpm_defers_a_request_sharing_its_prefix_with_one_admitted_before_it():
    """Two uncached prompts that share 40 tokens: the second waits a round (then its prefix is
    cached) instead of computing it in the same batch; one with a long cached prefix is not
    checked, and one sharing less than the threshold is not deferred."""
    shared = list(range(300, 340))
    policy, _ = policy_over([SYSTEM], "lpm")
    waiting = [req("a", shared + [1]), req("cached", SYSTEM + [2, 2]), req("b", shared + [3]),
               req("short", shared[:20] + [4]), req("c", [9] + shared)]
    assert [r.rid for r in policy.order(waiting)] == ["cached", "a", "short", "c", "b"]


@pytest.mark.parametrize("low_first", [False, True])
@pytest.mark.parametrize("name", ["fcfs", "lpm"])
def test_priority_comes_before_the_policy(name, low_first):
    policy, _ = policy_over([SYSTEM], name, enable_priority_scheduling=True,
                            schedule_low_priority_values_first=low_first)
    waiting = [req(f"r{i}", (SYSTEM if i % 2 else []) + [i, i], priority=p) for i, p in enumerate([0, 3, 3, -1, 0, 3])]
    plain = policy_over([SYSTEM], name)[0].order(waiting)  # the policy's own order
    sign = 1 if low_first else -1
    assert policy.order(waiting) == sorted(plain, key=lambda r: (sign * r.priority, plain.index(r)))


def test_a_decode_workers_queue_takes_a_request_behind_its_priority():
    policy, _ = policy_over([], "fcfs", enable_priority_scheduling=True)
    queue_ = []
    for rid, p in [("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", 9)]:
        policy.enqueue(queue_, req(rid, [1, 2], priority=p))
    assert [r.rid for r in queue_] == ["e", "b", "d", "a", "c"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"), seed=0))


def priority_engine(model_dir, max_total_tokens=1024, max_running_requests=2, **kwargs):
    return Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=max_total_tokens,
                  max_running_requests=max_running_requests, enable_priority_scheduling=True, **kwargs)


def greedy_reqs(engine, prompts, priorities, max_new_tokens, ignore_eos=False):
    """``{rid: prompt}`` as greedy requests of ``priorities`` (``{rid: priority}``, 0 if absent)."""
    reqs = {rid: req(rid, ids, max_new_tokens, priority=priorities.get(rid, 0)) for rid, ids in prompts.items()}
    for r in reqs.values():
        r.sampling_params.temperature, r.sampling_params.ignore_eos = 0.0, ignore_eos
        r.eos_token_ids = engine.eos_token_ids
    return reqs


def finish_and_check(engine, model_dir, prompts, reqs, max_new_tokens, ignore_eos=False):
    """Run ``engine``'s scheduler to idle: every request done, its greedy tokens HF's, nothing leaked."""
    sched = engine.scheduler
    while sched.has_work():
        sched.step()
    assert all(r.finished for r in reqs.values())
    eos = () if ignore_eos else engine.eos_token_ids
    assert_greedy_parity(model_dir, list(prompts.values()), [reqs[rid].output_ids for rid in prompts],
                         max_new_tokens, eos)
    engine._check_integrity()


def test_a_much_higher_priority_request_preempts_a_running_one(model_dir):
    """Two rows, both decoding priority-0 requests: a priority-5 arrival (within the threshold
    of 10) waits; a priority-20 one retracts the latest priority-0 request and runs. Every
    request's greedy tokens are still HF's, and nothing leaks."""
    engine = priority_engine(model_dir)
    try:
        sched, prompts = engine.scheduler, {"low0": [5, 6, 7, 8], "low1": [9, 10, 11], "mid": [12, 13, 14, 15, 16],
                                            "high": [17, 18, 19]}
        reqs = greedy_reqs(engine, prompts, dict(mid=5, high=20), 12)

        def scenario():
            sched.add_request(reqs["low0"])
            sched.add_request(reqs["low1"])
            sched.step()
            sched.add_request(reqs["mid"])
            sched.step()
            assert sched.running == [reqs["low0"], reqs["low1"]] and sched.num_retractions == 0
            sched.add_request(reqs["high"])
            sched.step()
            assert sched.running == [reqs["low0"], reqs["high"]] and sched.num_retractions == 1
            assert sched.num_preemptions == 1
            assert [r.rid for r in sched.waiting] == ["low1", "mid"]
            finish_and_check(engine, model_dir, prompts, reqs, 12)

        engine.loop.run_exclusive(scenario)
        assert reqs["low1"].num_retractions == 1
    finally:
        engine.shutdown()


# A 128-slot pool; two 4-token priority-0 prompts decoding (40 new tokens each, reserving 27 slots
# each at the ratio 0.7 after their first token) leave 128 - 8 - 54 = 66 slots to a prefill. A
# 40-token prompt reserving 28 needs 40 + 28 + 1 = 69: 3 short, which one of them gives back.
ROOM_PROMPTS = {"low0": [5, 6, 7, 8], "low1": [9, 10, 11, 12], "high": list(range(20, 60))}


@pytest.mark.parametrize("max_running_requests", [4, 2])
def test_a_higher_priority_request_short_of_room_preempts_only_what_it_needs(model_dir, max_running_requests):
    """Short of KV room (with rows to spare, or with none either), a priority-20 arrival retracts
    the latest priority-0 request, and only it: the room that one gives back is enough. (With the
    row taken first on its own, the room it gave back was not counted, and the other was retracted
    too.) The preempted request comes back after, its output kept; every request's greedy tokens
    are HF's, and nothing leaks."""
    engine = priority_engine(model_dir, max_total_tokens=128, max_running_requests=max_running_requests)
    try:
        sched = engine.scheduler
        reqs = greedy_reqs(engine, ROOM_PROMPTS, dict(high=20), 40, ignore_eos=True)

        def scenario():
            sched.add_request(reqs["low0"])
            sched.add_request(reqs["low1"])
            sched.step()
            sched.step()
            kept = list(reqs["low1"].output_ids)
            sched.add_request(reqs["high"])
            sched.step()
            assert sched.running == [reqs["low0"], reqs["high"]] and sched.waiting == [reqs["low1"]]
            assert sched.num_retractions == 1 and reqs["low1"].output_ids == kept
            finish_and_check(engine, model_dir, ROOM_PROMPTS, reqs, 40, ignore_eos=True)

        engine.loop.run_exclusive(scenario)
        assert reqs["low1"].num_retractions == 1 and reqs["low0"].num_retractions == 0
    finally:
        engine.shutdown()


def test_a_request_that_preemption_cannot_make_room_for_retracts_nothing(model_dir):
    """Both rows taken, by a priority-0 and a priority-15 request: a priority-20 arrival may preempt
    only the first (the second is within the threshold), whose row it would get but whose room is
    too little for its 70-token prompt. It waits and retracts nothing (taken for its row alone, the
    priority-0 request was retracted in vain), and runs once they are done."""
    prompts = dict(ROOM_PROMPTS, high=list(range(20, 90)))
    engine = priority_engine(model_dir, max_total_tokens=128, max_running_requests=2)
    try:
        sched = engine.scheduler
        reqs = greedy_reqs(engine, prompts, dict(low1=15, high=20), 40, ignore_eos=True)

        def scenario():
            sched.add_request(reqs["low0"])
            sched.add_request(reqs["low1"])
            sched.step()
            sched.add_request(reqs["high"])
            sched.step()
            assert sched.running == [reqs["low1"], reqs["low0"]] and sched.waiting == [reqs["high"]]  # (by priority)
            assert sched.num_retractions == 0
            finish_and_check(engine, model_dir, prompts, reqs, 40, ignore_eos=True)

        engine.loop.run_exclusive(scenario)
    finally:
        engine.shutdown()


def test_a_victims_prefix_a_backup_in_flight_also_locks_counts_as_room_it_gives_back(model_dir):
    """Host tier, write-through backups held in flight: a finished request's 16-token prompt is
    being copied to the host (its backup locks it) when a priority-0 request that extends it
    runs. What retracting that request gives back is counted exactly — its decode reserve, its
    own KV and the 16 tokens only it and the backup lock, which the admission counts as room at
    once (``writing_size``: eviction waits for the copy) — not 16 short. Greedy tokens are HF's;
    nothing leaks."""
    engine = priority_engine(model_dir, max_total_tokens=256, enable_hierarchical_cache=True, hicache_ratio=4.0)
    try:
        sched, tree = engine.scheduler, engine.scheduler.tree_cache
        gate, _, _ = gated_backups(tree.cache_controller)
        prompts = {"first": list(range(30, 46)), "other": list(range(5, 17)), "next": list(range(30, 46)) + [7, 8, 9, 10]}
        reqs = greedy_reqs(engine, prompts, {}, 8, ignore_eos=True)
        reqs["first"].sampling_params.max_new_tokens = 1

        def scenario():
            sched.add_request(reqs["first"])
            sched.add_request(reqs["other"])
            while not reqs["first"].finished:
                sched.step()
            sched.add_request(reqs["next"])
            sched.step()
            victim = reqs["next"]
            assert victim in sched.running and tree.writes_pending and tree.writing_size() == 0
            room, freed = sched._prefill_room()[0], sched._freed_by([victim])
            sched._retract(victim)
            assert tree.writing_size() == 16 and freed.full == sched._prefill_room()[0] - room
            gate.set()
            while sched.has_work():
                sched.step()
            assert_greedy_parity(model_dir, [prompts["other"], prompts["next"]],
                                 [reqs["other"].output_ids, reqs["next"].output_ids], 8, ())
            engine._check_integrity()

        engine.loop.run_exclusive(scenario)
    finally:
        engine.shutdown()

@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return str(build_tiny_checkpoint("gemma3", tmp_path_factory.mktemp("tiny-gemma3"), seed=0))


def test_a_request_short_of_swa_room_preempts_for_the_window_a_victim_holds_in_the_tree(gemma3_dir):
    """Gemma 3 (window 16), a 64-slot SWA pool: a 30-token conversation is cached; a priority-0
    request extending it locks its 31-token path, SWA included (whole nodes), and decodes. A
    priority-20 40-token arrival lacks 13 SWA slots (none of the 512 full ones): the priority-0
    request gives back 34 (its row's, its reserve's, and the tree's window only its lock held). (In
    full-pool terms, its reserve and row beyond the cache: 3 slots, and it was not preempted.)"""
    prompts = {"warm": list(range(10, 40)), "low": list(range(10, 40)) + [50], "high": list(range(60, 100))}
    engine = priority_engine(gemma3_dir, max_total_tokens=512, max_running_requests=4, swa_full_tokens_ratio=0.125)
    try:
        sched = engine.scheduler
        reqs = greedy_reqs(engine, prompts, dict(high=20), 5, ignore_eos=True)

        def scenario():
            sched.add_request(reqs["warm"])
            while sched.has_work():
                sched.step()
            sched.add_request(reqs["low"])
            sched.step()
            sched.step()
            sched.add_request(reqs["high"])
            sched.step()
            assert sched.running == [reqs["high"]] and sched.waiting == [reqs["low"]] and sched.num_retractions == 1
            finish_and_check(engine, gemma3_dir, prompts, reqs, 5, ignore_eos=True)

        engine.loop.run_exclusive(scenario)
    finally:
        engine.shutdown()


def test_a_request_that_a_victims_swa_room_cannot_make_room_for_retracts_nothing(gemma3_dir):
    """Gemma 3, a 128-slot SWA pool: a priority-15 request holds 40 tokens' SWA, a priority-0
    4-token one decodes with 60 new tokens to go. A priority-20 72-token arrival lacks 25 SWA slots;
    retracting the priority-0 request gives back 21 (its reserve is 41 full slots, but at most a
    window's 16 SWA ones): it retracts nothing and waits. (Counted in full-pool slots, 42 were
    enough: it was retracted, the arrival still did not fit, and it had been retracted in vain.)"""
    prompts = {"mid": list(range(100, 140)), "low": [5, 6, 7, 8], "high": list(range(60, 132))}
    engine = priority_engine(gemma3_dir, max_total_tokens=512, max_running_requests=4, swa_full_tokens_ratio=0.25)
    try:
        sched = engine.scheduler
        reqs = greedy_reqs(engine, prompts, dict(mid=15, high=20), 60, ignore_eos=True)
        reqs["mid"].sampling_params.max_new_tokens = reqs["high"].sampling_params.max_new_tokens = 30

        def scenario():
            sched.add_request(reqs["mid"])
            sched.add_request(reqs["low"])
            sched.step()
            sched.step()
            sched.add_request(reqs["high"])
            sched.step()
            assert sched.running == [reqs["mid"], reqs["low"]] and sched.waiting == [reqs["high"]]
            assert sched.num_retractions == 0
            while sched.has_work():
                sched.step()
            assert all(r.finished for r in reqs.values()) and reqs["low"].num_retractions == 0
            for rids, max_new in [(["mid", "high"], 30), (["low"], 60)]:
                assert_greedy_parity(gemma3_dir, [prompts[r] for r in rids], [reqs[r].output_ids for r in rids], max_new)
            engine._check_integrity()

        engine.loop.run_exclusive(scenario)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("cached", [True, False])
def test_a_higher_priority_request_preempts_for_a_mamba_state_slot(tmp_path_factory, monkeypatch, cached):
    """Qwen3-Next, three Mamba state slots: a priority-15 and a priority-0 request decode, and the
    third holds the state the cache keeps of the first's prompt (under its lock). A priority-20
    arrival has KV room and a row, not a state slot: ``cached``, it extends that prompt and the
    copy of the state finds no slot; else its row finds none. It preempts the priority-0 request
    for its slot, and only it. (It stopped at the failed copy, or was planned without the slot
    and failed its allocation: no preemption was tried.) Greedy tokens are HF's; nothing leaks."""
    from actors.engine.model_runner import ModelRunner

    model_dir = str(build_tiny_checkpoint("qwen3_next", tmp_path_factory.mktemp("tiny-qwen3-next"), seed=0))
    monkeypatch.setattr(ModelRunner, "_num_mamba_slots", lambda self, max_running_requests: 3)
    prompts = {"mid": [9, 10, 11], "low": [5, 6, 7, 8], "high": [9, 10, 11, 7, 8] if cached else list(range(60, 70))}
    engine = priority_engine(model_dir, max_total_tokens=512, max_running_requests=4)
    try:
        sched, tree = engine.scheduler, engine.scheduler.tree_cache
        reqs = greedy_reqs(engine, prompts, dict(mid=15, high=20), 6, ignore_eos=True)

        def scenario():
            sched.add_request(reqs["mid"])
            sched.add_request(reqs["low"])
            sched.step()
            assert engine.runner.mamba_pool.available_size() == tree.mamba_evictable_size() == 0
            sched.add_request(reqs["high"])
            sched.step()
            assert sched.running == [reqs["mid"], reqs["high"]] and sched.waiting == [reqs["low"]]
            assert sched.num_retractions == 1 and reqs["high"].cached_tokens == (3 if cached else 0)
            finish_and_check(engine, model_dir, prompts, reqs, 6, ignore_eos=True)

        engine.loop.run_exclusive(scenario)
    finally:
        engine.shutdown()


def test_a_priority_needs_priority_scheduling(model_dir):
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=256)
    try:
        with pytest.raises(ValueError, match="priority 3: priority scheduling is not enabled"):
            engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2}, priority=3)
        assert engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2}, priority=0)["output_ids"]
    finally:
        engine.shutdown()
