"""The engine under memory pressure it must work its way through: conversations whose
next turns arrive together, each with a cached history, in a pool too small for all of
them at once (prefixes locked while others wait, eviction, retraction, chunked prefill,
the host tier). Every round must finish — a scheduler that plans what it cannot allocate
repeats the plan forever — with tokens equal to HF's and nothing leaked."""

import random
import threading

import pytest

from actors.engine import Engine
from actors.engine.tiny import VOCAB_SIZE, build_tiny_checkpoint
from tests.parity import assert_greedy_parity

ROUND_TIMEOUT_S = 90
CASES = {  # name: (family, engine args)
    "llama": ("llama", {"page_size": 4, "max_total_tokens": 320}),
    "llama-chunked-lpm": ("llama", {"page_size": 4, "max_total_tokens": 320, "chunked_prefill_size": 16,
                                    "schedule_policy": "lpm"}),
    "llama-host-tier": ("llama", {"page_size": 4, "max_total_tokens": 320, "enable_hierarchical_cache": True,
                                  "hicache_ratio": 3.0, "hicache_write_policy": "write_back"}),
    "deepseek_v3": ("deepseek_v3", {"page_size": 1, "max_total_tokens": 300}),
    "qwen3_next": ("qwen3_next", {"page_size": 1, "max_total_tokens": 300, "max_running_requests": 4}),
    "gemma3": ("gemma3", {"page_size": 1, "max_total_tokens": 320}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("stress")
    families = sorted({family for family, _ in CASES.values()})
    return {family: str(build_tiny_checkpoint(family, root / family, seed=3)) for family in families}


def generate_within(engine, prompts, params):
    done = []
    worker = threading.Thread(target=lambda: done.append(engine.generate(input_ids=prompts, sampling_params=params)),
                              daemon=True)
    worker.start()
    worker.join(ROUND_TIMEOUT_S)
    assert done, f"a round of {len(prompts)} requests did not finish in {ROUND_TIMEOUT_S}s: the scheduler is stuck"
    return done[0]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_conversations_outgrowing_the_pool_all_finish(checkpoints, case, seed):
    family, args = CASES[case]
    model_dir = checkpoints[family]
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, **args)
    rng = random.Random(seed)
    out_len = 6
    params = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
    histories = [[] for _ in range(8)]
    try:
        for _ in range(3):  # eight conversations, three turns, each turn's requests arriving together
            prompts = [h + [rng.randrange(5, VOCAB_SIZE) for _ in range(rng.randint(10, 40))] for h in histories]
            outs = generate_within(engine, prompts, params)
            assert all(len(o["output_ids"]) == out_len for o in outs)
            engine.check_integrity()
            histories = [p + o["output_ids"] for p, o in zip(prompts, outs)]
        assert sum(len(p) + out_len for p in prompts) > args["max_total_tokens"]  # the last round did not fit at once
        assert_greedy_parity(model_dir, prompts, [o["output_ids"] for o in outs], out_len, [])
    finally:
        engine.shutdown()
