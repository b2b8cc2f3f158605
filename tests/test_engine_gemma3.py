"""Gemma 3 (sliding-window + full layers) through the engine: parity with HF
when prompts and generations run past the window, with chunks and prefix hits."""

import random

import pytest
import torch

from actors.engine import Engine
from actors.engine.tiny import build_tiny_checkpoint
from tests.parity import assert_greedy_parity


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3") / "m", seed=0))


@pytest.mark.parametrize("backend, page_size", [("torch", 1), ("torch", 4), ("triton", 1)])
def test_gemma3_parity_past_the_window(model_dir, backend, page_size):
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    rng = random.Random(1)
    system = [rng.randrange(5, 261) for _ in range(24)]  # longer than the 16-token window
    batch = [system + [rng.randrange(5, 261) for _ in range(n)] for n in (3, 9)] + [[7, 8, 9]]
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, attention_backend=backend, device=device,
                    page_size=page_size, max_total_tokens=2048, chunked_prefill_size=8)
    params = {"max_new_tokens": 20, "temperature": 0}
    outs = engine.generate(input_ids=batch, sampling_params=params)
    assert_greedy_parity(model_dir, batch, [o["output_ids"] for o in outs], 20, engine.eos_token_ids)
    again = engine.generate(input_ids=[system + [11, 12]], sampling_params=params)
    assert again[0]["meta_info"]["cached_tokens"] >= 24 // page_size * page_size
    assert_greedy_parity(model_dir, [system + [11, 12]], [again[0]["output_ids"]], 20, engine.eos_token_ids)
    engine.check_integrity()
    engine.shutdown()
