"""N-gram speculative decoding: the tokens plain decoding gives (and HF's), several a step.

Greedy requests keep exactly plain decoding's tokens through batching, paging, both attention
backends, finishes inside an accepted run, retraction, aborts, TP and PD's decode side; requests
with logprobs, penalties, min_new_tokens, logit_bias, bad words, allowed ids or a grammar are
drafted too, each row adjusted and masked as at its position; every test ends with no slot leaked."""

import asyncio
import json
import random
import re

import pytest
import torch
import xgrammar as xgr
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from actors.engine import Engine
from actors.engine import spec_decode
from actors.engine.config import EngineConfig
from actors.engine.req import Req
from actors.engine.sampling_params import SamplingParams
from actors.engine.scheduler import Scheduler
from actors.engine.ngram import NgramIndex, propose_ngram
from actors.engine.spec_accept import rejection_sample
from actors.engine.tiny import tiny_config
from actors.engine.tokenizer import save_tokenizer
from actors.workers import PrefillWorker
from cluster.backend import spec_accept_length
from cluster.metrics import ServerMetrics
from tests.parity import assert_greedy_parity
from tests.test_allowed_and_bad_words import ascii_text
from tests.test_structured_output import hf_constrained_greedy
from tests.pd_helpers import close_workers, decode_together, make_pair, run_batch
from tests.tp_helpers import thread_ranks

SPEC = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4, "speculative_ngram_max": 3}
GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Llama with HF's default init (under greedy decoding it loops sooner than the tiny
    checkpoint's own init: drafts get accepted) and the tiny byte-level tokenizer."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("spec") / "llama"
    LlamaForCausalLM(tiny_config("llama")).save_pretrained(path)
    save_tokenizer(path)
    return str(path)


def prompts(n=3, seed=0):
    """Random prompts and one that repeats itself (a greedy random model soon loops on either)."""
    rng = random.Random(seed)
    return [[rng.randrange(5, 250) for _ in range(rng.randint(4, 24))] for _ in range(n)] + [[40, 41, 42, 43, 44] * 5]


def generate(model_dir, batch, params, **engine_args):
    """Outputs, and the engine's speculative-decoding stats, of one batch on a fresh engine."""
    engine = Engine(model_path=model_dir, max_total_tokens=4096, **engine_args)
    try:
        outs = engine.generate(input_ids=batch, sampling_params=params)
        engine.check_integrity()
        return outs, engine.scheduler.spec_stats.as_dict()
    finally:
        engine.shutdown()


def ids(outs):
    return [o["output_ids"] for o in outs]


@pytest.fixture
def recorded_runs(monkeypatch):
    """``(rid, output length before, tokens)`` of every run of tokens a decode or verify step appended."""
    runs = []
    process = Scheduler._process_decode

    def recording(self, reqs, step_runs, **kwargs):
        runs.extend((r.rid, len(r.output_ids), [p.token for p in run]) for r, run in zip(reqs, step_runs))
        return process(self, reqs, step_runs, **kwargs)

    monkeypatch.setattr(Scheduler, "_process_decode", recording)
    return runs


def test_propose_ngram_takes_the_longest_match_at_its_earliest_place():
    assert propose_ngram([1, 2, 3, 4, 2, 3], 4, 2, 3) == [4, 2, 3]  # vLLM's example: [2, 3], what follows it
    assert propose_ngram([1, 2, 3, 9, 2, 3, 8, 7, 2, 3], 2, 1, 3) == [9, 2]  # [2, 3] twice: the earliest
    assert propose_ngram([5, 2, 3, 6, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [7, 1]  # [1, 2, 3] beats [2, 3]
    assert propose_ngram([1, 2, 3, 4], 4, 1, 3) == []  # the last token never came before
    assert propose_ngram([7, 1, 8, 2, 1], 3, 2, 3) == []  # only a 1-gram matches: shorter than n_min
    assert propose_ngram([3, 3, 3], 5, 1, 1) == [3, 3]  # overlapping its end, up to the sequence's end


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 30), st.integers(1, 4), st.integers(0, 3),
       st.integers(0, 5), st.lists(st.integers(1, 5), max_size=10))
def test_the_incremental_index_proposes_what_the_whole_sequence_lookup_does(tokens, prompt_len, n_min, n_extra, k,
                                                                            chunks):
    """The index, fed the output a few tokens at a time (and once a shorter output: it starts
    over), proposes after every step what :func:`propose_ngram` finds in the whole sequence."""
    prompt, output = tokens[:prompt_len], tokens[prompt_len:]
    index, n_max, held = NgramIndex(n_min, n_min + n_extra), n_min + n_extra, 0
    for step in [0] + chunks + [len(output)]:
        held = min(len(output), held + step)
        index.sync(prompt, output[:held])
        assert index.propose(k) == propose_ngram(prompt + output[:held], k, n_min, n_max)
    index.sync(prompt, output[:held // 2])
    assert index.propose(k) == propose_ngram(prompt + output[:held // 2], k, n_min, n_max)


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_tokens_equal_plain_decoding_and_hf(model_dir, page_size):
    batch = prompts()
    plain, _ = generate(model_dir, batch, GREEDY, page_size=page_size)
    spec, stats = generate(model_dir, batch, GREEDY, page_size=page_size, **SPEC)
    assert ids(spec) == ids(plain)
    assert stats["num_accepted_tokens"] > 0 and stats["mean_accepted_len"] > 1.0
    assert_greedy_parity(model_dir, batch, ids(spec), GREEDY["max_new_tokens"])


def test_triton_attention_backend_verifies_through_its_extend_kernel(model_dir):
    batch = prompts(0)
    params = {**GREEDY, "max_new_tokens": 16}
    plain, _ = generate(model_dir, batch, params, page_size=4)
    spec, stats = generate(model_dir, batch, params, page_size=4, attention_backend="triton", **SPEC)
    assert ids(spec) == ids(plain) and stats["num_accepted_tokens"] > 0


def test_every_kind_of_request_is_drafted_and_keeps_plain_decodings_tokens_and_logprobs(model_dir, recorded_runs):
    """Logprobs, penalties (frequency, presence, repetition), min_new_tokens over a stop token,
    logit_bias, and a sampled request with a penalty (a one-token nucleus: greedy's tokens, through
    rejection sampling): each request's tokens (and logprobs, up to float rounding) are plain
    decoding's, each row adjusted as at its position, and every one had drafts accepted."""
    prompt = prompts(0)[0]
    looping = generate(model_dir, [prompt], GREEDY)[0][0]["output_ids"][8]  # (a token of its loop)
    logprobs = {"return_logprob": True, "top_logprobs_num": 2}
    # (penalties small enough to leave loops for the drafts, large enough to change the tokens)
    kinds = {"greedy": {}, "logprobs": logprobs, "frequency": {"frequency_penalty": 0.02, **logprobs},
             "presence": {"presence_penalty": 0.02}, "repetition": {"repetition_penalty": 1.1},
             "min_tokens": {"min_new_tokens": 24, "stop_token_ids": [looping]}, "bias": {"logit_bias": {looping: 5.0}},
             "sampled": {"temperature": 1.0, "top_p": 1e-6, "frequency_penalty": 0.02, **logprobs}}
    params = [{**GREEDY, "max_new_tokens": 32, **p} for p in kinds.values()]
    plain, _ = generate(model_dir, [prompt] * len(kinds), params)
    recorded_runs.clear()
    spec, stats = generate(model_dir, [prompt] * len(kinds), params, **SPEC)
    assert ids(spec) == ids(plain)
    assert all(out != ids(plain)[0] for out in ids(plain)[2:])  # every adjustment changed the tokens
    flat = lambda pairs: [v for _, v in pairs]  # noqa: E731
    for got, want in ((s["meta_info"], p["meta_info"]) for s, p in zip(spec, plain) if "output_token_logprobs" in s["meta_info"]):
        # (in a verify batch its forward is another's: equal up to float rounding)
        assert flat(got["output_token_logprobs"]) == pytest.approx(flat(want["output_token_logprobs"]), abs=1e-5)
        for top, top_want in zip(got["output_top_logprobs"], want["output_top_logprobs"]):
            assert [t for t, _ in top] == [t for t, _ in top_want] and flat(top) == pytest.approx(flat(top_want), abs=1e-5)
    accepted = {rid for rid, _, run in recorded_runs if len(run) > 1}
    assert {o["meta_info"]["id"] for o in spec} <= accepted, dict(zip(kinds, (o["meta_info"]["id"] for o in spec)))


def test_a_draft_token_its_bans_refuse_is_rejected_as_sampling_would_reject_it(model_dir, monkeypatch, recorded_runs):
    """A printable token (not a space) a free run wrote in an accepted draft is banned, as a bad
    word or left out of the allowed ids, in requests that go on from before that draft (their
    prompt the free run's sequence up to it): the same draft is proposed and the token is never
    kept — each verify row is adjusted after the draft tokens before it —; greedy tokens are plain
    decoding's; a sampled request under both bans writes it neither (rejection sampling over the
    masked rows)."""
    outs, _ = generate(model_dir, prompts(), GREEDY, **SPEC)
    free = {o["meta_info"]["id"]: prompt + o["output_ids"] for prompt, o in zip(prompts(), outs)}
    lens = dict(zip(free, map(len, prompts())))
    rid, n, banned = next((rid, n, t) for rid, n, run in recorded_runs if len(run) > 1 for t in run[:-1]
                          if 33 <= t - 5 < 127 and t != free[rid][lens[rid] + n - 1])
    batch = [free[rid][:lens[rid] + n - 1]]  # (its first token the free run's before the draft)
    bans = {"bad_words": [ascii_text([banned])],
            "allowed_token_ids": [t for t in range(tiny_config("llama").vocab_size) if t != banned]}
    params = [{**GREEDY, "bad_words": bans["bad_words"]}, {**GREEDY, "allowed_token_ids": bans["allowed_token_ids"]},
              {**GREEDY, "temperature": 1.0, "seed": 5, **bans}]
    plain, _ = generate(model_dir, batch * len(params), params)
    drafts = []  # (rid, draft) of every drafted request of a verify step
    drafted_runs = Scheduler._drafted_runs

    def recording(self, reqs, step_drafts, rows):
        drafts.extend((r.rid, d) for r, d in zip(reqs, step_drafts))
        return drafted_runs(self, reqs, step_drafts, rows)

    monkeypatch.setattr(Scheduler, "_drafted_runs", recording)
    spec, stats = generate(model_dir, batch * len(params), params, **SPEC)
    assert ids(spec)[:2] == ids(plain)[:2] and stats["num_accepted_tokens"] > 0
    for out in spec:
        assert any(banned in d for rid, d in drafts if rid == out["meta_info"]["id"]), out["meta_info"]["id"]
        assert banned not in out["output_ids"]


@pytest.mark.parametrize("regex", [r"[a-z ]{10,60}", r"(cat|dog)( (cat|dog))*"])
def test_grammar_requests_are_drafted_under_exact_masks(model_dir, monkeypatch, regex):
    """A regex request's drafts are cut before a token the grammar refuses (the prompts' punctuation
    follows letters the output ends with), and each verify row is masked after the draft tokens
    before it: the tokens are plain decoding's and HF's greedy under the same mask, drafts are
    accepted; one that ends (EOS) ends the request as plain decoding does."""
    cuts = []
    prefix = spec_decode.grammar_prefix

    def recording(matcher, draft):
        kept = prefix(matcher, draft)
        cuts.append(len(draft) - len(kept))
        return kept

    monkeypatch.setattr(spec_decode, "grammar_prefix", recording)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = [tokenizer.encode(t) for t in ("f, p. y; hello hello hello world", "p, f. x! abc abc abc, abc abc",
                                           "the cat sat on the mat. the cat")]
    params = {"regex": regex, "temperature": 0, "max_new_tokens": 48}
    plain, _ = generate(model_dir, batch, params)
    spec, stats = generate(model_dir, batch, params, **SPEC)
    assert ids(spec) == ids(plain) and stats["num_accepted_tokens"] > 0 and any(cuts)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=tiny_config("llama").vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_regex(regex)
    for prompt, out in zip(batch, spec):
        assert out["output_ids"] == hf_constrained_greedy(model_dir, prompt, compiled, 48, [tokenizer.eos_token_id])


def test_a_structural_tag_request_is_drafted_under_its_exact_masks(model_dir):
    """A structural tag whose trigger is a space (every space of the output starts ``=``, a number
    of its schema, ``;``): with drafts the tokens are plain decoding's and HF's greedy under the
    same grammar, drafts are accepted, and the structures are written."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tag = {"type": "structural_tag", "structures": [{"begin": " =", "schema": {"enum": [1, 22]}, "end": ";"}],
           "triggers": [" "]}
    batch = [tokenizer.encode(t) for t in ("f, p. y; hello hello hello world", "the cat sat on the mat. the cat")]
    params = {"structural_tag": json.dumps(tag), "temperature": 0, "max_new_tokens": 48}
    plain, _ = generate(model_dir, batch, params)
    spec, stats = generate(model_dir, batch, params, **SPEC)
    assert ids(spec) == ids(plain) and stats["num_accepted_tokens"] > 0
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=tiny_config("llama").vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_structural_tag(
        [xgr.StructuralTagItem(begin=" =", schema=json.dumps({"enum": [1, 22]}), end=";")], [" "])
    for prompt, out in zip(batch, spec):
        assert out["output_ids"] == hf_constrained_greedy(model_dir, prompt, compiled, 48, [tokenizer.eos_token_id])
    assert " =1;" in spec[0]["text"]
    for out in spec:  # (a structure the length cut short: a prefix of one at the end)
        assert re.fullmatch(r"([^ ]| =(1|22);)*( (=(1|22?)?)?)?", out["text"], re.S), out["text"]


def test_rejection_sampling_emits_what_plain_sampling_draws():
    """A one-hot draft through the rejection sampler: the first token is distributed as the first
    row ``p`` (chi-square, 3 degrees of freedom), whatever the draft; the draft token is kept with
    probability ``p(x)``; after a kept one the next comes from the next row; a draft token ``p``
    gives nothing is never kept."""
    torch.manual_seed(0)
    n, p, q = 20000, torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.7, 0.1, 0.1, 0.1])
    for x in (0, 3):
        probs = torch.stack([p * 5.0, q] * n)  # (not normalised, as the sampler's filters leave a row)
        runs = rejection_sample(probs, [[x]] * n, [None] * n)
        first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=4).float()
        assert float(((first - n * p) ** 2 / (n * p)).sum()) < 16.27  # (p-value 0.001)
        kept = [r for r in runs if len(r) == 2]
        assert all(r[0] == x for r in kept) and abs(len(kept) / n - float(p[x])) < 0.02
        second = torch.bincount(torch.tensor([r[1] for r in kept]), minlength=4).float()
        assert float(((second - len(kept) * q) ** 2 / (len(kept) * q)).sum()) < 16.27
    never = rejection_sample(torch.tensor([[0.0, 0.5, 0.5, 0.0]] * 2 * 1000), [[0]] * 1000, [None] * 1000)
    assert all(len(r) == 1 and r[0] in (1, 2) for r in never)


def test_sampled_requests_are_drafted_and_stay_reproducible(model_dir):
    """Sampling with a draft: a one-token nucleus (top_p near 0, not greedy by its parameters)
    leaves the argmax alone, so rejection sampling must give greedy decoding's tokens; a seeded
    request gives the same tokens again."""
    batch = prompts()
    greedy, _ = generate(model_dir, batch, GREEDY)
    nucleus, stats = generate(model_dir, batch, {**GREEDY, "temperature": 1.0, "top_p": 1e-6}, **SPEC)
    assert ids(nucleus) == ids(greedy) and stats["num_accepted_tokens"] > 0
    params = {**GREEDY, "temperature": 0.7, "top_k": 20, "seed": 3}
    first, stats = generate(model_dir, batch, params, **SPEC)
    assert ids(generate(model_dir, batch, params, **SPEC)[0]) == ids(first) and stats["num_draft_tokens"] > 0


def test_a_finish_inside_an_accepted_run_cuts_it_where_plain_decoding_stops(model_dir, recorded_runs):
    """A stop token, EOS and a stop string at a token inside a run of accepted drafts: the output
    (ids, text, finish reason) is plain decoding's, the tokens after it dropped. The prompt ends
    with the model's own loop, which its continuation goes on with: drafted from the first step."""
    first, _ = generate(model_dir, [prompts()[1]], GREEDY, **SPEC)
    prompt = prompts()[1] + first[0]["output_ids"][:20]
    recorded_runs.clear()
    full, _ = generate(model_dir, [prompt], GREEDY, **SPEC)
    tokens = full[0]["output_ids"]
    inside = [start + i for _, start, run in recorded_runs for i in range(len(run) - 1)]  # not a run's last
    char = AutoTokenizer.from_pretrained(model_dir).decode  # (one byte a token: an ASCII one is a character)
    j = next(j for j in inside if tokens.index(tokens[j]) == j and char([tokens[j]]).isalnum())
    stop = tokens[j]
    cases = [{"stop_token_ids": [stop]}, {"stop": [char([stop])]}, {"ignore_eos": False}, {"max_new_tokens": j + 1}]
    params = [{**GREEDY, **case} for case in cases]
    outs = {}
    for args in ({}, SPEC):
        engine = Engine(model_path=model_dir, max_total_tokens=4096, **args)
        engine.eos_token_ids = [stop]  # (only the request that does not ignore EOS sees it)
        try:
            outs[bool(args)] = engine.generate(input_ids=[prompt] * len(cases), sampling_params=params)
            engine.check_integrity()
        finally:
            engine.shutdown()
    for spec, plain in zip(outs[True], outs[False]):
        assert spec["output_ids"] == plain["output_ids"] == tokens[:j + 1]
        assert spec["text"] == plain["text"] and spec["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]


def assert_retraction_keeps_tokens(model_dir, spec, **args):
    """Greedy tokens with speculation ``spec`` equal plain decoding's where both runs retract
    (an engine of ``args``), and drafts are accepted."""
    batch = [p + p for p in prompts(5, seed=5)]
    outs = {}
    for spec_args in ({}, spec):
        engine = Engine(model_path=model_dir, max_running_requests=6, chunked_prefill_size=-1, page_size=4,
                        **args, **spec_args)
        try:
            outs[bool(spec_args)] = ids(engine.generate(input_ids=batch, sampling_params=GREEDY))
            engine.check_integrity()
            assert engine.scheduler.num_retractions > 0
            if spec_args:
                assert engine.scheduler.spec_stats.num_accepted_tokens > 0
        finally:
            engine.shutdown()
    assert outs[True] == outs[False]


def test_retraction_under_a_small_pool(model_dir):
    assert_retraction_keeps_tokens(model_dir, SPEC, max_total_tokens=192)


def test_streamed_steps_carry_several_tokens_and_an_abort_mid_run_leaks_nothing(model_dir):
    engine = Engine(model_path=model_dir, max_total_tokens=4096, **SPEC)
    try:
        async def stream():
            return [o["output_ids"] async for o in await engine.async_generate(
                input_ids=prompts(0)[0], sampling_params=GREEDY, stream=True)]

        steps = asyncio.run(stream())
        assert max(len(b) - len(a) for a, b in zip(steps, steps[1:])) > 1  # a step's delta: several tokens
        assert steps[-1] == generate(model_dir, [prompts(0)[0]], GREEDY)[0][0]["output_ids"]

        sched = engine.scheduler
        req = Req("abort-me", prompts(0)[0], SamplingParams(**GREEDY))

        def scenario():
            sched.add_request(req)
            while sched.spec_stats.num_accepted_tokens == 0 or len(req.output_ids) < 8:
                sched.step()
            assert req.kv_allocated_len == req.kv_committed_len  # rejected drafts' pages given back
            assert sched.abort("abort-me")
            while sched.has_work():
                sched.step()

        engine.loop.run_exclusive(scenario)
        assert req.finished_reason["type"] == "abort"
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_tp2_verify_batches_reach_the_follower(model_dir, monkeypatch):
    thread_ranks(monkeypatch)
    batch = prompts(2)
    plain, _ = generate(model_dir, batch, GREEDY)
    spec, stats = generate(model_dir, batch, GREEDY, tp_size=2, **SPEC)  # (check_integrity: the follower's tables)
    assert ids(spec) == ids(plain) and stats["num_accepted_tokens"] > 0


def test_bad_speculative_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="speculative_ngram_min .* more than speculative_ngram_max"):
        EngineConfig(model_path="m", speculative_algorithm="ngram", speculative_ngram_min=4, speculative_ngram_max=2)
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        EngineConfig(model_path="m", speculative_algorithm="ngram", speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="a prefill worker never decodes"):
        PrefillWorker("m", dict(SPEC))  # (refused before the model is read)


@pytest.mark.parametrize("tight", [False, True])
def test_pd_decode_side_speculates_with_plain_decodings_tokens(model_dir, tight):
    """Speculation set in the decode side's engine args: its verify steps give the single engine's
    greedy tokens. ``tight``: a decode pool the reservations nearly fill — a verify step's drafts
    take only free slots (else the step decodes plainly), and retraction, not an OOM, makes room."""
    batch = prompts(5, seed=5)
    params = {**GREEDY, "max_new_tokens": 24}
    plain, _ = generate(model_dir, batch, params)
    decode_args = {**SPEC, "page_size": 4}
    extra = {}
    if tight:
        decode_args.update(max_total_tokens=160, init_new_token_ratio=0.02, min_new_token_ratio=0.02)
        extra["num_reserved_decode_tokens"] = 2
    prefill, decode = make_pair(model_dir, page_size=4, decode_args=decode_args, **extra)
    if tight:
        decode_together(decode, len(batch))
    results = run_batch(prefill, decode, batch, params)
    assert [r[0]["output_ids"] for r in results] == ids(plain)
    stats = decode.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0
    assert (decode.scheduler.num_retractions > 0) == tight
    # /get_server_info's sizes of each worker: speculation is the decode side's alone
    info = decode.server_info()
    assert (info["speculative_algorithm"], info["speculative_num_draft_tokens"]) == ("ngram", 4)
    assert info["max_total_num_tokens"] == (160 if tight else decode.runner.max_total_num_tokens)
    assert prefill.server_info()["speculative_algorithm"] is None
    # the decode worker's counters on the server's /metrics (from its load report, as heartbeats fetch it)
    metrics = ServerMetrics("m")
    metrics.set_workers([{"id": "d0", "role": "decode", "alive": True, "load": decode.load()}], running=0, queued=0)
    got = {(s.name, s.labels.get("position")): s.value
           for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
           for s in family.samples if s.name.startswith("raydix_worker_spec_decode")}
    per_pos = [got[("raydix_worker_spec_decode_num_accepted_tokens_per_pos_total", str(i))]
               for i in range(len(stats.num_accepted_tokens_per_pos))]
    assert got[("raydix_worker_spec_decode_num_drafts_total", None)] == stats.num_drafts
    assert got[("raydix_worker_spec_decode_num_draft_tokens_total", None)] == stats.num_draft_tokens
    assert got[("raydix_worker_spec_decode_num_accepted_tokens_total", None)] == stats.num_accepted_tokens
    assert sum(per_pos) == stats.num_accepted_tokens and per_pos == sorted(per_pos, reverse=True) and per_pos[0] > 0
    # ... and its /get_server_info entry's avg_spec_accept_length (SGLang's: the bonus token counted)
    assert spec_accept_length(decode.load())["avg_spec_accept_length"] == pytest.approx(
        1 + stats.num_accepted_tokens / stats.num_drafts)
    close_workers(prefill, decode)
