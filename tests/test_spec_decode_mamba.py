"""Speculative decoding on a Mamba hybrid (Qwen3-Next): greedy tokens equal plain decoding's and
HF's with drafts both accepted and rejected — a rejected draft leaves nothing in the recurrent
state —, through chunked prefill, a prefix hit on the state a verify step committed (no_buffer: the
finished request's; extra_buffer: a decode checkpoint taken inside a verify step), retraction, a
dense draft model, TP 2 and PD's decode side; every test ends with no slot or state leaked."""

import random

import pytest
import torch

from actors.engine import Engine
from actors.engine.scheduler import Scheduler
from actors.engine.tiny import build_tiny_checkpoint, tiny_config
from actors.engine.tokenizer import save_tokenizer
from mem_cache.mamba_pool import MambaPool
from tests.parity import assert_greedy_parity
from tests.pd_helpers import close_workers, make_pair, run_batch
from tests.test_spec_decode import GREEDY, SPEC, assert_retraction_keeps_tokens, ids
from tests.tp_helpers import thread_ranks

NO_BUFFER = {"chunked_prefill_size": 16}
EXTRA_BUFFER = {"chunked_prefill_size": 16, "page_size": 4, "mamba_scheduler_strategy": "extra_buffer",
                "mamba_track_interval": 8}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Qwen3-Next with HF's default init: under greedy decoding it loops on some prompts
    (drafts accepted) and leaves the loop on others (drafts rejected)."""
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("spec_mamba") / "qwen3_next"
    Qwen3NextForCausalLM(tiny_config("qwen3_next")).save_pretrained(path)
    save_tokenizer(path)
    return str(path)


def prompts(seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, 250) for _ in range(n)] for n in (6, 20)] + [[40, 41, 42, 43, 44] * 6]


def generate(model_dir, batch, **args):
    """Outputs of ``batch``, then of a follow-up that extends the last prompt by its whole output
    (a prefix hit on what the first round cached), and the speculative-decoding stats."""
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=2048, **args)
    try:
        outs = engine.generate(input_ids=batch, sampling_params=GREEDY)
        follow = batch[-1] + outs[-1]["output_ids"] + [7, 8]
        outs.append(engine.generate(input_ids=follow, sampling_params=GREEDY))
        engine.check_integrity()
        return outs, engine.scheduler.spec_stats.as_dict()
    finally:
        engine.shutdown()


@pytest.fixture
def verify_commits(monkeypatch):
    """Per verify step, the requests' rows of each state commit made while it was processed."""
    steps = []
    process, commit = Scheduler._process_decode, MambaPool.commit_verify_states

    def processing(self, reqs, runs, verified=False):
        if verified:
            steps.append([])
        return process(self, reqs, runs, verified)

    def committing(self, rows, positions, slots):
        steps[-1].append(list(rows))
        return commit(self, rows, positions, slots)

    monkeypatch.setattr(Scheduler, "_process_decode", processing)
    monkeypatch.setattr(MambaPool, "commit_verify_states", committing)
    return steps


@pytest.mark.parametrize("args, cached", [(NO_BUFFER, 69), (EXTRA_BUFFER, 64)], ids=["no_buffer", "extra_buffer"])
def test_greedy_tokens_equal_plain_decoding_and_hf_with_drafts_rejected(model_dir, args, cached, verify_commits):
    """The follow-up (72 tokens) hits the state the first round's last request committed after its
    verify steps: no_buffer, at its last committed token (30 prompt + 39 output tokens); extra_buffer,
    its last checkpoint at a multiple of 8 (64, from a verify step's scratch). Its tokens too are HF's.
    Each verify step commits all its requests' states (and checkpoints) in one op."""
    batch = prompts()
    plain, _ = generate(model_dir, batch, **args)
    spec, stats = generate(model_dir, batch, **args, **SPEC)
    assert verify_commits and all(len(commits) == 1 for commits in verify_commits)
    assert max(len(set(rows)) for (rows,) in verify_commits) == len(batch)  # every request's in the op
    tracked = any(len(rows) > len(set(rows)) for (rows,) in verify_commits)  # a row's slot and its track slot
    assert tracked == ("mamba_scheduler_strategy" in args)
    assert ids(spec) == ids(plain)
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # drafts kept and drafts rejected
    follow_prompt = batch[-1] + spec[-2]["output_ids"] + [7, 8]
    assert spec[-1]["meta_info"]["cached_tokens"] == cached
    assert_greedy_parity(model_dir, batch + [follow_prompt], ids(spec), GREEDY["max_new_tokens"])


def test_retraction_under_a_small_pool(model_dir):
    assert_retraction_keeps_tokens(model_dir, SPEC, max_total_tokens=160, mamba_scheduler_strategy="extra_buffer")


def test_a_dense_draft_model_over_the_hybrid_target(model_dir, tmp_path):
    """A one-layer random llama drafts (its own KV pool, no state; its drafts mostly rejected);
    a hybrid draft is refused by its kind."""
    draft = str(build_tiny_checkpoint("llama", tmp_path / "draft", seed=1, num_hidden_layers=1))
    batch = prompts()
    plain, _ = generate(model_dir, batch, **NO_BUFFER)
    spec, stats = generate(model_dir, batch, **NO_BUFFER, speculative_algorithm="draft_model",
                           speculative_draft_model_path=draft, speculative_num_draft_tokens=4)
    assert ids(spec) == ids(plain) and stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    with pytest.raises(ValueError, match="a draft of KV cache kind 'hybrid_mamba' is not supported .a recurrent state"):
        Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=256,
               speculative_algorithm="draft_model", speculative_draft_model_path=model_dir)


def test_tp2_equals_tp1(model_dir, monkeypatch):
    """Each rank's verify forward writes its heads' scratch; the follower replays the commits."""
    thread_ranks(monkeypatch)
    batch = prompts()
    plain, _ = generate(model_dir, batch, **EXTRA_BUFFER)
    spec, stats = generate(model_dir, batch, **EXTRA_BUFFER, tp_size=2, **SPEC)
    assert ids(spec) == ids(plain) and 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


def test_pd_decode_side_speculates_from_the_pushed_state(model_dir):
    batch = prompts()
    plain, _ = generate(model_dir, batch, **NO_BUFFER)
    prefill, decode = make_pair(model_dir, prefill_args=NO_BUFFER, decode_args=SPEC)
    try:
        results = run_batch(prefill, decode, batch, GREEDY)
        assert [r[0]["output_ids"] for r in results] == ids(plain)[:len(batch)]
        stats = decode.scheduler.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    finally:
        close_workers(prefill, decode)
