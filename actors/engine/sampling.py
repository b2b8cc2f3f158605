"""From last-token logits to next tokens: logit bias, min-tokens masks, penalties,
temperature, top-k/p, min-p, seeds.

In vLLM's order: first the additive adjustments — ``logit_bias`` and, while a request has
fewer than ``min_new_tokens`` tokens, ``-inf`` at EOS and its ``stop_token_ids`` —, then the
penalties, as OpenAI / vLLM define them: repetition (divide positive, multiply negative
logits of tokens seen in the prompt or output), frequency (``-= f * count in output``) and
presence (``-= p`` for tokens in the output). Greedy requests take the argmax of the
adjusted, penalised logits; others are divided by the temperature, filtered by top-k, top-p
and min-p, and sampled with a per-request generator (seeded when the request gives a seed,
so the same seed gives the same tokens).

:func:`logit_adjustments` and :func:`apply_penalties` are the plain definitions (one dense
``[bs, vocab]`` tensor, one row's sets rebuilt): :func:`sample_next` takes them for a row on
its own. A batch takes :func:`~actors.engine.sparse_logits.adjust_logits` (the same values,
written sparsely from per-request state) and :func:`pick_tokens`.

Logprobs are those of the model's own distribution (log-softmax of the raw
logits), as OpenAI and vLLM (``logprobs_mode="raw_logprobs"``) report them:
bias, masks, penalties, temperature and the filters shape the choice, not its
logprob.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

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
    ``params[i].logit_bias`` and ``-inf`` at ``masked_ids[i]`` (its
    :meth:`~SamplingParams.masked_token_ids`); ids outside ``vocab`` are never sampled and
    are skipped. None when no row has a bias or a mask (nothing is built)."""
    if not any(p.logit_bias for p in params) and not any(masked_ids):
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
    return adjust


def filter_probs(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Zero out what top-k, top-p and min-p exclude (then renormalise)."""
    if params.top_k > 0 and params.top_k < probs.shape[-1]:  # exactly k, ties or not (a threshold keeps every tie)
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(0, torch.topk(probs, params.top_k).indices, True)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, 0)
        drop = cumulative - sorted_probs > params.top_p * cumulative[-1]
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs / probs.sum()


def make_generator(seed: Optional[int]) -> torch.Generator:
    gen = torch.Generator()
    if seed is not None:
        gen.manual_seed(seed)
    else:
        gen.seed()
    return gen


def draw_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Next token from one row of adjusted, penalised float32 logits ``[vocab]`` on the CPU:
    the argmax if greedy, else a draw after temperature, top-k, top-p and min-p."""
    if params.is_greedy:
        return int(torch.argmax(logits))
    probs = filter_probs(torch.softmax(logits / params.temperature, dim=-1), params)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_next(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: List[int], output_ids: List[int], generator: torch.Generator,
    adjust: Optional[torch.Tensor] = None,
) -> Tuple[int, Optional[torch.Tensor]]:
    """Next token of one request and, when it asks for logprobs, the log-softmax of its raw logits
    (before ``adjust`` — its row of :func:`logit_adjustments` —, penalties and temperature)."""
    logits = logits.float().cpu()
    logprobs = torch.log_softmax(logits, dim=-1) if params.return_logprob else None
    if adjust is not None:
        logits = logits + adjust.cpu()
    logits = apply_penalties(logits, params, prompt_ids, output_ids)
    return draw_token(logits, params, generator), logprobs


def plain_greedy_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                        adjust: Optional[torch.Tensor] = None, penalised: bool = False) -> Dict[int, int]:
    """``{row: token}`` for the rows of a batch's logits ``[bs, vocab]`` that need nothing but
    an argmax (greedy, no penalties, no logprobs) of the logits plus ``adjust`` (the batch's
    :func:`logit_adjustments`, on the logits' device): one argmax over those rows on the
    logits' device and one transfer of their tokens, not a row at a time through host
    memory. ``penalised``: the logits are already adjusted and penalised
    (:func:`~actors.engine.sparse_logits.adjust_logits`), so greedy rows with penalties are
    taken too. The other rows are :func:`sample_next`'s."""
    rows = [i for i, p in enumerate(params)
            if p.is_greedy and (penalised or not p.has_penalties) and not p.return_logprob]
    if not rows:
        return {}
    if adjust is not None:
        logits = logits.float() + adjust
    picked = logits if len(rows) == len(params) else logits[torch.tensor(rows, device=logits.device)]
    return dict(zip(rows, torch.argmax(picked, dim=-1).tolist()))


def pick_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
                states: Sequence[Optional[LogitState]]) -> List[Tuple[int, Optional[torch.Tensor]]]:
    """Each row's next token and, when its request asks for logprobs, the log-softmax of its raw
    ``logits`` row (on the CPU) — what :func:`sample_next` gives row by row —, with ``states``
    the rows' :class:`~actors.engine.sparse_logits.LogitState` (synced; None: nothing to adjust).
    ``logits`` are the step's own: float32 ones are adjusted in place
    (:func:`~actors.engine.sparse_logits.adjust_logits`), once the logprob rows' raw values are
    copied out. The plain greedy rows take one argmax; the others' rows reach the host in one
    transfer and are drawn one by one with their own generators."""
    with_logprobs = [i for i, p in enumerate(params) if p.return_logprob]
    raw = {} if not with_logprobs else dict(zip(with_logprobs, logits[
        torch.tensor(with_logprobs, device=logits.device)].float().cpu()))
    adjusted = adjust_logits(logits, states, in_place=True)
    picked: Dict[int, Tuple[int, Optional[torch.Tensor]]] = {
        row: (token, None) for row, token in plain_greedy_tokens(adjusted, params, penalised=True).items()}
    rest = [i for i in range(len(params)) if i not in picked]
    if rest:
        rows = adjusted[torch.tensor(rest, device=logits.device)].float().cpu()
        for row, adjusted_row in zip(rest, rows):
            logprobs = torch.log_softmax(raw[row], dim=-1) if row in raw else None
            picked[row] = (draw_token(adjusted_row, params[row], generators[row]), logprobs)
    return [picked[i] for i in range(len(params))]
