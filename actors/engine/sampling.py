"""From last-token logits to next tokens: allowed ids, logit bias, min-tokens and bad-words
masks, penalties, grammar masks, temperature, top-k/p, min-p, seeds.

In vLLM's order: first ``-inf`` at every id but a request's ``allowed_token_ids``, then the
additive adjustments — ``logit_bias``, ``-inf`` at EOS and its ``stop_token_ids`` while it has
fewer than ``min_new_tokens`` tokens, and at what its ``bad_words`` ban after its output —, then the
penalties, as OpenAI / vLLM define them: repetition (divide positive, multiply negative
logits of tokens seen in the prompt or output), frequency (``-= f * count in output``) and
presence (``-= p`` for tokens in the output); then, for a request with a grammar, ``-inf``
at every token it does not allow next (:mod:`actors.engine.grammar`, SGLang's place for its
vocab mask). Greedy requests take the argmax of the adjusted, penalised, masked logits;
others are divided by the temperature, filtered by top-k, top-p and min-p, and drawn.

A batch is sampled on its logits' device, as SGLang and vLLM do it (:func:`pick_tokens`):
the temperatures a ``[n, 1]`` tensor, top-k, top-p and min-p per-row tensors applied to each
row's largest probabilities, the whole row sorted only where they do not settle what is kept
(:func:`filter_sorted_probs`), and the draw an exponential race — the argmax of
``probs / q`` with ``q ~ Exp(1)`` draws token ``i`` with probability ``probs[i] / sum(probs)``
(vLLM's sampler). A seeded request fills its ``q`` row from its own generator (on the
logits' device), so the same seed, parameters and logits give the same tokens whatever else
is in the batch; the other rows share the device's default generator. Only the chosen
tokens, and the logprobs rows ask for, reach the host.

:func:`logit_adjustments`, :func:`apply_penalties` and :func:`filter_probs` are the plain
per-row definitions: :func:`sample_next` takes them for a row on its own (the reference the
tests hold the batch to). A batch takes :func:`~actors.engine.sparse_logits.adjust_logits`
(the same values, written sparsely from per-request state) and :func:`pick_tokens`.

Logprobs are those of the model's own distribution (log-softmax of the raw
logits), as OpenAI and vLLM (``logprobs_mode="raw_logprobs"``) report them:
allowed ids, bias, masks, penalties, temperature and the filters shape the choice,
not its logprob (vLLM's sampler takes the raw logprobs before its allowed-ids mask too).
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch

from actors.engine.grammar import apply_grammar_masks
from actors.engine.sampling_params import SamplingParams
from actors.engine.sparse_logits import LogitState, adjust_logits


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: List[int], output_ids: List[int]) -> torch.Tensor:
    """Penalised copy of one request's logits ``[vocab]``."""
    if not params.has_penalties:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.int64)
        seen = seen[seen < vocab]
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.int64), minlength=vocab)[:vocab].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def logit_adjustments(params: Sequence[SamplingParams], masked_ids: Sequence[Sequence[int]], vocab: int,
                      device="cpu") -> Optional[torch.Tensor]:
    """What to add to a batch's logits ``[bs, vocab]`` before anything else: row ``i`` gets
    ``params[i].logit_bias``, ``-inf`` at ``masked_ids[i]`` (its
    :meth:`~SamplingParams.masked_token_ids` and its
    :func:`~actors.engine.sampling_params.bad_word_bans`) and at every id but its
    ``allowed_token_ids``; ids outside ``vocab`` are never sampled and are skipped. None when no
    row has a bias or a mask (nothing is built)."""
    allowed = [(i, p.allowed_token_ids) for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not any(p.logit_bias for p in params) and not any(masked_ids) and not allowed:
        return None
    biased = [(i, token, bias) for i, p in enumerate(params) for token, bias in (p.logit_bias or {}).items()
              if token < vocab]
    masked = [(i, token) for i, ids in enumerate(masked_ids) for token in ids if 0 <= token < vocab]
    adjust = torch.zeros(len(params), vocab, dtype=torch.float32, device=device)
    if biased:
        rows, cols, vals = zip(*biased)
        adjust[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = torch.tensor(
            vals, dtype=torch.float32, device=device)
    if masked:  # after the bias: a masked token stays -inf whatever its bias
        rows, cols = zip(*masked)
        adjust[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")
    for i, ids in allowed:
        refused = torch.ones(vocab, dtype=torch.bool, device=device)
        refused[torch.tensor([t for t in ids if t < vocab], dtype=torch.int64, device=device)] = False
        adjust[i, refused] = float("-inf")
    return adjust


def filter_probs(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Zero out what top-k, top-p and min-p exclude (then renormalise); equal probabilities are
    ordered by token id (a stable sort), so a tie at a cut keeps the lowest ids."""
    if params.top_k > 0 and params.top_k < probs.shape[-1]:  # exactly k, ties or not (a threshold keeps every tie)
        first_k = torch.sort(probs, descending=True, stable=True).indices[:params.top_k]  # equal ones: lowest ids
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(0, first_k, True)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        cumulative = torch.cumsum(sorted_probs, 0)
        drop = cumulative - sorted_probs > params.top_p * cumulative[-1]
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs / probs.sum()


def make_generator(seed: Optional[int], device="cpu") -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (None: a random seed)."""
    gen = torch.Generator(device=device)
    if seed is not None:
        gen.manual_seed(seed)
    else:
        gen.seed()
    return gen


def argmax_rows(values: torch.Tensor) -> torch.Tensor:
    """Each row's ``argmax`` (int64, on the values' device): the first of equal largest values,
    a NaN above every number (torch's rule, and numpy's). float32 rows on the CPU go through
    numpy: torch's CPU argmax over rows is several times slower (torch 2.13, one thread: 64 ×
    2,048 174 µs against 12 µs; 64 × 32,000 3.5 ms against 0.7 ms), the largest piece of a small
    model's decode step outside its forward."""
    if values.device.type == "cpu" and values.dtype == torch.float32:
        return torch.from_numpy(values.numpy().argmax(axis=-1))
    return values.argmax(dim=-1)


def exponential_race(probs: torch.Tensor, generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
    """One token per row of ``probs`` ``[n, vocab]`` (non-negative, not necessarily normalised;
    divided in place), drawn with probability ``probs[i] / sum(probs)``: the argmax of
    ``probs / q``, ``q ~ Exp(1)`` (as ``-log(u)``, ``u`` uniform: the same law as
    ``exponential_``, three times cheaper on a CPU). Row ``r``'s ``u`` comes from
    ``generators[r]`` (on the probabilities' device) when it has one, else from the device's
    default generator. A zero of ``q`` is raised to the smallest normal float: ``0 / 0`` (NaN)
    would win the argmax."""
    u = torch.empty_like(probs)
    seeded = [row for row, gen in enumerate(generators) if gen is not None]
    if len(seeded) < len(generators):
        u.uniform_()
    for row in seeded:
        u[row].uniform_(generator=generators[row])
    q = u.log_().neg_().clamp_min_(torch.finfo(u.dtype).tiny)
    return argmax_rows(probs.div_(q))


def draw_token(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator]) -> int:
    """Next token from one row of adjusted, penalised float32 logits ``[vocab]``: the argmax if
    greedy, else the :func:`exponential_race` over :func:`filter_probs` of the softmax after
    temperature (``generator`` on the logits' device; None: the default one)."""
    if params.is_greedy:
        return int(torch.argmax(logits))
    probs = filter_probs(torch.softmax(logits / params.temperature, dim=-1), params)
    return int(exponential_race(probs[None], [generator])[0])


def sample_next(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: List[int], output_ids: List[int],
    generator: Optional[torch.Generator], adjust: Optional[torch.Tensor] = None,
) -> Tuple[int, Optional[torch.Tensor]]:
    """Next token of one request and, when it asks for logprobs, the log-softmax of its raw logits
    (before ``adjust`` — its row of :func:`logit_adjustments` —, penalties and temperature): the
    per-row reference of :func:`pick_tokens`."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1) if params.return_logprob else None
    if adjust is not None:
        logits = logits + adjust
    logits = apply_penalties(logits, params, prompt_ids, output_ids)
    return draw_token(logits, params, generator), logprobs


class Pick(NamedTuple):
    """One row's next token; with logprobs, the raw logprob of that token and, when the request
    asks for ``top_logprobs_num`` of them, the ``(token, logprob)`` pairs of the most likely."""

    token: int
    logprob: Optional[float] = None
    top_logprobs: Optional[List[Tuple[int, float]]] = None


FIRST_HEAD = 256  # tokens of each row :func:`filter_sorted_probs` looks at first
HEAD_GROWTH = 16  # how many times as many a row they do not settle looks at next (no head past an
# eighth of the vocab: a row that needs one is sorted whole for little more)


def keep_largest(probs: torch.Tensor, ordered: torch.Tensor, num_kept: torch.Tensor) -> torch.Tensor:
    """``probs`` ``[m, vocab]`` with all but each row's ``num_kept`` ``[m, 1]`` largest zeroed, in
    place; of equal ones at the cut, the lowest ids stay. ``ordered``: each row's first
    probabilities in descending order, at least ``num_kept`` of them (any later ones at most
    the cut, or zeroed)."""
    cut = ordered.gather(-1, num_kept - 1)
    drop = probs < cut
    if (probs.shape[-1] - drop.sum(dim=-1, keepdim=True) > num_kept).any():  # a tie crosses a cut
        equal = probs == cut
        drop |= equal & (equal.cumsum(dim=-1) > num_kept - (ordered > cut).sum(dim=-1, keepdim=True))
    return probs.masked_fill_(drop, 0.0)


def filter_sorted_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                        head: Optional[int] = None) -> torch.Tensor:
    """:func:`filter_probs` for every row of ``probs`` ``[n, vocab]`` at once, in place and not
    renormalised (the draw needs no normalising). In descending order, row ``r`` keeps its first
    ``top_k[r]`` tokens, then the smallest prefix whose cumulative probability reaches
    ``top_p[r]`` of what is kept (at least one token; without top-k, of the row's sum), then
    those at least ``min_p[r]`` times its most likely one; of equal probabilities at the cut,
    the lowest ids. ``top_k`` int64 (``vocab``: all), ``top_p`` and ``min_p`` float32 (1 and 0:
    off), on the probabilities' device. Rows no filter is on are not touched.

    How many a row keeps depends on its sorted values only (:func:`keep_largest` then keeps
    them by value and id, whatever order a sort gave equal ones), and a ``topk``'s values are
    the sort's first ones, with the same cumulative sums (a prefix's). So a row's first
    ``head`` settle it when its top-k is at most ``head``, or when the filters drop one of them
    (each filter drops a suffix: every later one goes too); the rows left look at
    :data:`HEAD_GROWTH` times as many, then at the whole sort (at once when none of them could
    be settled so). None: whole rows sorted (the reference)."""
    vocab = probs.shape[-1]
    rows = torch.nonzero((top_k < vocab) | (top_p < 1.0) | (min_p > 0.0))[:, 0]
    total = probs.sum(dim=-1)  # (not a sorted row's last cumulative sum: one head does without the sort)
    k = vocab if head is None else head
    while rows.numel():
        block = probs if rows.numel() == probs.shape[0] else probs[rows]
        ordered = (torch.topk(block, k, dim=-1) if k < vocab else torch.sort(block, dim=-1, descending=True)).values
        row_top_k, row_top_p, smallest = top_k[rows], top_p[rows], ordered[:, -1].clone()
        ordered.masked_fill_(torch.arange(ordered.shape[-1], device=probs.device) >= row_top_k[:, None], 0.0)
        cumulative = torch.cumsum(ordered, dim=-1)
        mass = torch.where(row_top_k < vocab, cumulative[:, -1], total[rows])
        ordered.masked_fill_((cumulative - ordered > (row_top_p * mass)[:, None]) & (row_top_p[:, None] < 1.0), 0.0)
        ordered.masked_fill_(ordered < min_p[rows, None] * ordered[:, :1], 0.0)
        # (a row whose logits overflowed, NaN, keeps none: as one, its cut drops nothing and it is
        # left as it is, as the whole sort left it, not read at position -1)
        num_kept = (ordered > 0).sum(dim=-1, keepdim=True).clamp_(min=1)
        settled = (k >= vocab) | (row_top_k <= k) | ((row_top_k == vocab) & (num_kept[:, 0] < k))
        if settled.all():
            keep_largest(block, ordered, num_kept)
        else:
            block = keep_largest(block[settled], ordered[settled], num_kept[settled])
        if block is not probs:
            probs[rows[settled]] = block
        next_k = k * HEAD_GROWTH if k * HEAD_GROWTH <= vocab // 8 else vocab
        # top-p alone, short of its mass even if the next head's new ones were all as likely as this one's last
        short = ((row_top_k == vocab) & (min_p[rows] == 0.0)
                 & (cumulative[:, -1] + (next_k - k) * smallest < row_top_p * mass))
        rows, k = rows[~settled], vocab if short[~settled].all() else next_k
    return probs


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
    """The draws ``[n]`` (on the logits' device) of non-greedy rows of adjusted, penalised
    float32 ``logits`` ``[n, vocab]`` (overwritten): temperature, the filters, the race."""
    return exponential_race(sampling_probs(logits, params), generators)


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """What non-greedy rows of float32 ``logits`` ``[n, vocab]`` (overwritten) draw from: the
    softmax at each row's temperature, its top-k, top-p and min-p filters applied (the tokens
    they drop at 0; the rest not normalised again)."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    probs = torch.softmax(logits.div_(temperature[:, None]), dim=-1)
    if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        probs = filter_sorted_probs(
            probs, torch.tensor(top_k, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            min(FIRST_HEAD, max(top_k)))
    elif any(p.min_p > 0.0 for p in params):  # no sort needed: relative to each row's max
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        probs.masked_fill_(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def logprob_picks(raw: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]) -> List[Pick]:
    """Picks of rows asking for logprobs from their raw logits ``raw`` ``[m, vocab]`` and chosen
    ``tokens`` ``[m]`` (device tensors): log-softmax, the chosen token's value and the largest
    ``top_logprobs_num`` computed there; three small transfers."""
    logprobs = torch.log_softmax(raw.float(), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    num_top = min(max(p.top_logprobs_num for p in params), logprobs.shape[-1])
    top_values, top_ids = ([], []) if not num_top else (t.tolist() for t in logprobs.topk(num_top, dim=-1))
    picks = []
    for i, (p, token) in enumerate(zip(params, tokens.tolist())):
        k = p.top_logprobs_num
        picks.append(Pick(token, chosen[i], list(zip(top_ids[i][:k], top_values[i][:k])) if k else None))
    return picks


def pick_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[Optional[torch.Generator]], states: Sequence[Optional[LogitState]],
                matchers: Sequence[Any] = ()) -> List[Pick]:
    """Each row's :class:`Pick` (what :func:`sample_next` gives row by row), with ``states`` the
    rows' :class:`~actors.engine.sparse_logits.LogitState` (synced; None: nothing to adjust),
    ``generators`` the seeded rows' (on the logits' device; None: the default one) and
    ``matchers`` the rows' grammar matchers (none, or None: no grammar), whose masks come after
    the adjustments (:func:`~actors.engine.grammar.apply_grammar_masks`). ``logits``
    are the step's own: float32 ones are adjusted and masked in place, once the logprob rows'
    raw values are copied out, and, when every row is sampled, divided by the temperatures in
    place too. Everything runs on the logits' device — one argmax for the greedy rows, one
    :func:`sample_rows` for the others —; the tokens (and the logprobs asked for) are all that
    is copied to the host."""
    with torch.inference_mode():  # (a forward's logits are inference tensors: written in place only so)
        return _pick_tokens(logits, params, generators, states, matchers)


def _pick_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[Optional[torch.Generator]], states: Sequence[Optional[LogitState]],
                 matchers: Sequence[Any]) -> List[Pick]:
    device = logits.device
    with_logprobs = [i for i, p in enumerate(params) if p.return_logprob]
    raw = None if not with_logprobs else logits[torch.tensor(with_logprobs, device=device)].float()
    adjusted = adjust_logits(logits, states, in_place=True)
    apply_grammar_masks(adjusted, matchers)
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    tokens = argmax_rows(adjusted)
    if sampled:
        index = torch.tensor(sampled, device=device)
        rows = adjusted if len(sampled) == len(params) and adjusted.dtype == torch.float32 else adjusted[index].float()
        tokens[index] = sample_rows(rows, [params[i] for i in sampled], [generators[i] for i in sampled])
    picks = [Pick(token) for token in tokens.tolist()]
    if with_logprobs:
        chosen = tokens[torch.tensor(with_logprobs, device=device)]
        for row, pick in zip(with_logprobs, logprob_picks(raw, chosen, [params[i] for i in with_logprobs])):
            picks[row] = pick
    return picks
