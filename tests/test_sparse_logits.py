"""The sparse per-step adjustments (allowed ids, bias, min-tokens and bad-words masks, penalties
from per-request state) against the dense definitions, bit for bit, and the batched pick against
sample_next."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine.sampling import apply_penalties, logit_adjustments, make_generator, pick_tokens, sample_next
from actors.engine.sampling_params import SamplingParams, bad_word_bans
from actors.engine.sparse_logits import LogitState, TokenCounts, adjust_logits

VOCAB = 12
EOS = [2, 40]  # 40: outside the vocabulary (skipped, as a padded tokenizer's id would be)
token = st.integers(0, VOCAB + 2)  # a few ids past the vocabulary too
penalty = st.sampled_from([0.0, 0.0, -1.5, 0.5, 2.0])

params_strategy = st.builds(
    lambda bias, min_new, stops, f, p, rep, temperature, logprob, allowed: SamplingParams(
        logit_bias=bias or None, min_new_tokens=min_new, max_new_tokens=8, stop_token_ids=stops,
        frequency_penalty=f, presence_penalty=p, repetition_penalty=rep, temperature=temperature,
        return_logprob=logprob, seed=7, allowed_token_ids=allowed),
    st.dictionaries(token, st.sampled_from([-100.0, -2.5, 0.75, 3.0, 100.0]), max_size=4),
    st.integers(0, 3), st.lists(token, max_size=3), penalty, penalty, st.sampled_from([1.0, 1.0, 0.5, 1.3, 2.0]),
    st.sampled_from([0.0, 0.7]), st.booleans(),
    st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)))
# bad words as token ids (what bad_words_token_ids gives), from a small alphabet: their prefixes match often
bad_words_ids = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=3), max_size=3)


def _with_bad_words(params, prompt, steps, words):
    """A request whose params name one (stand-in) bad word per entry of ``words``, their token ids."""
    return params.model_copy(update={"bad_words": ["w"] * len(words)}), prompt, steps, words


request = st.builds(_with_bad_words, params_strategy, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
                    st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=3), min_size=1, max_size=4), bad_words_ids)


def _dense_reference(logits, params, prompts, outputs, words):
    """The definitions: one dense adjustment tensor, then each row's penalties from its id lists."""
    masked = [p.masked_token_ids(len(out), EOS) + bad_word_bans(w, out) for p, out, w in zip(params, outputs, words)]
    adjust = logit_adjustments(params, masked, logits.shape[-1])
    adjusted = logits.float() if adjust is None else logits.float() + adjust
    return torch.stack([apply_penalties(adjusted[i], p, prompts[i], outputs[i]) for i, p in enumerate(params)])


@settings(max_examples=60, deadline=None)
@given(st.lists(request, min_size=1, max_size=5), st.integers(0, 2 ** 31))
def test_sparse_adjustments_equal_the_dense_definitions_bit_for_bit_step_after_step(reqs, seed):
    """Each request's state is built once and takes its new output tokens step by step (one step
    shrinks an output, as a recount); every step's logits equal the dense reference's exactly."""
    gen = torch.Generator().manual_seed(seed)
    states = [LogitState(p, prompt, EOS, VOCAB, words) if LogitState.needed(p) else None
              for p, prompt, _, words in reqs]
    outputs = [[] for _ in reqs]
    num_steps = max(len(steps) for _, _, steps, _ in reqs)
    for step in range(num_steps + 1):
        logits = torch.randn(len(reqs), VOCAB, generator=gen) * 4
        for state, out in zip(states, outputs):
            if state is not None:
                state.sync(out)
        got = adjust_logits(logits, states)
        want = _dense_reference(logits, [r[0] for r in reqs], [r[1] for r in reqs], outputs, [r[3] for r in reqs])
        assert torch.equal(got, want), (step, got, want)
        for (_, _, steps, _), out in zip(reqs, outputs):
            if step < len(steps):
                out.extend(steps[step])
        if step == 1:
            del outputs[0][-2:]  # shorter than what the state took: it recounts


@settings(max_examples=40, deadline=None)
@given(request, st.lists(token, min_size=1, max_size=4), st.integers(0, 2 ** 31))
def test_a_state_ahead_by_draft_tokens_adjusts_as_one_synced_to_them(req, draft, seed):
    """A verify step's row after ``draft[:j]`` (:meth:`LogitState.ahead`, chained) adjusts as a
    state synced to the output with them; the state it came from is left as it was."""
    params, prompt, steps, words = req
    if not LogitState.needed(params):
        return
    output = [t for step in steps for t in step]
    state = LogitState(params, prompt, EOS, VOCAB, words)
    state.sync(output)
    logits = torch.randn(len(draft) + 1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    rows, ahead = [state], state
    for t in draft:
        ahead = ahead.ahead(t)
        rows.append(ahead)
    want = []
    for j in range(len(draft) + 1):
        fresh = LogitState(params, prompt, EOS, VOCAB, words)
        fresh.sync(output + draft[:j])
        want.append(adjust_logits(logits[j:j + 1], [fresh]))
    assert torch.equal(adjust_logits(logits, rows), torch.cat(want))
    assert torch.equal(adjust_logits(logits[:1], [state]), want[0]) and state.num_generated == len(output)


def test_a_batch_without_adjustments_keeps_its_logits_and_a_state_takes_only_new_tokens():
    logits = torch.randn(3, VOCAB, dtype=torch.bfloat16)
    plain = SamplingParams(temperature=0)
    assert not LogitState.needed(plain)
    assert adjust_logits(logits, [None, None, None]) is logits
    done = LogitState(SamplingParams(min_new_tokens=1), [1], EOS, VOCAB)
    done.sync([5])  # its one token is out: no mask any more, nothing to write
    assert adjust_logits(logits, [None, done, None]) is logits
    counts = TokenCounts([3, 3, 5])
    for _ in range(40):  # past the first buffer's 16 slots
        counts.add([len(counts) + 6])
    counts.add([3])
    assert counts.ids[:2].tolist() == [3, 5] and counts.counts[:2].tolist() == [3.0, 1.0] and len(counts) == 42


def test_pick_tokens_gives_what_sample_next_gives_row_by_row():
    """Greedy rows (penalised or not), sampled rows with their seeds, raw logprobs: the batch's
    picks equal sample_next's on the dense reference, row by row."""
    vocab = 40
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(3)) * 3
    params = [SamplingParams(temperature=0, repetition_penalty=1.7, frequency_penalty=0.5),
              SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=11, logit_bias={7: 3.0},
                             return_logprob=True, top_logprobs_num=3),
              SamplingParams(temperature=0, min_new_tokens=3, stop_token_ids=[9], logit_bias={9: 100.0}),
              SamplingParams(temperature=1.0, seed=4, presence_penalty=1.2),
              SamplingParams(temperature=0, return_logprob=True, top_logprobs_num=2)]
    prompts, outputs = [[1, 2, 3], [4], [5, 6], [7, 7], [8]], [[3, 3, 10], [], [11], [12, 7], []]
    states = [LogitState(p, prompt, EOS, vocab) if LogitState.needed(p) else None for p, prompt in zip(params, prompts)]
    for state, out in zip(states, outputs):
        if state is not None:
            state.sync(out)
    picked = pick_tokens(logits.clone(), params, [make_generator(p.seed) for p in params], states)
    masked = [p.masked_token_ids(len(out), EOS) for p, out in zip(params, outputs)]
    adjust = logit_adjustments(params, masked, vocab)
    for row, p in enumerate(params):
        want, want_logprobs = sample_next(logits[row], p, prompts[row], outputs[row], make_generator(p.seed), adjust[row])
        pick = picked[row]
        assert pick.token == want, row
        assert (pick.logprob is None) == (want_logprobs is None) == (not p.return_logprob)
        assert (pick.top_logprobs is None) == (not p.top_logprobs_num)
        if want_logprobs is not None:
            assert want_logprobs[want].item() == pick.logprob
            assert torch.equal(want_logprobs, torch.log_softmax(logits[row], -1))
        if pick.top_logprobs is not None:
            top = want_logprobs.topk(p.top_logprobs_num)
            assert pick.top_logprobs == list(zip(top.indices.tolist(), top.values.tolist()))
    assert picked[2].token != 9  # masked although biased up


@pytest.mark.parametrize("rows", [[0], [0, 1]])
def test_pick_tokens_of_a_single_plain_row_takes_the_raw_argmax(rows):
    logits = torch.randn(len(rows), VOCAB)
    params = [SamplingParams(temperature=0)] * len(rows)
    picked = pick_tokens(logits, params, [make_generator(0)] * len(rows), [None] * len(rows))
    assert [p.token for p in picked] == logits.argmax(-1).tolist()
