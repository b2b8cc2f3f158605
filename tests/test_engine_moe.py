"""Qwen3-MoE, Mixtral (the shared sparse MoE block) and Mistral (every layer's sliding window,
which the prompts and outputs run past, its KV in the SWA pool) through the engine: greedy tokens and
their logprobs equal HF's through a batch, chunked prefill and a prefix-cache hit; TP 2 (ranks as
threads) equals TP 1, each rank holding its slice of every expert; prefill and decode workers in one
process equal HF. Expert parallelism (enable_expert_parallel) over every MoE family (GPT-OSS, DeepSeek-V3
and Qwen3-Next too): EP 2 equals TP 1 and HF, each rank holding its half of the experts whole, a weight
update, the config error. moe_backend='triton' (the fused experts) equals the eager experts and HF at TP 2
and EP 2, GPT-OSS's too. The config variants (dense layers, top-k not renormalised, windows) are in
test_model_configs."""

import random

import pytest
import torch

from actors.engine import Engine
from actors.engine.fused_moe import FusableExperts
from actors.engine.model_loader import EXPERT_TENSOR, build_model
from actors.engine.parallel import TPGroup
from actors.engine.tiny import build_tiny_checkpoint, tiny_config
from tests.parity import assert_greedy_parity
from tests.pd_helpers import close_workers, make_pair, run_batch
from tests.tp_helpers import thread_ranks

FAMILIES = ("qwen3_moe", "mixtral", "mistral")
# every MoE family, each with 4 experts: EP 2 gives each rank 2
EP_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "qwen3_next")
GREEDY = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
SCORED = dict(GREEDY, return_logprob=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {family: str(build_tiny_checkpoint(family, root / family, seed=0))
            for family in dict.fromkeys(FAMILIES + EP_FAMILIES)}


def prompts():
    """A batch sharing a 40-token system prompt, and a follow-up of its longest prompt."""
    rng = random.Random(0)
    system = [rng.randrange(5, 261) for _ in range(40)]
    batch = [system + [rng.randrange(5, 261) for _ in range(n)] for n in (3, 12, 30)]
    return batch, [batch[2] + [9, 10, 11]]


def generate(model_dir, tp_size=1, params=SCORED, **args):
    """Outputs (and logprobs) of the batch then of the follow-up, the follow-up's cached tokens, the KV
    spec and every rank's model."""
    batch, follow = prompts()
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=1024, tp_size=tp_size,
                    chunked_prefill_size=16, **args)
    try:
        outs = engine.generate(input_ids=batch, sampling_params=params)
        outs += engine.generate(input_ids=follow, sampling_params=params)
        engine.check_integrity()
        cached = outs[-1]["meta_info"]["cached_tokens"]
        logprobs = [[lp for lp, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
        models = [engine.runner.model] + [rank.runner.model for rank in getattr(engine.tp_group, "followers", [])]
        return [o["output_ids"] for o in outs], logprobs, cached, engine.runner.spec, models
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_equal_hf_through_chunks_and_a_prefix_hit(checkpoints, family):
    outputs, logprobs, cached, spec, _ = generate(checkpoints[family])
    assert cached >= 40
    batch, follow = prompts()
    assert_greedy_parity(checkpoints[family], batch + follow, outputs, GREEDY["max_new_tokens"], logprobs=logprobs)
    if family == "mistral":  # every layer slides: all KV in the SWA pool, the full pool holds slot numbers only
        assert (spec.kind, spec.swa_attention_layer_ids, spec.full_attention_layer_ids) == ("swa", [0, 1], [])
    else:
        assert spec.kind == "mha"


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_equals_tp1_with_every_expert_split(checkpoints, family, monkeypatch):
    """Each rank runs every expert on its half of the intermediate dim; the block's one
    all-reduce sums the routed outputs (a second reduce, or one per expert, would double them).
    Mistral: the SWA pools' slot map mirrored on the follower."""
    thread_ranks(monkeypatch)
    assert_tp2_equals_tp1(checkpoints[family])


def assert_tp2_equals_tp1(model_dir):
    """:func:`generate` at TP 2 (ranks as threads: ``thread_ranks``) gives TP 1's tokens, logprobs and cache hit."""
    ref_outputs, ref_logprobs, ref_cached, _, _ = generate(model_dir)
    outputs, logprobs, cached, _, _ = generate(model_dir, tp_size=2)
    assert outputs == ref_outputs and cached == ref_cached
    for ours, ref in zip(logprobs, ref_logprobs):
        assert ours == pytest.approx(ref, abs=1e-4)


def test_expert_slices_per_rank():
    """What each rank holds of the checkpoint's experts: rows (gate, up) and columns (down) of its half."""
    for family, architecture, field, expert in (("qwen3_moe", "Qwen3MoeForCausalLM", "moe_intermediate_size", "mlp"),
                                                ("mixtral", "MixtralForCausalLM", "intermediate_size",
                                                 "block_sparse_moe")):
        config = tiny_config(family)
        config.architectures = [architecture]
        size = getattr(config, field)
        for rank in range(2):
            block = getattr(build_model(config, TPGroup(rank=rank, size=2)).model.layers[1], expert)
            half = range(rank * size // 2, (rank + 1) * size // 2)
            shards = sorted(((p.dim, p.ranges) for m in block.experts[3].modules()
                             for p in getattr(m, "param_shards", {}).values()), key=lambda shard: shard[0])
            assert shards == [(0, [half]), (0, [half]), (1, [half])], (family, rank, shards)
            assert not hasattr(block.gate, "param_shards")  # the router is replicated: every rank routes alike


@pytest.mark.parametrize("family, page_size", [("qwen3_moe", 4), ("mixtral", 1), ("mistral", 4)])
def test_prefill_and_decode_workers_equal_hf(checkpoints, family, page_size):
    path = checkpoints[family]
    prefill, decode = make_pair(path, page_size)
    try:
        batch, follow = prompts()
        results = run_batch(prefill, decode, batch + follow, GREEDY)
        assert_greedy_parity(path, batch + follow, [r[0]["output_ids"] for r in results], GREEDY["max_new_tokens"])
        assert prefill.scheduler.bytes_pushed > 0
    finally:
        close_workers(prefill, decode)


@pytest.mark.parametrize("family, ep", [("qwen3_moe", False), ("mixtral", True), ("gpt_oss", False)])
def test_fused_experts_equal_eager_and_hf(checkpoints, family, ep, monkeypatch):
    """moe_backend='triton' (the fused kernels, interpreted here): tokens and logprobs equal the eager
    experts' (TP 1) and HF's through chunks and a prefix hit, at TP 2 (each rank's slice of every expert
    stacked) and EP 2 (each rank's experts stacked, the others' tokens adding 0 on it). GPT-OSS: its 3-D
    weights read as stored, its down bias added by rank 0 alone."""
    thread_ranks(monkeypatch)
    params = dict(SCORED, max_new_tokens=8)  # (the kernels interpreted: ~6 ms a block)
    ref_outputs, ref_logprobs, _, _, _ = generate(checkpoints[family], params=params)
    outputs, logprobs, _, _, models = generate(checkpoints[family], tp_size=2, params=params,
                                               enable_expert_parallel=ep, moe_backend="triton")
    experts = [m for model in models for m in model.modules() if isinstance(m, FusableExperts)]
    assert len(experts) == 2 * tiny_config(family).num_hidden_layers and all(m.fused is not None for m in experts)
    assert outputs == ref_outputs
    for ours, ref in zip(logprobs, ref_logprobs):
        assert ours == pytest.approx(ref, abs=1e-4)
    batch, follow = prompts()
    assert_greedy_parity(checkpoints[family], batch + follow, outputs, params["max_new_tokens"], logprobs=logprobs)


def test_moe_backend_auto_and_triton_without_the_interpreter(checkpoints, monkeypatch):
    """auto runs the experts eagerly on the CPU; triton there without Triton's interpreter is refused at
    start, naming the field, not at the first forward's launch."""
    engine = Engine(model_path=checkpoints["qwen3_moe"], skip_tokenizer_init=True, max_total_tokens=256)
    try:
        experts = [m for m in engine.runner.model.modules() if isinstance(m, FusableExperts)]
        assert len(experts) == 2 and all(m.fused is None for m in experts)
    finally:
        engine.shutdown()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="moe_backend='triton'.*TRITON_INTERPRET=1"):
        Engine(model_path=checkpoints["qwen3_moe"], skip_tokenizer_init=True, max_total_tokens=256,
               moe_backend="triton")


def expert_tensors(model):
    """The routed experts' tensors of ``model`` (shared experts are ``shared_expert(s)``), by name."""
    return {name: t for name, t in model.state_dict().items() if ".experts." in name}


def assert_holds_its_experts(model, rank, whole):
    """``model`` (EP rank ``rank`` of 2) holds experts [2·rank, 2·rank + 2) of 4, as the checkpoint
    (``whole``: TP 1's expert tensors) has them, and nothing of the others: half the expert bytes."""
    held, experts = expert_tensors(model), range(2 * rank, 2 * rank + 2)
    assert sum(t.numel() for t in held.values()) * 2 == sum(t.numel() for t in whole.values())
    for name, tensor in held.items():
        match = EXPERT_TENSOR.match(name)
        if match:  # one tensor an expert (Qwen, Mixtral, DeepSeek): only this rank's, whole
            assert int(match[2]) in experts, name
            assert torch.equal(tensor, whole[name]), name
        else:  # GPT-OSS's 3-D tensors (and biases): this rank's slice of the expert dim
            assert torch.equal(tensor, whole[name][experts.start:experts.stop]), name


@pytest.mark.parametrize("family", EP_FAMILIES)
def test_ep2_equals_tp1_and_hf_each_rank_holding_its_experts(checkpoints, family, monkeypatch):
    """Expert parallelism: each rank routes every token (the router replicated), runs its two experts,
    whole, on the tokens routed to them, and the block's one all-reduce sums the ranks' experts; GPT-OSS's
    down bias is added once (by the expert's only holder); DeepSeek's and Qwen3-Next's shared experts stay
    TP in the same reduce. Tokens and logprobs equal TP 1's and HF's through chunks and a prefix hit."""
    thread_ranks(monkeypatch)
    ref_outputs, ref_logprobs, _, _, (full,) = generate(checkpoints[family])
    outputs, logprobs, _, _, ranks = generate(checkpoints[family], tp_size=2, enable_expert_parallel=True)
    assert outputs == ref_outputs
    for ours, ref in zip(logprobs, ref_logprobs):
        assert ours == pytest.approx(ref, abs=1e-4)
    batch, follow = prompts()
    assert_greedy_parity(checkpoints[family], batch + follow, outputs, GREEDY["max_new_tokens"], logprobs=logprobs)
    assert len(ranks) == 2
    for rank, model in enumerate(ranks):
        assert_holds_its_experts(model, rank, expert_tensors(full))


def test_ep2_weight_update_copies_each_ranks_experts(checkpoints, tmp_path, monkeypatch):
    """A weight update under EP checks the whole checkpoint (every expert's tensors) on each rank and
    copies into each rank only its experts: after it, tokens are TP 1's on the new weights."""
    thread_ranks(monkeypatch)
    new = checkpoints["qwen3_moe"]
    ref_outputs, _, _, _, (full,) = generate(new)
    old = str(build_tiny_checkpoint("qwen3_moe", tmp_path / "old", seed=1))
    engine = Engine(model_path=old, skip_tokenizer_init=True, max_total_tokens=1024, tp_size=2,
                    enable_expert_parallel=True)
    try:
        engine.update_weights_from_disk(new, weight_version="v1")
        batch, follow = prompts()
        outs = engine.generate(input_ids=batch + follow, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == ref_outputs
        assert {o["meta_info"]["weight_version"] for o in outs} == {"v1"}
        engine.check_integrity()
        for rank, worker in enumerate([engine.tp_group.worker] + engine.tp_group.followers):
            assert_holds_its_experts(worker.runner.model, rank, expert_tensors(full))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family, field", [("qwen3_moe", "num_experts"), ("mixtral", "num_local_experts"),
                                           ("gpt_oss", "num_local_experts"), ("deepseek_v3", "n_routed_experts")])
def test_ep_needs_tp_size_to_divide_the_experts(family, field):
    """6 experts over 4 ranks: TP splits each expert's intermediate dim and builds; EP cannot give each
    rank whole experts alike and fails naming the field."""
    config = tiny_config(family, **{field: 6})
    config.architectures = [{"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                             "gpt_oss": "GptOssForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[family]]
    build_model(config, TPGroup(rank=0, size=4))
    with pytest.raises(ValueError, match=f"tp_size=4 must divide {field}=6 with enable_expert_parallel"):
        build_model(config, TPGroup(rank=0, size=4, expert_parallel=True))


def test_ep_rank_reads_only_its_experts(checkpoints, monkeypatch):
    """Rank 1 of EP 2 reads no tensor of experts 0 and 1 from the checkpoint (nor counts them
    unexpected), and every tensor it holds."""
    from actors.engine import model_loader

    read, original = [], model_loader._read
    monkeypatch.setattr(model_loader, "_read", lambda f, name, shard: read.append(name) or original(f, name, shard))
    path = checkpoints["mixtral"]
    model = build_model(model_loader.load_config(path), TPGroup(rank=1, size=2, expert_parallel=True))
    missing, unexpected = model_loader.load_weights(model.to_empty(device="cpu"),
                                                    model_loader.checkpoint_files(path))
    assert not missing and not unexpected
    experts = {int(m[2]) for m in map(EXPERT_TENSOR.match, read) if m}
    assert experts == {2, 3} and sorted(read) == sorted(model.state_dict())
