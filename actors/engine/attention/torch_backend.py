"""Reference attention over the paged KV cache, in plain PyTorch (one request at a time)."""

from __future__ import annotations

import torch


def context_kv_slots(forward_batch, i: int, layer) -> torch.Tensor:
    """KV slots of request ``i``'s whole context ``[0, seq_len)``, for ``layer``'s pool."""
    row = int(forward_batch.req_pool_indices[i])
    seq_len = forward_batch.seq_lens_cpu[i]
    slots = forward_batch.req_to_token_pool.req_to_token[row, :seq_len].to(torch.int64)
    translate = getattr(forward_batch.token_to_kv_pool, "translate_layer_loc", None)
    return translate(layer.layer_id, slots) if translate is not None else slots


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window) -> torch.Tensor:
    """True where query at ``q_pos`` may attend key at ``k_pos``."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return allowed


class TorchAttnBackend:
    def __init__(self, **_):
        pass

    def init_forward_metadata(self, forward_batch) -> None:
        """Nothing to precompute: every layer reads the rows directly."""

    def forward(self, q: torch.Tensor, layer, forward_batch) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        group = layer.num_heads // layer.num_kv_heads
        for i in range(forward_batch.batch_size):
            start = int(forward_batch.extend_start_loc[i])
            num_q = forward_batch.extend_seq_lens_cpu[i]
            prefix = forward_batch.extend_prefix_lens_cpu[i]
            slots = context_kv_slots(forward_batch, i, layer)
            k = k_buf[slots].to(q.dtype).repeat_interleave(group, dim=1)
            v = v_buf[slots].to(q.dtype)[..., : layer.v_head_dim].repeat_interleave(group, dim=1)
            qi = q[start : start + num_q]
            scores = torch.einsum("qhd,khd->hqk", qi.float(), k.float()) * layer.scaling
            if layer.logit_cap:
                scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
            q_pos = torch.arange(prefix, prefix + num_q, device=q.device)
            k_pos = torch.arange(slots.numel(), device=q.device)
            scores = scores.masked_fill(~attention_mask(q_pos, k_pos, layer.sliding_window), float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start : start + num_q] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
        return out


Backend = TorchAttnBackend
