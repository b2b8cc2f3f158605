"""Qwen3-Next (gated delta-net + gated attention + MoE) through the engine:
parity with HF with and without the Mamba-aware prefix cache (no_buffer),
through chunked prefill, prefix hits and retraction; Mamba slots conserved."""

import random

import pytest

from actors.engine import Engine
from actors.engine.tiny import build_tiny_checkpoint
from tests.parity import assert_greedy_parity

GREEDY = {"max_new_tokens": 10, "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_checkpoint("qwen3_next", tmp_path_factory.mktemp("qwen3_next") / "m", seed=0))


def prompts(seed=0, lens=(5, 30, 50)):
    rng = random.Random(seed)
    return [[rng.randrange(5, 261) for _ in range(n)] for n in lens]


def test_parity_without_cache(model_dir):
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=2048, disable_radix_cache=True)
    batch = prompts()
    outs = engine.generate(input_ids=batch, sampling_params=GREEDY)
    assert_greedy_parity(model_dir, batch, [o["output_ids"] for o in outs], 10, engine.eos_token_ids)
    engine.check_integrity()
    engine.shutdown()


def test_chunked_prefill_and_prefix_reuse_copy_the_state(model_dir):
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=2048, chunked_prefill_size=16)
    batch = prompts(1)
    outs = engine.generate(input_ids=batch, sampling_params=GREEDY)
    assert_greedy_parity(model_dir, batch, [o["output_ids"] for o in outs], 10, engine.eos_token_ids)
    follow = [batch[2] + [9, 10, 11]]
    again = engine.generate(input_ids=follow, sampling_params=GREEDY)
    assert again[0]["meta_info"]["cached_tokens"] >= 48  # a state checkpoint at a chunk end or the prompt end
    assert_greedy_parity(model_dir, follow, [again[0]["output_ids"]], 10, engine.eos_token_ids)
    engine.check_integrity()
    engine.shutdown()


def test_retraction_with_mamba_state(model_dir):
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=96, max_running_requests=4,
                    chunked_prefill_size=-1)
    batch = prompts(2, (6, 8, 10, 7))
    outs = engine.generate(input_ids=batch, sampling_params={"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
    assert engine.scheduler.num_retractions > 0
    assert_greedy_parity(model_dir, batch, [o["output_ids"] for o in outs], 24, [])
    engine.check_integrity()
    engine.shutdown()
