"""Pipeline parallelism: engines of pp_size stages (of tp_size ranks each) give TP=1's greedy
tokens and logprobs, and HF's, through a batch, chunked prefill, a prefix hit and retraction;
each rank holds and caches only its stage's layers; a stage failing breaks the group. The ranks
are threads (tests.tp_helpers) but in one test of spawned processes over gloo."""

import random
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.engine import Engine
from actors.engine.config import EngineConfig
from actors.engine.pipeline import PPMissingLayer, stage_layers
from actors.engine.tiny import build_tiny_checkpoint
from actors.engine.tp_worker import TPGroupBrokenError
from mem_cache.memory_budget import GiB
from tests.parity import assert_greedy_parity, assert_input_logprobs_close, hf_model
from tests.test_engine_tp import prompts  # (a shared system prompt, then a prefix hit)
from tests.tp_helpers import thread_ranks

GREEDY = {"max_new_tokens": 8, "temperature": 0}
SCORED = dict(GREEDY, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(build_tiny_checkpoint("llama", tmp_path_factory.mktemp("pp") / "llama", seed=0))


def run(model_dir, tp_size=1, pp_size=1, check=None, **args):
    """Outputs of a batch (the first scored) then of a prefix hit, and the first's meta; ``check(engine)``
    runs on the idle engine before it shuts down."""
    batch, follow = prompts()
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=1024, tp_size=tp_size,
                    pp_size=pp_size, chunked_prefill_size=32, **args)
    try:
        first = engine.generate(input_ids=batch, sampling_params=[SCORED, GREEDY, GREEDY])
        second = engine.generate(input_ids=follow, sampling_params=GREEDY)
        assert second[0]["meta_info"]["cached_tokens"] >= 32
        engine.check_integrity()  # with ranks: every follower's index tables are what rank 0 sent
        if check is not None:
            check(engine)
        return [o["output_ids"] for o in first + second], first[0]["meta_info"], engine.eos_token_ids
    finally:
        engine.shutdown()


def test_stage_layers_split_evenly_with_the_remainder_before_the_last():
    """vLLM's get_pp_indices: the last stage (norm, lm_head) gets the fewer layers."""
    assert [stage_layers(3, s, 2) for s in range(2)] == [range(0, 2), range(2, 3)]
    assert [stage_layers(5, s, 3) for s in range(3)] == [range(0, 2), range(2, 4), range(4, 5)]
    assert [stage_layers(4, s, 2, [1, 3]) for s in range(2)] == [range(0, 1), range(1, 4)]
    with pytest.raises(ValueError, match="pp_size=3 must be at most num_hidden_layers=2"):
        stage_layers(2, 0, 3)
    with pytest.raises(ValueError, match="pp_layer_partition=.2, 1. must be"):
        stage_layers(4, 0, 2, [2, 1])


def stage_checks(engine):
    """Every rank's spec (rank order: stage · tp_size + TP rank) and the followers' weights and pools."""
    worker = engine.tp_group.worker
    specs = engine.loop.run_exclusive(worker.check_followers)
    runners = [worker.runner] + [f.runner for f in sorted(engine.tp_group.followers, key=lambda f: f.tp.rank)]
    for runner in runners:
        runner.token_to_kv_pool.check_integrity()
    return specs, runners


def held_layers(runner):
    model = runner.model.model
    return [i for i, layer in enumerate(model.layers) if not isinstance(layer, PPMissingLayer)]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_pp2_tokens_and_logprobs_equal_tp1_and_hf(llama, monkeypatch, tp_size):
    """Each stage holds its layer, rank 0 the embedding, the last stage norm and lm_head; each
    rank's KV pool is its layer's (start_layer), sized as TP=1's (the min over the ranks); the
    server info says the ranks' shape."""
    ref_outputs, ref_meta, _ = run(llama)
    thread_ranks(monkeypatch)
    seen = {}

    def check(engine):
        seen["specs"], runners = stage_checks(engine)
        seen["layers"] = [held_layers(r) for r in runners]
        seen["ends"] = [(not isinstance(r.model.model.embed_tokens, PPMissingLayer),
                         not isinstance(r.model.lm_head, PPMissingLayer)) for r in runners]
        seen["pools"] = [(r.token_to_kv_pool.start_layer, r.token_to_kv_pool.layer_num, r.max_total_num_tokens)
                         for r in runners]
        seen["info"] = engine.server_info()

    outputs, meta, eos = run(llama, tp_size, 2, check=check)
    assert outputs == ref_outputs
    for key in ("output_token_logprobs", "input_token_logprobs"):
        assert [lp for lp, _ in meta[key][1:]] == pytest.approx([lp for lp, _ in ref_meta[key][1:]], abs=1e-5)
    batch, follow = prompts()
    assert_greedy_parity(llama, batch[:1], outputs[:1], GREEDY["max_new_tokens"], eos,
                         logprobs=[[lp for lp, _ in meta["output_token_logprobs"]]])
    assert_greedy_parity(llama, batch[1:] + follow, outputs[1:], GREEDY["max_new_tokens"], eos)
    assert_input_logprobs_close(llama, batch[0], meta, 0, top_logprobs_num=2)
    stages = [s for s in range(2) for _ in range(tp_size)]
    assert [(s.pp_rank, s.pp_size, s.tp_rank, s.start_layer, s.num_layers) for s in seen["specs"]] == [
        (stage, 2, rank % tp_size, stage, 1) for rank, stage in enumerate(stages)]
    assert seen["layers"] == [[stage] for stage in stages]
    assert seen["ends"] == [(stage == 0, stage == 1) for stage in stages]
    assert seen["pools"] == [(stage, 1, 1024) for stage in stages]
    assert (seen["info"]["tp_size"], seen["info"]["pp_size"], seen["info"]["max_total_num_tokens"]) == (tp_size, 2, 1024)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_uneven_stages_with_tied_embeddings_and_a_small_pool_retracting(monkeypatch, tmp_path, micro_batches):
    """3 layers on 2 stages (2 + 1) and tied embeddings (the last stage loads the embedding for its
    lm_head); a pool small enough to retract: the tokens are still HF's. With micro-batches, decode
    shares run two at a time and a request is never retracted while its batch is in flight (its
    slots are being written)."""
    path = str(build_tiny_checkpoint("llama", tmp_path / "llama3", seed=2, num_hidden_layers=3,
                                     tie_word_embeddings=True))
    thread_ranks(monkeypatch)
    rng = random.Random(5)
    batch = [[rng.randrange(5, 261) for _ in range(rng.randint(8, 12))] for _ in range(6)]
    engine = Engine(model_path=path, skip_tokenizer_init=True, max_total_tokens=160, max_running_requests=6,
                    chunked_prefill_size=-1, pp_size=2, pp_micro_batches=micro_batches)
    try:
        launches = watch_micro_batches(engine, monkeypatch)
        outs = engine.generate(input_ids=batch, sampling_params={"max_new_tokens": 40, "temperature": 0})
        assert engine.scheduler.num_retractions > 0
        assert any(kinds == [False] for _, prefill, _, kinds in launches if not prefill) == (micro_batches > 1)
        engine.check_integrity()
        _, runners = stage_checks(engine)
        assert [held_layers(r) for r in runners] == [[0, 1], [2]]
        last = runners[1].model
        assert last.lm_head.weight is last.model.embed_tokens.weight
        assert_greedy_parity(path, batch, [o["output_ids"] for o in outs], 40, engine.eos_token_ids)
    finally:
        engine.shutdown()


def test_moe_with_mla_at_pp2_equals_hf(monkeypatch, tmp_path):
    """DeepSeek-V3 (a dense first layer, then MoE layers; an MLA cache): 3 layers on 2 stages."""
    path = str(build_tiny_checkpoint("deepseek_v3", tmp_path / "dsv3", seed=0))
    thread_ranks(monkeypatch)
    outputs, _, eos = run(path, pp_size=2, check=lambda engine: stage_checks(engine))
    batch, follow = prompts()
    assert_greedy_parity(path, batch + follow, outputs, GREEDY["max_new_tokens"], eos)


def test_pp2_over_spawned_ranks_equals_hf(llama):
    """The stages as processes: the hidden states and the output cross gloo's send / recv, two
    micro-batches in flight (the last stage's output sent while rank 0 broadcasts the next batch)."""
    outputs, _, eos = run(llama, pp_size=2, pp_micro_batches=2)
    batch, follow = prompts()
    assert_greedy_parity(llama, batch + follow, outputs, GREEDY["max_new_tokens"], eos)


def test_a_follower_stage_failing_ends_the_requests_and_breaks_the_group(llama, monkeypatch):
    """The last stage's forward fails: rank 0, waiting for its output, fails the batch's requests and
    joins no collective again (the TP group's broken-group path)."""
    thread_ranks(monkeypatch)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # (the follower thread's own error)
    engine = Engine(model_path=llama, skip_tokenizer_init=True, max_total_tokens=256, pp_size=2)
    try:
        last = engine.tp_group.followers[0].runner.model.model.layers[1]

        def fail(*args):
            raise RuntimeError("injected")

        monkeypatch.setattr(last, "forward", fail)
        with pytest.raises(threading.BrokenBarrierError):  # (a thread rank's failure, as a gloo peer's exit)
            engine.generate(input_ids=[[7, 8, 9]], sampling_params=GREEDY)
        assert engine.tp_group.worker.broken.startswith("a forward failed")
        with pytest.raises(TPGroupBrokenError):
            engine.generate(input_ids=[[7, 8, 9]], sampling_params=GREEDY)
    finally:
        engine.shutdown()


def pool_layers(runner):
    """The global layer ids a runner's pools hold: (full-attention, sliding-window, Mamba)."""
    pool, rows = runner.token_to_kv_pool, runner.req_to_token_pool
    if hasattr(pool, "layers_mapping"):  # SWAKVPool
        return ([i for i, (_, swa) in pool.layers_mapping.items() if not swa],
                [i for i, (_, swa) in pool.layers_mapping.items() if swa], [])
    return list(pool.full_attention_layer_id_mapping), [], list(rows.mamba_map)


@pytest.mark.parametrize("family, overrides, layers", [
    ("gemma3", {}, [([], [0, 1], []), ([3], [2], [])]),  # (stage 0 has no full-attention layer: an empty full pool)
    ("qwen3_next", {}, [([], [], [0, 1]), ([3], [], [2])]),  # (... nor a KV layer at all)
    # Qwen3's window from max_window_layers on: stage 0 of a full layer only keeps an (empty) SWA pool too
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), [([0], [], []), ([], [1], [])]),
], ids=["gemma3", "qwen3_next", "qwen3_window_layers"])
def test_sliding_window_and_mamba_caches_split_into_stages(monkeypatch, tmp_path, family, overrides, layers):
    """Each stage's pools hold its layers only (the full-attention, sliding-window and Mamba layer id lists cut
    to the stage); rank 0's radix cache (SWA tombstones, Mamba checkpoints) decides for both stages over the
    same slots: the tokens through chunked prefill and a prefix hit are PP1's and HF's, every rank checks out."""
    path = str(build_tiny_checkpoint(family, tmp_path / family, seed=0, **overrides))
    ref_outputs, _, _ = run(path)
    thread_ranks(monkeypatch)
    seen = {}

    def check(engine):
        specs, runners = stage_checks(engine)
        seen["specs"] = [(s.full_attention_layer_ids, s.swa_attention_layer_ids, s.mamba_layer_ids) for s in specs]
        seen["pools"] = [pool_layers(r) for r in runners]
        for runner in runners:
            if hasattr(runner, "mamba_pool"):
                runner.mamba_pool.check_integrity()

    outputs, _, eos = run(path, pp_size=2, check=check)
    assert outputs == ref_outputs
    assert seen["specs"] == seen["pools"] == layers
    batch, follow = prompts()
    assert_greedy_parity(path, batch + follow, outputs, GREEDY["max_new_tokens"], eos)


@pytest.mark.parametrize("family, partition", [("gemma3", None), ("qwen3_next", [3, 1])])
def test_stages_sized_from_device_memory_share_their_slot_counts(monkeypatch, tmp_path, family, partition):
    """Pools sized from 1 MiB of device memory: Gemma 3's stages spread their budgets (2,048 tokens of two
    fp32 layers' 512 B) over full and SWA pools by their own layers, stage 0's two SWA layers to 2,560 full
    slots, stage 1's SWA and full one to 2,275 (2,048 x 2 / (1 + 0.8)); Qwen3-Next's first stage holds its
    three Mamba layers and no KV layer (no bound of its own), its second one the full-attention layer alone
    (256 B a token) and no Mamba state: every rank ends with the ranks' least full and SWA slot counts."""
    from actors.engine import model_runner

    total = 8 * GiB
    monkeypatch.setattr(model_runner, "get_device_memory", lambda device: (total // 2 + 2**20, total))
    path = str(build_tiny_checkpoint(family, tmp_path / family, seed=0))
    thread_ranks(monkeypatch)
    engine = Engine(model_path=path, skip_tokenizer_init=True, pp_size=2, pp_layer_partition=partition,
                    mem_fraction_static=0.5, max_running_requests=4)
    try:
        outputs = engine.generate(input_ids=prompts()[0], sampling_params=GREEDY)
        engine.check_integrity()
        _, runners = stage_checks(engine)
        if partition:
            assert [r.mamba_pool.num_mamba_layers for r in runners] == [3, 0]
        counts = {(r.max_total_num_tokens, getattr(r, "swa_max_total_num_tokens", None)) for r in runners}
    finally:
        engine.shutdown()
    assert len(counts) == 1
    tokens, swa_tokens = counts.pop()
    if family == "gemma3":
        assert (tokens, swa_tokens) == (2275, 1820)
    else:
        assert 0 < tokens <= 2**20 // 256 and swa_tokens is None
    assert_greedy_parity(path, prompts()[0], [o["output_ids"] for o in outputs], GREEDY["max_new_tokens"],
                         engine.eos_token_ids)


def test_pipeline_settings_are_checked_before_any_rank_starts(llama):
    with pytest.raises(ValueError, match="pp_size=3 must be at most num_hidden_layers=2"):
        Engine(model_path=llama, skip_tokenizer_init=True, max_total_tokens=256, pp_size=3)
    with pytest.raises(ValueError, match="pp_layer_partition has 1 counts for pp_size=2"):
        EngineConfig(model_path=llama, pp_size=2, pp_layer_partition=[2])
    with pytest.raises(ValueError, match="pp_size=2: speculative_algorithm is not served"):
        EngineConfig(model_path=llama, pp_size=2, speculative_algorithm="ngram")
    with pytest.raises(ValueError, match="pp_size=2: enable_hierarchical_cache is not served"):
        EngineConfig(model_path=llama, pp_size=2, enable_hierarchical_cache=True)
    with pytest.raises(ValueError, match="pp_micro_batches=2 needs pp_size > 1"):
        EngineConfig(model_path=llama, pp_micro_batches=2)


def test_each_stage_takes_its_layers_of_a_weight_update(llama, monkeypatch, tmp_path):
    """A checkpoint from disk, then one tensor of the last stage's layer only (rank 0 holds none of
    it): every rank copies the tensors of its stage, and the tokens are the new weights' (HF's)."""
    thread_ranks(monkeypatch)
    new = str(build_tiny_checkpoint("llama", tmp_path / "new", seed=3))
    name = "model.layers.1.mlp.down_proj.weight"
    tensor = 4 * hf_model(llama).state_dict()[name]
    mixed = tmp_path / "mixed"  # the new checkpoint with that tensor, for HF
    model = AutoModelForCausalLM.from_pretrained(new, local_files_only=True, dtype=torch.float32)
    model.model.layers[1].mlp.down_proj.weight.data.copy_(tensor)
    model.save_pretrained(mixed)
    batch, _ = prompts()
    engine = Engine(model_path=llama, skip_tokenizer_init=True, max_total_tokens=1024, pp_size=2)
    try:
        engine.update_weights_from_disk(new)
        first = [o["output_ids"] for o in engine.generate(input_ids=batch, sampling_params=GREEDY)]
        assert_greedy_parity(new, batch, first, GREEDY["max_new_tokens"], engine.eos_token_ids)
        engine.update_weights_from_tensor([(name, tensor)])
        outputs = [o["output_ids"] for o in engine.generate(input_ids=batch, sampling_params=GREEDY)]
        engine.check_integrity()
    finally:
        engine.shutdown()
    assert outputs != first
    assert_greedy_parity(str(mixed), batch, outputs, GREEDY["max_new_tokens"], engine.eos_token_ids)


def test_quantized_layers_of_the_last_stage_are_checked_there_in_an_update(monkeypatch, tmp_path):
    """Named tensors of the last stage's quantized layers are that stage's to check: another FP8 checkpoint's
    (FP8 weights with their scales) serves HF's tokens over its dequantization (rank 0 refused them as FP8 on a
    layer it does not serve in FP8), and a GPTQ act-order g_idx of the last stage's layer beside new tensors of
    the first stage's is refused before any copy, the tokens unchanged (the last stage was sent it on meta: it
    failed the copy instead, after rank 0 had written its stage's)."""
    from safetensors.torch import load_file

    from tests.test_fp8_weights import fp8_checkpoint
    from tests.wna16_helpers import packed_checkpoint

    thread_ranks(monkeypatch)
    batch, _ = prompts()
    quantized, _ = fp8_checkpoint("llama", tmp_path / "a")
    other, other_dequantized = fp8_checkpoint("llama", tmp_path / "b", seed=1)
    engine = Engine(model_path=quantized, skip_tokenizer_init=True, max_total_tokens=512, pp_size=2)
    try:
        engine.update_weights_from_tensor(list(load_file(f"{other}/model.safetensors").items()))
        outputs = [o["output_ids"] for o in engine.generate(input_ids=batch, sampling_params=GREEDY)]
    finally:
        engine.shutdown()
    assert_greedy_parity(other_dequantized, batch, outputs, GREEDY["max_new_tokens"], engine.eos_token_ids)

    packed, _ = packed_checkpoint("llama", tmp_path / "c", bits=4, group_size=16)
    new, _ = packed_checkpoint("llama", tmp_path / "d", bits=4, group_size=16, seed=2)
    act_order, _ = packed_checkpoint("llama", tmp_path / "e", bits=4, group_size=16, act_order=True, seed=1)
    g_idx = "model.layers.1.self_attn.q_proj.g_idx"
    engine = Engine(model_path=packed, skip_tokenizer_init=True, max_total_tokens=512, pp_size=2)
    try:
        before = [o["output_ids"] for o in engine.generate(input_ids=batch, sampling_params=GREEDY)]
        named = [(name, t) for name, t in load_file(f"{new}/model.safetensors").items()
                 if name.startswith("model.layers.0.")]
        named += [(name, t) for name, t in load_file(f"{act_order}/model.safetensors").items()
                  if name.startswith("model.layers.1.")]
        with pytest.raises(ValueError, match=f"rank 1: .*{g_idx} is not in group order"):
            engine.update_weights_from_tensor(named)
        assert [o["output_ids"] for o in engine.generate(input_ids=batch, sampling_params=GREEDY)] == before
        engine.check_integrity()
    finally:
        engine.shutdown()


def watch_micro_batches(engine, monkeypatch, on_launch=None):
    """Every micro-batch launched: (its request ids, whether a prefill, the ids of those in flight
    beside it, whether each of those is a prefill) (each launch checks the ids are disjoint);
    ``on_launch(scheduler, reqs)`` runs after each launch. A request retracted while in flight fails
    the test."""
    scheduler, launches = engine.scheduler, []
    launch, retract = scheduler.runner.launch, scheduler._retract

    def watched_launch(forward_batch):
        reqs = scheduler.in_flight[len(scheduler.in_flight) - forward_batch.batch_size:]
        beside = {r.rid for mb in scheduler.micro_batches for r in mb.reqs}
        assert not beside & {r.rid for r in reqs}
        launches.append(({r.rid for r in reqs}, forward_batch.forward_mode.is_extend, beside,
                         [mb.is_prefill for mb in scheduler.micro_batches]))
        output = launch(forward_batch)
        if on_launch is not None:
            on_launch(scheduler, reqs)
        return output

    def watched_retract(req):
        assert all(req is not r for r in scheduler.in_flight)
        retract(req)

    monkeypatch.setattr(scheduler.runner, "launch", watched_launch)
    monkeypatch.setattr(scheduler, "_retract", watched_retract)
    return launches


def micro_batch_prompts(n=6, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(5, 261) for _ in range(rng.randint(8, 70))] for _ in range(n)]


def test_micro_batches_in_flight_give_one_batchs_tokens(llama, monkeypatch):
    """pp_micro_batches=2: prefill chunks and decode shares of disjoint requests run two at a time, and
    the tokens are one batch at a time's (and HF's); every rank's pools are whole after."""
    batch = micro_batch_prompts()
    thread_ranks(monkeypatch)
    outputs = {}
    for micro_batches in (1, 2):
        engine = Engine(model_path=llama, skip_tokenizer_init=True, max_total_tokens=1024, pp_size=2,
                        chunked_prefill_size=32, pp_micro_batches=micro_batches)
        try:
            launches = watch_micro_batches(engine, monkeypatch)
            outs = engine.generate(input_ids=batch, sampling_params=dict(GREEDY, max_new_tokens=12))
            outputs[micro_batches] = [o["output_ids"] for o in outs]
            engine.check_integrity()
            stage_checks(engine)
            assert not engine.scheduler.in_flight
        finally:
            engine.shutdown()
        beside = [(prefill, tuple(kinds)) for _, prefill, _, kinds in launches]
        if micro_batches == 1:  # (runner.forward launches too)
            assert all(kinds == () for _, kinds in beside)
        else:  # a prefill chunk launched while one ran, a decode share while another share ran
            assert (True, (True,)) in beside and (False, (False,)) in beside
    assert outputs[2] == outputs[1]
    assert_greedy_parity(llama, batch, outputs[2], 12, engine.eos_token_ids)


@pytest.mark.parametrize("prefill", [True, False])
def test_a_request_aborted_in_flight_ends_when_its_batch_comes_back(llama, monkeypatch, prefill):
    """Aborted while its micro-batch (a prefill chunk, a decode share) runs: it ends aborted once that
    batch's output is back, every slot it held freed on every rank; the others' tokens are unchanged."""
    batch = micro_batch_prompts()
    params = dict(GREEDY, max_new_tokens=12)
    thread_ranks(monkeypatch)
    engine = Engine(model_path=llama, skip_tokenizer_init=True, max_total_tokens=1024, pp_size=2,
                    chunked_prefill_size=32, pp_micro_batches=2)
    aborted = []

    def abort_one(scheduler, reqs):
        victim = reqs[0]
        chunk = prefill and len(victim.fill_ids) < victim.seqlen  # (a chunk before its last)
        if not aborted and (chunk if prefill else len(victim.output_ids) == 3):
            aborted.append((victim.rid, len(victim.output_ids)))
            assert scheduler.abort(victim.rid)

    try:
        reference = [o["output_ids"] for o in engine.generate(input_ids=batch, sampling_params=params)]
        watch_micro_batches(engine, monkeypatch, abort_one)
        rids = [f"r{i}" for i in range(len(batch))]
        outs = engine.generate(input_ids=batch, sampling_params=params, rid=rids)
        (rid, decoded), = aborted
        for i, out in enumerate(outs):
            if rids[i] == rid:
                assert out["meta_info"]["finish_reason"]["type"] == "abort"
                assert out["output_ids"] == reference[i][:decoded]
            else:
                assert out["output_ids"] == reference[i]
        engine.check_integrity()
        stage_checks(engine)
    finally:
        engine.shutdown()
