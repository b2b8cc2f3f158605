"""Draft-model speculative decoding: a small model's drafts verified by the target.

A draft with the target's own weights must have every draft accepted (and hold, at every cached
slot, the target's KV: the draft's KV invariant); a one-layer cut of the target agrees often, not
always, and greedy requests keep plain decoding's (and HF's) tokens through batching, prefix hits,
chunked prefill, retraction, TP and PD's decode side; sampled requests draw the target's
distribution; every test ends with no slot leaked."""

import asyncio

import pytest
import torch
from transformers import LlamaForCausalLM

from actors.engine import Engine
from actors.engine.config import EngineConfig
from actors.engine.draft_model import DraftModel
from actors.engine.forward_batch import ForwardMode
from actors.engine.tiny import build_tiny_checkpoint, tiny_config
from actors.engine.tokenizer import save_tokenizer
from actors.workers import PrefillWorker
from tests.parity import assert_greedy_parity, hf_model
from tests.pd_helpers import close_workers, decode_together, make_pair, run_batch, run_pd
from tests.test_spec_decode import GREEDY, assert_retraction_keeps_tokens, generate, ids, prompts
from tests.test_spec_decode import model_dir  # noqa: F401 (a fixture)
from tests.tp_helpers import thread_ranks

KV_POOLS = {"llama": "MHATokenToKVPool", "deepseek_v3": "MLATokenToKVPool"}
LONG_PROMPT = [60 + i % 50 for i in range(40)]  # (past the short_context draft's 32)


def draft_args(path, k=4):
    return {"speculative_algorithm": "draft_model", "speculative_draft_model_path": path,
            "speculative_num_draft_tokens": k}


@pytest.fixture(scope="module")
def drafts(model_dir, tmp_path_factory):  # noqa: F811
    """``self``: the target's own checkpoint; ``short``: the target's first layer only (its
    embedding, layer 0, norm and head; loaded with one layer, the second's weights left out);
    ``short_context``: the target's weights with a context (max_position_embeddings) of 32."""
    paths = {"short": {"num_hidden_layers": 1}, "short_context": {"max_position_embeddings": 32}}
    for name, overrides in paths.items():
        paths[name] = tmp_path_factory.mktemp("draft") / name
        LlamaForCausalLM.from_pretrained(model_dir, **overrides).save_pretrained(paths[name])
        save_tokenizer(paths[name])
    return {"self": model_dir, **{name: str(path) for name, path in paths.items()}}


def _generate_with_lm_head_rows(model_dir, batch, params, **engine_args):
    """``generate``'s outputs and stats, and the rows each forward of the draft's ``lm_head`` took."""
    engine = Engine(model_path=model_dir, max_total_tokens=4096, **engine_args)
    rows = []
    engine.runner.draft.model.lm_head.register_forward_hook(lambda module, args, out: rows.append(len(args[0])))
    try:
        outs = engine.generate(input_ids=batch, sampling_params=params)
        engine.check_integrity()
        return outs, engine.scheduler.spec_stats.as_dict(), rows
    finally:
        engine.shutdown()


def test_a_draft_with_the_targets_weights_has_every_draft_accepted(model_dir, drafts):  # noqa: F811
    """Greedy tokens are plain decoding's (and HF's), every draft is accepted, and the draft's
    ``lm_head`` computes the proposals' rows only (a mirrored forward and a step that only writes
    KV take none)."""
    batch = prompts()
    plain, _ = generate(model_dir, batch, GREEDY, page_size=4)
    spec, stats, rows = _generate_with_lm_head_rows(model_dir, batch, GREEDY, page_size=4,
                                                    **draft_args(drafts["self"]))
    assert ids(spec) == ids(plain)
    assert stats["num_draft_tokens"] > 0 and stats["acceptance_rate"] == 1.0
    assert stats["mean_accepted_len"] > 4.0  # (k + 1 a step, less where max_new_tokens leaves less room)
    assert sum(rows) == stats["num_draft_tokens"]
    assert_greedy_parity(model_dir, batch, ids(spec), GREEDY["max_new_tokens"])


def test_the_triton_backend_drafts_through_its_decode_kernel(model_dir, drafts):  # noqa: F811
    batch, params = prompts(0), {**GREEDY, "max_new_tokens": 16}
    plain, _ = generate(model_dir, batch, params, page_size=4)
    spec, stats = generate(model_dir, batch, params, page_size=4, attention_backend="triton",
                           **draft_args(drafts["self"]))
    assert ids(spec) == ids(plain) and stats["num_draft_tokens"] > 0 and stats["acceptance_rate"] == 1.0


def _prefix_rounds(engine, batch, params):
    """Two rounds on one engine: the prompts, then each prompt with its first output as the prompt
    of a follow-up (a prefix hit on the slots the first round committed)."""
    first = engine.generate(input_ids=batch, sampling_params=params)
    follow = [p + o["output_ids"][:10] + [7, 8] for p, o in zip(batch, first)]
    second = engine.generate(input_ids=follow, sampling_params=params)
    assert all(o["meta_info"]["cached_tokens"] >= len(p) for p, o in zip(batch, second))
    return ids(first) + ids(second)


@pytest.mark.parametrize("draft", ["self", "short"])
def test_greedy_tokens_through_prefix_hits_chunks_and_the_drafts_kv_invariant(model_dir, drafts, draft):  # noqa: F811
    """Chunked prefill (8-token chunks) and a second round that hits the first's prefixes: the
    tokens are plain decoding's. With the target's weights as the draft, every slot the tree
    holds has the draft's KV equal to the target's (the same tokens at the same positions; up to
    float rounding): each was written by a mirrored forward or by the drafting itself."""
    args = dict(max_total_tokens=4096, page_size=4, chunked_prefill_size=8)
    params = {**GREEDY, "max_new_tokens": 24}
    outs = {}
    for spec_args in ({}, draft_args(drafts[draft])):
        engine = Engine(model_path=model_dir, **args, **spec_args)
        try:
            outs[bool(spec_args)] = _prefix_rounds(engine, prompts(), params)
            engine.check_integrity()
            if spec_args:
                stats = engine.scheduler.spec_stats.as_dict()
                runner = engine.runner
                slots = engine.scheduler.tree_cache.all_values().to(torch.int64)
        finally:
            engine.shutdown()
    assert outs[True] == outs[False]
    assert stats["num_accepted_tokens"] > 0
    if draft == "short":
        assert stats["acceptance_rate"] < 1.0
        return
    assert stats["acceptance_rate"] == 1.0 and len(slots) > 100
    target, mirror = runner.token_to_kv_pool, runner.draft.token_to_kv_pool
    for layer in range(len(target.k_buffer)):
        torch.testing.assert_close(mirror.k_buffer[layer][slots], target.k_buffer[layer][slots], atol=1e-5, rtol=0)
        torch.testing.assert_close(mirror.v_buffer[layer][slots], target.v_buffer[layer][slots], atol=1e-5, rtol=0)


def test_retraction_under_a_small_pool(model_dir, drafts):  # noqa: F811
    """A pool admission overfills (a small new-token ratio): requests are retracted and re-prefilled
    (the draft's KV with them), and the tokens stay plain decoding's."""
    assert_retraction_keeps_tokens(model_dir, draft_args(drafts["short"]), max_total_tokens=160,
                                   init_new_token_ratio=0.05, min_new_token_ratio=0.05)


def test_requests_with_logprobs_penalties_and_a_grammar_keep_plain_decodings_tokens(model_dir, drafts):  # noqa: F811
    """Each draft position's row adjusted and masked as at its position, logprobs from the raw rows
    (as n-gram drafts'), and a sampled one-token nucleus: greedy's tokens by rejection sampling."""
    prompt = prompts(0)[0]
    logprobs = {"return_logprob": True, "top_logprobs_num": 2}
    kinds = [{}, logprobs, {"frequency_penalty": 0.05, "repetition_penalty": 1.1}, {"regex": r"[a-z ]{10,60}"},
             {"temperature": 1.0, "top_p": 1e-6, **logprobs}]
    params = [{**GREEDY, "max_new_tokens": 24, **kind} for kind in kinds]
    plain, _ = generate(model_dir, [prompt] * len(kinds), params)
    spec, stats = generate(model_dir, [prompt] * len(kinds), params, **draft_args(drafts["short"]))
    assert ids(spec) == ids(plain) and stats["num_accepted_tokens"] > 0
    for got, want in zip(spec, plain):
        if "output_token_logprobs" in want["meta_info"]:
            assert [v for v, _ in got["meta_info"]["output_token_logprobs"]] == pytest.approx(
                [v for v, _ in want["meta_info"]["output_token_logprobs"]], abs=1e-5)


def test_the_draft_proposes_what_the_requests_masks_allow(model_dir, drafts, monkeypatch):  # noqa: F811
    """A draft model drafts under each request's allowed ids, bad words and grammar after its draft
    so far (the matcher advanced tentatively, rolled back): every token proposed passes them, so
    more are accepted than by the raw argmax (cut at the grammar's first refusal, rejected where an
    allowed set bans it), and the tokens stay plain decoding's."""
    from actors.engine.draft_masks import DraftMasks
    from actors.engine.spec_decode import SpecDecodeMixin

    allowed = list(range(97, 123))
    kinds = [{"allowed_token_ids": allowed}, {"regex": r"[a-z ]{10,60}"},
             {"allowed_token_ids": allowed, "bad_words": ["e", "ta"]}]
    params = [{**GREEDY, "max_new_tokens": 24, **kind} for kind in kinds]
    batch = [prompts(0)[0]] * len(kinds)
    plain, _ = generate(model_dir, batch, params)
    proposed, cuts = [], []
    propose, cut = DraftModel.propose, SpecDecodeMixin._grammar_cut
    monkeypatch.setattr(DraftModel, "propose", lambda self, reqs, *a: proposed.extend(
        zip(reqs, propose(self, reqs, *a))) or [d for _, d in proposed[-len(reqs):]])
    monkeypatch.setattr(SpecDecodeMixin, "_grammar_cut", staticmethod(
        lambda req, d: cuts.append((len(d), len(cut(req, d)))) or cut(req, d)))
    spec, stats = generate(model_dir, batch, params, **draft_args(drafts["short"]))
    assert ids(spec) == ids(plain)
    for req, draft in proposed:  # ("ta" bans "a" only after a "t", which a draft may propose)
        banned = [word[0] for word in req.bad_words_ids if len(word) == 1]
        assert set(draft) <= set(req.sampling_params.allowed_token_ids or draft) and not set(draft) & set(banned)
    assert any(draft and req.bad_words_ids for req, draft in proposed)
    assert all(kept == n for n, kept in cuts) and sum(n for n, _ in cuts) == stats["num_draft_tokens"] > 0
    monkeypatch.setattr(DraftMasks, "apply", lambda self, logits, index: logits)  # the raw argmax, as before
    monkeypatch.setattr(DraftMasks, "take", lambda self, index, tokens: None)
    raw, raw_stats = generate(model_dir, batch, params, **draft_args(drafts["short"]))
    assert ids(raw) == ids(plain)
    assert stats["mean_accepted_len"] > raw_stats["mean_accepted_len"]
    assert stats["num_accepted_tokens"] > raw_stats["num_accepted_tokens"]


def test_a_draft_with_the_targets_weights_under_adjustments_has_every_draft_accepted(model_dir, drafts):  # noqa: F811
    """With the target's weights as the draft, each draft step takes the adjustments plain decoding
    would at its position — penalties and min-tokens counting the draft so far as output, a bias, a
    grammar whose end (EOS) the draft proposes, then rolled back: the draft is plain decoding's own
    tokens, so every one is accepted (the raw argmax is rejected where an adjustment moves it)."""
    batch = prompts(2)
    kinds = [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0},
             {"logit_bias": {str(t): 5.0 for t in range(60, 70)}},
             {"min_new_tokens": 10, "ignore_eos": False, "stop_token_ids": [199, 50]},
             {"regex": r"(ab|ba)+c?", "ignore_eos": False}]
    params = [{**GREEDY, "max_new_tokens": 24, **kind} for kind in kinds for _ in batch]
    batch = batch * len(kinds)
    plain, _ = generate(model_dir, batch, params)
    spec, stats = generate(model_dir, batch, params, **draft_args(drafts["self"]))
    assert ids(spec) == ids(plain) and ids(plain) != ids(generate(model_dir, batch, GREEDY | {"max_new_tokens": 24})[0])
    assert stats["num_draft_tokens"] > 0 and stats["acceptance_rate"] == 1.0


HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _count_host_reads(monkeypatch) -> list:
    """Per draft proposal, ``(its steps, the sizes of the tensors read on the host)`` by the drafting's
    own code, the draft's forwards left out (each a sync on CUDA)."""
    calls, counting = [], [False]
    for name in HOST_READS:
        def read(self, *args, _method=getattr(torch.Tensor, name), **kwargs):
            if counting[0]:
                calls[-1][1].append(self.numel())
            return _method(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)
    propose, forward = DraftModel.propose, DraftModel.forward

    def switched(fn, on: bool):
        def call(*args):
            was, counting[0] = counting[0], on
            try:
                return fn(*args)
            finally:
                counting[0] = was
        return call

    monkeypatch.setattr(DraftModel, "propose", lambda self, reqs, lens, *rest: calls.append((max(lens), [])) or
                        switched(propose, True)(self, reqs, lens, *rest))
    monkeypatch.setattr(DraftModel, "forward", switched(forward, False))
    return calls


def test_drafting_under_tensor_masks_reads_nothing_on_the_host_per_step(model_dir, drafts, monkeypatch):  # noqa: F811
    """Allowed ids, bad words of one and more tokens, penalties, a bias and min-tokens: the draft
    steps apply them on the device, the draft tokens staying there — one host read per proposal,
    its tokens at the end (it read each step's tokens) —, exactly as plain decoding (a draft with
    the target's weights has every draft accepted; the tokens are plain decoding's). With a grammar
    in the batch, a step reads its grammar row's token only."""
    allowed = list(range(97, 123))
    kinds = [{"allowed_token_ids": allowed, "bad_words": ["e", "ta", "__", "jjj"]},  # (ids 100 100, 111 111 111)
             {"repetition_penalty": 2.0, "frequency_penalty": 1.0, "presence_penalty": 0.5},
             {"logit_bias": {str(t): 5.0 for t in range(60, 70)}, "bad_words": ["<>", "ab"]},
             {"min_new_tokens": 10, "ignore_eos": False, "stop_token_ids": [199, 50], "repetition_penalty": 1.5}]
    batch = prompts(2)
    params = [{**GREEDY, "max_new_tokens": 24, **kind} for kind in kinds for _ in batch]
    batch = batch * len(kinds)
    grammar = [{**GREEDY, "max_new_tokens": 24, "regex": r"(ab|ba)+c?", "ignore_eos": False}]
    plain, _ = generate(model_dir, batch + batch[:1], params + grammar)
    calls = _count_host_reads(monkeypatch)
    spec, stats = generate(model_dir, batch, params, **draft_args(drafts["self"]))
    assert ids(spec) == ids(plain[:-1]) and stats["num_draft_tokens"] > 0 and stats["acceptance_rate"] == 1.0
    assert max(steps for steps, _ in calls) > 1
    assert all(len(reads) == 1 for _, reads in calls)
    del calls[:]
    spec, stats = generate(model_dir, batch + batch[:1], params + grammar, **draft_args(drafts["self"]))
    assert ids(spec) == ids(plain) and stats["acceptance_rate"] == 1.0
    assert all(len(reads) <= steps + 1 and set(reads[:-1]) <= {1} for steps, reads in calls)
    assert any(len(reads) > 1 for _, reads in calls)


def test_sampled_tokens_follow_the_targets_distribution(model_dir, drafts):  # noqa: F811
    """400 sampled requests (temperature 1, top_k 3) of one prompt, each with a one-token draft
    at its second token: given the most common first token, the second is distributed as HF's
    target top-3 softmax there (chi-square, 2 degrees of freedom, p-value 0.001), drafts both
    kept and rejected."""
    prompt, n = prompts(0)[0], 400
    params = [{"max_new_tokens": 3, "temperature": 1.0, "top_k": 3, "ignore_eos": True, "seed": i} for i in range(n)]
    outs, stats = generate(model_dir, [prompt] * n, params, max_running_requests=n, **draft_args(drafts["short"], 1))
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"] == n
    firsts = [o[0] for o in ids(outs)]
    first = max(set(firsts), key=firsts.count)
    seconds = torch.tensor([o[1] for o in ids(outs) if o[0] == first])
    with torch.no_grad():
        logits = hf_model(model_dir)(torch.tensor([prompt + [first]])).logits[0, -1]
    top = logits.topk(3)
    probs = torch.softmax(top.values, -1)
    counts = torch.tensor([(seconds == t).sum() for t in top.indices.tolist()], dtype=torch.float)
    assert counts.sum() == len(seconds) > 100
    expected = len(seconds) * probs
    assert float(((counts - expected) ** 2 / expected).sum()) < 13.82


@pytest.mark.parametrize("target_family, draft_family", [("deepseek_v3", "llama"), ("llama", "deepseek_v3")])
def test_a_draft_of_another_kv_layout_has_a_pool_of_its_own(tmp_path, target_family, draft_family):
    """An MLA target with an MHA draft and the other way round (the tiny checkpoints share the
    vocabulary): the draft's pool has its own layout and layers over the target's slots, and the
    greedy tokens are plain decoding's."""
    target = str(build_tiny_checkpoint(target_family, tmp_path / "target", seed=0))
    draft = str(build_tiny_checkpoint(draft_family, tmp_path / "draft", seed=1, num_hidden_layers=1))
    batch, params = prompts(2), {**GREEDY, "max_new_tokens": 16}
    engine = Engine(model_path=target, max_total_tokens=1024, page_size=4, **draft_args(draft))
    try:
        spec = ids(engine.generate(input_ids=batch, sampling_params=params))
        engine.check_integrity()
        pools = engine.runner.token_to_kv_pool, engine.runner.draft.token_to_kv_pool
        assert [type(p).__name__ for p in pools] == [KV_POOLS[target_family], KV_POOLS[draft_family]]
        assert engine.scheduler.spec_stats.num_draft_tokens > 0
    finally:
        engine.shutdown()
    assert spec == ids(generate(target, batch, params, page_size=4)[0])


def test_tp2_drafts_on_rank_0_only(model_dir, drafts, monkeypatch):  # noqa: F811
    thread_ranks(monkeypatch)
    batch = prompts(2)
    plain, _ = generate(model_dir, batch, GREEDY)
    spec, stats = generate(model_dir, batch, GREEDY, tp_size=2, **draft_args(drafts["self"]))
    assert ids(spec) == ids(plain) and stats["acceptance_rate"] == 1.0 and stats["num_draft_tokens"] > 0


def test_pd_decode_side_computes_the_drafts_kv_of_a_transferred_prompt(model_dir, drafts):  # noqa: F811
    """The decode side drafts with the target's weights: every draft is accepted only if the
    draft's KV of each prompt (whose target KV came from the prefill side) was computed on
    arrival — in a second round, past the prefix the decode side's own tree held (its draft KV
    written there in the first)."""
    batch = prompts(4, seed=5)
    params = {**GREEDY, "max_new_tokens": 16}
    prefill, decode = make_pair(model_dir, page_size=4, decode_args={**draft_args(drafts["self"]), "page_size": 4})
    try:
        first = [r[0] for r in run_batch(prefill, decode, batch, params)]
        follow = [p + o["output_ids"] + [7, 8] for p, o in zip(batch, first)]
        second = [r[0] for r in run_batch(prefill, decode, follow, params)]
        assert all(o["meta_info"]["cached_tokens"] >= len(p) - 4 for p, o in zip(batch, second))  # decode side's
        plain = generate(model_dir, batch, params)[0] + generate(model_dir, follow, params)[0]
        assert ids(first + second) == ids(plain)
        stats = decode.scheduler.spec_stats.as_dict()
        assert stats["num_draft_tokens"] > 0 and stats["acceptance_rate"] == 1.0
    finally:
        close_workers(prefill, decode)


def test_pd_decode_side_computes_the_drafts_kv_of_a_steps_arrivals_in_one_forward(model_dir, drafts):  # noqa: F811
    """Requests whose KV lands in one step get the draft's KV of their prompts in one forward of the
    draft (it took one forward per request); every draft is accepted, the tokens plain decoding's."""
    batch, params = prompts(4, seed=7), {**GREEDY, "max_new_tokens": 8}
    prefill, decode = make_pair(model_dir, page_size=4, decode_args={**draft_args(drafts["self"]), "page_size": 4})
    draft, extends = decode.scheduler.runner.draft, []
    forward = draft.forward

    def recording(forward_batch):
        if forward_batch.forward_mode is ForwardMode.EXTEND:
            extends.append(forward_batch.extend_seq_lens_cpu)
        return forward(forward_batch)

    draft.forward = recording
    try:
        decode_together(decode, len(batch))
        outs = [r[0] for r in run_batch(prefill, decode, batch, params)]
        assert ids(outs) == ids(generate(model_dir, batch, params)[0])
        assert [sorted(lens) for lens in extends] == [sorted(len(p) for p in batch)]  # (none was cached there)
        assert decode.scheduler.spec_stats.as_dict()["acceptance_rate"] == 1.0
    finally:
        close_workers(prefill, decode)


def test_pd_decode_side_drafts_kv_of_arrivals_with_prefix_hits_and_a_finished_one(model_dir, drafts):  # noqa: F811
    """One step's arrivals in one forward of the draft when their prefixes differ (hits of 32 and 12
    tokens on the decode side's tree, none) and one ends at its first token (cached with the
    draft's KV): every draft is accepted, the tokens plain decoding's, no slot leaked."""
    base = list(range(20, 52))
    batch = [base + [7, 8, 9], base[:13] + [60] * 9, [100, 101, 102], base + list(range(60, 80))]
    params = [{**GREEDY, "max_new_tokens": n} for n in (8, 8, 1, 8)]
    prefill, decode = make_pair(model_dir, page_size=4, decode_args={**draft_args(drafts["self"]), "page_size": 4})
    draft, extends = decode.scheduler.runner.draft, []
    prefill_reqs = draft.prefill
    draft.prefill = lambda reqs, pool: extends.append([len(r.prefix_indices) for r in reqs]) or prefill_reqs(reqs, pool)
    try:
        run_batch(prefill, decode, [base], {**GREEDY, "max_new_tokens": 4})
        decode_together(decode, len(batch))

        async def land_together():
            return await asyncio.gather(*(run_pd(prefill, decode, p, s) for p, s in zip(batch, params)))

        outs = [r[0] for r in asyncio.run(land_together())]
        assert ids(outs) == ids(generate(model_dir, batch, params)[0])
        assert sorted(extends[-1]) == [0, 12, 32, 32]
        assert decode.scheduler.spec_stats.as_dict()["acceptance_rate"] == 1.0
    finally:
        close_workers(prefill, decode)


def test_pd_decode_side_retracts_and_re_prefills_with_the_drafts_kv(model_dir, drafts):  # noqa: F811
    """A decode pool the reservations nearly fill: requests are retracted there and re-prefilled by
    the decode side's own engine (the draft mirroring it); every draft is still accepted."""
    batch = prompts(5, seed=5)
    params = {**GREEDY, "max_new_tokens": 24}
    decode_args = {**draft_args(drafts["self"]), "page_size": 4, "max_total_tokens": 160,
                   "init_new_token_ratio": 0.02, "min_new_token_ratio": 0.02}
    prefill, decode = make_pair(model_dir, page_size=4, decode_args=decode_args, num_reserved_decode_tokens=2)
    try:
        decode_together(decode, len(batch))
        assert [r[0]["output_ids"] for r in run_batch(prefill, decode, batch, params)] == ids(
            generate(model_dir, batch, params)[0])
        assert decode.scheduler.num_retractions > 0
        assert decode.scheduler.spec_stats.as_dict()["acceptance_rate"] == 1.0
    finally:
        close_workers(prefill, decode)


def _record_positions(draft) -> list:
    """The last position of each forward of ``draft`` from now on (a list that grows as it runs)."""
    last, forward = [], draft.forward
    draft.forward = lambda forward_batch: last.append(int(forward_batch.positions.max())) or forward(forward_batch)
    return last


def test_a_draft_of_a_shorter_context_drafts_no_position_past_it(model_dir, drafts, caplog):  # noqa: F811
    """The target's weights as a draft of max_position_embeddings 32: requests that grow past 32
    tokens decode on undrafted (vLLM caps its draft's max_model_len and skips speculation past it),
    the served context stays the target's, a warning says so at start, and the tokens stay plain
    decoding's. The draft computes no position past 32 either — not its drafting steps (it used
    to run them at any position, RoPE past its training), nor its mirrored prefills and decode
    steps, nor an undrafted request's step in a drafting batch (a 40-token prompt's; these wrote
    its KV up to position 78) —, and every draft below it is still accepted."""
    batch = prompts(2) + [LONG_PROMPT]
    plain, _ = generate(model_dir, batch, GREEDY)
    engine = Engine(model_path=model_dir, max_total_tokens=4096, **draft_args(drafts["short_context"]))
    draft, fed = engine.runner.draft, []
    propose, last = draft.propose, _record_positions(draft)
    draft.propose = lambda reqs, lens, *rest: fed.extend(  # (the last position a drafted request's steps feed)
        r.seqlen - 1 + n for r, n in zip(reqs, lens) if n) or propose(reqs, lens, *rest)
    try:
        spec = engine.generate(input_ids=batch, sampling_params=GREEDY)
        engine.check_integrity()
        stats = engine.scheduler.spec_stats.as_dict()
        assert engine.runner.context_len == 4096
    finally:
        engine.shutdown()
    assert ids(spec) == ids(plain) and stats["num_draft_tokens"] > 0 and stats["acceptance_rate"] == 1.0
    assert max(fed) == 31 and max(len(p) for p in batch[:-1]) + GREEDY["max_new_tokens"] > 32
    assert max(last) == 31
    assert "draft's context length (32) is below the served context length (4096)" in caplog.text


def test_a_request_without_a_draft_adds_nothing_to_the_drafting(model_dir, drafts, monkeypatch):  # noqa: F811
    """A request past the draft's context takes no draft: its penalties and bad words make no masks
    of the drafting (they made its dense rows, its prompt's ids copied to the device each verify
    step, for a row no draft token comes from), so a batch where only it has any drafts unmasked;
    and the draft's ``lm_head`` computes the proposals' rows only when the drafts' lengths differ
    (it took every row of a step but the last: an undrafted request's, a shorter draft's last)."""
    batch = prompts(2) + [LONG_PROMPT]
    params = [GREEDY] * 3 + [{**GREEDY, "repetition_penalty": 1.5, "frequency_penalty": 0.5, "bad_words": ["ab"]}]
    plain, _ = generate(model_dir, batch, params)
    masks, lens, propose = [], [], DraftModel.propose
    monkeypatch.setattr(DraftModel, "propose", lambda self, reqs, n, pool, m=None: masks.append(m) or lens.append(
        n) or propose(self, reqs, n, pool, m))
    spec, stats, rows = _generate_with_lm_head_rows(model_dir, batch, params, **draft_args(drafts["short_context"]))
    assert ids(spec) == ids(plain) and stats["num_draft_tokens"] > 0 and stats["acceptance_rate"] == 1.0
    assert masks and all(m is None for m in masks)
    assert any(len(set(n)) > 1 for n in lens) and sum(rows) == stats["num_draft_tokens"]


def test_pd_decode_side_computes_no_draft_kv_past_the_drafts_context(model_dir, drafts):  # noqa: F811
    """A prompt longer than the draft's context of 32 lands on the decode side with a short one: the
    draft's KV of the arrivals is computed below 32 only (it was computed for the whole prompt),
    the short one is drafted (every draft accepted) and the tokens are plain decoding's."""
    batch, params = [prompts(1)[0], LONG_PROMPT], {**GREEDY, "max_new_tokens": 8}
    prefill, decode = make_pair(model_dir, page_size=4,
                                decode_args={**draft_args(drafts["short_context"]), "page_size": 4})
    last = _record_positions(decode.scheduler.runner.draft)
    try:
        decode_together(decode, len(batch))
        outs = [r[0] for r in run_batch(prefill, decode, batch, params)]
        assert ids(outs) == ids(generate(model_dir, batch, params)[0])
        stats = decode.scheduler.spec_stats.as_dict()
        assert stats["num_draft_tokens"] > 0 and stats["acceptance_rate"] == 1.0 and max(last) == 31
    finally:
        close_workers(prefill, decode)


def test_a_rope_scaled_drafts_context_is_its_scaled_length(model_dir, tmp_path):  # noqa: F811
    """A draft of max_position_embeddings 16 under YaRN, factor 4 over 16 (Qwen3's 40960 → 131072):
    it drafts up to 64 tokens, by the rule the target's context follows (vLLM's max_model_len of a
    draft), capped at the target's context; it stopped at its unscaled 16."""
    path = tmp_path / "yarn_draft"
    LlamaForCausalLM.from_pretrained(model_dir, max_position_embeddings=16, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16)).save_pretrained(path)
    vocab = tiny_config("llama").vocab_size
    assert [DraftModel(str(path), "float32", torch.device("cpu"), "torch", vocab, context_len).max_context_len
            for context_len in (4096, 48)] == [64, 48]


def test_bad_draft_settings_are_refused_naming_the_field(model_dir, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="speculative_draft_model_path is needed"):
        EngineConfig(model_path="m", speculative_algorithm="draft_model")
    with pytest.raises(ValueError, match="speculative_draft_model_path is set but speculative_algorithm is 'ngram'"):
        EngineConfig(model_path="m", speculative_algorithm="ngram", speculative_draft_model_path="d")
    with pytest.raises(ValueError, match="speculative_draft_model_path: .*enable_hierarchical_cache"):
        EngineConfig(model_path="m", enable_hierarchical_cache=True, **draft_args("d"))
    with pytest.raises(ValueError, match="a prefill worker never decodes"):
        PrefillWorker("m", draft_args("d"))
    other = tmp_path / "other_vocab"
    LlamaForCausalLM(tiny_config("llama", vocab_size=300, num_hidden_layers=1)).save_pretrained(other)
    with pytest.raises(ValueError, match=r"speculative_draft_model_path: the draft's vocabulary \(300 ids\)"):
        Engine(model_path=model_dir, max_total_tokens=256, **draft_args(str(other)))
