"""Structured outputs on an in-process engine (the tiny llama and its byte-level tokenizer):
greedy constrained decoding equals HF transformers' greedy under the same xgrammar mask,
token for token; what ends with ``stop`` follows its JSON schema, regex or grammar, sampled
too; a bad grammar is a ValueError naming its field; a retracted request keeps its grammar, on a
PD decode worker too; through PD the prefill worker's first token is constrained and the
decode worker goes on with the same grammar; TP=2 gives TP=1's tokens; ids past the
tokenizer's vocabulary are masked; an abort while a grammar compiles ends its request; the batch's
bitmask, filled in one call, holds what each row's matcher fills alone. A grammar held back until
``grammar_after`` (a thinking forced through ``tests.forced_output``) leaves the thinking free and
constrains the answer, through retraction in either, PD and TP."""

import json
import re
import threading

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList

from actors.engine import Engine
from actors.engine.grammar import PARALLEL_FILL_ROWS, ReasonerGrammar, active_matcher, fill_next_token_bitmask
from actors.engine.req import Req
from actors.engine.sampling_params import ANY_JSON, SamplingParams
from actors.engine.tiny import build_tiny_checkpoint
from tests.forced_output import forced_tokens
from tests.test_allowed_and_bad_words import ascii_text, chosen_bad_words, retracted_outputs
from tests.parity import hf_model
from tests.pd_helpers import close_workers, decode_together, make_pair, prompts, run_batch

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                                           "n": {"enum": [1, 2, 3]}},
          "required": ["name", "ok", "n"], "additionalProperties": False}
REGEX = r"(cat|dog)-[0-9]{2,3}"
TEXTS = ["Give me JSON:", "Hello there", "x", "The answer is", "{", "[1, 2"]
# a random model writes JSON's optional whitespace until max_new_tokens, greedy: here it writes none
NO_WHITESPACE = {"constrained_json_disable_any_whitespace": True}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(build_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama", seed=0))


@pytest.fixture(scope="module")
def engine(model_path):
    eng = Engine(model_path=model_path, max_total_tokens=4096, **NO_WHITESPACE)
    yield eng
    eng.shutdown()


class GrammarMask(LogitsProcessor):
    """HF's side of the oracle: an xgrammar matcher of its own, fed each token HF chose."""

    def __init__(self, compiled: xgr.CompiledGrammar, prompt_len: int):
        self.matcher, self.prompt_len = xgr.GrammarMatcher(compiled), prompt_len

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.accept_token(int(input_ids[0, -1]))
        bitmask = xgr.allocate_token_bitmask(1, scores.shape[-1])
        self.matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(scores, bitmask)
        return scores


def hf_constrained_greedy(model_path, prompt, compiled, max_new_tokens, eos_id):
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model(model_path).generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=eos_id, pad_token_id=0,
            logits_processor=LogitsProcessorList([GrammarMask(compiled, len(prompt))]))
    return out[0, len(prompt):].tolist()


def hold_make_req(owner, monkeypatch):
    """``owner._make_req`` (an engine's or a worker's, which compiles the grammar) held until the test
    lets it go: returns the events (set when it is held, set to go on)."""
    compiling, go_on = threading.Event(), threading.Event()
    make_req = owner._make_req

    def held(*args):
        compiling.set()
        assert go_on.wait(30), "the abort never came"
        return make_req(*args)

    monkeypatch.setattr(owner, "_make_req", held)
    return compiling, go_on


def follows(kind: str, text: str) -> bool:
    """A finished output's text follows its grammar (checked without xgrammar)."""
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    value = json.loads(text, strict=False)  # (xgrammar's JSON strings take raw control characters, as JSON's do not)
    return (set(value) == {"name", "ok", "n"} and isinstance(value["name"], str) and len(value["name"]) <= 6
            and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3))


@pytest.mark.parametrize("kind,spec", [("json_schema", json.dumps(SCHEMA)), ("regex", REGEX)])
def test_greedy_constrained_tokens_equal_hf_under_the_same_mask(engine, model_path, kind, spec):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=engine.runner.model_config.vocab_size)
    compiler = xgr.GrammarCompiler(info)
    compiled = (compiler.compile_json_schema(spec, any_whitespace=False) if kind == "json_schema"
                else compiler.compile_regex(spec))
    params = {kind: spec, "temperature": 0, "max_new_tokens": 64}
    ids = [tokenizer.encode(t) for t in TEXTS[:4]]
    outs = engine.generate(input_ids=ids, sampling_params=params)
    for prompt, out in zip(ids, outs):
        assert out["output_ids"] == hf_constrained_greedy(model_path, prompt, compiled, 64, engine.eos_token_ids)
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": engine.eos_token_ids[0]}, out
        assert follows(kind, out["text"]), out
    engine.check_integrity()


@pytest.mark.parametrize("temperature", [0, 1])
def test_finished_outputs_follow_their_schema_regex_or_grammar(engine, temperature):
    """Batched with one another and with an unconstrained request; logprobs still the model's."""
    grammars = [{"json_schema": json.dumps(SCHEMA)}, {"regex": REGEX}, {"ebnf": 'root ::= "yes" | "no" | "maybe"'},
                {}]
    params = [dict(g, temperature=temperature, seed=7 + i, max_new_tokens=64, return_logprob=True)
              for i, g in enumerate(grammars * 3)]
    ids = [engine.tokenizer.encode(t) for t in TEXTS] * 2
    outs = engine.generate(input_ids=ids, sampling_params=params)
    finished = {"json_schema": 0, "regex": 0, "ebnf": 0}
    for p, out in zip(params, outs):
        grammar = SamplingParams(**p).grammar
        assert all(lp <= 0 for lp, _ in out["meta_info"]["output_token_logprobs"])
        if grammar is None or out["meta_info"]["finish_reason"]["type"] != "stop":
            continue
        kind = grammar[0]
        finished[kind] += 1
        assert (out["text"] in ("yes", "no", "maybe")) if kind == "ebnf" else follows(kind, out["text"]), out
    assert finished == {"json_schema": 3, "regex": 3, "ebnf": 3}
    engine.check_integrity()


def test_ignore_eos_still_ends_at_the_grammars_end(engine):
    out = engine.generate(prompt="x", sampling_params={"regex": "ab", "ignore_eos": True, "max_new_tokens": 10})
    assert out["text"] == "ab" and out["output_ids"][-1] == engine.eos_token_ids[0]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": engine.eos_token_ids[0]}


@pytest.mark.parametrize("params,field", [
    ({"json_schema": '{"type": "nope"}'}, "json_schema: the JSON schema does not compile"),
    ({"json_schema": "{"}, "json_schema"),
    ({"regex": "(ab"}, "regex: the regex does not compile"),
    ({"ebnf": "root ::= "}, "ebnf: the EBNF grammar does not compile"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf: structured output takes one of"),
    ({"regex": "a+", "min_new_tokens": 2}, "min_new_tokens"),
])
def test_a_bad_grammar_is_refused_naming_its_field(engine, params, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        engine.generate(prompt="x", sampling_params=params)
    engine.check_integrity()


def test_a_retracted_request_keeps_its_grammar(model_path):
    """A pool too small for the batch retracts requests mid-output; their recomputed tokens, and the
    grammar's, equal an unretracted run's."""
    ids = prompts(6, 8, 12, seed=5)
    params = {"json_schema": json.dumps(SCHEMA), "temperature": 0, "max_new_tokens": 40}
    retracted = retracted_outputs(model_path, ids, params)
    big = Engine(model_path=model_path, max_total_tokens=4096)
    try:
        unretracted = big.generate(input_ids=ids, sampling_params=params)
        assert retracted == [o["output_ids"] for o in unretracted]
    finally:
        big.shutdown()


def test_pd_constrains_the_first_token_and_the_decode_side_goes_on_with_the_grammar(engine, model_path):
    """The prefill worker samples the first token under the grammar (a JSON object starts with
    ``{``, a regex match with ``c`` or ``d``); the decode worker's matcher takes it and goes on:
    tokens equal the single engine's."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = [tokenizer.encode(t) for t in TEXTS[:3]]
    prefill, decode = make_pair(model_path, page_size=4, prefill_args=NO_WHITESPACE, decode_args=NO_WHITESPACE)
    try:
        for kind, spec, first in (("json_schema", json.dumps(SCHEMA), "{"), ("regex", REGEX, "cd")):
            params = {kind: spec, "temperature": 0, "max_new_tokens": 64}
            results = run_batch(prefill, decode, ids, params)
            expected = engine.generate(input_ids=ids, sampling_params=params)
            for (final, notice, _), want in zip(results, expected):
                assert tokenizer.decode([notice["first_token"]]) in first
                assert final["output_ids"] == want["output_ids"]
                assert final["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    finally:
        close_workers(prefill, decode)


def test_an_abort_while_a_reservations_grammar_compiles_ends_it_before_it_holds_anything(model_path, monkeypatch):
    """The decode worker compiles a reservation's grammar off its event loop; an abort that comes
    meanwhile (the client gave up) ends the reservation as soon as the compile returns, before
    it takes a row or slots, rather than leaving it to wait out its notice's timeout."""
    import asyncio

    from actors.pd_scheduler import PDRequestError

    prefill, decode = make_pair(model_path, page_size=4, prefill_args=NO_WHITESPACE, decode_args=NO_WHITESPACE)
    make_req = decode._make_req
    compiling, go_on = hold_make_req(decode, monkeypatch)

    async def go():
        params = {"regex": REGEX, "temperature": 0, "max_new_tokens": 8}
        reserving = asyncio.ensure_future(decode.reserve("r", [5, 6, 7, 8], params, room=11))
        await asyncio.to_thread(compiling.wait, 30)
        assert await decode.abort("r", "the client went away", room=11) is False  # (nothing of it held yet)
        go_on.set()
        with pytest.raises(PDRequestError, match="aborted before its reservation"):
            await reserving
        # a later attempt under the id (another room) is served
        monkeypatch.setattr(decode, "_make_req", make_req)
        assert len(await decode.reserve("r", [5, 6, 7, 8], params, room=12)) == 1
        assert await decode.abort("r", "done", safe=True, room=12)

    try:
        asyncio.run(go())
        assert not decode.scheduler.prealloc and not decode.scheduler.transfer
    finally:
        close_workers(prefill, decode)


def test_tp2_constrained_greedy_tokens_equal_tp1(engine, model_path):
    """Only rank 0 schedules and samples, so only it compiles grammars and holds matchers (a held-back
    one too; the follower runs forwards only) and bans tokens: a TP=2 engine's constrained greedy
    tokens, batched with a free request and ones with bad words and allowed ids, are the TP=1
    engine's."""
    free = {"temperature": 0, "max_new_tokens": 8}
    plain = engine.generate(input_ids=engine.tokenizer.encode(TEXTS[3]), sampling_params=free)["output_ids"]
    single, pair = chosen_bad_words(plain)
    params = [{"json_schema": json.dumps(SCHEMA), "temperature": 0, "max_new_tokens": 64},
              {"regex": REGEX, "temperature": 0, "max_new_tokens": 64}, free, AFTER,
              {**free, "bad_words": [ascii_text([single]), ascii_text(pair)]},
              {**free, "allowed_token_ids": sorted(set(plain) - {plain[0]})}]
    ids = [engine.tokenizer.encode(t) for t in TEXTS[:4] + TEXTS[3:4] * 2]
    script = thinking_script(engine.tokenizer)
    outs = forced_run(model_path, script, ids, params, max_total_tokens=2048, tp_size=2)
    with forced_tokens(engine.scheduler, script):
        want = engine.generate(input_ids=ids, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in want]
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["stop", "stop", "length", "stop", "length", "length"]
    assert outs[4]["output_ids"] != plain != outs[5]["output_ids"]


@pytest.mark.parametrize("copies", [1, PARALLEL_FILL_ROWS // 6 + 1])  # (one thread; past it, xgrammar's "auto")
def test_the_batch_fill_gives_each_row_its_own_matchers_mask(engine, copies):
    """One ``BatchGrammarMatcher`` call for the batch gives every row what its matcher fills on
    its own: grammars of every kind, each at a few points of its output, among rows without one
    (every token allowed)."""
    grammars, vocab = engine.scheduler.grammars, engine.runner.model_config.vocab_size
    eos = engine.eos_token_ids
    written = [("json_schema", json.dumps(SCHEMA), ""), ("json_schema", json.dumps(SCHEMA), '{"name": "ab'),
               ("json_schema", json.dumps(SCHEMA), '{"name": "ab", "ok": '), ("json_schema", ANY_JSON, '{"a": [1, '),
               ("regex", REGEX, "do"), ("ebnf", 'root ::= "yes" | "no" | "maybe"', "")]
    matchers = []
    for field, spec, text in written * copies:
        matcher = grammars.matcher(SamplingParams(**{field: spec}), eos)
        assert matcher.accept_string(text) or not text
        matchers += [matcher, None]
    bitmask = fill_next_token_bitmask(matchers, vocab)
    alone = xgr.allocate_token_bitmask(len(matchers), vocab)
    for i, matcher in enumerate(matchers):
        if matcher is not None:
            matcher.fill_next_token_bitmask(alone, i)
    assert torch.equal(bitmask, alone)
    assert len({tuple(row) for row in bitmask[0::2].tolist()}) == len(written)  # (rows that differ)
    assert bool((bitmask[1::2] == -1).all()) and not bool((bitmask[0::2] == -1).all())


def test_ids_past_the_tokenizers_vocab_are_masked(tmp_path):
    """A model vocabulary larger than its tokenizer's (padded embeddings): the ids no token has
    are never allowed by a grammar, however the logits favour them."""
    path = str(build_tiny_checkpoint("llama", tmp_path / "llama", seed=0, vocab_size=320))
    eng = Engine(model_path=path, max_total_tokens=1024)
    try:
        assert len(eng.tokenizer) < 300 < eng.runner.model_config.vocab_size
        bias = {300: 100.0}
        params = [{"regex": REGEX, "temperature": t, "seed": 3, "logit_bias": bias, "max_new_tokens": 16}
                  for t in (0, 1)]
        for out in eng.generate(prompt=["x", "x"], sampling_params=params):
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eng.eos_token_ids[0]}, out
            assert follows("regex", out["text"]) and max(out["output_ids"]) < len(eng.tokenizer), out
        free = eng.generate(prompt="x", sampling_params={"logit_bias": bias, "temperature": 0, "max_new_tokens": 2})
        assert free["output_ids"] == [300, 300]  # (the bias does reach those ids without a grammar)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_decode_side_retraction_keeps_the_grammar(engine, model_path):
    """PD: a decode pool too small for the batch retracts requests mid-output; their matchers stay
    as they are (the output is recomputed, not redrawn) and the tokens equal the single engine's."""
    decode_args = dict(NO_WHITESPACE, max_total_tokens=160, init_new_token_ratio=0.02, min_new_token_ratio=0.02)
    prefill, decode = make_pair(model_path, prefill_args=NO_WHITESPACE, decode_args=decode_args,
                                num_reserved_decode_tokens=2)
    try:
        ids = prompts(6, 10, 20, seed=5)
        decode_together(decode, len(ids))
        params = {"json_schema": json.dumps(SCHEMA), "temperature": 0, "max_new_tokens": 40}
        results = run_batch(prefill, decode, ids, params)
        assert decode.scheduler.num_retractions > 0
        want = engine.generate(input_ids=ids, sampling_params=params)
        assert [r[0]["output_ids"] for r in results] == [o["output_ids"] for o in want]
    finally:
        close_workers(prefill, decode)


def test_an_engine_abort_while_a_grammar_compiles_ends_the_request(engine, monkeypatch):
    """``async_generate`` compiles a grammar off the caller's loop; an ``abort`` of its rid that
    comes meanwhile ends the request with "abort" as soon as the compile returns (it never runs),
    as it would a waiting one's, rather than being missed and the request run to its end."""
    import asyncio

    compiling, go_on = hold_make_req(engine, monkeypatch)

    async def go():
        params = {"regex": REGEX, "temperature": 0, "max_new_tokens": 8}
        running = asyncio.ensure_future(engine.async_generate(prompt="x", sampling_params=params, rid="compiling"))
        await asyncio.to_thread(compiling.wait, 30)
        assert engine.abort("compiling")
        go_on.set()
        return await running

    out = asyncio.run(go())
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"] == []
    assert not engine.abort("compiling")  # (nothing of it is left to abort)
    engine.check_integrity()


def test_the_grammar_cache_is_held_to_its_bytes_and_count(model_path):
    """Compiled grammars are kept by recency within a count and a byte budget (a JSON schema
    over a large vocabulary is megabytes); a hit moves a grammar to the back."""
    from actors.engine.grammar import GrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    specs = [f"(a|b){{{i}}}" for i in range(1, 6)]
    one = GrammarBackend(tokenizer, model_path, 261).compile("regex", specs[0]).memory_size_bytes
    backend = GrammarBackend(tokenizer, model_path, 261, cache_size=4, cache_bytes=int(2.5 * one))
    first = backend.compile("regex", specs[0])
    backend.compile("regex", specs[1])
    assert backend.compile("regex", specs[0]) is first  # a hit: now the newest
    backend.compile("regex", specs[2])  # over the bytes: the oldest (specs[1]) goes
    assert [spec for _, spec in backend._cache] == [specs[0], specs[2]]
    assert backend.cached_bytes == sum(g.memory_size_bytes for g in backend._cache.values())
    roomy = GrammarBackend(tokenizer, model_path, 261, cache_size=2)
    for spec in specs:
        roomy.compile("regex", spec)
    assert [spec for _, spec in roomy._cache] == specs[-2:]  # the count holds too


# ---- a grammar held back until the thinking's end (grammar_after) ------------------------------------
THINKING = "hm, {x}</think>"  # a JSON schema's grammar refuses its first byte: only a free thinking writes it
AFTER = {"json_schema": json.dumps(SCHEMA), "grammar_after": "</think>", "temperature": 0, "max_new_tokens": 64}


def thinking_script(tokenizer, text: str = THINKING):
    """``forced_tokens``' script: a held-back grammar's request thinks ``text`` first; others are the model's."""
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return lambda req: tokens if req.sampling_params.grammar_after is not None else []


def forced_run(model_path, script, ids, params, **engine_args):
    """The outputs of a new engine (``engine_args``) whose requests ``script`` forces; idle after, checked."""
    eng = Engine(model_path=model_path, **NO_WHITESPACE, **engine_args)
    try:
        with forced_tokens(eng.scheduler, script):
            outs = eng.generate(input_ids=ids, sampling_params=params)
        eng.check_integrity()
        return outs
    finally:
        eng.shutdown()


def test_a_held_back_grammar_takes_the_tokens_after_the_one_that_completes_its_tag(engine):
    """While the output thinks nothing is masked or accepted, whatever the tokens (EOS and text
    the grammar refuses included); the tag is found however its bytes fall into tokens, broken
    or repeated starts included; the token that completes it is the thinking's, text it holds
    past the tag too; the matcher takes every token after it."""
    backend, eos = engine.scheduler.grammars, engine.eos_token_ids
    backend.compile("regex", REGEX)
    pieces = backend._token_bytes + [b"</th", b"ink>", b"ink>x{", b"inx"]  # (ids past the vocabulary: fake tokens)
    cases = [([b"a", b"<", b"<", b"/", b"t", b"h", b"i", b"n", b"k", b">"], 10),
             ([b"</th", b"ink>"], 2), ([b"</th", b"ink>x{"], 2), ([b"</th", b"inx", b"</th", b"ink>"], 4),
             ([b"</th", b"inx", b"k", b">", b"</th", b"ink>"], 6)]
    for thinking, closed_at in cases:
        grammar = ReasonerGrammar(backend.matcher(SamplingParams(regex=REGEX), eos), b"</think>", pieces)
        for i, piece in enumerate(thinking):
            assert active_matcher(grammar) is None and not grammar.is_terminated()
            assert grammar.accept_token(pieces.index(piece))
            assert (active_matcher(grammar) is grammar.matcher) is (i + 1 >= closed_at), (thinking, i)
        for token in engine.tokenizer.encode("cat-12", add_special_tokens=False) + eos:
            assert grammar.accept_token(token)  # (the regex from its start: "x{" was not its)
        assert grammar.is_terminated()
    grammar = ReasonerGrammar(backend.matcher(SamplingParams(regex=REGEX), eos), b"</think>", pieces)
    assert grammar.accept_token(eos[0]) and not grammar.is_terminated()  # (EOS ends a thinking as a free token)
    assert all(grammar.accept_token(pieces.index(p)) for p in [b"x", b"</th", b"ink>"])
    assert not grammar.accept_token(pieces.index(b"<"))  # a second tag is the answer's: the regex refuses it
    with pytest.raises(ValueError, match="grammar_after: needs a grammar"):
        SamplingParams(grammar_after="</think>")


def test_a_grammar_after_the_thinking_leaves_it_free_and_constrains_the_answer(engine):
    """The thinking (forced: a text the schema's grammar refuses) is written unmasked; the answer
    after the tag follows the schema, token for token what the grammar from its start writes
    after a prompt that ends with that thinking."""
    thinking = engine.tokenizer.encode(THINKING, add_special_tokens=False)
    ids = [engine.tokenizer.encode(t) for t in TEXTS[:3]]
    with forced_tokens(engine.scheduler, thinking_script(engine.tokenizer)):
        outs = engine.generate(input_ids=ids, sampling_params=AFTER)
    plain = {k: v for k, v in AFTER.items() if k != "grammar_after"}
    answers = engine.generate(input_ids=[p + thinking for p in ids], sampling_params=plain)
    for out, answer in zip(outs, answers):
        assert out["output_ids"] == thinking + answer["output_ids"]
        assert out["text"].startswith(THINKING) and follows("json_schema", out["text"][len(THINKING):]), out
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": engine.eos_token_ids[0]}, out
    engine.check_integrity()


@pytest.mark.parametrize("thought,phase", [("", "answer"), ("x" * 20, "thinking")])
def test_a_held_back_grammar_survives_retraction_mid_thinking_and_mid_answer(engine, model_path, monkeypatch,
                                                                             thought, phase):
    """A pool too small for the batch retracts a request at its 30th token, while it answers or,
    with a longer thinking, while it thinks: the recomputed outputs equal an unretracted run's
    (the grammar's state is kept with the output)."""
    ids = prompts(6, 8, 12, seed=5)
    long = dict(AFTER, max_new_tokens=40)
    script = thinking_script(engine.tokenizer, thought + THINKING)
    phases = set()
    retract = Req.reset_for_retract

    def recorded(req):
        phases.add("answer" if active_matcher(req.grammar) is not None else "thinking")
        retract(req)

    monkeypatch.setattr(Req, "reset_for_retract", recorded)
    retracted = forced_run(model_path, script, ids, long, max_total_tokens=160, max_running_requests=6,
                           chunked_prefill_size=-1)
    assert phases == {phase}
    with forced_tokens(engine.scheduler, script):
        unretracted = engine.generate(input_ids=ids, sampling_params=long)
    assert [o["output_ids"] for o in retracted] == [o["output_ids"] for o in unretracted]


def test_pd_holds_the_grammar_back_on_both_sides(engine, model_path):
    """The prefill worker samples the first token unmasked (the thinking's), the decode worker's
    grammar takes it as thinking and goes on: tokens equal the single engine's; a one-byte tag
    closes the thinking at the first token, the hand-off's, too."""
    ids = [engine.tokenizer.encode(t) for t in TEXTS[:3]]
    cases = [(AFTER, THINKING), (dict(AFTER, grammar_after="}"), "}")]
    want = {}
    for params, text in cases:
        with forced_tokens(engine.scheduler, thinking_script(engine.tokenizer, text)):
            want[text] = [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=params)]
    prefill, decode = make_pair(model_path, page_size=4, prefill_args=NO_WHITESPACE, decode_args=NO_WHITESPACE)
    try:
        for params, text in cases:
            script = thinking_script(engine.tokenizer, text)
            with forced_tokens(prefill.scheduler, script), forced_tokens(decode.scheduler, script):
                results = run_batch(prefill, decode, ids, params)
            assert [final["output_ids"] for final, _, _ in results] == want[text]
            assert [notice["first_token"] for _, notice, _ in results] == [ord(text[0]) + 5] * len(ids)
    finally:
        close_workers(prefill, decode)


# ---- structural tags (vLLM's response_format structural_tag) --------------------------------------------
TAG_SCHEMA = {"enum": [17, 28, 39, "cat"]}
TAGS = {"structures": {"type": "structural_tag", "triggers": ["<f"],
                       "structures": [{"begin": "<f>", "schema": TAG_SCHEMA, "end": "</f>"}]},
        "format": {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
            {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": TAG_SCHEMA},
             "end": "</f>"}]}}}


def tagged_contents(text: str, after: str):
    """The contents of the structures written after ``after`` (each between ``<f>`` and ``</f>``), as JSON."""
    assert text.startswith(after), text
    return [json.loads(content) for content in re.findall(r"<f>(.*?)</f>", text[len(after):], re.S)]


@pytest.mark.parametrize("shape", list(TAGS))
def test_a_structural_tag_constrains_the_structure_its_trigger_starts(engine, shape):
    """vLLM's two shapes (``structures`` + ``triggers``; xgrammar's ``format``): the output is free
    until its trigger (forced: free text, then ``<f``), then goes on with the tag's begin, content
    its schema accepts and its end; the same forced text without the tag goes on otherwise. With
    ``grammar_after`` (a reasoning chat's) a trigger in the thinking is free: the thinking forced
    through it (the tag's grammar refuses its next byte, which would leave no token) and the tag
    still constrains the answer after it."""
    params = {"structural_tag": json.dumps(TAGS[shape]), "temperature": 0, "max_new_tokens": 24}
    ids = [engine.tokenizer.encode(t) for t in TEXTS[:3]]
    forced = "ab <f"
    with forced_tokens(engine.scheduler, lambda req: engine.tokenizer.encode(forced, add_special_tokens=False)):
        outs = engine.generate(input_ids=ids, sampling_params=params)
        free = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 24})
    for out, unconstrained in zip(outs, free):
        contents = tagged_contents(out["text"], forced[:-2])
        assert contents and all(c in TAG_SCHEMA["enum"] for c in contents), out["text"]
        assert not tagged_contents(unconstrained["text"], forced[:-2]), unconstrained["text"]
    thinking = "<fx hm</think>"
    script = thinking_script(engine.tokenizer, thinking + forced)
    with forced_tokens(engine.scheduler, script):
        outs = engine.generate(input_ids=ids, sampling_params={**params, "grammar_after": "</think>",
                                                               "max_new_tokens": 40})
    for out in outs:
        contents = tagged_contents(out["text"], thinking + forced[:-2])
        assert contents and all(c in TAG_SCHEMA["enum"] for c in contents), out["text"]
    engine.check_integrity()


@pytest.mark.parametrize("tag,match", [
    ({"type": "structural_tag", "structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<f"]},
     r"structural_tag\n.*structures\[0\]: needs begin and end \(texts\) and schema"),
    ({"type": "structural_tag"}, r"structural_tag\n.*is \{\"type\": \"structural_tag\", \"format\""),
    ({"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<g"]},
     "structural_tag: the structural tag does not compile: .*does not match any trigger"),
])
def test_a_bad_structural_tag_is_refused_naming_its_field(engine, tag, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(input_ids=[5, 6], sampling_params={"structural_tag": json.dumps(tag)})
    engine.check_integrity()
