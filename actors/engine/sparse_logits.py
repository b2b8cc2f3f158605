"""A batch's allowed ids, logit bias, masks and penalties as sparse writes, not dense tensors.

What :func:`~actors.engine.sampling.logit_adjustments` and
:func:`~actors.engine.sampling.apply_penalties` define (the dense references), done as vLLM
and SGLang do it: each request's ``(token, value)`` pairs are built once, when it first needs
them (:class:`LogitState`, kept with the request), and its tokens seen so far grow by the new
tokens only (:class:`TokenCounts`); a step gathers the rows' pairs into ``(row, token, value)``
triples and writes them with ``index_put_``. A step's cost grows with the number of biased,
masked and seen tokens — never with ``batch x vocab`` (but for the rows with
``allowed_token_ids``: each a fill) and never with the prompt's length —, and a batch with none
of these leaves its logits alone.

Same order and values as the references, bit for bit on every adjusted token: ``-inf`` at every
id but ``allowed_token_ids`` (vLLM's first), ``logit_bias`` added, then ``-inf`` at EOS and
``stop_token_ids`` while a request has fewer than ``min_new_tokens`` tokens and at what its bad
words ban after its output (:func:`~actors.engine.sampling_params.bad_word_bans`), then
repetition (divide positive, multiply negative logits of the prompt's and output's tokens),
then frequency and presence (``-= f * count + p`` on the output's tokens).
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Iterable, List, Optional, Sequence

import numpy as np
import torch

from actors.engine.sampling_params import SamplingParams, bad_word_bans


class TokenCounts:
    """Distinct token ids in the order first added, each with how often it was added.
    ``ids`` and ``counts`` are views of buffers that grow by doubling: adding a token costs
    O(1) amortised, whatever was added before."""

    def __init__(self, tokens: Iterable[int] = ()):
        self._slots: dict = {}
        self._ids = np.empty(16, dtype=np.int64)
        self._counts = np.zeros(16, dtype=np.float32)  # (exact: counts stay far below 2 ** 24)
        self.add(tokens)

    def __len__(self) -> int:
        return len(self._slots)

    def add(self, tokens: Iterable[int]) -> None:
        for token, count in Counter(tokens).items():
            slot = self._slots.get(token)
            if slot is None:
                slot = self._slots[token] = len(self._slots)
                if slot == len(self._ids):
                    self._ids = np.concatenate([self._ids, np.empty_like(self._ids)])
                    self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
                self._ids[slot] = token
            self._counts[slot] += count

    def copy(self) -> "TokenCounts":
        """An independent copy (O(distinct tokens))."""
        other = TokenCounts()
        other._slots, other._ids, other._counts = dict(self._slots), self._ids.copy(), self._counts.copy()
        return other

    @property
    def ids(self) -> np.ndarray:
        """``[len(self)]`` int64 (a view of the buffer: read it before the next :meth:`add`)."""
        return self._ids[:len(self._slots)]

    @property
    def counts(self) -> np.ndarray:
        """``[len(self)]`` float32, the counts of :attr:`ids`."""
        return self._counts[:len(self._slots)]


class LogitState:
    """One request's sparse adjustments for a vocabulary of ``vocab`` ids (ids outside it are
    never sampled and are left out): its ``allowed_token_ids``, its ``logit_bias`` pairs, its
    min-tokens mask ids (EOS and ``stop_token_ids``), its bad words (``bad_words_ids``, the
    request's :func:`~actors.engine.sampling_params.bad_words_token_ids`) with the output's last
    tokens they are matched against, and, when it has penalties, the tokens of its prompt and
    output (repetition) and its output's counts (frequency, presence). :meth:`sync` takes the
    output's new tokens; an output that shrank is recounted."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], eos_token_ids: Sequence[int], vocab: int,
                 bad_words_ids: Sequence[Sequence[int]] = ()):
        self.params, self.vocab = params, vocab
        allowed = sorted({t for t in params.allowed_token_ids or () if t < vocab})
        self.allowed_ids = None if params.allowed_token_ids is None else np.array(allowed, dtype=np.int64)
        self.bad_words_ids = [list(word) for word in bad_words_ids]
        self.tail_len = max((len(word) - 1 for word in self.bad_words_ids), default=0)
        self.tail: List[int] = []  # the output's last tail_len tokens: what a bad word's start is matched against
        bias = [(t, b) for t, b in (params.logit_bias or {}).items() if t < vocab]
        self.bias_ids = np.array([t for t, _ in bias], dtype=np.int64)
        self.bias_values = np.array([b for _, b in bias], dtype=np.float32)
        masked = params.masked_token_ids(0, eos_token_ids) if params.min_new_tokens else []
        self.mask_ids = np.array([t for t in masked if 0 <= t < vocab], dtype=np.int64)
        self._prompt_ids = prompt_ids
        self.seen: Optional[TokenCounts] = None  # prompt and output: repetition
        self.output: Optional[TokenCounts] = None  # output only: frequency and presence
        self.num_generated = 0
        self._recount([])

    @staticmethod
    def needed(params: SamplingParams) -> bool:
        """Whether a request with ``params`` has anything to adjust (else it needs no state)."""
        return (bool(params.logit_bias) or params.min_new_tokens > 0 or params.has_penalties
                or params.allowed_token_ids is not None or bool(params.bad_words))

    def _recount(self, output_ids: Sequence[int]) -> None:
        p = self.params
        if p.repetition_penalty != 1.0:
            self.seen = TokenCounts(t for t in self._prompt_ids if 0 <= t < self.vocab)
            self.seen.add(t for t in output_ids if 0 <= t < self.vocab)
        if p.frequency_penalty or p.presence_penalty:
            self.output = TokenCounts(t for t in output_ids if 0 <= t < self.vocab)
        self.num_generated = len(output_ids)
        self._keep_tail(output_ids)

    def _keep_tail(self, output_ids: Sequence[int]) -> None:
        self.tail = list(output_ids[max(len(output_ids) - self.tail_len, 0):]) if self.tail_len else []

    def sync(self, output_ids: Sequence[int]) -> None:
        """Take the tokens of ``output_ids`` past those taken before (O(new tokens))."""
        if len(output_ids) < self.num_generated:
            self._recount(output_ids)
            return
        new = [t for t in output_ids[self.num_generated:] if 0 <= t < self.vocab]
        for counts in (self.seen, self.output):
            if counts is not None and new:
                counts.add(new)
        self.num_generated = len(output_ids)
        self._keep_tail(output_ids)

    def ahead(self, token: int) -> "LogitState":
        """A copy that has taken ``token`` after this one's output (the state a verify step's next
        draft position is adjusted by: its counts, its min-tokens mask), this one left as it is."""
        other = copy.copy(self)
        if 0 <= token < self.vocab:
            for name in ("seen", "output"):
                counts = getattr(self, name)
                if counts is not None:
                    setattr(other, name, counts.copy())
                    getattr(other, name).add([token])
        other.num_generated += 1
        other._keep_tail(self.tail + [token])
        return other

    def for_draft_step(self, num_drafted: int) -> "LogitState":
        """A copy that adjusts as this one would after ``num_drafted`` more tokens whose values the
        host does not know (a draft model's step: :mod:`actors.engine.draft_masks`): its allowed ids,
        bias, min-tokens mask (counting them) and one-token bad words; no penalties nor longer bad
        words (they depend on the tokens: the device computes them), this one left as it is."""
        other = copy.copy(self)
        other.seen = other.output = None
        other.tail = []  # (a longer bad word's other tokens never end an empty output)
        other.num_generated += num_drafted
        return other

    @property
    def masked(self) -> bool:
        """Whether the min-tokens mask holds for the next token."""
        return self.num_generated < self.params.min_new_tokens

    def banned_ids(self) -> np.ndarray:
        """The ids set to ``-inf`` for the next token: the min-tokens mask's while it holds, and
        what the bad words ban after the output."""
        banned = [t for t in bad_word_bans(self.bad_words_ids, self.tail) if 0 <= t < self.vocab]
        if not banned:
            return self.mask_ids if self.masked else self.mask_ids[:0]
        return np.array(([*self.mask_ids] if self.masked else []) + banned, dtype=np.int64)


class Triples:
    """``(row, token, value)`` triples gathered from the rows of a batch (host arrays), then as
    tensors on the logits' device (one copy each)."""

    def __init__(self):
        self.rows: List[int] = []
        self.lens: List[int] = []
        self.ids: List[np.ndarray] = []
        self.values: List[np.ndarray] = []

    def add(self, row: int, ids: np.ndarray, values: Optional[np.ndarray] = None) -> None:
        if len(ids):
            self.rows.append(row)
            self.lens.append(len(ids))
            self.ids.append(ids)
            if values is not None:
                self.values.append(values)

    def index(self, device):
        """``(rows, ids)`` on ``device``: the advanced index of every triple."""
        rows = np.repeat(np.array(self.rows, dtype=np.int64), self.lens)
        return torch.from_numpy(rows).to(device), torch.from_numpy(np.concatenate(self.ids)).to(device)

    def value(self, device) -> torch.Tensor:
        """The values given to :meth:`add`, one per triple."""
        return torch.from_numpy(np.concatenate(self.values)).to(device)

    def per_row(self, values: List[float], device) -> torch.Tensor:
        """One float32 value per row (``values``, in :meth:`add`'s order), repeated per triple."""
        return torch.from_numpy(np.repeat(np.array(values, dtype=np.float32), self.lens)).to(device)


def adjust_logits(logits: torch.Tensor, states: Sequence[Optional[LogitState]], in_place: bool = False) -> torch.Tensor:
    """The batch's logits ``[bs, vocab]`` after its rows' allowed ids, bias, masks and penalties
    (``states[i]`` for row ``i``, synced to its output; None: nothing), with only the listed
    tokens written: into ``logits`` themselves when ``in_place`` and they are float32 (no dense
    copy, as vLLM's logits processors), else into a float32 copy; ``logits`` untouched when no
    row adjusts anything."""
    allowed, bias, masks, seen, output = Triples(), Triples(), Triples(), Triples(), Triples()
    rep, freq, pres = [], [], []
    for row, state in enumerate(states):
        if state is None:
            continue
        if state.allowed_ids is not None:
            allowed.add(row, state.allowed_ids)
        bias.add(row, state.bias_ids, state.bias_values)
        masks.add(row, state.banned_ids())
        if state.seen is not None and len(state.seen):
            seen.add(row, state.seen.ids)
            rep.append(state.params.repetition_penalty)
        if state.output is not None and len(state.output):
            output.add(row, state.output.ids, state.output.counts)
            freq.append(state.params.frequency_penalty)
            pres.append(state.params.presence_penalty)
    if not (allowed.rows or bias.rows or masks.rows or seen.rows or output.rows):
        return logits
    with torch.inference_mode():  # (a forward's logits are inference tensors: written in place only so)
        return _write(logits if in_place and logits.dtype == torch.float32 else logits.to(torch.float32, copy=True),
                      allowed, bias, masks, seen, output, rep, freq, pres)


def _write(out: torch.Tensor, allowed: Triples, bias: Triples, masks: Triples, seen: Triples, output: Triples,
           rep: List[float], freq: List[float], pres: List[float]) -> torch.Tensor:
    """:func:`adjust_logits`'s writes into ``out``, in the references' order."""
    device = out.device
    if allowed.rows:  # the allowed values kept, their rows filled with -inf, the values put back
        index = allowed.index(device)
        kept = out[index]
        out.index_fill_(0, torch.tensor(allowed.rows, device=device), float("-inf"))
        out.index_put_(index, kept)
    if bias.rows:
        out.index_put_(bias.index(device), bias.value(device), accumulate=True)
    if masks.rows:  # after the bias: a masked token stays -inf whatever its bias
        out.index_put_(masks.index(device), torch.tensor(float("-inf"), device=device))
    if seen.rows:
        index = seen.index(device)
        vals, penalty = out[index], seen.per_row(rep, device)
        out[index] = torch.where(vals > 0, vals / penalty, vals * penalty)
    if output.rows:
        index = output.index(device)
        counts = output.value(device)
        out[index] -= output.per_row(freq, device) * counts + output.per_row(pres, device)
    return out
