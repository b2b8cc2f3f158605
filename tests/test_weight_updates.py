"""Weights updated from disk while serving (SGLang's ``update_weights_from_disk``,
actors.engine.weight_updates): the engine's tokens are HF's on the new checkpoint, its caches
(device, host, file tier) serve no KV of the old weights, a checkpoint that does not fit is
refused before any weight is touched, requests in flight finish (or are aborted) and new ones
wait; at TP 2 every rank takes its shard; over HTTP through PDBackend to both PD workers."""

import asyncio
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.engine import Engine
from actors.engine import weight_updates
from actors.engine.tiny import build_tiny_checkpoint
from tests.parity import assert_greedy_parity
from tests.pd_helpers import Handle
from tests.tp_helpers import thread_ranks

GREEDY = {"temperature": 0, "max_new_tokens": 8}
ENGINE = dict(skip_tokenizer_init=True, max_total_tokens=1024, page_size=4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(old, new): one tiny Llama's config, two seeds' weights."""
    root = tmp_path_factory.mktemp("weights")
    return tuple(str(build_tiny_checkpoint("llama", root / name, seed=seed)) for name, seed in (("old", 0), ("new", 1)))


def prompts(n=2, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(9, 20))] for _ in range(n)]


def tensors_of(engine):
    """(the objects, their storage) of the served tensors: an update copies into them."""
    targets = engine.runner.weights.targets
    return [t for t, _ in targets.values()], [t.data_ptr() for t, _ in targets.values()]


def test_update_serves_the_new_weights_and_misses_the_old_cache(checkpoints):
    old, new = checkpoints
    eng = Engine(model_path=old, **ENGINE)
    try:
        batch = prompts()
        before = eng.generate(input_ids=batch, sampling_params=GREEDY)
        assert_greedy_parity(old, batch, [o["output_ids"] for o in before], 8, eng.eos_token_ids)
        assert {o["meta_info"]["weight_version"] for o in before} == {"default"}
        assert eng.generate(input_ids=batch[0], sampling_params=GREEDY)["meta_info"]["cached_tokens"] > 0
        objects, storage = tensors_of(eng)
        result = eng.update_weights_from_disk(new, weight_version="step-1")
        assert result.success and result.num_paused_requests == 0
        assert eng.get_weight_version() == "step-1" and eng.runner.weights.path == new
        after = eng.generate(input_ids=batch, sampling_params=GREEDY)
        assert [o["meta_info"]["cached_tokens"] for o in after] == [0, 0]  # the old weights' KV is gone
        assert {o["meta_info"]["weight_version"] for o in after} == {"step-1"}
        assert_greedy_parity(new, batch, [o["output_ids"] for o in after], 8, eng.eos_token_ids)
        assert [o["output_ids"] for o in after] != [o["output_ids"] for o in before]
        assert tensors_of(eng)[1] == storage and all(a is b for a, b in zip(tensors_of(eng)[0], objects))
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_lora_layers_compute_with_the_new_base_weights(checkpoints, tmp_path):
    """An adapter's layers wrap the base modules: after the update a request under it equals HF
    on the new checkpoint with the adapter merged."""
    from actors.engine.tiny import make_adapter
    from tests.lora_helpers import merged_checkpoint

    old, new = checkpoints
    adapter = make_adapter(old, tmp_path / "sql", rank=8, alpha=16, seed=1)
    eng = Engine(model_path=old, lora_paths={"sql": str(adapter)}, max_loras_per_batch=1, **ENGINE)
    try:
        batch = prompts(seed=6)
        eng.update_weights_from_disk(new)
        outs = eng.generate(input_ids=batch, sampling_params=GREEDY, lora_path="sql")
        merged = merged_checkpoint(new, adapter, tmp_path / "merged")
        assert_greedy_parity(merged, batch, [o["output_ids"] for o in outs], 8, eng.eos_token_ids)
        eng.check_integrity()
    finally:
        eng.shutdown()


def variant(src, dst, drop=None, config=None):
    """A copy of checkpoint ``src`` without tensor ``drop`` / with ``config`` fields changed."""
    import json
    import shutil

    shutil.copytree(src, dst)
    if drop:
        tensors = load_file(f"{dst}/model.safetensors")
        del tensors[drop]
        save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})
    if config:
        with open(f"{dst}/config.json") as f:
            data = json.load(f)
        with open(f"{dst}/config.json", "w") as f:
            json.dump({**data, **config}, f)
    return str(dst)


def assert_the_old_weights_serve(eng, old, batch):
    """After refused updates: nothing changed (the version, the checkpoint), HF's tokens on ``old``, nothing leaked."""
    assert eng.get_weight_version() == "default" and eng.runner.weights.path == old
    outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
    assert_greedy_parity(old, batch, [o["output_ids"] for o in outs], 8, eng.eos_token_ids)
    eng.check_integrity()


def test_a_checkpoint_that_does_not_fit_is_refused_and_the_old_weights_serve(checkpoints, tmp_path):
    old, new = checkpoints
    wider = str(build_tiny_checkpoint("llama", tmp_path / "wider", seed=1, hidden_size=32))
    missing = variant(new, tmp_path / "missing", drop="model.layers.1.mlp.down_proj.weight")
    # the config says 64 while the tensors are the wider model's: only the headers tell
    lying = variant(wider, tmp_path / "lying", config={"hidden_size": 64, "head_dim": 16})
    eng = Engine(model_path=old, **ENGINE)
    try:
        batch = prompts(seed=1)
        for path, why in ((wider, r"hidden_size=32 \(served 64\)"),
                          (missing, r"missing tensors \['model.layers.1.mlp.down_proj.weight'\]"),
                          (lying, r"tensor shapes differ: model.embed_tokens.weight \[261, 32\] \(served \[261, 64\]\)"),
                          (str(tmp_path / "nowhere"), "has no config.json")):
            with pytest.raises(ValueError, match=why):
                eng.update_weights_from_disk(path, weight_version="bad")
        assert_the_old_weights_serve(eng, old, batch)
    finally:
        eng.shutdown()


def run_in_thread(fn, *args, **kwargs):
    box = {}

    def run():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # (re-raised by the caller's join)
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join():
        thread.join(60)
        assert not thread.is_alive()
        if "error" in box:
            raise box["error"]
        return box["result"]

    return join


def running(eng, rid):
    return eng.loop.run_exclusive(lambda: any(r.rid == rid and r.output_ids for r in eng.scheduler.running))


def wait_for(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_request_in_flight_finishes_on_the_old_weights_and_a_new_one_waits(checkpoints):
    """The update waits for the running request, which ends under the old weights; a request
    sent meanwhile waits (not refused, not run) and then runs on the new ones; one aborted while
    it waits ends aborted."""
    old, new = checkpoints
    eng = Engine(model_path=old, **ENGINE)
    try:
        long_prompt, new_prompt = prompts(seed=2)
        came, step = threading.Event(), eng.scheduler.step

        def held():  # the long request decodes no further until the new ones have come (however slow the host)
            if not came.is_set() and running(eng, "long"):
                time.sleep(0.005)
                return []
            return step()

        eng.scheduler.step = held
        first = run_in_thread(eng.generate, input_ids=long_prompt, rid="long",
                              sampling_params={"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
        wait_for(lambda: running(eng, "long"))
        update = run_in_thread(eng.update_weights_from_disk, new, weight_version="v2")
        wait_for(lambda: eng.loop._holds == 1)
        second = run_in_thread(eng.generate, input_ids=new_prompt, rid="new", sampling_params=GREEDY)
        gone = run_in_thread(eng.generate, input_ids=new_prompt, rid="gone", sampling_params=GREEDY)
        wait_for(lambda: len(eng.loop._parked) == 2)
        assert eng.abort("gone")  # (parked: ended once it reaches the scheduler)
        assert eng.get_weight_version() == "default"  # (still waiting for "long")
        came.set()
        old_out, result, new_out = first(), update(), second()
        assert result.num_paused_requests == 2
        assert gone()["meta_info"]["finish_reason"]["type"] == "abort"
        assert old_out["meta_info"]["weight_version"] == "default" and len(old_out["output_ids"]) == 40
        assert new_out["meta_info"]["weight_version"] == "v2"
        assert_greedy_parity(old, [long_prompt], [old_out["output_ids"]], 40, ())
        assert_greedy_parity(new, [new_prompt], [new_out["output_ids"]], 8, eng.eos_token_ids)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_abort_all_requests_ends_the_running_ones_and_frees_what_they_held(checkpoints):
    old, new = checkpoints
    eng = Engine(model_path=old, **ENGINE)
    try:
        batch = prompts(seed=3)
        params = {"temperature": 0, "max_new_tokens": 900, "ignore_eos": True}
        runs = [run_in_thread(eng.generate, input_ids=p, rid=f"r{i}", sampling_params=params)
                for i, p in enumerate(batch)]
        wait_for(lambda: all(running(eng, f"r{i}") for i in range(2)))
        eng.update_weights_from_disk(new, abort_all_requests=True)
        for run in runs:
            out = run()
            assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 900
        eng.check_integrity()
        outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
        assert_greedy_parity(new, batch, [o["output_ids"] for o in outs], 8, eng.eos_token_ids)
    finally:
        eng.shutdown()


def test_pd_workers_abort_their_requests_and_serve_the_new_weights(checkpoints):
    """The update on both PD workers with abort_all_requests: a request decoding ends aborted on
    the decode side, its reservation and the prefill side's copy freed; the next request runs on
    the new weights on both sides (its prompt KV from the prefill worker's, its tokens the decode's)."""
    import asyncio

    from tests.pd_helpers import close_workers, make_pair, run_pd, until

    old, new = checkpoints
    prefill, decode = make_pair(old, page_size=4)
    try:
        long_prompt, prompt = prompts(seed=7)

        async def go():
            params = {"temperature": 0, "max_new_tokens": 900, "ignore_eos": True}
            running = asyncio.ensure_future(run_pd(prefill, decode, long_prompt, params))
            await until(lambda: any(r.output_ids for r in decode.scheduler.running), what="decoding")
            results = await asyncio.gather(*(w.update_weights_from_disk(new, "v1", True) for w in (prefill, decode)))
            return (await running)[0], results, (await run_pd(prefill, decode, prompt))[0]

        aborted, results, out = asyncio.run(go())
        assert [r["success"] for r in results] == [True, True]
        assert aborted["meta_info"]["finish_reason"]["type"] == "abort" and len(aborted["output_ids"]) < 900
        assert out["meta_info"]["weight_version"] == "v1" == prefill.get_weight_version()
        assert_greedy_parity(new, [prompt], [out["output_ids"]], 8, decode.eos_token_ids)
    finally:
        close_workers(prefill, decode)


def test_pd_abort_all_requests_ends_a_request_whose_kv_is_moving(checkpoints):
    """A request reserved on the decode side while its prefill pushes: the update on both workers
    (abort_all_requests) aborts the push; the client's confirmed stop (as PDClient's) frees the
    reservation at once, so neither update waits for the hand-off's deadline."""
    import asyncio

    from actors.pd_scheduler import PDRequestError
    from tests.pd_helpers import close_workers, make_pair, run_pd, slow_push, until

    old, new = checkpoints
    prefill, decode = make_pair(old, page_size=4, waiting_timeout_s=60)
    pushing = threading.Event()
    slow_push(prefill, lambda _: pushing.wait(30))
    try:
        async def go():
            request = asyncio.ensure_future(run_pd(prefill, decode, prompts(1, seed=8)[0]))
            await until(lambda: decode.scheduler.transfer, what="a reservation waiting for its KV")
            threading.Timer(0.2, pushing.set).start()  # (the prefill side's abort waits for a copy under way)
            start = time.monotonic()
            results = await asyncio.gather(*(w.update_weights_from_disk(new, "v1", True) for w in (prefill, decode)))
            with pytest.raises(PDRequestError, match="aborted"):
                await request
            return results, time.monotonic() - start

        results, took = asyncio.run(go())
        assert [r["success"] for r in results] == [True, True] and took < 10
    finally:
        close_workers(prefill, decode)



def test_pd_backend_checks_every_worker_first_and_names_mixed_versions(checkpoints, tmp_path):
    """PDBackend's update: a checkpoint a worker refuses changes no worker (each named with why);
    one worker failing after every check passed is a RuntimeError naming each worker's version."""
    import asyncio

    from cluster.backend import PDBackend
    from tests.pd_helpers import close_workers, make_pair

    old, new = checkpoints
    missing = variant(new, tmp_path / "missing", drop="model.norm.weight")
    prefill, decode = make_pair(old, page_size=4)
    refs = [SimpleNamespace(worker_id=w.worker_id, alive=True, handle=Handle(w)) for w in (prefill, decode)]
    backend = PDBackend(SimpleNamespace(prefill=refs[:1], decode=refs[1:]))
    p, d = prefill.worker_id, decode.worker_id
    try:
        with pytest.raises(ValueError, match=rf"^{p}: .*missing tensors \['model.norm.weight'\]; {d}: .*missing"):
            asyncio.run(backend.update_weights_from_disk(missing, "v1"))
        assert [prefill.runner.weights.path, decode.runner.weights.path] == [old, old]
        update = decode.update_weights_from_disk

        async def out_of_memory(*args):
            raise RuntimeError("out of memory")

        decode.update_weights_from_disk = out_of_memory
        with pytest.raises(RuntimeError, match=rf"failed on {d}: out of memory; .*: {p}=v1, {d}=default$"):
            asyncio.run(backend.update_weights_from_disk(new, "v1"))
        assert backend.weight_version == "default"
        decode.update_weights_from_disk = update
        result = asyncio.run(backend.update_weights_from_disk(new, "v1"))
        assert result["success"] and backend.weight_version == decode.get_weight_version() == "v1"
    finally:
        close_workers(prefill, decode)


def test_pd_backend_refuses_a_paused_flush_on_every_worker_before_any_applies(checkpoints):
    """Paused in_place with a request decoding, its KV on the decode worker alone: an update with
    flush_cache is refused there, so it is checked before any worker applies it (a 400, both on the
    old weights), not applied on the prefill worker while the decode worker refuses (mixed weights);
    without the flush both apply it and the request ends on the new weights."""
    import asyncio

    from cluster.backend import PDBackend
    from tests.pd_helpers import close_workers, make_pair, pause_once, run_pd, until

    old, new = checkpoints
    prefill, decode = make_pair(old, page_size=4)
    refs = [SimpleNamespace(worker_id=w.worker_id, alive=True, handle=Handle(w)) for w in (prefill, decode)]
    backend = PDBackend(SimpleNamespace(prefill=refs[:1], decode=refs[1:], router=None))
    decoding = pause_once(decode, lambda: any(r.output_ids for r in decode.scheduler.running))
    try:
        async def go():
            params = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
            running = asyncio.ensure_future(run_pd(prefill, decode, prompts(1, seed=9)[0], params))
            await until(decoding.is_set, what="decoding")  # (still decoding when the pause takes hold)
            await backend.pause_generation("in_place")
            with pytest.raises(ValueError, match=f"{decode.worker_id}: generation is paused with requests holding KV"):
                await backend.update_weights_from_disk(new, "v1")
            assert prefill.get_weight_version() == decode.get_weight_version() == "default"
            assert (await backend.update_weights_from_disk(new, "v1", flush_cache=False))["success"]
            await backend.continue_generation()
            return (await running)[0]

        out = asyncio.run(go())
        assert out["meta_info"]["weight_version"] == "v1" == prefill.get_weight_version() == decode.get_weight_version()
        prefill.check_integrity()
        decode.check_integrity()
    finally:
        close_workers(prefill, decode)


def test_pd_backend_pauses_every_worker_and_updates_them_paused(checkpoints):
    """/pause_generation's retract and in_place reach both workers of a pair through PDBackend; a
    paused pair's update applies at once (SGLang's: nothing to wait for), its loops still paused
    until continue_generation; a worker added while paused takes the update and the pause."""
    import asyncio

    from cluster.backend import PDBackend
    from tests.pd_helpers import close_workers, make_pair

    old, new = checkpoints
    prefill, decode = make_pair(old, page_size=4)
    refs = [SimpleNamespace(worker_id=w.worker_id, alive=True, handle=Handle(w)) for w in (prefill, decode)]
    calls = []

    class Recorder:  # the handle of a worker the cluster adds
        def __getattr__(self, name):
            async def call(*args):
                calls.append((name, args))

            return SimpleNamespace(remote=call)

    added = SimpleNamespace(worker_id="d-new", role="decode", node_id="n", alive=True, handle=Recorder())
    backend = PDBackend(SimpleNamespace(prefill=refs[:1], decode=refs[1:], router=None),
                        SimpleNamespace(add_worker=lambda role: added))
    try:
        for mode in ("in_place", "retract"):
            asyncio.run(backend.pause_generation(mode))
            assert prefill.loop.paused and decode.loop.paused
            result = asyncio.run(backend.update_weights_from_disk(new if mode == "retract" else old, mode))
            assert result["success"] and prefill.get_weight_version() == decode.get_weight_version() == mode
            assert prefill.loop.paused and decode.loop.paused
            calls.clear()
            asyncio.run(backend.add_worker("decode"))
            assert [name for name, _ in calls] == ["update_weights_from_disk", "pause_generation"]
            assert calls[1][1] == (mode,)
            asyncio.run(backend.continue_generation())
            assert not (prefill.loop.paused or decode.loop.paused)
        assert [prefill.runner.weights.path, decode.runner.weights.path] == [new, new]
        prefill.check_integrity()
        decode.check_integrity()
    finally:
        close_workers(prefill, decode)


def test_tp2_every_rank_takes_its_shard(checkpoints, monkeypatch):
    """TP 2 (ranks as threads): the update is checked on both ranks, then each copies its shard;
    a checkpoint only a follower cannot read fails the whole update, and rank 0 keeps its weights;
    a copy failing on the follower rolls both ranks back to the served checkpoint; with
    ``torch_empty_cache`` each rank empties its device's cache after the copy."""
    thread_ranks(monkeypatch)
    emptied = []
    monkeypatch.setattr(weight_updates, "empty_device_cache", emptied.append)
    old, new = checkpoints
    eng = Engine(model_path=old, tp_size=2, **ENGINE)
    try:
        batch = prompts(seed=4)
        wait_for(lambda: eng.tp_group.followers)  # (its thread files it once its constructor returns)
        follower = eng.tp_group.followers[0]
        check = follower.handlers["weights_check"]

        def refuse(path):
            if path == new:
                raise ValueError("this rank cannot read it")
            check(path)

        follower.handlers["weights_check"] = refuse
        served = {name: t.clone() for name, (t, _) in eng.runner.weights.targets.items()}
        with pytest.raises(ValueError, match="rank 1: ValueError: this rank cannot read it"):
            eng.update_weights_from_disk(new, weight_version="v1")
        assert all(torch.equal(t, served[name]) for name, (t, _) in eng.runner.weights.targets.items())
        assert eng.get_weight_version() == "default" and follower.runner.weights.path == old
        follower.handlers["weights_check"] = check
        load = follower.handlers["weights_load"]

        def fail_after_copying(path):  # (both ranks hold the new weights when it fails)
            load(path)
            if path == new:
                raise OSError("the disk went away")

        follower.handlers["weights_load"] = fail_after_copying
        with pytest.raises(RuntimeError, match=f"the disk went away.*rolled back to '{old}' on every rank"):
            eng.update_weights_from_disk(new, weight_version="v1")
        assert all(torch.equal(t, served[name]) for name, (t, _) in eng.runner.weights.targets.items())
        outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
        assert_greedy_parity(old, batch, [o["output_ids"] for o in outs], 8, eng.eos_token_ids)
        follower.handlers["weights_load"] = load
        assert emptied == []
        eng.update_weights_from_disk(new, weight_version="v1", torch_empty_cache=True)
        assert follower.runner.weights.path == new
        assert emptied == [eng.runner.device, follower.runner.device]
        outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
        assert_greedy_parity(new, batch, [o["output_ids"] for o in outs], 8, eng.eos_token_ids)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_empty_device_cache_empties_the_cuda_allocators_cache_only(monkeypatch):
    """SGLang's ``torch_empty_cache`` on a CUDA rank returns the allocator's cached blocks; a CPU
    rank has no such cache (and must not initialize CUDA)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("cuda"))
    weight_updates.empty_device_cache(torch.device("cpu"))
    assert calls == []
    weight_updates.empty_device_cache(torch.device("cuda", 0))
    assert calls == ["cuda"]


def stored_pages(eng, storage):
    """The page files under ``storage`` once ``eng``'s writes to its file tier have ended."""
    eng.check_integrity()  # (the backups to the host tier, which go on to the files, have ended)
    eng.loop.run_exclusive(eng.scheduler.tree_cache.cache_controller.flush_storage)
    return set(storage.rglob("*.bin"))


def test_the_host_and_file_tiers_serve_no_kv_of_the_old_weights(checkpoints, tmp_path):
    """With the host tier and a file tier: after the update a prompt cached under the old weights
    on device, host and files is computed anew; the old weights' pages stay where they were, for
    an engine still on them, and the new weights' pages go to their version's folder."""
    old, new = checkpoints
    storage = tmp_path / "kv-files"
    args = dict(ENGINE, max_total_tokens=256, enable_hierarchical_cache=True, hicache_ratio=4.0,
                hicache_storage_dir=str(storage))
    prompt = prompts(1, seed=5)[0] * 4
    eng = Engine(model_path=old, **args)
    try:
        eng.generate(input_ids=prompt, sampling_params=GREEDY)
        old_pages = stored_pages(eng, storage)
        assert old_pages
        eng.update_weights_from_disk(new, weight_version="v1")
        out = eng.generate(input_ids=prompt, sampling_params=GREEDY)
        assert out["meta_info"]["cached_tokens"] == 0
        assert_greedy_parity(new, [prompt], [out["output_ids"]], 8, eng.eos_token_ids)
        new_pages = stored_pages(eng, storage) - old_pages
        assert new_pages and all("weights" in p.relative_to(storage).parts for p in new_pages)
    finally:
        eng.shutdown()
    again = Engine(model_path=old, **args)  # an engine on the old weights still reads their pages
    try:
        assert again.generate(input_ids=prompt, sampling_params=GREEDY)["meta_info"]["cached_tokens"] > 0
    finally:
        again.shutdown()


def test_pause_retract_frees_a_prompt_prefilled_in_chunks(checkpoints):
    """pause_generation("retract") frees the KV of the request whose prompt is mid-way through
    its chunks too (the engine's ``chunked_req``, in no running batch), so that a paused engine's
    update may flush the cache; at continue_generation it prefills again, on the new weights."""
    old, new = checkpoints
    eng = Engine(model_path=old, chunked_prefill_size=8, **ENGINE)
    try:
        prompt = prompts(n=1, seed=5)[0] + prompts(n=1, seed=6)[0]
        eng.pause_generation("in_place")  # (the loop steps no more: the test takes the first chunk itself)
        out = run_in_thread(eng.generate, input_ids=prompt, rid="chunked", sampling_params=GREEDY)
        wait_for(lambda: eng.loop.held_rids() == ["chunked"])
        eng.loop.run_exclusive(eng.scheduler.step)
        assert eng.scheduler.chunked_req is not None and eng.scheduler.chunked_req.req_pool_idx is not None
        eng.pause_generation("retract")
        assert eng.scheduler.chunked_req is None and [r.rid for r in eng.scheduler.waiting] == ["chunked"]
        rows, tree = eng.runner.req_to_token_pool, eng.scheduler.tree_cache
        assert rows.available_size() == rows.size and tree.protected_size() == 0  # (it waits, holding nothing)
        assert eng.update_weights_from_disk(new).success
        eng.continue_generation()
        assert_greedy_parity(new, [prompt], [out()["output_ids"]], 8, eng.eos_token_ids)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_pd_prefill_pause_retract_keeps_the_prompt_it_pushes_in_chunks(checkpoints):
    """A prefill worker paused "retract" mid-chunks keeps its chunked request (pushes of its first
    chunks may be reading its slots; it never decodes there), and at continue_generation pushes
    the rest: the decode side's tokens are HF's, nothing leaked on either side."""
    import asyncio

    from tests.pd_helpers import close_workers, make_pair, pause_once, run_pd, until, wait_idle

    old, _ = checkpoints
    prefill, decode = make_pair(old, page_size=4, prefill_args={"chunked_prefill_size": 8})
    try:
        prompt = prompts(n=1, seed=5)[0] + prompts(n=1, seed=6)[0]
        paused = pause_once(prefill, lambda: prefill.scheduler.chunked_req is not None)

        async def go():
            running = asyncio.ensure_future(run_pd(prefill, decode, prompt, GREEDY))
            await until(paused.is_set, what="the prefill mid-chunks")
            chunked = prefill.scheduler.chunked_req
            prefill.pause_generation("retract")
            assert prefill.scheduler.chunked_req is chunked and chunked.req_pool_idx is not None
            prefill.continue_generation()
            return (await running)[0]

        out = asyncio.run(go())
        assert_greedy_parity(old, [prompt], [out["output_ids"]], 8, decode.eos_token_ids)
        assert wait_idle(prefill) and wait_idle(decode)
        prefill.check_integrity()
        decode.check_integrity()
    finally:
        close_workers(prefill, decode)


def test_a_paused_update_ends_the_storage_prefetches_of_the_old_weights(checkpoints, tmp_path):
    """A request that came while the engine was paused has its prompt's pages prefetched from the
    file tier of the old weights; an update then (paused: at once, with flush_cache) ends that
    prefetch, keeping nothing: the request computes its prompt anew on the new weights."""
    old, new = checkpoints
    args = dict(ENGINE, max_total_tokens=256, enable_hierarchical_cache=True, hicache_ratio=4.0,
                hicache_storage_dir=str(tmp_path / "kv-files"))
    prompt = prompts(1, seed=5)[0] * 4
    eng = Engine(model_path=old, **args)
    try:
        eng.generate(input_ids=prompt, sampling_params=GREEDY)
        assert stored_pages(eng, tmp_path / "kv-files")
        eng.flush_cache()  # (device and host: the prompt's pages are in the files alone)
        eng.pause_generation("in_place")
        out = run_in_thread(eng.generate, input_ids=prompt, sampling_params=GREEDY)
        wait_for(lambda: any(r.prefetch_op is not None and r.prefetch_op.done.is_set()
                             for r in eng.loop.held_reqs()))
        assert eng.update_weights_from_disk(new, weight_version="v1").success
        eng.continue_generation()
        result = out()
        assert result["meta_info"]["cached_tokens"] == 0
        assert_greedy_parity(new, [prompt], [result["output_ids"]], 8, eng.eos_token_ids)
        eng.check_integrity()
    finally:
        eng.shutdown()


def pd_backend(prefill, decode):
    """PDBackend over a PDClient of the in-process pair (its calls tasks, as Ray's)."""
    from cluster.backend import PDBackend
    from cluster.pd_client import PDClient
    from cluster.pd_rotation import WorkerRef
    from tests.test_pd_client_retries import _Handle

    refs = [WorkerRef(w.worker_id, w.role, _Handle(w), "n") for w in (prefill, decode)]
    return PDBackend(PDClient(refs[:1], refs[1:]))


def hold_prefill_until_its_update(prefill, rid, grace_s=1.0):
    """``rid``'s prefill call waits until the prefill worker's update has begun (its own requests then
    parked behind it), or ``grace_s`` when none begins meanwhile: a request reserved on the decode
    side whose prefill comes while the update is under way."""
    started, real_prefill, real_update = threading.Event(), prefill.prefill, prefill.update_weights_from_disk

    async def update(*args):
        started.set()
        return await real_update(*args)

    async def held(*args, **kwargs):
        if args[0] == rid:
            deadline = time.monotonic() + grace_s
            while not started.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
        return await real_prefill(*args, **kwargs)

    prefill.prefill, prefill.update_weights_from_disk = held, update


async def collect(stream):
    return [result async for result in stream]


def one_version(results):
    """The weight version of a request's results: one for all of them."""
    versions = {r["meta_info"]["weight_version"] for r in results}
    assert len(versions) == 1, f"one request's results carry versions {versions}"
    return versions.pop()


def test_pd_update_lets_a_request_in_flight_end_on_the_old_weights_on_both_sides(checkpoints):
    """A request reserved on the decode worker whose prefill comes after the update began: the
    update waits for it before any worker applies (not the prefill worker at once, which would
    prefill it on the new weights while the decode worker, draining, decodes it on the old), so
    its tokens are HF's on the old checkpoint, one version throughout; a /generate sent to the
    server meanwhile waits, then runs on the new weights."""
    import httpx

    from cluster.config import ServerConfig
    from cluster.server import build_app
    from tests.pd_helpers import close_workers, make_pair, until

    old, new = checkpoints
    prefill, decode = make_pair(old, page_size=4)
    backend = pd_backend(prefill, decode)
    app = build_app(backend, None, ServerConfig(allow_weight_updates=True))
    first_prompt, later_prompt = prompts(seed=10)
    hold_prefill_until_its_update(prefill, "first")

    async def go():
        first = asyncio.ensure_future(collect(backend.generate_stream(first_prompt, GREEDY, "first")))
        await until(lambda: decode.scheduler.transfer, what="the first request's reservation")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app",
                                     timeout=60) as http:
            update = asyncio.ensure_future(http.post("/update_weights_from_disk",
                                                     json={"model_path": new, "weight_version": "v1"}))
            await until(lambda: not backend._serving.is_set(), what="the update under way")
            later = await http.post("/generate", json={"input_ids": later_prompt, "sampling_params": GREEDY})
            return await first, await update, later

    try:
        first, update, later = asyncio.run(go())
        assert update.status_code == 200 and update.json()["success"]
        assert one_version(first) == "default"
        assert_greedy_parity(old, [first_prompt], [first[-1]["output_ids"]], 8, decode.eos_token_ids)
        assert later.status_code == 200 and later.json()["meta_info"]["weight_version"] == "v1"
        assert_greedy_parity(new, [later_prompt], [later.json()["output_ids"]], 8, decode.eos_token_ids)
    finally:
        close_workers(prefill, decode)


def test_pd_update_with_abort_all_requests_ends_the_request_in_flight_on_both_sides(checkpoints):
    """abort_all_requests: the update waits for nothing; the request reserved on the decode worker
    ends aborted there, and its prefill, come after the update began, pushes nowhere (nothing
    decodes it on other weights); one sent meanwhile waits, then runs on the new weights; nothing leaks."""
    from actors.pd_scheduler import PDRequestError
    from tests.pd_helpers import close_workers, make_pair, until

    old, new = checkpoints
    prefill, decode = make_pair(old, page_size=4)
    backend = pd_backend(prefill, decode)
    first_prompt, later_prompt = prompts(seed=11)
    hold_prefill_until_its_update(prefill, "first")

    async def go():
        first = asyncio.ensure_future(collect(backend.generate_stream(first_prompt, GREEDY, "first")))
        await until(lambda: decode.scheduler.transfer, what="the first request's reservation")
        update = asyncio.ensure_future(backend.update_weights_from_disk(new, "v1", abort_all_requests=True))
        await until(lambda: not backend._serving.is_set(), what="the update under way")
        later = await collect(backend.generate_stream(later_prompt, GREEDY, "later"))
        with pytest.raises(PDRequestError, match="abort"):
            await first
        return await update, later

    try:
        result, later = asyncio.run(go())
        assert result["success"] and prefill.get_weight_version() == decode.get_weight_version() == "v1"
        assert one_version(later) == "v1"
        assert_greedy_parity(new, [later_prompt], [later[-1]["output_ids"]], 8, decode.eos_token_ids)
    finally:
        close_workers(prefill, decode)
