"""vLLM's ``allowed_token_ids`` and ``bad_words`` on an in-process engine (the tiny llama and its
byte-level tokenizer, one token a byte): greedy equals HF's greedy under the same restriction
(``prefix_allowed_tokens_fn``, ``bad_words_ids``), logprobs stay the raw model's; a bad word's
tokens are found as vLLM finds them, a one-token word is never drawn, a longer one's last token
only after its others in the output; the same tokens after a retraction and through PD (the
prefill worker's first token included; TP=2 in tests.test_structured_output's TP test); bad values
are refused naming their field."""

import pytest
import torch

from actors.engine import Engine
from actors.engine.sampling_params import SamplingParams, bad_word_bans, bad_words_token_ids
from actors.engine.sparse_logits import LogitState
from actors.engine.tiny import build_tiny_checkpoint
from tests.parity import hf_model
from tests.pd_helpers import close_workers, make_pair, run_batch

TEXTS = ["The answer is", "Hello there", "Give me JSON:"]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(build_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama", seed=0))


@pytest.fixture(scope="module")
def engine(model_path):
    eng = Engine(model_path=model_path, max_total_tokens=4096)
    yield eng
    eng.shutdown()


def hf_greedy_under(model_path, prompt, max_new_tokens, **restriction):
    """HF's greedy continuation and raw logits (``output_logits``: before any processor) under
    ``restriction`` (``prefix_allowed_tokens_fn`` or ``bad_words_ids``, HF's own processors)."""
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model(model_path).generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True, **restriction)
    return out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits]


def ascii_text(tokens):
    """The text of byte tokens (ids 5.. are the bytes); asserted printable, so that it tokenizes back to them."""
    text = bytes(t - 5 for t in tokens).decode()
    assert text.isprintable(), tokens
    return text


def chosen_bad_words(plain):
    """From a greedy output: a printable token it writes (banned alone) and a printable pair it
    writes in a row, of two other tokens (banned as a two-token word)."""
    printable = [t for t in plain if 32 <= t - 5 < 127]
    single = printable[0]
    pair = next((a, b) for a, b in zip(plain, plain[1:])
                if single not in (a, b) and a != b and {a, b} <= set(printable))
    return single, pair


def retracted_outputs(model_path, ids, params):
    """The output ids of a batch on an engine whose pool is too small for it: requests are retracted
    mid-output (asserted) and recomputed; idle after, checked."""
    small = Engine(model_path=model_path, max_total_tokens=160, max_running_requests=6, chunked_prefill_size=-1)
    try:
        outs = small.generate(input_ids=ids, sampling_params=params)
        assert small.scheduler.num_retractions > 0
        small.check_integrity()
        return [o["output_ids"] for o in outs]
    finally:
        small.shutdown()


def test_bad_words_token_ids_take_the_spaced_form_only_when_it_is_another_token_of_the_same_length():
    class Words:  # a tokenizer whose leading space merges into some words' first token (a metaspace one's)
        vocab = {"cat": [1], " cat": [2], "dog house": [3, 4, 5], " dog house": [6, 4, 5], "xy": [7, 8],
                 " xy": [9, 7, 8], "z": [10], " z": [10], "#": []}

        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens
            return self.vocab[text]

    assert bad_words_token_ids(["cat", "  dog house", "xy", "z"], Words()) == [[1], [2], [3, 4, 5], [6, 4, 5],
                                                                            [7, 8], [10]]
    with pytest.raises(ValueError, match="bad_words: .#. has no tokens"):
        bad_words_token_ids(["#"], Words())


def test_a_longer_words_last_token_is_banned_only_after_its_others_in_the_output():
    words = [[7], [3, 4], [1, 2, 3]]
    assert bad_word_bans(words, []) == [7]
    assert bad_word_bans(words, [5, 3]) == [7, 4]
    assert bad_word_bans(words, [3, 5]) == [7]
    assert bad_word_bans(words, [1, 2]) == [7, 3]
    assert bad_word_bans(words, [9, 1, 2, 3]) == [7, 4]  # (3 ends the word [1, 2, 3]: its own last token, not banned)
    state = LogitState(SamplingParams(bad_words=["w"]), [3], [], 10, words)  # a prompt's 3 starts no word
    state.sync([])
    assert state.banned_ids().tolist() == [7]
    state.sync([1])
    assert state.banned_ids().tolist() == [7] and state.ahead(2).banned_ids().tolist() == [7, 3]
    state.sync([1, 2, 3])
    assert state.banned_ids().tolist() == [7, 4]
    state.sync([1])  # a shorter output (a recount): the tail is the output's again
    assert state.banned_ids().tolist() == [7]


def test_allowed_token_ids_restrict_every_token_and_greedy_equals_hfs_argmax_over_them(engine, model_path):
    """Allowed: the plain output's tokens but its first (greedy must take another there); each token
    is HF's argmax over the set, each logprob the raw model's (vLLM reads them before its mask);
    a sampled request beside it draws only allowed tokens too."""
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    plains = [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=GREEDY)]
    allowed = [sorted(set(p) - {p[0]}) for p in plains]
    params = [{**GREEDY, "allowed_token_ids": a, "return_logprob": True} for a in allowed]
    sampled = {**GREEDY, "temperature": 1.0, "seed": 3, "allowed_token_ids": allowed[0]}
    outs = engine.generate(input_ids=ids + ids[:1], sampling_params=params + [sampled])
    for prompt, out, keep in zip(ids, outs, allowed):
        want, logits = hf_greedy_under(model_path, prompt, GREEDY["max_new_tokens"],
                                       prefix_allowed_tokens_fn=lambda batch_id, sent, keep=keep: keep)
        assert out["output_ids"] == want and set(want) <= set(keep)
        raw = [float(torch.log_softmax(row.float(), -1)[t]) for row, t in zip(logits, want)]
        assert [v for v, _ in out["meta_info"]["output_token_logprobs"]] == pytest.approx(raw, abs=1e-4)
    assert outs[0]["output_ids"][0] != plains[0][0]
    assert set(outs[-1]["output_ids"]) <= set(allowed[0])
    engine.check_integrity()


def test_bad_words_are_never_written_and_greedy_equals_hf_under_the_same_bans(engine, model_path):
    """A printable token and a two-token word the plain greedy output writes: banned, neither is
    written, the tokens are HF's greedy with ``bad_words_ids`` (the prompts end with no word's first
    token, where HF's would look into the prompt); the pair's last token is still written after
    another token (banned only after the first)."""
    ids = engine.tokenizer.encode(TEXTS[0])
    plain = engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    single, (first, last) = chosen_bad_words(plain)
    words = [ascii_text([single]), ascii_text([first, last])]
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "bad_words": words})["output_ids"]
    want, _ = hf_greedy_under(model_path, ids, GREEDY["max_new_tokens"], bad_words_ids=[[single], [first, last]])
    assert out == want and out != plain
    assert single not in out and (first, last) not in set(zip(out, out[1:]))
    assert last in out[1:] and first in out, (out, first, last)  # each written, never the one after the other
    engine.check_integrity()


def test_a_retracted_request_keeps_its_allowed_ids_and_bad_words(engine, model_path):
    """A pool too small for the batch retracts requests mid-output: their bans are rebuilt from the
    output they keep, and the tokens equal the big engine's."""
    ids = [engine.tokenizer.encode(t) for t in TEXTS * 2]
    plain = engine.generate(input_ids=ids[0], sampling_params=GREEDY)["output_ids"]
    single, pair = chosen_bad_words(plain)
    params = [{**GREEDY, "max_new_tokens": 40, "bad_words": [ascii_text([single]), ascii_text(pair)]},
              {**GREEDY, "max_new_tokens": 40, "allowed_token_ids": sorted(set(plain))}]
    params = [params[i % 2] for i in range(len(ids))]
    want = engine.generate(input_ids=ids, sampling_params=params)
    assert retracted_outputs(model_path, ids, params) == [o["output_ids"] for o in want]


def test_pd_bans_the_prefill_workers_first_token_and_the_decode_worker_goes_on(engine, model_path):
    """The prefill worker samples the first token under the request's bans (the plain first token
    refused), the decode worker's state takes it from the notice: tokens equal the single engine's."""
    ids = [engine.tokenizer.encode(t) for t in ["x"] + TEXTS[:2]]
    plains = [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=GREEDY)]
    with_tokenizer = {"skip_tokenizer_init": False}
    prefill, decode = make_pair(model_path, page_size=4, prefill_args=with_tokenizer, decode_args=with_tokenizer)
    try:
        for params in ({**GREEDY, "bad_words": [ascii_text(plains[0][:1]), ascii_text(chosen_bad_words(plains[1])[1])]},
                       {**GREEDY, "allowed_token_ids": sorted(set(plains[0]) - {plains[0][0]})}):
            results = run_batch(prefill, decode, ids, params)
            want = engine.generate(input_ids=ids, sampling_params=params)
            for (final, notice, _), expected in zip(results, want):
                assert notice["first_token"] == expected["output_ids"][0]
                assert final["output_ids"] == expected["output_ids"]
            assert results[0][1]["first_token"] != plains[0][0]
    finally:
        close_workers(prefill, decode)


def test_bad_values_are_refused_naming_their_field(engine, model_path):
    ids = engine.tokenizer.encode("hi")
    for params, match in (({"allowed_token_ids": []}, "allowed_token_ids\n.*at least 1"),
                          ({"allowed_token_ids": [3, -1]}, "allowed_token_ids\n.*token id -1 is negative"),
                          ({"bad_words": ["ok", " "]}, "bad_words\n.*empty or blank")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**params)
    vocab = engine.runner.model_config.vocab_size
    with pytest.raises(ValueError, match=f"allowed_token_ids: token id {vocab} is out of the vocabulary"):
        engine.generate(input_ids=ids, sampling_params={"allowed_token_ids": [5, vocab]})
    bare = Engine(model_path=model_path, max_total_tokens=256, skip_tokenizer_init=True)
    try:
        with pytest.raises(ValueError, match="bad_words: need the tokenizer"):
            bare.generate(input_ids=ids, sampling_params={"bad_words": ["x"]})
        bare.check_integrity()
    finally:
        bare.shutdown()
    engine.check_integrity()
