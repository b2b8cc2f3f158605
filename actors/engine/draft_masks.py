"""A draft model's proposals under each request's logit adjustments and grammar, as plain decoding
would pick at their positions (SGLang's EAGLE drafting under xgrammar; :mod:`actors.engine.draft_model`).

Draft step ``j`` picks request ``i``'s next draft token from the draft's logits adjusted as plain
decoding's step after its output and ``draft[:j]``. The draft's tokens stay on the device between
the steps, so what depends on their values is computed there:

- allowed ids, ``logit_bias``, the min-tokens mask (it counts the draft's tokens, not their values)
  and one-token bad words: the host's sparse writes, as a decode step's
  (:meth:`~actors.engine.sparse_logits.LogitState.for_draft_step`);
- repetition, frequency and presence penalties (:class:`_DensePenalties`): a dense seen mask or
  count row per request with them, built from its output once, each step's tokens scattered in;
- longer bad words (:class:`_BadWordTails`): each word's other tokens compared with the request's
  last output tokens and its draft so far;
- the grammar: its matcher takes the tokens on the host, so only the rows of requests with one are
  copied there, once per step (a batch without a grammar copies nothing until the drafts are done).

Each value is a decode step's, bit for bit (the same float32 operations in the same order: the
bias before the penalties; a ban is ``-inf`` whatever comes after), so a draft with the target's
weights proposes plain decoding's tokens.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import xgrammar as xgr

from actors.engine.forward_batch import int64_tensor
from actors.engine.sparse_logits import LogitState, Triples, adjust_logits
from actors.engine.spec_accept import apply_bitmask


class DraftMasks:
    """Request ``i``'s draft tokens adjusted by ``states[i]`` (:class:`LogitState`: allowed ids, bad
    words, min-tokens, bias, penalties, synced to its output) and masked by ``matchers[i]``, each
    after the request's draft so far: the matchers accept the tokens tentatively, rolled back by
    :meth:`rollback`. Without them a draft is the raw argmax, and the verify step cuts it at the
    first token a grammar refuses (or never accepts one an allowed set bans): accepted length lost.

    A request whose matcher ended (or refused a token: none is allowed) is no longer masked; the
    verify step's cut ends its draft there. Calls alternate: :meth:`apply` for a step's logits, then
    :meth:`take` for its tokens, the requests of a step a subset of the step before's."""

    def __init__(self, states: Sequence[Optional[LogitState]], matchers: Sequence[Optional[xgr.GrammarMatcher]]):
        self.states, self.matchers = list(states), list(matchers)
        self.taken = [0] * len(self.matchers)  # tokens each matcher accepted tentatively
        self.refused = [False] * len(self.matchers)
        self.num_steps = 0  # steps taken: every request of a step has drafted this many tokens
        self._penalties: Optional[_DensePenalties] = None  # (on the logits' device: made at the first step)
        self._bad_words: Optional[_BadWordTails] = None

    @property
    def needed(self) -> bool:
        """Whether some request has anything to adjust or mask (else its drafts are the raw argmax)."""
        return any(s is not None for s in self.states) or any(m is not None for m in self.matchers)

    def apply(self, logits: torch.Tensor, index: Sequence[int]) -> torch.Tensor:
        """``logits`` (float32, row ``r`` request ``index[r]``'s next draft position) adjusted and
        masked in place."""
        if self._penalties is None:
            self._penalties = _DensePenalties(self.states, logits.shape[-1], logits.device)
            self._bad_words = _BadWordTails(self.states, logits.device)
        with torch.inference_mode():  # (a forward's logits are inference tensors: written in place only so)
            states = [self.states[i] for i in index]
            logits = adjust_logits(logits, [None if s is None else s.for_draft_step(self.num_steps) for s in states],
                                   in_place=True)
            self._penalties.apply(logits, index)
            self._bad_words.apply(logits, index)
            live = [(r, self.matchers[i]) for r, i in enumerate(index) if self._masks(i)]
            if live:
                bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
                for r, matcher in live:
                    matcher.fill_next_token_bitmask(bitmask, r)
                apply_bitmask(logits, bitmask, [r for r, _ in live])
        return logits

    def take(self, index: Sequence[int], tokens: torch.Tensor) -> None:
        """Requests ``index`` drafted ``tokens`` (row ``r`` request ``index[r]``'s, on the device):
        what their next positions are adjusted after. Only the grammar rows' tokens reach the host."""
        self._penalties.take(index, tokens)
        self._bad_words.take(index, tokens)
        self.num_steps += 1
        live = [(r, i) for r, i in enumerate(index) if self._masks(i)]
        if not live:
            return
        for (_, i), token in zip(live, tokens[int64_tensor([r for r, _ in live], tokens.device)].tolist()):
            if self.matchers[i].accept_token(token):
                self.taken[i] += 1
            else:
                self.refused[i] = True

    def _masks(self, i: int) -> bool:
        matcher = self.matchers[i]
        return matcher is not None and not self.refused[i] and not matcher.is_terminated()

    def rollback(self) -> None:
        """Every matcher as it was before the drafting."""
        for matcher, taken in zip(self.matchers, self.taken):
            if matcher is not None and taken:
                matcher.rollback(taken)


def _rows(index: Sequence[int], own: Dict[int, int], device) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(logits rows, own rows)`` of the requests of ``index`` that ``own`` maps (request → its row of
    a per-request tensor), or None when none is there."""
    pairs = [(r, own[i]) for r, i in enumerate(index) if i in own]
    if not pairs:
        return None
    return int64_tensor([r for r, _ in pairs], device), int64_tensor([k for _, k in pairs], device)


class _DensePenalties:
    """The penalties of the requests with them, as a decode step's sparse writes would give after
    the draft so far: a ``[n, vocab]`` mask of the ids seen in prompt and output (repetition) and
    one of the output's counts (frequency, presence), per request with them, each step's token
    scattered in on the device."""

    def __init__(self, states: Sequence[Optional[LogitState]], vocab: int, device):
        self.device = device
        seen = [(i, s) for i, s in enumerate(states) if s is not None and s.seen is not None]
        output = [(i, s) for i, s in enumerate(states) if s is not None and s.output is not None]
        self.seen_rows = {i: k for k, (i, _) in enumerate(seen)}
        self.output_rows = {i: k for k, (i, _) in enumerate(output)}
        self.seen = torch.zeros(len(seen), vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(len(output), vocab, dtype=torch.float32, device=device)
        ids, counts = Triples(), Triples()  # (every row's in one copy: not one, or two, per request)
        for k, (_, s) in enumerate(seen):
            ids.add(k, s.seen.ids)
        for k, (_, s) in enumerate(output):
            counts.add(k, s.output.ids, s.output.counts)
        if ids.rows:
            self.seen[ids.index(device)] = True
        if counts.rows:
            self.counts[counts.index(device)] = counts.value(device)
        self.repetition = self._per_row(seen, lambda p: p.repetition_penalty)
        self.frequency = self._per_row(output, lambda p: p.frequency_penalty)
        self.presence = self._per_row(output, lambda p: p.presence_penalty)

    def _per_row(self, rows, value) -> torch.Tensor:
        return torch.tensor([[value(s.params)] for _, s in rows], dtype=torch.float32, device=self.device)

    def apply(self, logits: torch.Tensor, index: Sequence[int]) -> None:
        """Repetition, then frequency and presence, on the rows of ``index`` with them (in place)."""
        rows = _rows(index, self.seen_rows, self.device)
        if rows is not None:
            vals, seen, penalty = logits[rows[0]], self.seen[rows[1]], self.repetition[rows[1]]
            logits[rows[0]] = torch.where(seen, torch.where(vals > 0, vals / penalty, vals * penalty), vals)
        rows = _rows(index, self.output_rows, self.device)
        if rows is not None:
            counts = self.counts[rows[1]]
            logits[rows[0]] -= self.frequency[rows[1]] * counts + self.presence[rows[1]] * (counts > 0)

    def take(self, index: Sequence[int], tokens: torch.Tensor) -> None:
        rows = _rows(index, self.seen_rows, self.device)
        if rows is not None:
            self.seen[rows[1], tokens[rows[0]]] = True
        rows = _rows(index, self.output_rows, self.device)
        if rows is not None:
            self.counts.index_put_((rows[1], tokens[rows[0]]), torch.ones(len(rows[1]), device=self.device),
                                   accumulate=True)


class _BadWordTails:
    """The bad words of more than one token of the requests with them: a word's last token is banned
    where the request's output and draft so far end with its other tokens (bad_word_bans'), compared
    on the device against each request's last output tokens (its :class:`LogitState`'s ``tail``)
    followed by its draft tokens, a column per step."""

    def __init__(self, states: Sequence[Optional[LogitState]], device):
        self.device = device
        words = [(i, w) for i, s in enumerate(states) if s is not None for w in s.bad_words_ids if len(w) > 1]
        self.rows = {i: k for k, i in enumerate(dict.fromkeys(i for i, _ in words))}  # request → its history row
        width = max((len(w) - 1 for _, w in words), default=0)
        # right-aligned, -1 before a short one (history pads with -1 too: matched only where the word allows)
        self.history = torch.tensor([[-1] * (width - len(states[i].tail)) + states[i].tail for i in self.rows],
                                    dtype=torch.int64, device=device).reshape(len(self.rows), width)
        self.owner = [i for i, _ in words]
        self.prefixes = torch.tensor([[-1] * (width - len(w) + 1) + w[:-1] for _, w in words], dtype=torch.int64,
                                     device=device).reshape(len(words), width)
        self.checked = torch.tensor([[False] * (width - len(w) + 1) + [True] * (len(w) - 1) for _, w in words],
                                    dtype=torch.bool, device=device).reshape(len(words), width)
        self.last = int64_tensor([w[-1] for _, w in words], device)
        self.history_rows = int64_tensor([self.rows[i] for i in self.owner], device)

    def apply(self, logits: torch.Tensor, index: Sequence[int]) -> None:
        """``-inf``, in place, at each word's last token on the rows of ``index`` whose output and
        draft end with its other tokens (added: a word that does not match adds 0)."""
        row_of = {i: r for r, i in enumerate(index)}
        words = [(w, row_of[i]) for w, i in enumerate(self.owner) if i in row_of]
        if not words:
            return
        w = int64_tensor([w for w, _ in words], self.device)
        tail = self.history[self.history_rows[w], -self.prefixes.shape[1]:]
        matched = ((tail == self.prefixes[w]) | ~self.checked[w]).all(dim=1)
        logits.index_put_((int64_tensor([r for _, r in words], self.device), self.last[w]),
                          torch.where(matched, float("-inf"), 0.0), accumulate=True)

    def take(self, index: Sequence[int], tokens: torch.Tensor) -> None:
        if not self.rows:
            return
        column = torch.full((len(self.rows), 1), -1, dtype=torch.int64, device=self.device)
        rows = _rows(index, self.rows, self.device)
        if rows is not None:
            column[rows[1], 0] = tokens[rows[0]]
        self.history = torch.cat([self.history, column], dim=1)
