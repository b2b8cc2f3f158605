"""The batched, on-device sampler (:func:`pick_tokens`): its filters against the per-row
definitions, its draws against the exact filtered distributions, seeds independent of the batch."""

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine import sampling
from actors.engine.req import Req
from actors.engine.sampling import argmax_rows, exponential_race, filter_probs, filter_sorted_probs, make_generator, pick_tokens
from actors.engine.sampling_params import SamplingParams


def _filter_batch(probs, params, head=None):
    """:func:`filter_sorted_probs` with ``params``' per-row tensors, as :func:`sample_rows` builds
    them; ``head``: each row's largest ``head`` looked at first (None: whole rows sorted)."""
    vocab = probs.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    return filter_sorted_probs(probs, torch.tensor(top_k), torch.tensor([p.top_p for p in params]),
                               torch.tensor([p.min_p for p in params]), head)


row_params = st.builds(lambda k, p, m: SamplingParams(top_k=k, top_p=p, min_p=m),
                       st.sampled_from([-1, 1, 2, 3, 5, 40]), st.sampled_from([1.0, 1.0, 0.3, 0.5, 0.9, 0.99]),
                       st.sampled_from([0.0, 0.0, 0.05, 0.3, 1.0]))


@settings(max_examples=60, deadline=None)
@given(st.lists(row_params, min_size=1, max_size=6), st.integers(1, 24), st.integers(0, 2 ** 31), st.floats(0.1, 6),
       st.sampled_from([None, 1, 2, 5]))
def test_batched_filters_equal_the_per_row_definition(params, vocab, seed, scale, head):
    """Rows with different top-k, top-p and min-p in one batch keep exactly the tokens
    filter_probs keeps row by row, with the same weights — whole rows sorted, or only the
    largest ``head`` first."""
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(seed)) * scale
    probs = torch.softmax(logits, dim=-1)
    got = _filter_batch(probs.clone(), params, head)
    for row, p in enumerate(params):
        want = filter_probs(probs[row], p)
        assert torch.equal(got[row] > 0, want > 0), (row, p)
        assert torch.allclose(got[row] / got[row].sum(), want, atol=1e-6)


def test_a_tie_at_a_cut_keeps_exactly_the_lowest_ids():
    """Top-k keeps exactly k and top-p the smallest prefix, ties or not: of equal probabilities
    at the cut, the lowest ids stay — in filter_probs, whole rows sorted, and from a head that
    sees only some of the tied tokens."""
    probs = torch.tensor([[0.2, 0.4, 0.2, 0.2, 0, 0, 0, 0], [0.125] * 8, [0.05, 0.1, 0.3, 0.1, 0.1, 0.1, 0.1, 0.15]])
    params = [SamplingParams(top_k=2), SamplingParams(top_k=3), SamplingParams(top_p=0.6)]
    want = [[0, 1], [0, 1, 2], [1, 2, 3, 7]]  # row 2: 0.3, 0.15, then two of the five 0.1s reach 0.6
    for head in (None, 2, 3, 5):
        kept = _filter_batch(probs.clone(), params, head)
        assert [row.nonzero()[:, 0].tolist() for row in kept] == want, head
    assert [filter_probs(row, p).nonzero()[:, 0].tolist() for row, p in zip(probs, params)] == want



@pytest.mark.parametrize("head", [None, 2])
def test_a_row_of_overflowed_logits_is_left_as_it_is_and_fails_no_other(head):
    """A row whose logits overflowed (an inf: its softmax is NaN) keeps no probability above 0.
    The filters leave it as it is, as the whole sort did, and filter the other rows as ever: the
    cut read position -1 of its kept ones, an index out of range that failed the whole step (on
    CUDA a device-side assert, the process's end)."""
    logits = torch.tensor([[0.0, 1.0, float("inf"), 2.0], [0.0, 1.0, 2.0, 3.0]])
    probs = torch.softmax(logits, dim=-1)
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.9, min_p=0.1)]
    got = _filter_batch(probs.clone(), params, head)
    assert torch.isnan(got[0]).all()
    assert torch.allclose(got[1] / got[1].sum(), filter_probs(probs[1], params[1]), atol=1e-6)

drawn_params = st.builds(lambda k, p, m, t: SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m),
                         st.sampled_from([-1, -1, 2, 3, 40]), st.sampled_from([1.0, 0.3, 0.6, 0.9, 0.95, 0.99]),
                         st.sampled_from([0.0, 0.0, 0.02, 0.3]), st.sampled_from([0.5, 1.0, 1.7]))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(drawn_params, st.booleans()), min_size=1, max_size=6), st.integers(2, 300),
       st.integers(0, 2 ** 31), st.sampled_from([0.5, 2.0, 6.0]), st.booleans(), st.sampled_from([1, 3, 16]))
def test_a_head_keeps_and_draws_exactly_what_whole_rows_sorted_do(rows, vocab, seed, scale, ties, head):
    """Top-k, top-p, min-p and temperatures mixed, logits with ties at every cut (rounded) or
    none: the probabilities filtered from each row's largest ``head`` (and the larger heads
    after it) are those of whole rows sorted, bit for bit, and pick_tokens (its first head
    ``head``) draws the tokens the whole sort's probabilities draw with the same generators."""
    params, seeds = [p for p, _ in rows], [seed + i if seeded else None for i, (_, seeded) in enumerate(rows)]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * scale
    logits = logits.round() if ties else logits
    probs = torch.softmax(logits / torch.tensor([p.temperature for p in params])[:, None], dim=-1)
    whole = _filter_batch(probs.clone(), params)
    assert torch.equal(_filter_batch(probs.clone(), params, head), whole)

    def generators():
        torch.manual_seed(seed)  # (the unseeded rows' noise)
        return [None if s is None else make_generator(s) for s in seeds]

    want = exponential_race(whole, generators()).tolist()
    with mock.patch.object(sampling, "FIRST_HEAD", head):
        assert [p.token for p in pick_tokens(logits, params, generators(), [None] * len(rows))] == want


def test_rows_whose_head_settles_them_are_never_sorted_whole(monkeypatch):
    """Peaked rows of a 20,000-token vocab under top-p and min-p alone: one topk of each row's
    largest, no sort of its vocab."""
    logits = torch.randn(4, 20_000, generator=torch.Generator().manual_seed(0)) * 8
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5, min_p=0.01), SamplingParams(min_p=0.1),
              SamplingParams(top_p=0.95, seed=1)]
    sort = torch.sort
    sorted_lengths = []
    monkeypatch.setattr(torch, "sort", lambda x, *a, **kw: sorted_lengths.append(x.shape[-1]) or sort(x, *a, **kw))
    pick_tokens(logits, params, [None, None, None, make_generator(1)], [None] * 4)
    assert all(n <= sampling.FIRST_HEAD for n in sorted_lengths), sorted_lengths


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


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(1, 40), seed=st.integers(0, 2**16), levels=st.integers(1, 4))
def test_argmax_rows_is_torch_s_argmax_with_ties_nans_and_infinities(rows, vocab, seed, levels):
    """The CPU's numpy path picks what torch's argmax picks: the first of equal largest values, a
    NaN above all, -inf rows at 0; on a transposed view too, into a tensor the sampler writes."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, levels, (rows, vocab), generator=gen).float()  # few levels: many ties
    specials = torch.tensor([float("nan"), float("inf"), -float("inf")])
    mask = torch.rand(rows, vocab, generator=gen) < 0.1
    values[mask] = specials[torch.randint(0, 3, (int(mask.sum()),), generator=gen)]
    values[0] = -float("inf") if seed % 5 == 0 else values[0]
    for view in (values, values.t().contiguous().t()):
        picked = argmax_rows(view)
        assert picked.dtype == torch.int64 and picked.tolist() == torch.argmax(view, dim=-1).tolist()
    picked[0] = -1  # (the sampler overwrites its drawn rows)
