"""The attention math of the torch backend (:mod:`.torch_backend`): attention that also returns
the log-sum-exp of its scores, the cascade's shared-prefix call, and the merge of two partial
results over disjoint keys by their log-sum-exps, and attention sinks."""

from __future__ import annotations

from typing import Tuple

import torch


def attend_shared(q, k, v, layer) -> Tuple[torch.Tensor, torch.Tensor]:
    """A family's query tokens (``q`` [n, heads, dim], of any of its members) over keys they all
    share (``k``/``v`` [1, kv_heads, keys, dim]) in one call: the tokens are the query rows of one
    batch row, with no mask, as every query sees every shared key. Returns ``[n, heads,
    v_head_dim]`` and the log-sum-exp, ``[n, heads]``."""
    o, lse = attention_with_lse(q.transpose(0, 1)[None], k, v, None, layer)
    return o[0].transpose(0, 1), lse[0].transpose(0, 1)


def attention_with_lse(q, k, v, bias, layer) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention and the log-sum-exp of its scores (``[b, heads, num_q]``), which weighs it against
    attention over other keys: on the CPU the fused kernel returns it (its op takes GQA as it is),
    elsewhere and for what that kernel does not take, the fp32 scores are written out. Every row
    must see a key: one with all masked gets lse 0 and zeros from that kernel (not -inf, which
    :func:`merge_attention` would weigh as nothing), NaN written out (the cascade's own keys hold
    each query's own token, so neither happens there)."""
    if layer.logit_cap or layer.v_head_dim != layer.head_dim or q.device.type != "cpu":
        return explicit_attention(q, k, v, bias, layer)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=layer.scaling)


def merge_attention(o1, lse1, o2, lse2) -> torch.Tensor:
    """Attention over two disjoint sets of keys, merged into attention over both: each weighs by
    its share of the softmax's whole denominator, ``e^lse1 / (e^lse1 + e^lse2) = sigmoid(lse1 - lse2)``
    (``lse2`` -inf: ``o1`` exactly, whatever ``o2`` holds but NaN)."""
    return torch.lerp(o2, o1, torch.sigmoid(lse1 - lse2)[..., None])


def attend_sinks(o, lse, sinks) -> torch.Tensor:
    """Attention ``o`` over keys whose scores' log-sum-exp is ``lse`` (``[..., heads]``), with each head's
    sink (GPT-OSS's ``sinks``, fp32 ``[heads]``) joining the softmax's denominator: a logit with no value,
    so its share, ``e^sink / (e^lse + e^sink)``, is left out: ``o · sigmoid(lse - sink)``. Applied once,
    to the log-sum-exp over all the query's keys (after a cascade's merge)."""
    return o * torch.sigmoid(lse - sinks)[..., None]


def explicit_attention(q, k, v, bias, layer) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention with its fp32 scores written out, for what the fused kernel does not take:
    a soft cap, or values narrower than keys (MLA; the kernel would repeat K/V per head). GQA
    folds each KV head's query heads into rows. ``q`` [b, heads, num_q, dim], ``k``/``v``
    [b, kv_heads, keys, dim], ``bias`` [b, 1, num_q, keys] or None; returns [b, heads, num_q,
    v_head_dim] and the scores' log-sum-exp, [b, heads, num_q]."""
    b, heads, num_q, _ = q.shape
    kv_heads = k.shape[1]
    per_kv = heads // kv_heads
    scores = torch.matmul(q.reshape(b, kv_heads, per_kv * num_q, -1), k.transpose(2, 3)) * layer.scaling
    scores = scores.view(b, kv_heads, per_kv, num_q, -1)
    if layer.logit_cap:
        scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
    if bias is not None:
        scores.add_(bias[:, :, None])
    lse = scores.logsumexp(-1, keepdim=True)
    probs = scores.sub_(lse).exp_()
    o = torch.matmul(probs.view(b, kv_heads, per_kv * num_q, -1), v).view(b, heads, num_q, -1)
    return o, lse.view(b, heads, num_q)
