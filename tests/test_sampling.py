"""Sampling: seeds reproduce, stop conditions cut where they should, penalties follow their definitions."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from actors.engine.sampling import apply_penalties, filter_probs, make_generator, sample_next
from actors.engine.sampling_params import SamplingParams


def test_penalties_change_logits_as_defined():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    p = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits, p, prompt_ids=[0], output_ids=[1])
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0]  # seen: positive /2, negative *2; unseen untouched
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, p, prompt_ids=[3], output_ids=[2, 2, 0])
    assert out.tolist() == [2.0 - 0.5 - 0.25, -1.0, 0.5 - 1.0 - 0.25, 3.0]  # prompt tokens not counted
    assert apply_penalties(logits, SamplingParams(), [0], [1]) is logits


def test_top_k_top_p_min_p_filters():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert filter_probs(probs, SamplingParams(top_k=2)).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    for disabled in (0, -1):  # vLLM's two ways to say "all tokens"
        params = SamplingParams(top_k=disabled)
        assert params.top_k == -1 and not params.is_greedy
        assert filter_probs(probs, params).tolist() == pytest.approx(probs.tolist())
    assert filter_probs(probs, SamplingParams(top_p=0.7)).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    assert filter_probs(probs, SamplingParams(top_p=0.81)).tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    assert filter_probs(probs, SamplingParams(min_p=0.5)).tolist() == pytest.approx([0.625, 0.375, 0, 0])


def test_seed_makes_sampling_reproducible():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=1234)

    def draw(seed_params):
        gen = make_generator(seed_params.seed)
        return [sample_next(logits, seed_params, [], [], gen)[0] for _ in range(20)]

    assert draw(params) == draw(params)
    assert draw(params) != draw(SamplingParams(temperature=1.0, seed=99))
    greedy, logprobs = sample_next(logits, SamplingParams(temperature=0, return_logprob=True), [], [],
                                   make_generator(None))
    assert greedy == int(logits.argmax()) and math.isclose(float(logprobs.exp().sum()), 1.0, rel_tol=1e-5)
    assert sample_next(logits, SamplingParams(temperature=0), [], [], make_generator(None))[1] is None


def test_bad_sampling_params_name_the_field():
    with pytest.raises(ValueError, match="top_k\n.*or -1 or 0 to disable top-k"):
        SamplingParams(top_k=-2)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="unknown_field"):
        SamplingParams(unknown_field=1)
    assert SamplingParams(stop="###").stop == ["###"]


def test_logprobs_are_the_raw_models_not_the_penalised_ones():
    """OpenAI / vLLM: a token's logprob is that of the model's own distribution (log-softmax of
    the raw logits), whatever penalties and temperature did to the choice."""
    logits = torch.tensor([3.0, 2.0, 1.0, -1.0])
    raw = torch.log_softmax(logits, dim=-1)
    for params in (SamplingParams(temperature=0, return_logprob=True, repetition_penalty=2.0),
                   SamplingParams(temperature=0, return_logprob=True, frequency_penalty=2.0, presence_penalty=2.0),
                   SamplingParams(temperature=0.5, return_logprob=True, presence_penalty=1.5, seed=3)):
        token, logprobs = sample_next(logits, params, [0], [0, 0], make_generator(params.seed))
        assert torch.allclose(logprobs, raw)
    # the penalised choice is still the penalised argmax (token 1), with its raw logprob
    token, logprobs = sample_next(logits, SamplingParams(temperature=0, return_logprob=True, frequency_penalty=2.0),
                                  [], [0], make_generator(None))
    assert token == 1 and math.isclose(float(logprobs[token]), float(raw[1]), rel_tol=1e-6)


def test_top_k_keeps_exactly_k_tokens_even_when_probabilities_tie():
    probs = torch.tensor([0.4, 0.2, 0.2, 0.2])
    kept = filter_probs(probs, SamplingParams(top_k=2))
    assert int((kept > 0).sum()) == 2 and kept[0] == pytest.approx(0.4 / 0.6)
    assert float(kept.sum()) == pytest.approx(1.0)


def test_an_empty_stop_string_is_refused():
    """Every text contains "": it would end every request at its first token with no text."""
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="")


def test_a_near_zero_temperature_is_greedy_not_a_failed_step():
    """logits / 1e-40 overflow to inf (NaN probabilities: multinomial raises, failing every request
    of the batch); below SGLang's epsilon a temperature means greedy."""
    logits = torch.tensor([3.0, 2.0, 1.0, -1.0, 2.5])
    for temperature in (1e-40, 1e-7):
        params = SamplingParams(temperature=temperature, seed=0)
        assert params.is_greedy
        assert sample_next(logits, params, [], [], make_generator(0))[0] == 0


def _byte_tokenizer():
    from transformers import PreTrainedTokenizerFast

    from actors.engine.tokenizer import BOS, EOS, PAD, build_byte_tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=build_byte_tokenizer(), bos_token=BOS, eos_token=EOS, pad_token=PAD)


def _generate(req, tokenizer, tokens, context_len=1000):
    from actors.engine.finish import check_finished, stream_text

    for token in tokens:
        req.output_ids.append(token)
        stream_text(req, tokenizer)
        check_finished(req, tokenizer, context_len)
        if req.finished:
            break


def test_a_matched_stop_token_is_kept_in_output_ids_but_not_in_the_text():
    """SGLang trims the matched stop token before detokenizing, vLLM cuts its text: a stop
    token id (or EOS shown with skip_special_tokens=False) never ends up in the text."""
    from actors.engine.req import Req
    from actors.engine.tokenizer import EOS_ID

    tok = _byte_tokenizer()
    ids = [5 + b for b in b"hello!"]
    req = Req("r", [5 + ord("q")], SamplingParams(stop_token_ids=[5 + ord("!")]), eos_token_ids=[EOS_ID])
    _generate(req, tok, ids)
    assert req.finished_reason == {"type": "stop", "matched": 5 + ord("!")}
    assert req.output_ids == ids and req.output_text == "hello"
    req = Req("r", [5 + ord("q")], SamplingParams(skip_special_tokens=False), eos_token_ids=[EOS_ID])
    _generate(req, tok, [5 + ord("h"), 5 + ord("i"), EOS_ID])
    assert req.finished_reason == {"type": "stop", "matched": EOS_ID} and req.output_text == "hi"


def _metaspace_tokenizer():
    """A SentencePiece-style (Metaspace) word-level tokenizer: ids 2..5 are ▁The ▁quick ▁fox ▁jumps."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "▁The": 2, "▁quick": 3, "▁fox": 4, "▁jumps": 5}
    sp = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    sp.pre_tokenizer, sp.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=sp, eos_token="</s>", unk_token="<unk>")


def test_output_text_keeps_the_leading_space_the_prompt_context_gives_it():
    """A SentencePiece-style tokenizer drops the leading space of the first token it decodes:
    decoded on their own the output tokens '▁fox' read 'fox', not the ' fox' that follows the
    prompt. The text is the difference of decoding with and without them after the prompt's tail
    (SGLang's surr_offset / read_offset)."""
    from actors.engine.req import Req

    tok = _metaspace_tokenizer()
    req = Req("r", [2, 3], SamplingParams(stop=[" ju"]), eos_token_ids=[1])
    _generate(req, tok, [4])
    assert req.output_text == " fox" and not req.finished
    _generate(req, tok, [5])  # the stop string spans the boundary of two tokens' text
    assert req.output_text == " fox" and req.finished_reason == {"type": "stop", "matched": " ju"}
    # byte-level text is unchanged, a character split over two tokens included
    req = Req("r", [5 + ord("a")], SamplingParams(max_new_tokens=3))
    _generate(req, _byte_tokenizer(), [5 + b for b in "é!".encode()], context_len=1000)
    assert req.output_text == "é!" and req.finished_reason == {"type": "length", "length": 3}


def test_the_server_decodes_like_the_engine_for_workers_without_a_tokenizer():
    """Workers that skip the tokenizer send ids only: the server's text is the engine's — after
    the prompt's tail (' fox', not 'fox'), a matched stop token left out."""
    from cluster.streaming import TextDelta

    tok = _metaspace_tokenizer()
    delta = TextDelta(tok, prompt_ids=[2, 3])
    assert delta.update({"output_ids": [4], "meta_info": {"finish_reason": None}}, False) == " fox"
    end = {"output_ids": [4, 5, 1], "meta_info": {"finish_reason": {"type": "stop", "matched": 1}}}
    assert delta.update(end, True) == " jumps" and delta.sent == " fox jumps"
    kept = TextDelta(tok, skip_special_tokens=False, prompt_ids=[2, 3])  # the stop token's text too is left out
    assert kept.update(end, True) == " fox jumps"


def _byte_ids(pieces):
    """Byte-level ids (5 + byte) of text pieces; an int piece is a special token id (0-4)."""
    return [t for p in pieces for t in ([p] if isinstance(p, int) else [5 + b for b in p.encode()])]


_pieces = st.lists(st.one_of(st.text(alphabet="aZ é€😀\n", max_size=3), st.integers(0, 4)), max_size=10)


@settings(max_examples=80, deadline=None)
@given(prompt=_pieces, output=_pieces.filter(bool), cut=st.integers(0, 3), skip=st.booleans(),
       metaspace=st.booleans())
def test_incremental_text_equals_decoding_the_whole_output_after_the_prompt(prompt, output, cut, skip, metaspace):
    """After every step the text decoded a few tokens at a time is the whole output decoded after
    the prompt's tail: byte-level ids whose characters (up to 4 bytes) are split over tokens, a
    prompt that ends inside one (``cut`` bytes dropped from its end), special tokens skipped or
    not, and a SentencePiece-style decoder that drops a leading space."""
    from actors.engine.finish import IncrementalText, decode_after

    tok = _metaspace_tokenizer() if metaspace else _byte_tokenizer()
    prompt, output = _byte_ids(prompt), _byte_ids(output)
    prompt = prompt[: max(len(prompt) - cut, 0)]
    if metaspace:
        prompt, output = [t % 6 for t in prompt], [t % 6 for t in output]
    if not output:
        return
    text = IncrementalText(tok, prompt, skip)
    for n in range(1, len(output) + 1):
        assert text.update(tok, output, n) == decode_after(tok, prompt, output[:n], skip)


def test_a_seed_outside_int64_names_the_field():
    """A seed past int64 reached the torch generator: "Overflow when unpacking long long"."""
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2 ** 64)
    assert make_generator(SamplingParams(seed=-2 ** 63).seed).initial_seed() == 2 ** 63  # (torch's uint64 view)
    assert make_generator(SamplingParams(seed=2 ** 63 + 3).seed).initial_seed() == 2 ** 63 + 3  # int64 max + choice 4


# ---- logit_bias and min_new_tokens (vLLM's min_tokens) ---------------------------------------------
def _biased_and_masked(row: torch.Tensor, params: SamplingParams, masked) -> torch.Tensor:
    """The brute-force reference of one row: each bias added, then each masked id in the vocabulary -inf."""
    row = row.clone().float()
    for token, bias in (params.logit_bias or {}).items():
        if token < row.shape[0]:
            row[token] += bias
    for token in masked:
        if 0 <= token < row.shape[0]:
            row[token] = float("-inf")
    return row


def test_logit_adjustments_equal_a_per_row_reference_and_greedy_takes_the_biased_token():
    from actors.engine.sampling import logit_adjustments

    vocab = 50
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0, logit_bias={"7": 100.0, 3: -2.5, 60: 5.0}),  # 60: past the vocabulary
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=[4, 99], logit_bias={4: 100.0}),
              SamplingParams(temperature=0, return_logprob=True, logit_bias={11: 100.0}),
              SamplingParams(temperature=0.7, seed=3, logit_bias={13: 100.0}, min_new_tokens=1)]
    masked = [p.masked_token_ids(1, eos_token_ids=[2]) for p in params]
    assert masked == [[], [], [2, 4, 99], [], []]  # row 4 has its one token: nothing is masked any more
    assert logit_adjustments([SamplingParams(), SamplingParams(min_new_tokens=1)], [[], []], vocab) is None
    adjust = logit_adjustments(params, masked, vocab)
    reference = torch.stack([_biased_and_masked(logits[i], p, m) for i, (p, m) in enumerate(zip(params, masked))])
    assert torch.equal(logits + adjust, reference)
    # row 2: its stop token and EOS are masked although token 4 got +100: the argmax is another one
    greedy = {row: int(reference[row].argmax()) for row in range(3)}
    assert greedy[0] == 7 and greedy[1] == int(logits[1].argmax()) and greedy[2] not in (2, 4)
    for row in range(len(params)):
        token, logprobs = sample_next(logits[row], params[row], [1], [1], make_generator(params[row].seed), adjust[row])
        assert token == {0: 7, 1: greedy[1], 2: greedy[2], 3: 11, 4: 13}[row]
    _, logprobs = sample_next(logits[3], params[3], [1], [1], make_generator(None), adjust[3])
    assert torch.allclose(logprobs, torch.log_softmax(logits[3], dim=-1))  # the raw model's, not the biased


def test_logit_bias_comes_before_the_penalties_as_in_vllm():
    """vLLM applies logit_bias (and the min-tokens mask) before the penalties: with token 1 seen,
    (-1 + 4.5) / 2 = 1.75 loses to 2.0; the penalty first (-1 * 2 + 4.5 = 2.5) would win."""
    from actors.engine.sampling import logit_adjustments

    logits = torch.tensor([2.0, -1.0, 0.0])
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={1: 4.5})
    adjust = logit_adjustments([params], [[]], 3)
    assert sample_next(logits, params, [1], [], make_generator(None), adjust[0])[0] == 0
    assert sample_next(logits, params.model_copy(update={"repetition_penalty": 1.0}), [1], [],
                       make_generator(None), adjust[0])[0] == 1


def test_a_sampled_row_never_draws_a_masked_token():
    from actors.engine.sampling import logit_adjustments

    logits = torch.zeros(6)  # uniform: every token as likely
    params = SamplingParams(temperature=1.0, seed=0, min_new_tokens=3, stop_token_ids=[1, 2])
    gen = make_generator(0)
    draws = set()
    for _ in range(60):
        adjust = logit_adjustments([params], [params.masked_token_ids(0, [5])], 6)
        draws.add(sample_next(logits, params, [], [], gen, adjust[0])[0])
    assert draws == {0, 3, 4}


def test_min_new_tokens_holds_off_stop_strings_in_the_text_of_its_first_tokens():
    """vLLM (min_tokens): a stop string is looked for only in the text of the tokens after the
    first ``min_new_tokens`` (one may begin inside that text and end after it); an earlier one
    never ends the output, then or later."""
    from actors.engine.req import Req

    tok = _byte_tokenizer()
    ids = _byte_ids(["hello there"])
    for min_new, stop, text in [(0, "e", "h"), (5, "e", "hello th"), (4, "lo ", "hel"), (2, "he", "hello t")]:
        req = Req("r", _byte_ids(["q"]), SamplingParams(stop=[stop], min_new_tokens=min_new, max_new_tokens=40))
        _generate(req, tok, ids)
        assert req.finished_reason == {"type": "stop", "matched": stop} and req.output_text == text, (min_new, stop)


def test_bad_logit_bias_and_min_new_tokens_name_the_field():
    assert SamplingParams(logit_bias={"42": 1, 7: -100}).logit_bias == {42: 1.0, 7: -100.0}  # JSON's string ids
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bias, reason in [({"x": 1}, "'x' is not an integer"), ({5.5: 1}, "5.5 is not an integer"),
                         ({"-1": 1}, "-1 is negative"), ({"5": 100.5}, r"in \[-100, 100\]"),
                         ({"5": float("nan")}, r"in \[-100, 100\]")]:
        with pytest.raises(ValueError, match=f"logit_bias\n.*{reason}"):
            SamplingParams(logit_bias=bias)
    with pytest.raises(ValueError, match="min_new_tokens: 5 is more than max_new_tokens"):
        SamplingParams(min_new_tokens=5, max_new_tokens=4)
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(min_new_tokens=-1)
