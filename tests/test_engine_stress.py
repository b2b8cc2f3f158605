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


@pytest.mark.parametrize("family, args", [
    ("llama", {}),
    ("qwen3_next", {"mamba_scheduler_strategy": "extra_buffer", "mamba_track_interval": 16}),
])
def test_a_batch_of_short_prompts_is_planned_in_whole_pages(checkpoints, family, args):
    """Thirty 3-token prompts on 16-token pages: each takes a whole page, which admission counted
    as 3 tokens — it planned batches that could never be allocated and repeated them forever.
    A failed batch is now planned shorter at once, whose rows give back their Mamba slots once."""
    model_dir = checkpoints[family]
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=256, page_size=16, **args)
    rng = random.Random(4)
    batch = [[rng.randrange(5, VOCAB_SIZE) for _ in range(3)] for _ in range(30)]
    try:
        outs = generate_within(engine, batch, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        engine.check_integrity()
        assert_greedy_parity(model_dir, batch[:4], [o["output_ids"] for o in outs[:4]], 8, [])
    finally:
        engine.shutdown()


def test_a_failed_batch_gives_back_a_copied_mamba_state_once(checkpoints, monkeypatch):
    """A hybrid request that matched a cached state holds its own copy (copy-on-write); when its
    batch cannot be allocated, freeing its row frees that copy too — the request kept naming it,
    and its next match or an abort freed the slot a second time (two requests could then share it)."""
    from actors.engine.schedule_batch import prepare_for_extend

    engine = Engine(model_path=checkpoints["qwen3_next"], skip_tokenizer_init=True, max_total_tokens=256)
    try:
        prompt = [random.Random(5).randrange(5, VOCAB_SIZE) for _ in range(24)]
        engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 2, "temperature": 0})
        sched, runner = engine.scheduler, engine.runner

        def fail_to_allocate():
            req = engine._make_req(None, prompt + [7, 8, 9], {"max_new_tokens": 2, "temperature": 0}, "cow")
            sched._match_prefix(req, admit=True)
            assert req.mamba_pool_idx is not None  # its own copy of the cached state
            sched._lock(req)
            monkeypatch.setattr(runner.allocator, "alloc_extend", lambda *a, **k: None)
            assert prepare_for_extend([req], runner, sched.tree_cache) is None
            monkeypatch.undo()
            sched._unlock(req)
            return req

        req = engine.loop.run_exclusive(fail_to_allocate)
        assert req.mamba_pool_idx is None and req.req_pool_idx is None
        engine.check_integrity()  # every Mamba slot free once
    finally:
        engine.shutdown()
