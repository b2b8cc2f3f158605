"""Families of the torch backend's cascade (:mod:`.torch_backend`): requests of a batch whose
rows begin with the same slots, found over the whole batch, nested where some share more."""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Tuple

import torch


class Family(NamedTuple):
    """Requests whose rows all hold the same slots ``[start, stop)``, before their queries (past
    the prefix of the family it nests in, if any): their query tokens attend those keys at once."""

    token_index: torch.Tensor  # [tokens] the members' query tokens in the batch's flat q
    kv_slots: torch.Tensor  # [stop - start] int64, the shared slots


def find_families(fb, min_shared_len: int) -> Tuple[List[Family], List[int]]:
    """The batch's families, and each request's ``shared_len``: the slots it shares with the
    deepest family it is in (0: none). A family is two or more requests whose rows hold the
    same ``min_shared_len`` or more slots from ``start`` on (0, or where the family it nests
    in stops), all before their first queries (so every query sees every shared key):
    requests whose rows hold the same slot at ``start`` and share at least that many with the
    first of them, sharing what all of them share; the others are tried again among
    themselves."""
    prefix_lens = fb.extend_prefix_lens_cpu
    shared_lens = [0] * len(prefix_lens)
    candidates = [i for i, prefix in enumerate(prefix_lens) if prefix >= min_shared_len]
    if len(candidates) < 2:
        return [], shared_lens
    rows = fb.req_to_token_pool.req_to_token[
        fb.req_pool_indices[torch.tensor(candidates, device=fb.seq_lens.device)],
        : max(prefix_lens[i] for i in candidates)]
    families: List[Family] = []
    todo = [(list(range(len(candidates))), 0)]  # rows (of ``rows``) that hold the same [0, start)
    while todo:
        members, start = todo.pop()
        room = {j: prefix_lens[candidates[j]] - start for j in members}  # slots it may share past start
        members = [j for j in members if room[j] >= min_shared_len]
        if len(members) < 2:
            continue
        by_slot: Dict[int, List[int]] = {}
        for j, slot in zip(members, rows[members, start].tolist()):
            by_slot.setdefault(slot, []).append(j)
        for same in by_slot.values():
            if len(same) < 2:
                continue
            runs = (rows[same, start:] == rows[same[0], start:]).cumprod(1).sum(1).tolist()
            shares = [min(run, room[j]) for j, run in zip(same, runs)]  # (the first's: all its room)
            family = [j for j, share in zip(same, shares) if share >= min_shared_len]
            rest = [j for j in same if j not in family]
            if rest:
                todo.append((rest, start))
            if len(family) > 1:
                stop = start + min(share for share in shares if share >= min_shared_len)
                members_of = [candidates[j] for j in family]
                families.append(build_family(fb, members_of, rows[family[0], start:stop]))
                for i in members_of:
                    shared_lens[i] = stop
                todo.append((family, stop))
    return families, shared_lens


def build_family(fb, members: List[int], kv_slots: torch.Tensor) -> Family:
    """``members``' family over ``kv_slots``, with their query tokens in the batch's order."""
    device = fb.seq_lens.device
    num_q = torch.tensor([fb.extend_seq_lens_cpu[i] for i in members], device=device)
    num_tokens = sum(fb.extend_seq_lens_cpu[i] for i in members)
    # member r's tokens: [extend_start_loc, + extend_len), at [cumsum(num_q) - num_q, cumsum(num_q)) here
    shift = fb.extend_start_loc[torch.tensor(members, device=device)] - (num_q.cumsum(0) - num_q)
    token_index = shift.repeat_interleave(num_q, output_size=num_tokens) + torch.arange(num_tokens, device=device)
    return Family(token_index, kv_slots.to(torch.int64))
