"""N-gram speculative decoding on sliding-window models (Gemma 3, GPT-OSS with its sinks, Mistral
whose every layer slides) on their SWA pools: greedy tokens and logprobs equal plain decoding's and
HF's past the window, through chunked prefill and a prefix hit (or without the prefix cache),
retraction under a tight pool, TP 2 and PD's decode side; sampled requests keep plain sampling's
tokens where it has one choice. At every forward each request's window has slid by its committed
tokens only (out of it, no SWA KV; from it to the step's drafts, all of it); every test ends with no
slot of either pool leaked.

The tiny checkpoints' windows are 16 (Gemma 3, Mistral) and 8 (GPT-OSS) tokens."""

import random
from typing import List, NamedTuple

import pytest

from actors.engine import Engine
from actors.engine.scheduler import Scheduler
from actors.engine.tiny import build_tiny_checkpoint
from tests.parity import assert_greedy_parity
from tests.pd_helpers import close_workers, make_pair, run_batch
from tests.test_spec_decode import GREEDY, SPEC, ids
from tests.tp_helpers import thread_ranks

FAMILIES = ("gemma3", "gpt_oss", "mistral")
SCORED = dict(GREEDY, return_logprob=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("swa_spec")
    return {family: str(build_tiny_checkpoint(family, root / family, seed=0)) for family in FAMILIES}


@pytest.fixture
def verify_steps(monkeypatch):
    """Checks, before every forward, that each of its requests' rows holds SWA KV exactly from the
    window of the KV it has on (:meth:`SWARadixCache.window_start` of ``kv_committed_len``, of its
    prefix in a prefill) to the step's last token, none for its own tokens before (a chunked prompt's
    earlier chunks too); returns the verify forwards' count."""
    count = [0]
    forward = Scheduler._forward

    def checked(self, forward_batch):
        extend = forward_batch.forward_mode.is_extend
        count[0] += forward_batch.forward_mode.is_target_verify
        mapping = self.runner.allocator.full_to_swa_index_mapping
        for req in self.in_flight if extend else self.running:
            row = self.runner.req_to_token_pool.req_to_token[req.req_pool_idx, :req.kv_allocated_len]
            has_swa = (mapping[row.long()] > 0).tolist()
            start = self.tree_cache.window_start(len(req.prefix_indices) if extend else req.kv_committed_len)
            assert all(has_swa[start:]), f"{req.rid}: a token of its window or step has no SWA KV"
            assert not any(has_swa[req.cache_protected_len:start]), f"{req.rid}: SWA KV kept out of the window"
        return forward(self, forward_batch)

    monkeypatch.setattr(Scheduler, "_forward", checked)
    return count


def prompts(seed=0):
    """A batch sharing a 30-token system prompt (past every window), a prompt that repeats itself and
    a short one; then a follow-up sharing the system prompt (a prefix hit)."""
    rng = random.Random(seed)
    system = [rng.randrange(5, 250) for _ in range(30)]
    batch = [system + [rng.randrange(5, 250) for _ in range(n)] for n in (3, 9)] + [[40, 41, 42, 43, 44] * 6, [7, 8]]
    return batch, [system + [11, 12, 13]]


class Run(NamedTuple):
    outs: List[dict]
    cached: int  # the follow-up's cached tokens
    stats: dict  # the speculative-decoding stats
    num_retractions: int


def generate(model_dir, params, batch=None, **args) -> Run:
    """Outputs (and logprobs) of ``batch`` (by default :func:`prompts`') then of the follow-up on a
    fresh engine, in 16-token chunks unless ``args`` say otherwise."""
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True,
                    **{"max_total_tokens": 1024, "chunked_prefill_size": 16, "swa_full_tokens_ratio": 0.5, **args})
    try:
        outs = engine.generate(input_ids=batch or prompts()[0], sampling_params=params)
        outs += engine.generate(input_ids=prompts()[1], sampling_params=params)
        engine.check_integrity()
        sched = engine.scheduler
        return Run(outs, outs[-1]["meta_info"]["cached_tokens"], sched.spec_stats.as_dict(), sched.num_retractions)
    finally:
        engine.shutdown()


def logprobs(outs):
    return [[lp for lp, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]


@pytest.mark.parametrize("family, page_size", [("gemma3", 1), ("gpt_oss", 4), ("mistral", 4)])
def test_greedy_tokens_and_logprobs_equal_plain_decoding_and_hf_past_the_window(checkpoints, verify_steps, family,
                                                                                 page_size):
    """Each emitted token's logprob comes from its verify row: every draft position's sliding-window
    layers saw plain decoding's keys (the window back from that position, GPT-OSS's sinks)."""
    plain = generate(checkpoints[family], SCORED, page_size=page_size)
    spec = generate(checkpoints[family], SCORED, page_size=page_size, **SPEC)
    assert ids(spec.outs) == ids(plain.outs) and spec.cached >= 28
    assert spec.stats["num_accepted_tokens"] > 0 and verify_steps[0] > 0
    batch, follow = prompts()
    assert_greedy_parity(checkpoints[family], batch + follow, ids(spec.outs), GREEDY["max_new_tokens"],
                         logprobs=logprobs(spec.outs))


@pytest.mark.parametrize("family, page_size", [("gemma3", 1), ("mistral", 4)])
def test_without_the_prefix_cache(checkpoints, verify_steps, family, page_size):
    """disable_radix_cache (SGLang's SWAChunkCache): the follow-up computes the system prompt again, and
    drafts are verified as with the cache: greedy tokens and logprobs equal the cached run's and HF's."""
    cached = generate(checkpoints[family], SCORED, page_size=page_size)
    spec = generate(checkpoints[family], SCORED, page_size=page_size, disable_radix_cache=True, **SPEC)
    assert ids(spec.outs) == ids(cached.outs) and cached.cached >= 28 and spec.cached == 0
    assert spec.stats["num_accepted_tokens"] > 0 and verify_steps[0] > 0
    batch, follow = prompts()
    assert_greedy_parity(checkpoints[family], batch + follow, ids(spec.outs), GREEDY["max_new_tokens"],
                         logprobs=logprobs(spec.outs))


def test_sampled_requests_keep_plain_samplings_tokens(checkpoints, verify_steps):
    """A one-token nucleus leaves rejection sampling greedy decoding's tokens; a seeded request gives
    the same tokens again (the distribution itself: test_spec_decode's rejection sampler test)."""
    path = checkpoints["gemma3"]
    greedy = generate(path, GREEDY, page_size=4)
    nucleus = generate(path, {**GREEDY, "temperature": 1.0, "top_p": 1e-6}, page_size=4, **SPEC)
    assert ids(nucleus.outs) == ids(greedy.outs) and nucleus.stats["num_accepted_tokens"] > 0
    seeded = {**GREEDY, "temperature": 0.7, "top_k": 20, "seed": 3}
    first = generate(path, seeded, page_size=4, **SPEC)
    assert ids(generate(path, seeded, page_size=4, **SPEC).outs) == ids(first.outs)
    assert first.stats["num_draft_tokens"] > 0


def test_retraction_under_a_tight_pool(checkpoints, verify_steps):
    """Both pools tight (96 SWA slots beside 192 full ones) and requests admitted beyond what their
    decoding will need: they are retracted and come back, with drafts accepted, and the tokens are
    plain decoding's."""
    batch = [p + p for p in prompts(5)[0]]
    args = dict(max_total_tokens=192, page_size=4, init_new_token_ratio=0.02, min_new_token_ratio=0.02)
    plain = generate(checkpoints["gemma3"], GREEDY, batch, **args)
    spec = generate(checkpoints["gemma3"], GREEDY, batch, **args, **SPEC)
    assert ids(spec.outs) == ids(plain.outs) and plain.num_retractions > 0 and spec.num_retractions > 0
    assert spec.stats["num_accepted_tokens"] > 0


def test_tp2_equals_tp1(checkpoints, verify_steps, monkeypatch):
    """The followers read the SWA map's entries the verify batches name (the slid-out ones cleared)."""
    thread_ranks(monkeypatch)
    plain = generate(checkpoints["mistral"], GREEDY, page_size=4)
    spec = generate(checkpoints["mistral"], GREEDY, page_size=4, tp_size=2, **SPEC)
    assert ids(spec.outs) == ids(plain.outs) and spec.stats["num_accepted_tokens"] > 0


@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_pd_decode_side_speculates_past_the_window(checkpoints, verify_steps, disable_radix_cache):
    """The decode worker holds only each prompt's last window of SWA KV (the rest of its row has none
    from the hand-off on) and speculates from there: a single engine's plain tokens, with or without
    the prefix cache on both sides."""
    path = checkpoints["gpt_oss"]
    batch = prompts()[0]
    plain = generate(path, GREEDY, page_size=4)
    args = {"disable_radix_cache": disable_radix_cache}
    prefill, decode = make_pair(path, page_size=4, prefill_args=dict(args, chunked_prefill_size=16),
                                decode_args=dict(args, **SPEC))
    results = run_batch(prefill, decode, batch, GREEDY)
    assert [r[0]["output_ids"] for r in results] == ids(plain.outs)[:len(batch)]
    assert decode.scheduler.spec_stats.num_accepted_tokens > 0 and verify_steps[0] > 0
    close_workers(prefill, decode)


def test_a_draft_model_over_a_sliding_window_target(checkpoints, verify_steps, tmp_path):
    """A draft model (a one-layer llama, MHA) over GPT-OSS's SWA pools: its KV pool is indexed by the
    full pool's slots, which a sliding token keeps, so the window's slide takes nothing from it; the
    greedy tokens are plain decoding's, past the window, through chunks and a prefix hit."""
    draft = str(build_tiny_checkpoint("llama", tmp_path / "draft", seed=1, num_hidden_layers=1))
    path = checkpoints["gpt_oss"]
    plain = generate(path, GREEDY, page_size=4)
    spec = generate(path, GREEDY, page_size=4, speculative_algorithm="draft_model",
                    speculative_draft_model_path=draft, speculative_num_draft_tokens=4)
    assert ids(spec.outs) == ids(plain.outs) and spec.cached >= 28
    assert spec.stats["num_draft_tokens"] > 0 and verify_steps[0] > 0
