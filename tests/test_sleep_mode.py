"""Sleep mode (actors.engine.memory_occupation): an engine's KV cache and weights given back and taken
again (vLLM's sleep / wake_up, SGLang's release / resume_memory_occupation). Released, the buffers hold no
memory and requests are refused; woken from level 1 the engine gives the tokens it gave before, from an
empty cache; level 2's weights serve only once an update has written them; a request in flight refuses
the release; at TP 2 both ranks release."""

import asyncio
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from actors.engine import Engine
from actors.engine.memory_occupation import NotIdleError, RankMemory, SleepingError, kv_pools, parse_tags
from actors.engine.tiny import build_tiny_checkpoint
from actors.engine.weight_updates import WeightUpdater
from actors.workers import DecodeWorker, PrefillWorker
from cluster.backend import PDBackend
from mem_cache.buffer_allocator import LocalBufferAllocator, SharedMemoryBufferAllocator
from tests.parity import assert_greedy_parity
from tests.pd_helpers import Handle, close_workers, make_pair, run_batch
from tests.test_weight_tensor_updates import tensors
from tests.tp_helpers import pd_worker_tp2, thread_ranks
from transfer.base import KVHandoff, TransferError

GREEDY = {"temperature": 0, "max_new_tokens": 8}
ENGINE = dict(skip_tokenizer_init=True, max_total_tokens=1024, page_size=4)
NGRAM = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4, "speculative_ngram_max": 3}
BATCH = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sleep")
    return {name: str(build_tiny_checkpoint(family, root / name, seed=seed)) for name, family, seed in
            (("old", "llama", 0), ("new", "llama", 1), ("qwen3_next", "qwen3_next", 0), ("gemma3", "gemma3", 0))}


def held_bytes(runner):
    """(KV and Mamba state bytes, a verify step's scratch's too, weight bytes) the runner's buffers hold."""
    kv = sum(t.untyped_storage().nbytes() for p in kv_pools(runner)
             for t in [*p.buffer_allocator.buffers().values(), *getattr(p, "verify_states", [])])
    weights = sum(t.untyped_storage().nbytes() for t, _ in runner.weights.targets.values())
    return kv, weights


def outputs(eng):
    return [o["output_ids"] for o in eng.generate(input_ids=BATCH, sampling_params=GREEDY)]


def served(eng):
    return {name: t.clone() for name, (t, _) in eng.runner.weights.targets.items()}


@pytest.mark.parametrize("model, extra", [
    ("old", {}), ("old", {"enable_hierarchical_cache": True, "hicache_ratio": 2.0}),  # MHA, with a host tier
    ("qwen3_next", {"page_size": 1}), ("gemma3", {}),  # Mamba + full attention; SWA + full
    ("qwen3_next", {"page_size": 1, **NGRAM})])  # the Mamba pool's verify scratch too
def test_level_1_gives_the_memory_back_and_wakes_up_to_the_same_tokens(checkpoints, model, extra):
    eng = Engine(model_path=checkpoints[model], **{**ENGINE, **extra})
    try:
        before, weights = outputs(eng), served(eng)
        kv_bytes, weight_bytes = held_bytes(eng.runner)
        assert kv_bytes > 0 and weight_bytes > 0 and not eng.is_sleeping()
        eng.sleep(level=1)
        assert eng.is_sleeping() and held_bytes(eng.runner) == (0, 0)
        with pytest.raises(RuntimeError, match="sleeping"):
            eng.generate(input_ids=BATCH[0], sampling_params=GREEDY)
        with pytest.raises(RuntimeError, match="sleeping"):
            asyncio.run(eng.async_generate(input_ids=BATCH[0], sampling_params=GREEDY))
        with pytest.raises(ValueError, match="weights are released"):
            eng.update_weights_from_disk(checkpoints[model])
        eng.wake_up()
        assert not eng.is_sleeping() and held_bytes(eng.runner) == (kv_bytes, weight_bytes)
        assert all(torch.equal(t, weights[name]) for name, t in served(eng).items())
        eng.check_integrity()  # (the cache empty, every slot free)
        after = eng.generate(input_ids=BATCH, sampling_params=GREEDY)
        assert [o["meta_info"]["cached_tokens"] for o in after] == [0, 0]  # its KV went, the host tier's copies too
        assert [o["output_ids"] for o in after] == before
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_level_2_serves_once_an_update_wrote_the_weights(checkpoints):
    """vLLM's RL flow: sleep level 2, wake the weights, update them, wake the KV cache; the new
    checkpoint's tokens. Woken without an update, the discarded weights refuse requests."""
    eng = Engine(model_path=checkpoints["old"], **ENGINE)
    try:
        before = outputs(eng)
        eng.sleep(level=2)
        eng.wake_up(tags=["weights"])
        assert eng.is_sleeping()  # (its KV cache still released)
        assert all(not t.any() for t in served(eng).values())  # discarded: no copy restored them
        eng.update_weights_from_disk(checkpoints["new"], weight_version="step-1")
        eng.wake_up(tags=["kv_cache"])
        after = outputs(eng)
        assert_greedy_parity(checkpoints["new"], BATCH, after, 8, eng.eos_token_ids)
        assert after != before
        eng.check_integrity()
        eng.release_memory_occupation(tags=["weights", "cuda_graph"])  # (SGLang's: no copy kept)
        eng.resume_memory_occupation()
        assert_refused_until_updated(eng, checkpoints["old"], before)
    finally:
        eng.shutdown()


def draft_bytes(runner):
    """Bytes a draft model's checkpoint tensors hold."""
    return sum(t.untyped_storage().nbytes() for t in RankMemory(runner)._draft_weights())


def test_a_draft_models_weights_are_released_and_always_restored(checkpoints):
    """Draft-model speculation: the draft's weights go with ``weights`` and come back from their CPU copy at
    level 2 too (no update writes them): woken and updated, every draft is accepted as before (a draft of the
    target's weights; zeros would propose token 0)."""
    eng = Engine(model_path=checkpoints["old"], **ENGINE, speculative_algorithm="draft_model",
                 speculative_draft_model_path=checkpoints["old"], speculative_num_draft_tokens=4)
    try:
        before, stats = outputs(eng), eng.scheduler.spec_stats
        weights = [t.clone() for t in RankMemory(eng.runner)._draft_weights()]
        drafted = stats.num_draft_tokens
        assert drafted > 0 and stats.num_accepted_tokens == drafted
        for level in (1, 2):
            eng.sleep(level=level)
            assert held_bytes(eng.runner) == (0, 0) and draft_bytes(eng.runner) == 0
            eng.wake_up()
            assert all(torch.equal(t, w) for t, w in zip(RankMemory(eng.runner)._draft_weights(), weights))
            if level == 2:
                eng.update_weights_from_disk(checkpoints["old"])
            assert outputs(eng) == before
            assert stats.num_draft_tokens > drafted and stats.num_accepted_tokens == stats.num_draft_tokens
            drafted = stats.num_draft_tokens
        eng.check_integrity()
    finally:
        eng.shutdown()


def assert_refused_until_updated(eng, checkpoint, before):
    """Discarded weights: ``eng`` refuses to generate until ``checkpoint`` (whose outputs were ``before``)
    is written over them, then serves as before."""
    with pytest.raises(RuntimeError, match="weights were discarded"):
        eng.generate(input_ids=BATCH[0], sampling_params=GREEDY)
    eng.update_weights_from_disk(checkpoint)
    assert outputs(eng) == before
    eng.check_integrity()


def test_discarded_weights_serve_once_every_tensor_was_written(checkpoints):
    """Level 2's weights updated from tensors in two buckets (a trainer's): after the first, the other
    tensors still zeros, requests are refused (served garbage before); after the second, the tokens of
    the checkpoint. A level-1 sleep meanwhile keeps what is left to write."""
    eng = Engine(model_path=checkpoints["old"], **ENGINE)
    try:
        before = outputs(eng)
        bucket = sorted(tensors(checkpoints["old"]).items())
        eng.sleep(level=2)
        eng.wake_up()
        eng.update_weights_from_tensor(bucket[:len(bucket) // 2])
        eng.sleep(level=1)
        eng.wake_up()
        with pytest.raises(RuntimeError, match="weights were discarded"):
            eng.generate(input_ids=BATCH[0], sampling_params=GREEDY)
        eng.update_weights_from_tensor(bucket[len(bucket) // 2:])
        assert outputs(eng) == before
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_a_release_racing_a_weight_update_refuses_the_update(checkpoints, monkeypatch):
    """A release landing while an update waits for the engine to drain (after its start, before its copy):
    the update is refused there, under the loop's lock, and writes nothing (it copied into the freed
    weights: a segfault, before the check moved under the lock); resumed, the weights serve once updated."""
    eng = Engine(model_path=checkpoints["old"], **ENGINE)
    hold = WeightUpdater._hold

    def hold_then_release(updater):
        hold(updater)
        eng.sleep(level=2)

    try:
        monkeypatch.setattr(WeightUpdater, "_hold", hold_then_release)
        with pytest.raises(ValueError, match="weights are released"):
            eng.update_weights_from_disk(checkpoints["new"])
        monkeypatch.undo()
        eng.wake_up()
        with pytest.raises(RuntimeError, match="weights were discarded"):
            eng.generate(input_ids=BATCH[0], sampling_params=GREEDY)
        eng.update_weights_from_disk(checkpoints["new"])
        assert_greedy_parity(checkpoints["new"], BATCH, outputs(eng), 8, eng.eos_token_ids)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_a_request_in_flight_refuses_the_release(checkpoints):
    """A request held (here by a pause, KV kept) refuses the release, nothing released; once it has
    ended the release goes. Unknown tags are refused; "cuda_graph" alone releases nothing."""
    eng = Engine(model_path=checkpoints["old"], **ENGINE)
    try:
        eng.pause_generation("in_place")
        done = []
        thread = threading.Thread(target=lambda: done.append(eng.generate(input_ids=BATCH[0], sampling_params=GREEDY)))
        thread.start()
        deadline = time.monotonic() + 30
        while not eng.loop.held_reqs() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="requests are in flight"):
            eng.sleep(level=1)
        assert not eng.is_sleeping() and held_bytes(eng.runner)[0] > 0
        eng.continue_generation()
        thread.join(30)
        assert len(done[0]["output_ids"]) == 8
        with pytest.raises(ValueError, match="unknown memory tags \\['kv'\\]"):
            eng.release_memory_occupation(tags=["kv"])
        eng.release_memory_occupation(tags=["cuda_graph"])
        assert not eng.is_sleeping()
        eng.release_memory_occupation(tags=["kv_cache"])
        assert held_bytes(eng.runner)[0] == 0 and held_bytes(eng.runner)[1] > 0
        eng.resume_memory_occupation(tags=["kv_cache"])
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_tp2_every_rank_releases_and_resumes(checkpoints, monkeypatch):
    thread_ranks(monkeypatch)
    eng = Engine(model_path=checkpoints["old"], tp_size=2, **ENGINE)
    try:
        before = outputs(eng)
        deadline = time.monotonic() + 30
        while not eng.tp_group.followers and time.monotonic() < deadline:
            time.sleep(0.01)
        follower = eng.tp_group.followers[0].runner
        held = held_bytes(follower)
        eng.sleep(level=1)
        assert held_bytes(follower) == (0, 0) and held_bytes(eng.runner) == (0, 0)
        eng.wake_up()
        assert held_bytes(follower) == held
        assert outputs(eng) == before
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_pp2_discarded_weights_serve_once_every_stages_tensors_were_written(checkpoints, monkeypatch):
    """Level 2 at PP 2: rank 0 holds the first stage's tensors only. An update of those alone leaves the
    last stage's zeros, and requests are refused (served garbage before: rank 0's names were all it
    waited for); the last stage's then written, the tokens are the checkpoint's."""
    thread_ranks(monkeypatch)
    eng = Engine(model_path=checkpoints["old"], pp_size=2, **ENGINE)
    try:
        before = outputs(eng)
        first = set(eng.runner.weights.targets)
        bucket = sorted(tensors(checkpoints["old"]).items())
        eng.sleep(level=2)
        eng.wake_up()
        eng.update_weights_from_tensor([(name, t) for name, t in bucket if name in first])
        with pytest.raises(RuntimeError, match="weights were discarded"):
            eng.generate(input_ids=BATCH[0], sampling_params=GREEDY)
        eng.update_weights_from_tensor([(name, t) for name, t in bucket if name not in first])
        assert outputs(eng) == before
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_tp2_a_follower_failing_the_release_leaves_every_rank_awake(checkpoints, monkeypatch):
    """All ranks or none: a follower refusing the release, rank 0 (released first) allocates its memory
    anew and the engine serves the same tokens (it looked awake on freed buffers before); at level 2 the
    discarded weights refuse requests until an update."""
    thread_ranks(monkeypatch)
    eng = Engine(model_path=checkpoints["old"], tp_size=2, **ENGINE)
    release = RankMemory.release

    def fail_on_the_follower(rank, tags, keep_weights=False):
        if rank.runner is not eng.runner:
            raise RuntimeError("out of host memory")
        release(rank, tags, keep_weights)

    try:
        before, held = outputs(eng), held_bytes(eng.runner)
        monkeypatch.setattr(RankMemory, "release", fail_on_the_follower)
        for level in (1, 2):
            with pytest.raises(ValueError, match="rank 1: RuntimeError: out of host memory"):
                eng.sleep(level=level)
            assert not eng.is_sleeping() and held_bytes(eng.runner) == held
        assert_refused_until_updated(eng, checkpoints["old"], before)
    finally:
        eng.shutdown()


def test_buffers_released_and_resumed_zero_filled_shared_ones_in_new_files():
    alloc = LocalBufferAllocator("cpu")
    buf = alloc.zeros("k", (4, 8), torch.float32)
    view = buf[1]
    buf.fill_(3.0)
    alloc.release()
    assert buf.untyped_storage().nbytes() == 0 and buf.shape == (4, 8)
    alloc.resume()
    assert buf.untyped_storage().nbytes() == buf.nbytes and not buf.any()
    view.fill_(1.0)  # (a view shares the new storage)
    assert buf[1].eq(1.0).all() and buf.sum() == 8
    shared = SharedMemoryBufferAllocator(prefix="sleep")
    try:
        buf, (old,) = shared.zeros("k", (4, 8), torch.float32), shared.export_handles()
        view = buf[1]
        buf.fill_(3.0)
        shared.release()  # (the file unlinked, unmapped here)
        assert buf.untyped_storage().nbytes() == 0 and not os.path.exists(old.payload) and not shared.export_handles()
        shared.resume()
        (new,) = shared.export_handles()
        assert new.payload != old.payload and buf.untyped_storage().filename == new.payload and not buf.any()
        view.fill_(1.0)
        assert buf[1].eq(1.0).all() and buf.sum() == 8
    finally:
        shared.close()
    assert not os.path.exists(new.payload)
    assert parse_tags(None) == {"kv_cache", "weights", "cuda_graph"}


def segments(hosts):
    """The shared-memory files of the decode ranks' pools (``hosts``: their RankHosts)."""
    return {h.payload for host in hosts for h in host.buffer_allocator.export_handles()}


def mapped(paths):
    """Those of ``paths`` this process maps (a prefill rank's mapping of a decode pool: both workers run here)."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    return {p for p in paths if p in maps}


def peer_files(prefill_hosts):
    """The decode pools' files the prefill ranks' agents map, by the decode agent id they map them as."""
    return {agent_id: {t.untyped_storage().filename for t in tensors.values()}
            for host in prefill_hosts for agent_id, tensors in host.agents["shm"]._peers.items()}


def pd_workers(path, tp, monkeypatch):
    """A prefill and a decode worker of TP ``tp`` in this process (TP 2: the followers on threads), and
    each one's rank hosts."""
    if tp == 1:
        prefill, decode = make_pair(path, 4)
        return prefill, decode, [prefill.rank], [decode.rank], []
    thread_ranks(monkeypatch)
    args = dict(max_total_tokens=2048, page_size=4, skip_tokenizer_init=True)
    (prefill, p1), (decode, d1) = pd_worker_tp2(PrefillWorker, path, args), pd_worker_tp2(DecodeWorker, path, args)
    return prefill, decode, [prefill.rank, p1.host], [decode.rank, d1.host], [p1, d1]


@pytest.mark.parametrize("tp", [1, 2])
def test_pd_workers_release_and_resume_into_new_decode_segments(checkpoints, monkeypatch, tp):
    """Both workers of a PD pair sleep (level 1) and wake, every TP rank: the decode pools' shared-memory
    files are unlinked and unmapped by both sides (each prefill rank's agent dropped its mapping),
    requests are refused meanwhile, and woken the decode pools are new files, under new agent ids,
    which each prefill rank maps and pushes into afresh; the tokens those of before."""
    prefill, decode, prefill_hosts, decode_hosts, followers = pd_workers(checkpoints["old"], tp, monkeypatch)
    workers = (prefill, decode)
    try:
        first = run_batch(prefill, decode, BATCH, GREEDY)
        before, stale = [r[0]["output_ids"] for r in first], KVHandoff.from_bytes(first[0][2][0])
        old = segments(decode_hosts)
        old_ids = [host.agents["shm"].agent_id for host in decode_hosts]
        assert peer_files(prefill_hosts) == {i: segments([h]) for i, h in zip(old_ids, decode_hosts)}
        assert mapped(old) == old and len(old) == tp * len(segments(decode_hosts[:1]))
        for w in workers:
            asyncio.run(w.release_memory_occupation(keep_weights=True))
        assert all(w.is_sleeping() and held_bytes(w.runner) == (0, 0) for w in workers)
        assert not any(os.path.exists(p) for p in old) and not mapped(old) and not peer_files(prefill_hosts)
        with pytest.raises(SleepingError, match="sleeping"):
            run_batch(prefill, decode, BATCH[:1], GREEDY)
        for w in workers:
            asyncio.run(w.resume_memory_occupation())
        new = segments(decode_hosts)
        assert len(new) == len(old) and not new & old
        after = run_batch(prefill, decode, BATCH, GREEDY)
        assert [r[0]["output_ids"] for r in after] == before
        assert [r[0]["meta_info"]["cached_tokens"] for r in after] == [0, 0]
        new_ids = [host.agents["shm"].agent_id for host in decode_hosts]
        assert not set(new_ids) & set(old_ids)  # (what each prefill rank pushed into:)
        assert peer_files(prefill_hosts) == {i: segments([h]) for i, h in zip(new_ids, decode_hosts)}
        with pytest.raises(TransferError, match="unlinked"):  # (a hand-off of before the release: never written)
            prefill.agents["shm"].push(stale, [1], None, [])
    finally:
        close_workers(*workers)
        for follower in followers:
            follower.shutdown()


def test_the_prefill_pusher_forgets_the_decode_agent_ids_of_before_each_wake_up(checkpoints):
    """Each wake-up gives the decode rank a new agent id (a new push destination): after several sleep /
    wake cycles the prefill rank's pusher maps only the destination it pushes to now, not one per
    wake-up (a removed decode worker's goes the same way: no push to it is open any more)."""
    prefill, decode = make_pair(checkpoints["old"], 4)
    try:
        for _ in range(3):
            run_batch(prefill, decode, BATCH, GREEDY)
            for w in (prefill, decode):
                asyncio.run(w.release_memory_occupation(keep_weights=True))
            for w in (prefill, decode):
                asyncio.run(w.resume_memory_occupation())
        run_batch(prefill, decode, BATCH, GREEDY)
        assert list(prefill.rank.pusher._lane_of) == [f"shm/{decode.agents['shm'].agent_id}"]
    finally:
        close_workers(prefill, decode)



def test_pd_backend_releases_every_worker_or_none(checkpoints):
    """The cluster sleeps together: a decode worker holding a reservation refuses (NotIdleError naming
    it) and the prefill worker, released meanwhile, is resumed; idle, both release, the router re-indexes
    them (their caches dropped) and the backend refuses requests (SleepingError) until woken."""
    prefill, decode = make_pair(checkpoints["old"], 4)
    router = SimpleNamespace(rebuilds=[])
    router.rebuild_from_workers = lambda: router.rebuilds.append(True)
    refs = [SimpleNamespace(worker_id=w.worker_id, alive=True, handle=Handle(w)) for w in (prefill, decode)]
    backend = PDBackend(SimpleNamespace(prefill=refs[:1], decode=refs[1:], router=router))

    async def sleep_and_wake():
        await decode.reserve("held", BATCH[0], GREEDY)
        with pytest.raises(NotIdleError, match=f"not released .*: {decode.worker_id}: requests are in flight \\(held\\)"):
            await backend.release_memory_occupation(keep_weights=True)
        assert not prefill.is_sleeping() and held_bytes(prefill.runner)[0] > 0
        assert not backend.is_sleeping and not router.rebuilds
        await decode.abort("held", safe=True)
        while decode.loop.held_rids():
            await asyncio.sleep(0.01)
        await backend.release_memory_occupation(["kv_cache"])
        assert prefill.is_sleeping() and decode.is_sleeping() and backend.is_sleeping and router.rebuilds == [True]
        with pytest.raises(SleepingError, match="sleeping"):
            async for _ in backend.generate_stream(BATCH[0], GREEDY, "asleep"):
                pass
        await backend.resume_memory_occupation()
        assert not (prefill.is_sleeping() or decode.is_sleeping() or backend.is_sleeping)

    try:
        before = [r[0]["output_ids"] for r in run_batch(prefill, decode, BATCH, GREEDY)]
        asyncio.run(sleep_and_wake())
        assert [r[0]["output_ids"] for r in run_batch(prefill, decode, BATCH, GREEDY)] == before
    finally:
        close_workers(prefill, decode)


@pytest.mark.gpu
def test_pd_workers_on_cuda_sleep_and_wake_to_the_same_tokens(checkpoints):
    """The CUDA path: the decode pools come from a private MemPool exported over CUDA IPC; released, the
    pool is dropped, resumed they are allocated in a new one and pushed into; the tokens of before.
    (Both workers in this process: the prefill side uses the decode agent's tensors, as an exporter
    cannot open its own IPC handles.)"""
    args = dict(ENGINE, device="cuda", attention_backend="triton")
    prefill = PrefillWorker(checkpoints["old"], args, backend="cuda_ipc")
    decode = DecodeWorker(checkpoints["old"], args, backend="cuda_ipc")
    workers = (prefill, decode)
    try:
        before = [r[0]["output_ids"] for r in run_batch(prefill, decode, BATCH, GREEDY)]
        pool = decode.rank.buffer_allocator.mem_pool
        for w in workers:
            asyncio.run(w.release_memory_occupation(keep_weights=True))
        assert all(held_bytes(w.runner) == (0, 0) for w in workers) and not prefill.agents["cuda_ipc"]._peers
        for w in workers:
            asyncio.run(w.resume_memory_occupation())
        assert decode.rank.buffer_allocator.mem_pool is not pool
        assert [r[0]["output_ids"] for r in run_batch(prefill, decode, BATCH, GREEDY)] == before
        for w in workers:
            w.check_integrity()
    finally:
        close_workers(*workers)
