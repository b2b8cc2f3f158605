"""Config fields that change the math: each case builds a tiny random checkpoint of a
family with the field set (HF transformers writes it) and holds our greedy tokens
*and* their log-probabilities against HF's. A field we cannot serve must be refused
naming it, never served silently wrong."""

import random

import pytest
import torch

from actors.engine import Engine
from actors.engine.tiny import build_tiny_checkpoint
from tests.parity import assert_greedy_parity

MAX_NEW = 6

# case id -> (family, config overrides)
CASES = {
    # Qwen2/Qwen3 with use_sliding_window: layers from max_window_layers on attend a window
    "qwen3_sliding_window": ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
}


def prompts():
    rng = random.Random(0)
    return [[rng.randrange(5, 261) for _ in range(n)] for n in (3, 20, 37)]


def generate(model_dir, batch, **engine_args):
    """Our greedy outputs and their logprobs."""
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=1024, **engine_args)
    try:
        params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "return_logprob": True}
        outs = engine.generate(input_ids=batch, sampling_params=params)
        engine.check_integrity()
    finally:
        engine.shutdown()
    return [o["output_ids"] for o in outs], [[lp for lp, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]


@pytest.mark.parametrize("case", list(CASES))
def test_config_variant_matches_hf(case, tmp_path):
    family, overrides = CASES[case]
    model_dir = str(build_tiny_checkpoint(family, tmp_path / case, seed=0, **overrides))
    batch = prompts()
    outputs, logprobs = generate(model_dir, batch)
    assert_greedy_parity(model_dir, batch, outputs, MAX_NEW, logprobs=logprobs)
