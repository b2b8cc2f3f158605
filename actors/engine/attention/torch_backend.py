"""Reference attention over the paged KV cache, in plain PyTorch, batched over requests.

Once a forward, requests are packed into groups of similar lengths. Once a layer, each group
attends all its queries, padded to ``[b, max_q]``, in chunks of query rows; a chunk gathers the
K/V its rows see in one ``index_select`` into a padded table (padding reads the dummy slot 0) and
attends them through the CPU's fused ``scaled_dot_product_attention`` (GQA without repeating K/V,
no scores tensor), or with fp32 scores written out where that kernel falls short (a soft cap,
MLA's narrower values). A full-attention layer's chunks see each request's whole context up to
their last query; a sliding-window layer's only the keys in their queries' windows (so each row's
columns start at its own position), and its chunks are about a window of queries, so a long
prompt costs O(n·window) there, not O(n²). An additive bias masks causality, each request's
length and the sliding window. Padding and memory are bounded: a member's padded score cells
stay within ``MAX_PADDING`` × its useful ones (a lone long request is a group of its own); a
group's fp32 K/V plus one query row of scores stay within ``max_chunk_bytes`` (unless one
request's alone do not), and its query chunks' fp32 scores and bias do.

Requests whose rows begin with the same run of slots (a prefix the radix cache matched, before all
their queries) form a family, found over the whole batch, and a full-attention layer attends them in
cascade (FlashInfer's cascade attention, SGLang's shared-prefix attention): the shared prefix's K/V
are gathered once, and all the family's query tokens attend them in one call, with no mask (every
query sees every shared key); members that share more than the family form a family again, nested
in it, over the slots past its prefix. A request's own keys (past the deepest prefix it shares) are
packed, gathered and attended as above, by their length, not its context's (a 300- and a
3,000-token conversation after the same system prompt pad nothing over it), and the results merge
by their log-sum-exps. Without it, every member gathered the shared K/V again, a layer and a
forward at a time. The shared keys run in chunks of keys and of query tokens within
``max_chunk_bytes``; their merged results are fp32, a row a query token, as the output is.

A layer with attention sinks (GPT-OSS) attends through the log-sum-exp path; once a query's keys
are all merged, the sink's share of the denominator is taken out of its result (``attend_sinks``).
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from actors.engine.attention.attention_math import (attend_shared, attend_sinks, attention_with_lse, explicit_attention,
                                                     merge_attention)
from actors.engine.attention.cascade import Family, find_families

MAX_PADDING = 2  # a request's padded score cells, at most this many times its useful ones
MAX_CHUNK_BYTES = 256 << 20
MIN_WINDOW_ROWS = 128  # a sliding-window layer's query chunk, at least (smaller ones cost more in ops than they save)
MIN_SHARED_LEN = 64  # a shared prefix attended in cascade, at least (a shorter one saves less than its call costs)


def context_kv_slots(forward_batch, layer, slots: torch.Tensor) -> torch.Tensor:
    """Rows of ``layer``'s K/V buffers that hold full slots ``slots`` (any shape): the slots
    themselves, or their SWA rows for a sliding-window layer of an SWA pool."""
    translate = getattr(forward_batch.token_to_kv_pool, "translate_layer_loc", None)
    return translate(layer.layer_id, slots) if translate is not None else slots


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window) -> torch.Tensor:
    """True where query at ``q_pos`` (``[..., q]``) may attend key at ``k_pos`` (``[..., k]``): ``[..., q, k]``."""
    k_pos = k_pos[..., None, :]
    allowed = k_pos <= q_pos[..., None]
    if sliding_window is not None:
        allowed &= k_pos > q_pos[..., None] - sliding_window
    return allowed


def window_start(pos: int, sliding_window) -> int:
    """The first key position a query at ``pos`` sees."""
    return 0 if sliding_window is None else max(0, pos - sliding_window + 1)


def gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``buf[slots]`` for a 2-D ``slots``; ``index_select`` over the flat slots copies whole
    rows, about 3× faster on the CPU than advanced indexing."""
    return buf.index_select(0, slots.flatten()).view(*slots.shape, *buf.shape[1:])


def gather_kv(forward_batch, layer, slots: torch.Tensor, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """``layer``'s K and V at full slots ``slots`` (``[b, keys]``), ``[b, kv_heads, keys, dim]`` in
    fp32 after ``dtype`` (the model's), as HF rounds."""
    pool = forward_batch.token_to_kv_pool
    slots = context_kv_slots(forward_batch, layer, slots)
    k = gather(pool.get_key_buffer(layer.layer_id), slots).to(dtype).float().transpose(1, 2)
    v_buf = pool.get_value_buffer(layer.layer_id)[..., : layer.v_head_dim]
    return k, gather(v_buf, slots).to(dtype).float().transpose(1, 2)


def key_bytes(layer) -> int:
    """fp32 bytes a key takes in a chunk: its K and V, and one query row's scores over it."""
    return 4 * (layer.num_heads + layer.num_kv_heads * (layer.head_dim + layer.v_head_dim))


class KeyRange(NamedTuple):
    """The keys a group's layers of one sliding window gather: row ``r``'s column ``c`` is its key
    at position ``first[r] + c``, ``first[r]`` the first one its first new token sees."""

    first: List[int]
    kv_slots: torch.Tensor  # [b, num_k] full KV slots; slot 0 (the dummy) past seq_len
    k_pos: torch.Tensor  # [b, num_k] their positions (past seq_len too: no query sees those)


class AttnGroup(NamedTuple):
    """Requests attended together. Row ``r`` is one request; query column ``j`` is its
    ``min(j, extend_len - 1)``-th new token, so padded columns repeat its last query (never a
    row with nothing to attend) and write to a scratch row, ``out``'s last, past the batch's
    tokens (dropped: no boolean mask, which would wait for CUDA on every layer)."""

    q_index: torch.Tensor  # [b, max_q] token index in the batch's flat q
    q_pos: torch.Tensor  # [b, max_q] position of that query in its request
    out_index: torch.Tensor  # [b, max_q] q_index, or -1 (the scratch row) on padded columns
    token_slots: torch.Tensor  # [b, max_k] int64, the members' req_to_token rows up to the longest seq_len
    prefix_lens: List[int]
    seq_lens: List[int]
    shared_lens: List[int]  # each row's slots shared with its families, before its queries (0: none)
    key_ranges: Dict[object, KeyRange]  # by sliding_window

    def keys(self, sliding_window) -> KeyRange:
        """Built at a forward's first layer of each window: ``[window_start(prefix_len), seq_len)``
        of each request, so a sliding-window layer never reads the slots that slid out (an SWA
        pool may have freed them: they translate to slot 0, or to a row reused since); for a
        full-attention layer, ``[shared_len, seq_len)``, the keys past its families' prefixes."""
        if sliding_window not in self.key_ranges:
            device = self.q_pos.device
            first = [shared if sliding_window is None else window_start(prefix, sliding_window)
                     for prefix, shared in zip(self.prefix_lens, self.shared_lens)]
            num_k = max(seq_len - f for seq_len, f in zip(self.seq_lens, first))
            k_pos = torch.tensor(first, device=device)[:, None] + torch.arange(num_k, device=device)
            inside = k_pos < torch.tensor(self.seq_lens, device=device)[:, None]
            kv_slots = self.token_slots.gather(1, k_pos * inside).masked_fill_(~inside, 0)
            self.key_ranges[sliding_window] = KeyRange(first, kv_slots, k_pos)
        return self.key_ranges[sliding_window]


def pack_requests(key_lens: List[int], extend_lens: List[int], fits) -> List[List[int]]:
    """Requests grouped greedily, most keys first (a request's keys: its context, or past the
    prefix its families share): a group takes the next request while every member's padded row
    (``max_q × max_k`` score cells) stays within ``MAX_PADDING`` × its useful ones (``extend_len ×
    key_len``), so the whole batch pads at most that much, and while ``fits(b, max_k)``. A request
    no other fits beside is a group of its own."""
    groups: List[List[int]] = []
    order = sorted(range(len(key_lens)), key=lambda i: (key_lens[i], extend_lens[i]), reverse=True)
    max_q = least_useful = 0
    for i in order:
        useful = extend_lens[i] * key_lens[i]
        wider_q, least = max(max_q, extend_lens[i]), min(least_useful, useful)
        if groups:
            max_k = key_lens[groups[-1][0]]
            if wider_q * max_k <= MAX_PADDING * least and fits(len(groups[-1]) + 1, max_k):
                groups[-1].append(i)
                max_q, least_useful = wider_q, least
                continue
        groups.append([i])
        max_q, least_useful = extend_lens[i], useful
    return groups


class TorchAttnBackend:
    def __init__(self, max_chunk_bytes: int = MAX_CHUNK_BYTES, min_window_rows: int = MIN_WINDOW_ROWS,
                 min_shared_len: int = MIN_SHARED_LEN, **_):
        self.max_chunk_bytes, self.min_window_rows = max_chunk_bytes, min_window_rows
        self.min_shared_len = min_shared_len
        self.forward_batch = None
        self.families: Optional[Tuple[List[Family], List[int]]] = None  # and each request's shared_len
        # by (num_heads, bytes per key column, full attention)
        self.groups: Dict[Tuple[int, int, bool], List[AttnGroup]] = {}

    def init_forward_metadata(self, forward_batch) -> None:
        """Forget the last forward's families and groups; this one's are built at its first layer
        (of each shape, for groups)."""
        self.forward_batch, self.families, self.groups = forward_batch, None, {}

    def batch_families(self) -> Tuple[List[Family], List[int]]:
        """:func:`find_families` of the forward, found at its first full-attention layer."""
        if self.families is None:
            self.families = find_families(self.forward_batch, self.min_shared_len)
        return self.families

    def layer_groups(self, layer) -> List[AttnGroup]:
        """Requests packed by the keys the layer gathers for them: past their shared prefixes on a
        full-attention layer, their contexts on a sliding-window one (which attends no family)."""
        column_bytes = key_bytes(layer)  # (per key column of a one-request group)
        key = (layer.num_heads, column_bytes, layer.sliding_window is None)
        if key not in self.groups:
            fb = self.forward_batch
            fits = lambda b, max_k: b * max_k * column_bytes <= self.max_chunk_bytes  # noqa: E731
            shared_lens = self.batch_families()[1] if layer.sliding_window is None else [0] * len(fb.seq_lens_cpu)
            key_lens = [seq_len - shared for seq_len, shared in zip(fb.seq_lens_cpu, shared_lens)]
            self.groups[key] = [self.build_group(members, shared_lens)
                                for members in pack_requests(key_lens, fb.extend_seq_lens_cpu, fits)]
        return self.groups[key]

    def build_group(self, members: List[int], shared_lens: List[int]) -> AttnGroup:
        fb = self.forward_batch
        device = fb.seq_lens.device
        take = lambda values: torch.tensor([values[i] for i in members], device=device)  # noqa: E731
        seq_lens, prefix_lens, extend_lens = fb.seq_lens_cpu, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu
        num_q, prefixes = take(extend_lens), take(prefix_lens)
        cols = torch.arange(max(extend_lens[i] for i in members), device=device)
        offset = torch.minimum(cols[None, :], num_q[:, None] - 1)
        max_k = max(seq_lens[i] for i in members)
        rows = fb.req_pool_indices[torch.tensor(members, device=device)]
        q_index = fb.extend_start_loc[torch.tensor(members, device=device)][:, None] + offset
        return AttnGroup(
            q_index=q_index, q_pos=prefixes[:, None] + offset,
            out_index=q_index.masked_fill(cols[None, :] >= num_q[:, None], -1),
            token_slots=fb.req_to_token_pool.req_to_token[rows, :max_k].to(torch.int64),
            prefix_lens=[prefix_lens[i] for i in members], seq_lens=[seq_lens[i] for i in members],
            shared_lens=[shared_lens[i] for i in members], key_ranges={},
        )

    def forward(self, q: torch.Tensor, layer, forward_batch, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``sinks``: the layer's per-head sink logits (:func:`attend_sinks`), or None."""
        window = layer.sliding_window
        sinks = None if sinks is None else sinks.float()
        out = q.new_empty(q.shape[0] + 1, layer.num_heads, layer.v_head_dim)  # + the scratch row
        shared = self.attend_families(q, layer) if window is None and self.batch_families()[0] else None
        for group in self.layer_groups(layer):
            b, max_q = group.q_index.shape
            num_k = group.keys(window).k_pos.shape[1]
            rows = max(1, self.max_chunk_bytes // (4 * b * layer.num_heads * num_k))
            if window is not None:  # a chunk sees about rows + window keys: O(n·window) for n queries, not O(n²)
                rows = min(rows, max(self.min_window_rows, window))
            for start in range(0, max_q, rows):
                self.attend_rows(q, layer, forward_batch, group, start, min(start + rows, max_q), out,
                                 shared if any(group.shared_lens) else None, sinks)
        return out[:-1]

    def attend_families(self, q, layer) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each family's query tokens over its shared keys, a chunk of keys (gathered once for all
        of them) and of tokens at a time within ``max_chunk_bytes``, merged by log-sum-exp, nested
        families' with their outer ones': per query token, attention over all its shared keys
        (fp32, ``[tokens, heads, v_head_dim]``) and its log-sum-exp (``[tokens, heads]``; -inf,
        which weighs as nothing, for a token in no family)."""
        fb = self.forward_batch
        shared_o = q.new_zeros(q.shape[0], layer.num_heads, layer.v_head_dim, dtype=torch.float32)
        shared_lse = q.new_full((q.shape[0], layer.num_heads), float("-inf"), dtype=torch.float32)
        num_k = max(1, self.max_chunk_bytes // key_bytes(layer))
        for family in self.batch_families()[0]:
            for lo in range(0, family.kv_slots.shape[0], num_k):
                k, v = gather_kv(fb, layer, family.kv_slots[None, lo : lo + num_k], q.dtype)
                rows = max(1, self.max_chunk_bytes // (4 * layer.num_heads * k.shape[2]))
                for start in range(0, family.token_index.shape[0], rows):
                    index = family.token_index[start : start + rows]
                    o, lse = attend_shared(q[index].float(), k, v, layer)
                    shared_o[index] = merge_attention(o, lse, shared_o[index], shared_lse[index])
                    shared_lse[index] = torch.logaddexp(lse, shared_lse[index])
        return shared_o, shared_lse

    @staticmethod
    def attend_rows(q, layer, forward_batch, group: AttnGroup, start: int, stop: int, out: torch.Tensor,
                    shared: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                    sinks: Optional[torch.Tensor] = None) -> None:
        """Query columns ``[start, stop)`` of ``group`` over the key columns any of them sees,
        gathered for them alone, merged with their tokens' attention over their ``shared``
        prefixes if given (:meth:`attend_families`), with the ``sinks`` if given (over both),
        written into ``out``."""
        window = layer.sliding_window
        keys = group.keys(window)
        # row r's queries here sit at [prefix + start, prefix + stop), held to its last one (seq_len - 1)
        spans = [(max(first, window_start(min(prefix + start, seq_len - 1), window)) - first,
                  min(seq_len, prefix + stop) - first)
                 for prefix, seq_len, first in zip(group.prefix_lens, group.seq_lens, keys.first)]
        lo, hi = min(lo for lo, _ in spans), max(hi for _, hi in spans)
        k, v = gather_kv(forward_batch, layer, keys.kv_slots[:, lo:hi], q.dtype)  # [b, kv_heads, keys, dim]
        q_index = group.q_index[:, start:stop]
        qi = q[q_index].float().transpose(1, 2)  # [b, heads, num_q, dim]
        # built a chunk at a time, as the scores are (a whole prompt's would be quadratic in it)
        allowed = attention_mask(group.q_pos[:, start:stop], keys.k_pos[:, lo:hi], window)
        bias = torch.where(allowed, 0.0, float("-inf"))[:, None]
        if shared is not None or sinks is not None:
            o, lse = attention_with_lse(qi, k, v, bias, layer)
            o, lse = o.transpose(1, 2), lse.transpose(1, 2)
            if shared is not None:  # (rows in no family merge with -inf: their own attention, exactly)
                shared_o, shared_lse = (t[q_index] for t in shared)
                o = merge_attention(o, lse, shared_o, shared_lse)
                if sinks is not None:
                    lse = torch.logaddexp(lse, shared_lse)
            if sinks is not None:
                o = attend_sinks(o, lse, sinks)
        elif layer.logit_cap or layer.v_head_dim != layer.head_dim:
            o = explicit_attention(qi, k, v, bias, layer)[0].transpose(1, 2)
        else:  # the CPU's fused (flash) kernel: no scores tensor, GQA without repeating K/V
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=bias, scale=layer.scaling,
                                               enable_gqa=True).transpose(1, 2)
        out[group.out_index[:, start:stop]] = o.to(out.dtype)  # [b, num_q, heads, v_head_dim]


Backend = TorchAttnBackend
