"""How a verify step picks and accepts each draft position (:mod:`actors.engine.spec_decode`):
a draft cut to what its grammar accepts and each row's grammar mask and logit adjustments after
the draft tokens before it; greedy acceptance, and vLLM's rejection sampler for one-hot drafts.
A draft model's steps take the same masks and adjustments (:mod:`actors.engine.draft_masks`)."""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch
import xgrammar as xgr

from actors.engine.sampling import exponential_race
from actors.engine.sparse_logits import LogitState


def grammar_prefix(matcher: xgr.GrammarMatcher, draft: Sequence[int]) -> List[int]:
    """The longest prefix of ``draft`` that ``matcher`` accepts, none past a token that ends its
    grammar (found by accepting them; rolled back: the matcher is left as it was)."""
    n = 0
    while n < len(draft) and not matcher.is_terminated() and matcher.accept_token(draft[n]):
        n += 1
    if n:
        matcher.rollback(n)
    return list(draft[:n])


def apply_draft_grammar_masks(rows: torch.Tensor, matchers: Sequence[Optional[xgr.GrammarMatcher]],
                              drafts: List[List[int]]) -> None:
    """Set to ``-inf``, in place, what each request's grammar refuses in its rows of a verify step
    (``rows``: request ``i``'s ``len(drafts[i]) + 1`` in a row; ``matchers[i]`` None: no grammar):
    row ``j`` what its matcher allows after ``drafts[i][:j]``, accepted one by one between the
    fills and rolled back after (the drafts are :func:`grammar_prefix`'s). A row after a token
    that ended the grammar is left alone: the request ends at that token."""
    if all(m is None for m in matchers):
        return
    bitmask = xgr.allocate_token_bitmask(rows.shape[0], rows.shape[-1])
    masked, row = [], 0
    for matcher, draft in zip(matchers, drafts):
        if matcher is not None:
            for j in range(len(draft) + 1):
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask, row + j)
                masked.append(row + j)
                if j < len(draft):
                    matcher.accept_token(draft[j])
            matcher.rollback(len(draft))
        row += len(draft) + 1
    apply_bitmask(rows, bitmask, masked)


def apply_bitmask(rows: torch.Tensor, bitmask: torch.Tensor, masked: List[int]) -> None:
    """``-inf``, in place, where ``bitmask``'s rows ``masked`` refuse a token of ``rows``."""
    if masked:
        xgr.apply_token_bitmask_inplace(rows, bitmask.to(rows.device, non_blocking=True), indices=masked)


def position_states(state: Optional[LogitState], draft: Sequence[int]) -> List[Optional[LogitState]]:
    """The adjustments of a drafted request's rows: row ``j``'s after ``draft[:j]`` (``state``
    synced to its output; None: nothing to adjust)."""
    states = [state]
    for token in draft:
        states.append(None if state is None else states[-1].ahead(token))
    return states


def accept_greedy(draft: Sequence[int], targets: Sequence[int]) -> List[int]:
    """The tokens a greedy verify step emits: the draft's longest prefix equal to the target's
    argmax at each position (``targets[i]``, the token after the ``i``-th input), then the
    target's own token after it (``len(targets) == len(draft) + 1``)."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return list(draft[:accepted]) + [targets[accepted]]


def rejection_sample(probs: torch.Tensor, drafts: List[List[int]],
                     generators: Sequence[Optional[torch.Generator]]) -> List[List[int]]:
    """vLLM's rejection sampler for one-hot drafts (an n-gram draft has no probabilities of its
    own): request ``i``'s rows of ``probs`` (``len(drafts[i]) + 1`` in a row, in request order;
    each row what plain sampling draws from, not necessarily normalised) check its draft token
    ``x`` at each position: kept with probability ``p(x)``; at the first one rejected, the token
    is drawn from ``p`` without ``x`` (``max(p - onehot(x), 0)`` renormalised), and the run ends;
    all kept, the bonus token is drawn from the last row. Each emitted token is so distributed as
    plain sampling's would be. A seeded request's uniforms and draw come from its generator."""
    probs = probs / probs.sum(dim=-1, keepdim=True)
    starts = np.cumsum([0] + [len(d) + 1 for d in drafts])
    draft_rows = torch.tensor([starts[i] + j for i, d in enumerate(drafts) for j in range(len(d))], device=probs.device)
    flat = torch.tensor([t for d in drafts for t in d], device=probs.device)
    kept_p = probs[draft_rows, flat].tolist()
    uniforms = torch.rand(len(kept_p), device=probs.device).tolist()
    accepted, ends, offset = [], [], 0
    for i, (draft, gen) in enumerate(zip(drafts, generators)):
        u = uniforms[offset:offset + len(draft)] if gen is None else torch.rand(
            len(draft), generator=gen, device=probs.device).tolist()
        n = 0
        while n < len(draft) and u[n] < kept_p[offset + n]:
            n += 1
        accepted.append(n)
        ends.append(int(starts[i]) + n)
        offset += len(draft)
    residual = probs[torch.tensor(ends, device=probs.device)]
    rejected = [i for i, (n, d) in enumerate(zip(accepted, drafts)) if n < len(d)]
    if rejected:
        rows = torch.tensor(rejected, device=probs.device)
        residual[rows, torch.tensor([drafts[i][accepted[i]] for i in rejected], device=probs.device)] = 0.0
    last = exponential_race(residual, generators).tolist()
    return [list(d[:n]) + [t] for d, n, t in zip(drafts, accepted, last)]
