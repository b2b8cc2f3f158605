"""Speculative decoding: drafts verified in one forward of the target.

A decode step of the running batch becomes a verify step when some request has a draft: up
to ``speculative_num_draft_tokens`` tokens that followed, earlier in its prompt or output, the
longest n-gram its sequence ends with (``ngram``: :mod:`actors.engine.ngram`, vLLM's prompt
lookup), or that a small draft model proposes (``draft_model``: :mod:`actors.engine.draft_model`,
SGLang's STANDALONE; it writes its own KV into the step's slots as it drafts). Each request
extends by its last sampled token and its draft (``1 + d`` tokens, ``d = 0`` for one without a
draft) over its committed prefix, through the attention backends'
extend path, and the forward returns the logits at every one of those tokens
(``ForwardMode.TARGET_VERIFY``). A greedy request keeps the longest draft prefix that equals
the argmax at each position and the argmax after it (the bonus token): the tokens plain decode
would have produced, several per step. A sampled request goes through vLLM's rejection sampler
for a one-hot draft (:func:`~actors.engine.spec_accept.rejection_sample`): each token is what
plain sampling would draw, in distribution (a seeded request stays reproducible, but its draws
are not plain decoding's).

Each draft position is picked as plain decoding's step there would pick: the row that picks the
token after ``draft[:j]`` takes the request's allowed ids, ``logit_bias``, min-tokens and
bad-words masks and its penalties with ``draft[:j]`` counted as output
(:meth:`~actors.engine.sparse_logits.LogitState.ahead`), and its grammar's mask after
``draft[:j]``, accepted into the matcher tentatively and rolled back
(:func:`~actors.engine.spec_accept.apply_draft_grammar_masks`); a draft is cut before the first
token its grammar refuses (never pickable). Each emitted token's logprobs come from its row's
raw logits, as a decode step's. Only a request whose grammar is held back for its thinking takes
no draft (a draft token could close the tag, after which the grammar masks): it decodes as
before, in the same batch, with ``d = 0``.

KV (for request ``i``, ``L`` its length before the step, ``a`` drafts accepted)::

    [0, L - 1)         committed before the step
    [L - 1, L + d)     allocated for the step (``kv_allocated_len``), written by the forward
                       (a draft model's draft: allocated for its length before a grammar cut)
    [0, L + a)         committed after it: the last token and the accepted drafts (the bonus has no KV yet)
    [ceil_page(L + a), L + d)   the rejected drafts' whole pages: freed at once

so after every step ``kv_allocated_len == kv_committed_len`` again, as after a plain decode
step, and the tree cache only ever sees committed tokens. A rejected draft's slot inside the
last, partial page stays the row's (it owns the page) and is written again by the next step.
A run cut short by a finish (EOS, a stop string, ``max_new_tokens``) commits only the tokens
before the finish, exactly where plain decode would have stopped.

Sliding-window models (KV cache kind ``"swa"``, SGLang's ``is_hybrid_swa``): every slot above is a
full slot and an SWA slot allocated together, and a rejected draft's whole pages are freed in both
pools alike. The window slides by committed tokens only: before the step, as before a decode step,
the SWA slots of each request's tokens that left the window of ``kv_committed_len`` are freed
(:func:`~actors.engine.schedule_batch.free_swa_out_of_windows`), never by the drafts' length, so a
rejected draft takes no key from the window of the positions after it. The forward's sliding-window
layers mask each row by its own position (the extend path's), their sinks included: every draft
position sees the keys plain decode would.

Mamba hybrids (Qwen3-Next, KV cache kind ``"hybrid_mamba"``; SGLang's EAGLE on them): a request's
recurrent state cannot drop a token, so the verify forward leaves each request's state slot as it
was and writes the linear-attention layers' conv and SSM state after each of its ``1 + d`` tokens to
the Mamba pool's verify scratch (a state per request row and verify token, allocated at start and
counted in the memory budget). After acceptance the state after the last committed token is copied
into the slot, the whole batch's in one copy (:meth:`SpecDecodeMixin._commit_verified_states`): a
rejected draft leaves no trace, and the slot holds the state of ``kv_committed_len`` tokens, as after
plain decode steps, for the radix cache to insert. With ``extra_buffer`` a checkpoint a decode step
among the committed ones would have saved (at a multiple of ``mamba_track_interval``) is copied from
the scratch likewise, in the same copy.

The drafts' slots are held for one step only, so no reserve counts them — neither admission's
decode reserve nor a PD decode worker's reservations (``num_reserved_decode_tokens``): they are
taken when free after eviction, else the step runs as a plain decode step, which alone retracts
when short. Under PD the decode worker speculates (the cluster's ``decode.engine``); a prefill
worker refuses the setting (:func:`~actors.engine.config.prefill_speculative_error`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from actors.engine.forward_batch import ForwardBatch, ForwardMode, int64_tensor
from actors.engine.grammar import active_matcher
from actors.engine.ngram import NgramIndex
from actors.engine.req import Req
from actors.engine.sampling import Pick, argmax_rows, logprob_picks, sampling_probs
from actors.engine.draft_masks import DraftMasks
from actors.engine.spec_accept import (accept_greedy, apply_draft_grammar_masks, grammar_prefix, position_states,
                                       rejection_sample)
from actors.engine.schedule_batch import (_NO_SLOTS, _last_locs, _mamba_indices, _mamba_tracks, _mm_extend_fields,
                                         _table_rows, alloc_extend_slots, extend_batch, free_swa_out_of_windows)
from actors.engine.sparse_logits import adjust_logits


def draftable(req: Req) -> bool:
    """Whether ``req`` may take a draft: not while its grammar is held back for its thinking."""
    return req.grammar is None or active_matcher(req.grammar) is not None


@dataclass
class SpecStats:
    """Counts over verify steps, per request with a draft (vLLM's spec-decode metrics)."""

    num_drafts: int = 0  # request-steps that had a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: drafts whose token at position i was accepted (as long as the longest draft so far)
    num_accepted_tokens_per_pos: List[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verify step: a draft of ``num_draft_tokens``, its first ``num_accepted`` kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos += [0] * (num_draft_tokens - len(per_pos))
        for pos in range(num_accepted):
            per_pos[pos] += 1

    def as_dict(self) -> Dict[str, Any]:
        """The counts, the acceptance rate (accepted / drafted tokens) and the mean accepted length
        (tokens a drafted request gets per step, its bonus token included)."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "acceptance_rate": self.num_accepted_tokens / max(1, self.num_draft_tokens),
                "mean_accepted_len": (self.num_accepted_tokens + self.num_drafts) / max(1, self.num_drafts)}


def alloc_verify_slots(reqs: List[Req], draft_lens: List[int], runner, tree_cache) -> bool:
    """Slots for each request's last sampled token and a draft of ``draft_lens[i]`` tokens,
    positions ``[seqlen - 1, seqlen + draft_lens[i])`` (one ``alloc_extend`` over the batch, the
    last partial page filled first), written into the rows; False, having taken nothing, when
    they cannot be had even after eviction. Sliding-window models first free the SWA slots of the
    tokens out of the committed windows, as a decode step."""
    pool = runner.req_to_token_pool
    free_swa_out_of_windows(reqs, tree_cache)
    prefix_lens = [r.seqlen - 1 for r in reqs]
    extend_lens = [1 + n for n in draft_lens]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    prefix_t = int64_tensor(prefix_lens)
    last_loc = _last_locs(runner.allocator, pool, _table_rows(pool, reqs), prefix_t)
    out = alloc_extend_slots(runner, tree_cache, prefix_t, int64_tensor(seq_lens), last_loc, sum(extend_lens))
    if out is None:
        return False
    pool.write_extend([r.req_pool_idx for r in reqs], [_NO_SLOTS] * len(reqs), prefix_lens, extend_lens, out)
    for req, s in zip(reqs, seq_lens):
        req.kv_allocated_len = s
    return True


def verify_batch(reqs: List[Req], drafts: List[List[int]], runner) -> ForwardBatch:
    """The verify forward of each request's last sampled token and its draft, into the slots its
    row holds there (:func:`alloc_verify_slots`'; a draft cut after they were taken uses the first); an
    image request's tokens at their M-RoPE positions, past its prompt (a decode step's)."""
    table = runner.req_to_token_pool.req_to_token
    input_ids, positions, rows = [], [], []
    for req, draft in zip(reqs, drafts):
        input_ids += [req.output_ids[-1]] + draft
        positions.extend(range(req.seqlen - 1, req.seqlen + len(draft)))
        rows += [req.req_pool_idx] * (1 + len(draft))
    out = table[int64_tensor(rows, table.device), int64_tensor(positions, table.device)]
    prefix_lens = [r.seqlen - 1 for r in reqs]
    seq_lens = [r.seqlen + len(d) for r, d in zip(reqs, drafts)]
    return extend_batch(ForwardMode.TARGET_VERIFY, runner, reqs, input_ids, positions, out, prefix_lens, seq_lens,
                        spec_draft_tokens=drafts,
                        mamba_pool_indices=_mamba_indices(runner.req_to_token_pool, reqs, runner),
                        **_mm_extend_fields(reqs, prefix_lens, seq_lens, runner))


class SpecDecodeMixin:
    """The verify step of the scheduler's ``running`` batch. Reads the scheduler's ``runner``,
    ``config``, ``tree_cache``, ``running`` and ``hybrid``; :meth:`_process_decode` commits the runs."""

    def _init_spec(self) -> None:
        self.spec_stats = SpecStats()
        self.speculative = self.config.speculative_algorithm is not None

    def _prepare_verify(self) -> Optional[ForwardBatch]:
        """The running batch's verify step, or None: speculation off, no request has a draft, or
        no room for the drafts (the caller then runs a plain decode step)."""
        if not self.speculative:
            return None
        reqs, runner = self.running, self.runner
        rooms = [self._draft_room(r) for r in reqs]
        if runner.draft is None:
            drafts = [self._grammar_cut(r, self._ngram_draft(r, n)) if n else [] for r, n in zip(reqs, rooms)]
            rooms = [len(d) for d in drafts]
        if not any(rooms) or not alloc_verify_slots(reqs, rooms, runner, self.tree_cache):
            return None
        if runner.draft is not None:  # (its steps write the draft's KV into the slots just taken; a cut
            # draft leaves the slots past it to the step's frees; an undrafted request's masks would
            # only adjust a row no draft token comes from: its dense rows and uploads are left out)
            vocab = runner.draft.vocab_size
            masks = DraftMasks([self._logit_state(r, vocab) if n else None for r, n in zip(reqs, rooms)],
                               [active_matcher(r.grammar) if n else None for r, n in zip(reqs, rooms)])
            drafts = [self._grammar_cut(r, d) for r, d in zip(reqs, runner.draft.propose(
                reqs, rooms, runner.req_to_token_pool, masks if masks.needed else None))]
        return verify_batch(reqs, drafts, runner)

    def _draft_room(self, req: Req) -> int:
        """The most draft tokens ``req`` may take: none past the token before its ``max_new_tokens``
        (the step's own token comes after the draft; a longer one could never be kept), nor, with a
        draft model, a draft step's position past the draft's context (``max_context_len``)."""
        room = min(self.config.speculative_num_draft_tokens,
                   req.sampling_params.max_new_tokens - len(req.output_ids) - 1)
        if self.runner.draft is not None:  # (its steps feed positions seqlen - 1 .. seqlen - 1 + room)
            room = min(room, self.runner.draft.max_context_len - req.seqlen)
        return max(0, room) if draftable(req) else 0

    def _ngram_draft(self, req: Req, room: int) -> List[int]:
        cfg = self.config
        if req.ngram_index is None:
            req.ngram_index = NgramIndex(cfg.speculative_ngram_min, cfg.speculative_ngram_max)
        req.ngram_index.sync(req.origin_input_ids_unpadded, req.output_ids)  # (an image's tokens: the image token)
        return req.ngram_index.propose(room)

    @staticmethod
    def _grammar_cut(req: Req, draft: List[int]) -> List[int]:
        """``draft`` cut before the first token ``req``'s grammar refuses."""
        matcher = active_matcher(req.grammar)
        return draft if matcher is None or not draft else grammar_prefix(matcher, draft)

    def _process_verify(self, reqs: List[Req], forward_batch: ForwardBatch, logits: torch.Tensor) -> List[Req]:
        """A verify forward's results: each request's run of tokens (:meth:`_verify_runs`) taken as
        that many decode steps would have."""
        # (rows of ``logits`` are tokens: the failed-load check filters request indices instead)
        reqs, kept = self._requeue_failed_loads(reqs, lambda r: r.seqlen - 1, torch.arange(len(reqs)))
        kept = kept.tolist()
        starts = np.cumsum([0] + forward_batch.extend_seq_lens_cpu)
        drafts = [forward_batch.spec_draft_tokens[i] for i in kept]
        runs = self._verify_runs(reqs, drafts, [int(starts[i]) for i in kept], logits)
        for draft, run in zip(drafts, runs):
            if draft:
                self.spec_stats.observe(len(draft), len(run) - 1)
        return self._process_decode(reqs, runs, verified=True)

    def _verify_runs(self, reqs: List[Req], drafts: List[List[int]], starts: List[int],
                     logits: torch.Tensor) -> List[List[Pick]]:
        """Each request's picks: one from its only row (no draft: picked as a decode step picks),
        or its accepted draft tokens and the token after them (:meth:`_drafted_runs`)."""
        runs: List[List[Pick]] = [[] for _ in reqs]
        plain = [i for i, d in enumerate(drafts) if not d]
        if plain:
            rows = torch.tensor([starts[i] for i in plain], device=logits.device)
            for i, pick in zip(plain, self._pick_tokens([reqs[i] for i in plain], logits[rows])):
                runs[i] = [pick]
        drafted = [i for i, d in enumerate(drafts) if d]
        if drafted:
            rows = logits[self._draft_rows(drafted, drafts, starts, logits)]
            picked = self._drafted_runs([reqs[i] for i in drafted], [drafts[i] for i in drafted], rows)
            for i, run in zip(drafted, picked):
                runs[i] = run
        return runs

    def _drafted_runs(self, reqs: List[Req], drafts: List[List[int]], rows: torch.Tensor) -> List[List[Pick]]:
        """The runs of drafted requests from their ``rows`` (a copy of the logits: request ``i``'s
        ``len(drafts[i]) + 1`` in a row), each row adjusted and masked as plain decoding's step at
        its position (the module's docstring); greedy ones from one argmax (:func:`accept_greedy`),
        sampled ones through :func:`rejection_sample`; logprobs from the emitted tokens' raw rows."""
        lens = [len(d) + 1 for d in drafts]
        starts = np.cumsum([0] + lens).tolist()
        params = [r.sampling_params for r, n in zip(reqs, lens) for _ in range(n)]
        with torch.inference_mode():  # (a forward's logits are inference tensors: written in place only so)
            rows = rows.float()
            raw = rows.clone() if any(p.return_logprob for p in params) else None
            states = [state for r, d in zip(reqs, drafts)
                      for state in position_states(self._logit_state(r, rows.shape[-1]), d)]
            rows = adjust_logits(rows, states, in_place=True)
            apply_draft_grammar_masks(rows, [active_matcher(r.grammar) for r in reqs], drafts)
        tokens: List[List[int]] = [[] for _ in reqs]
        greedy = [i for i, r in enumerate(reqs) if r.sampling_params.is_greedy]
        if greedy:
            targets = argmax_rows(rows[self._draft_rows(greedy, drafts, starts, rows)]).tolist()
            for i in greedy:
                tokens[i] = accept_greedy(drafts[i], targets[:lens[i]])
                targets = targets[lens[i]:]
        sampled = [i for i, r in enumerate(reqs) if not r.sampling_params.is_greedy]
        if sampled:
            index = self._draft_rows(sampled, drafts, starts, rows)
            probs = sampling_probs(rows[index], [params[k] for k in index.tolist()])
            picked = rejection_sample(probs, [drafts[i] for i in sampled],
                                      [reqs[i].generator_on(rows.device) for i in sampled])
            for i, run in zip(sampled, picked):
                tokens[i] = run
        runs = [[Pick(t) for t in run] for run in tokens]
        with_logprobs = [i for i, r in enumerate(reqs) if r.sampling_params.return_logprob]
        if with_logprobs:  # (emitted token j of request i: picked from its row starts[i] + j)
            index = [starts[i] + j for i in with_logprobs for j in range(len(tokens[i]))]
            picks = iter(logprob_picks(raw[torch.tensor(index, device=rows.device)],
                                       torch.tensor([t for i in with_logprobs for t in tokens[i]], device=rows.device),
                                       [params[k] for k in index]))
            for i in with_logprobs:
                runs[i] = [next(picks) for _ in tokens[i]]
        return runs

    @staticmethod
    def _draft_rows(index: List[int], drafts: List[List[int]], starts: List[int], logits) -> torch.Tensor:
        """The rows of requests ``index`` (each its last sampled token's and its draft's), request
        ``i``'s from ``starts[i]`` on."""
        return torch.tensor([starts[i] + j for i in index for j in range(len(drafts[i]) + 1)], device=logits.device)

    def _verified_state_commits(self, req: Req, num_kept: int) -> List[Tuple[int, int, int]]:
        """Hybrid models: the (row, verify position, slot) commits of ``req``'s Mamba state after the
        ``num_kept`` tokens of its verify step it committed, from the verify scratch into its slot (the
        forward left the slot as it was); with extra_buffer, of the state at the last multiple of
        ``mamba_track_interval`` among them, if any, into its next track slot, as a decode step there
        would have saved it. :meth:`_commit_verified_states` makes a step's commits at once."""
        if not self.hybrid:
            return []
        commits = [(req.req_pool_idx, num_kept - 1, req.mamba_pool_idx)]
        interval, computed = self.config.mamba_track_interval, req.kv_committed_len
        tracked = computed // interval * interval
        pool = self.runner.req_to_token_pool
        if pool.enable_mamba_extra_buffer and tracked > computed - num_kept:
            (slot,), _ = _mamba_tracks(pool, [req], [tracked])
            commits.append((req.req_pool_idx, tracked - (computed - num_kept) - 1, slot))
        return commits

    def _commit_verified_states(self, commits: List[Tuple[int, int, int]]) -> None:
        """A verify step's state commits, all its requests' in one (one copy per state tensor, one
        op for TP followers to replay, not one per request)."""
        if commits:
            self.runner.req_to_token_pool.mamba_pool.commit_verify_states(*zip(*commits))

    def _free_draft_slots(self, req: Req) -> None:
        """Free the whole pages of ``req``'s row past its committed KV (a verify step's rejected
        drafts; none after a plain decode step), so that it holds what a plain decode step leaves."""
        ps = self.page_size
        start = -(-req.kv_committed_len // ps) * ps
        if start < req.kv_allocated_len:
            slots = self.runner.req_to_token_pool.req_to_token[req.req_pool_idx, start:req.kv_allocated_len]
            self.runner.allocator.free(slots.to(torch.int64).clone())
        req.kv_allocated_len = req.kv_committed_len
