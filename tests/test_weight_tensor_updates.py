"""Weights updated from tensors while serving (SGLang's ``update_weights_from_tensor``, what a
colocated RL trainer pushes; actors.engine.weight_updates): after a full update the tokens are HF's
on the new checkpoint, after a partial one (one layer's tensors) HF's on a checkpoint with just that
layer changed; tensors that do not fit are refused before any weight is touched; at TP 2 every rank
takes its shard; through PDBackend to both PD workers and over HTTP."""

import asyncio
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.engine import Engine
from tests.parity import assert_greedy_parity
from tests.test_weight_updates import (ENGINE, GREEDY, assert_the_old_weights_serve, checkpoints,  # noqa: F401
                                       prompts, wait_for)  # (checkpoints: a fixture)
from tests.tp_helpers import thread_ranks

LAYER = "model.layers.1."


def tensors(path):
    return load_file(f"{path}/model.safetensors")


def layer_of(path):
    """Layer 1's tensors of the checkpoint in ``path``: a partial update's."""
    return [(n, t) for n, t in tensors(path).items() if n.startswith(LAYER)]


def with_layer(old, layer, dst):
    """Checkpoint ``old`` with ``layer``'s tensors instead of its own: what a partial update serves."""
    shutil.copytree(old, dst)
    save_file({**tensors(old), **dict(layer)}, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_a_full_update_serves_the_new_weights(checkpoints):
    old, new = checkpoints
    eng = Engine(model_path=old, **ENGINE)
    try:
        batch = prompts(seed=11)
        before = eng.generate(input_ids=batch, sampling_params=GREEDY)
        result = eng.update_weights_from_tensor(list(tensors(new).items()), weight_version="t1")
        assert result.success and eng.get_weight_version() == "t1"
        assert eng.runner.weights.path is None  # (no checkpoint holds them)
        after = eng.generate(input_ids=batch, sampling_params=GREEDY)
        assert [o["meta_info"]["cached_tokens"] for o in after] == [0, 0]
        assert_greedy_parity(new, batch, [o["output_ids"] for o in after], 8, eng.eos_token_ids)
        assert [o["output_ids"] for o in after] != [o["output_ids"] for o in before]
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_a_partial_update_changes_only_its_tensors(checkpoints, tmp_path):
    """One layer's tensors (bf16, as a trainer's: cast as they are copied) equal HF on the old
    checkpoint with that layer the new one's."""
    old, new = checkpoints
    eng = Engine(model_path=old, **ENGINE)
    try:
        batch = prompts(seed=12)
        layer = [(n, t.to(torch.bfloat16)) for n, t in layer_of(new)]
        eng.update_weights_from_tensor(layer)
        outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
        assert_greedy_parity(with_layer(old, [(n, t.float()) for n, t in layer], tmp_path / "mixed"), batch, [o["output_ids"] for o in outs], 8,
                             eng.eos_token_ids)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_tensors_that_do_not_fit_are_refused_and_the_old_weights_serve(checkpoints):
    old, new = checkpoints
    good = tensors(new)
    down = "model.layers.0.mlp.down_proj.weight"
    eng = Engine(model_path=old, **ENGINE)
    try:
        batch = prompts(seed=13)
        for named, why, kwargs in (
                ([*good.items(), ("model.layers.9.mlp.up_proj.weight", good[down])],
                 r"unexpected tensors \['model.layers.9.mlp.up_proj.weight'\]", {}),
                ([(down, good[down][:, :8])], rf"tensor shapes differ: {down} \[64, 8\] \(served \[64, 128\]\)", {}),
                ([(down, good[down].to(torch.float8_e4m3fn))], f"{down} is FP8 but its layer is not served in FP8", {}),
                ([(down, good[down]), (down, good[down])], "named more than once", {}),
                ([(down, good[down])], "load_format='flattened_bucket' is not served", {"load_format": "flattened_bucket"}),
                ([], "no tensors", {})):
            with pytest.raises(ValueError, match=why):
                eng.update_weights_from_tensor(named, weight_version="bad", **kwargs)
        assert_the_old_weights_serve(eng, old, batch)
    finally:
        eng.shutdown()


def test_tp2_every_rank_takes_its_shard_of_the_tensors(checkpoints, tmp_path, monkeypatch):
    """TP 2 (ranks as threads): the follower checks the tensors' shapes (sent on meta), then copies
    its shard of them; a follower that refuses them leaves both ranks' weights as they were; a copy
    failing on it rolls both back to the checkpoint served, or, once tensors replaced it, says the
    weights may be mixed."""
    thread_ranks(monkeypatch)
    old, new = checkpoints
    eng = Engine(model_path=old, tp_size=2, **ENGINE)
    try:
        batch = prompts(seed=14)
        wait_for(lambda: eng.tp_group.followers)
        follower = eng.tp_group.followers[0]
        check, checked = follower.handlers["weights_check"], []

        def refuse(source):
            checked.append({t.device.type for t in source.values()})
            raise ValueError("this rank refuses")

        follower.handlers["weights_check"] = refuse
        served = {name: t.clone() for name, (t, _) in eng.runner.weights.targets.items()}
        with pytest.raises(ValueError, match="rank 1: ValueError: this rank refuses"):
            eng.update_weights_from_tensor(list(tensors(new).items()))
        assert checked == [{"meta"}]
        assert all(torch.equal(t, served[name]) for name, (t, _) in eng.runner.weights.targets.items())
        follower.handlers["weights_check"] = check
        load = follower.handlers["weights_load"]

        def fail_after_copying(source):  # (tensors: a rollback's checkpoint loads)
            load(source)
            if not isinstance(source, str):
                raise OSError("the follower's copy failed")

        follower.handlers["weights_load"] = fail_after_copying  # (rolled back to the checkpoint served)
        with pytest.raises(RuntimeError, match=f"copy failed.*rolled back to '{old}' on every rank"):
            eng.update_weights_from_tensor(list(tensors(new).items()))
        assert all(torch.equal(t, served[name]) for name, (t, _) in eng.runner.weights.targets.items())
        follower.handlers["weights_load"] = load
        eng.update_weights_from_tensor(layer_of(new))
        outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
        assert follower.runner.weights.path is None
        follower.handlers["weights_load"] = fail_after_copying  # (now no checkpoint holds what is served)
        with pytest.raises(RuntimeError, match="no checkpoint holds the weights served before"):
            eng.update_weights_from_tensor(layer_of(old))
        follower.handlers["weights_load"] = load
        assert_greedy_parity(with_layer(old, layer_of(new), tmp_path / "mixed"), batch, [o["output_ids"] for o in outs], 8,
                             eng.eos_token_ids)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_pd_backend_updates_both_workers_from_tensors(checkpoints, tmp_path):
    """PDBackend sends the tensors to the prefill and the decode worker: refused on both (nothing
    changed) when they do not fit; else a request's prompt KV (the prefill worker's) and its tokens
    (the decode worker's) are of the new layer; a worker cannot be added after (no checkpoint holds
    those weights)."""
    from tests.pd_helpers import close_workers, make_pair, run_pd
    from tests.test_weight_updates import pd_backend

    old, new = checkpoints
    prefill, decode = make_pair(old, page_size=4)
    try:
        backend = pd_backend(prefill, decode)
        backend.cluster = object()  # (add_worker is refused before it is asked for a worker)
        (prompt,) = prompts(1, seed=15)
        bad = [("model.layers.1.mlp.up_proj.weight", torch.zeros(3, 3))]

        async def go():
            with pytest.raises(ValueError, match=r"prefill.*tensor shapes differ.*; decode.*tensor shapes differ"):
                await backend.update_weights_from_tensor(bad, weight_version="bad")
            result = await backend.update_weights_from_tensor(layer_of(new), weight_version="t1")
            with pytest.raises(RuntimeError, match="updated from tensors"):
                await backend.add_worker("decode")
            return result, (await run_pd(prefill, decode, prompt))[0]

        result, out = asyncio.run(go())
        assert result["success"] and backend.weight_version == "t1"
        assert [w.get_weight_version() for w in (prefill, decode)] == ["t1", "t1"]
        assert out["meta_info"]["weight_version"] == "t1"
        assert_greedy_parity(with_layer(old, layer_of(new), tmp_path / "mixed"), [prompt], [out["output_ids"]], 8,
                             decode.eos_token_ids)
        prefill.check_integrity()
        decode.check_integrity()
    finally:
        close_workers(prefill, decode)
