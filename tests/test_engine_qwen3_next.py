"""Qwen3-Next (gated delta-net + gated attention + MoE) through the engine:
parity with HF with and without the Mamba-aware prefix cache (no_buffer),
through chunked prefill, prefix hits and retraction; Mamba slots conserved."""

import random

import pytest
import torch

from actors.engine import Engine
from actors.engine.config import EngineConfig
from actors.engine.engine import check_engine_integrity
from actors.engine.model_runner import ModelRunner
from actors.engine.req import Req
from actors.engine.sampling_params import SamplingParams
from actors.engine.scheduler import Scheduler
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


def test_hybrid_prefix_cache_branching(model_dir):
    """SGLang's branching case: 257 "hi" tokens, then 256 of one of three words;
    extra_buffer, track interval 128, one new token each → cached 0, 0, 256."""
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=4096,
                    mamba_scheduler_strategy="extra_buffer", mamba_track_interval=128, chunked_prefill_size=-1)
    hi, words = 77, (101, 102, 103)
    cached = []
    for word in words:
        out = engine.generate(input_ids=[hi] * 257 + [word] * 256, sampling_params={"max_new_tokens": 1, "temperature": 0})
        cached.append(out["meta_info"]["cached_tokens"])
    assert cached == [0, 0, 256]
    engine.check_integrity()
    engine.shutdown()


# triton on the GPU only: its attention layers are the dense model's, whose Triton path the CPU runs
# interpreted in test_engine_dense (and ~25 s here)
@pytest.mark.parametrize("backend, page_size", [("torch", 1), ("torch", 16), pytest.param("triton", 1, marks=pytest.mark.gpu)])
def test_extra_buffer_parity_with_chunks_and_decode_checkpoints(model_dir, backend, page_size):
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=4096, attention_backend=backend,
                    device=device, page_size=page_size, mamba_scheduler_strategy="extra_buffer",
                    mamba_track_interval=64, chunked_prefill_size=64)
    rng = random.Random(3)
    system = [rng.randrange(5, 261) for _ in range(150)]
    first = [system + [rng.randrange(5, 261) for _ in range(20)]]
    outs = engine.generate(input_ids=first, sampling_params={"max_new_tokens": 40, "temperature": 0, "ignore_eos": True})
    assert_greedy_parity(model_dir, first, [o["output_ids"] for o in outs], 40, [])
    second = [system + [rng.randrange(5, 261) for _ in range(10)]]
    again = engine.generate(input_ids=second, sampling_params=GREEDY)
    assert again[0]["meta_info"]["cached_tokens"] == 128  # the last 64-aligned checkpoint inside the shared prefix
    assert_greedy_parity(model_dir, second, [again[0]["output_ids"]], 10, engine.eos_token_ids)
    engine.check_integrity()
    engine.shutdown()


def test_copy_on_write_waits_while_every_mamba_state_is_held(model_dir, monkeypatch):
    """Two Mamba slots. A and B arrive together, both extending a cached conversation: A's copy
    of its state takes the free slot and A's lock holds the source, so B's copy finds no slot
    even after eviction. A logical OOM (it raised, failing the step): B waits, then comes in
    once A is done, reusing the prefix, with HF's tokens; nothing leaks."""
    from actors.engine.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "_num_mamba_slots", lambda self, max_running_requests: 2)
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=512, max_running_requests=2)
    try:
        first = prompts(4, (20,))
        engine.generate(input_ids=first, sampling_params=GREEDY)
        tree, cow_failed = engine.scheduler.tree_cache, []
        real_match = tree.match_prefix

        def spy(*args, **kwargs):  # (the logical OOM did happen: the test is not vacuous)
            match = real_match(*args, **kwargs)
            cow_failed.append(match.mamba_cow_failed)
            return match

        tree.match_prefix = spy
        both = [first[0] + [7, 8], first[0] + [9, 10, 11]]
        outs = engine.generate(input_ids=both, sampling_params=GREEDY)
        assert any(cow_failed), "B's copy-on-write never found every state held"
        del tree.match_prefix
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [20, 20]
        assert_greedy_parity(model_dir, both, [o["output_ids"] for o in outs], 10, engine.eos_token_ids)
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_a_request_left_waiting_gives_back_its_state_copy(model_dir):
    """Requests extending a cached conversation, held back by the running request's decode
    reserve: each step matches the first in line, copying the cached state into a slot of its
    own, then leaves it waiting — the copy goes back every time (held, it took a Mamba slot
    from the running requests for nothing, every step). One is aborted while waiting; the other
    comes in once room is made, reusing the prefix with HF's tokens; nothing leaks."""
    sched = Scheduler(ModelRunner(EngineConfig(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=192)))
    pool, tree = sched.runner.req_to_token_pool, sched.tree_cache
    conversation = prompts(5, (20,))[0]

    def run(prompt, max_new, rid):
        req = Req(rid, prompt, SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True))
        sched.add_request(req)
        return req

    def left_waiting(req):
        for _ in range(2):
            sched.step()
            assert req in sched.waiting and len(req.prefix_indices) == 20  # matched (its state copied), not taken
            assert req.mamba_pool_idx is None
            pool.check_integrity(tree_mamba_slots=tree.all_mamba_values())  # free + running + tree: every slot

    run(conversation, 4, "first")
    while sched.has_work():
        sched.step()
    long = run(prompts(6, (100,))[0], 120, "long")
    sched.step()
    assert long in sched.running
    follow, twin = run(conversation + [7, 8, 9], 8, "follow"), run(conversation + [7, 8, 10], 8, "twin")
    left_waiting(follow)
    assert sched.abort("follow")
    left_waiting(twin)
    assert sched.abort("long")
    while sched.has_work():
        sched.step()
    assert twin.finished and twin.cached_tokens == 20
    assert_greedy_parity(model_dir, [twin.origin_input_ids], [twin.output_ids], 8, [])
    check_engine_integrity(sched, sched.runner)
