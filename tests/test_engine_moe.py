"""Qwen3-MoE, Mixtral (the shared sparse MoE block) and Mistral (every layer's sliding window,
which the prompts and outputs run past, its KV in the SWA pool) through the engine: greedy tokens and
their logprobs equal HF's through a batch, chunked prefill and a prefix-cache hit; TP 2 (ranks as
threads) equals TP 1, each rank holding its slice of every expert; prefill and decode workers in one
process equal HF. The config variants (dense layers, top-k not renormalised, windows) are in
test_model_configs."""

import random

import pytest

from actors.engine import Engine
from actors.engine.tiny import build_tiny_checkpoint, tiny_config
from tests.parity import assert_greedy_parity
from tests.pd_helpers import close_workers, make_pair, run_batch
from tests.tp_helpers import thread_ranks

FAMILIES = ("qwen3_moe", "mixtral", "mistral")
GREEDY = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
SCORED = dict(GREEDY, return_logprob=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {family: str(build_tiny_checkpoint(family, root / family, seed=0)) for family in FAMILIES}


def prompts():
    """A batch sharing a 40-token system prompt, and a follow-up of its longest prompt."""
    rng = random.Random(0)
    system = [rng.randrange(5, 261) for _ in range(40)]
    batch = [system + [rng.randrange(5, 261) for _ in range(n)] for n in (3, 12, 30)]
    return batch, [batch[2] + [9, 10, 11]]


def generate(model_dir, tp_size=1, **args):
    """Outputs (and logprobs) of the batch then of the follow-up, the follow-up's cached tokens."""
    batch, follow = prompts()
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=1024, tp_size=tp_size,
                    chunked_prefill_size=16, **args)
    try:
        outs = engine.generate(input_ids=batch, sampling_params=SCORED)
        outs += engine.generate(input_ids=follow, sampling_params=SCORED)
        engine.check_integrity()
        cached = outs[-1]["meta_info"]["cached_tokens"]
        logprobs = [[lp for lp, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
        return [o["output_ids"] for o in outs], logprobs, cached, engine.runner.spec
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_equal_hf_through_chunks_and_a_prefix_hit(checkpoints, family):
    outputs, logprobs, cached, spec = generate(checkpoints[family])
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
    ref_outputs, ref_logprobs, ref_cached, _ = generate(checkpoints[family])
    outputs, logprobs, cached, _ = generate(checkpoints[family], tp_size=2)
    assert outputs == ref_outputs and cached == ref_cached
    for ours, ref in zip(logprobs, ref_logprobs):
        assert ours == pytest.approx(ref, abs=1e-4)


def test_expert_slices_per_rank():
    """What each rank holds of the checkpoint's experts: rows (gate, up) and columns (down) of its half."""
    from actors.engine.model_loader import build_model
    from actors.engine.parallel import TPGroup

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
