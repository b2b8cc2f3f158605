"""The batched, on-device sampler (:func:`pick_tokens`): its filters against the per-row
definitions, its draws against the exact filtered distributions, seeds independent of the batch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine.req import Req
from actors.engine.sampling import exponential_race, filter_probs, filter_sorted_probs, make_generator, pick_tokens
from actors.engine.sampling_params import SamplingParams


def _filter_batch(probs, params, partial=False):
    """:func:`filter_sorted_probs` with ``params``' per-row tensors, as :func:`sample_rows` builds
    them; ``partial``: only the largest top-k of the batch sorted."""
    vocab = probs.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    return filter_sorted_probs(probs, torch.tensor(top_k), torch.tensor([p.top_p for p in params]),
                               torch.tensor([p.min_p for p in params]), max(top_k) if partial else None)


row_params = st.builds(lambda k, p, m: SamplingParams(top_k=k, top_p=p, min_p=m),
                       st.sampled_from([-1, 1, 2, 3, 5, 40]), st.sampled_from([1.0, 1.0, 0.3, 0.5, 0.9, 0.99]),
                       st.sampled_from([0.0, 0.0, 0.05, 0.3, 1.0]))


@settings(max_examples=60, deadline=None)
@given(st.lists(row_params, min_size=1, max_size=6), st.integers(1, 24), st.integers(0, 2 ** 31), st.floats(0.1, 6),
       st.booleans())
def test_batched_filters_equal_the_per_row_definition(params, vocab, seed, scale, partial):
    """Rows with different top-k (ties impossible here: continuous logits), top-p and min-p in
    one batch keep exactly the tokens filter_probs keeps row by row, with the same weights —
    whole rows sorted, or (``partial``) only the batch's largest top-k."""
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(seed)) * scale
    probs = torch.softmax(logits, dim=-1)
    got = _filter_batch(probs.clone(), params, partial)
    for row, p in enumerate(params):
        want = filter_probs(probs[row], p)
        assert torch.equal(got[row] > 0, want > 0), (row, p)
        assert torch.allclose(got[row] / got[row].sum(), want, atol=1e-6)


def test_batched_top_k_keeps_exactly_k_tokens_even_when_probabilities_tie():
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25]])
    for partial in (False, True):
        kept = _filter_batch(probs.clone(), [SamplingParams(top_k=2), SamplingParams(top_k=3)], partial)
        assert (kept > 0).sum(-1).tolist() == [2, 3] and kept[0, 0] == 0.4


MIXED = [SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.0, top_p=0.8),
         SamplingParams(temperature=1.5, min_p=0.2), SamplingParams(temperature=1.2, top_k=5, top_p=0.9, min_p=0.1),
         SamplingParams(temperature=0)]


def _exact(logits, params):
    """The distribution a row's draws must follow: filter_probs of the tempered softmax (float64)."""
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).double()
    return filter_probs(torch.softmax(logits.double() / params.temperature, dim=-1), params)


@pytest.mark.parametrize("seeded", [False, True])
def test_batched_draws_follow_the_exact_filtered_distribution(seeded):
    """800 draws of each of five parameter sets, all in one interleaved batch of 4,000 rows
    (each row its own seed, or the batch generator): every token drawn is one the filters keep,
    and each set's counts pass a chi-square test against its exact distribution (df <= 7,
    threshold 30: p < 1e-4 for a correct sampler; a fixed seed makes it deterministic)."""
    vocab, draws = 8, 800
    base = torch.randn(len(MIXED), vocab, generator=torch.Generator().manual_seed(0)) * 1.5
    params = MIXED * draws
    logits = base.repeat(draws, 1)
    torch.manual_seed(1)
    gens = [make_generator(10_000 + i) if seeded else None for i in range(len(params))]
    tokens = torch.tensor([p.token for p in pick_tokens(logits, params, gens, [None] * len(params))])
    counts = torch.zeros(len(MIXED), vocab, dtype=torch.float64)
    counts.index_put_((torch.arange(len(params)) % len(MIXED), tokens), torch.ones(len(params), dtype=torch.float64),
                      accumulate=True)
    for i, p in enumerate(MIXED):
        exact = _exact(base[i], p)
        assert counts[i][exact == 0].sum() == 0, (p, counts[i], exact)
        expected = exact[exact > 0] * draws
        chi2 = float(((counts[i][exact > 0] - expected) ** 2 / expected).sum())
        assert chi2 < 30, (p, chi2, counts[i], exact)


def test_a_seed_gives_the_same_tokens_whatever_the_batch_and_its_place_in_it():
    """A seeded row's draws depend on its seed, parameters and logits only: alone, at another
    position among unseeded, greedy and other seeded rows, the same tokens step after step."""
    vocab, steps = 50, 12
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=77)
    logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(4))  # one row a step
    others = [SamplingParams(temperature=0.9), SamplingParams(temperature=0), SamplingParams(temperature=1.3, seed=5)]

    def run(position, companions, target=target):
        gen, other_gens = make_generator(target.seed), [make_generator(p.seed) if p.seed is not None else None
                                                        for p in companions]
        out = []
        for step in range(steps):
            params = companions[:position] + [target] + companions[position:]
            gens = other_gens[:position] + [gen] + other_gens[position:]
            batch = torch.randn(len(params), vocab)
            batch[position] = logits[step]
            out.append(pick_tokens(batch, params, gens, [None] * len(params))[position].token)
        return out

    alone = run(0, [])
    assert run(2, others) == alone and run(0, others[::-1]) == alone and run(1, others * 3) == alone
    assert run(0, []) == alone
    assert run(0, [], target.model_copy(update={"seed": 78})) != alone  # (equal by chance: negligible odds)


def test_a_requests_generator_is_made_from_its_seed_on_the_device_it_samples_on():
    seeded, plain = Req("a", [1], SamplingParams(seed=3)), Req("b", [1], SamplingParams())
    gen = seeded.generator_on(torch.device("cpu"))
    assert gen.initial_seed() == 3 and gen.device.type == "cpu" and seeded.generator_on("cpu") is gen
    assert plain.generator_on("cpu") is None


def test_a_zero_from_the_exponential_never_picks_a_filtered_out_token(monkeypatch):
    """q = 0 (an Exp(1) draw, -log(u), can round to 0) made 0 / 0 = NaN, which wins torch's
    argmax: a token the filters removed was picked."""
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *args, **kwargs: self.fill_(1.0))
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0]])
    tokens = exponential_race(probs, [None, make_generator(0)]).tolist()
    assert tokens[0] in (1, 2) and tokens[1] == 3
