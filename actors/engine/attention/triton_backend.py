"""Attention with the Triton paged kernel (compiled on CUDA, interpreted on CPU)."""

from __future__ import annotations

import torch

from actors.engine.attention.triton_kernels import paged_attention


class TritonAttnBackend:
    def __init__(self, **_):
        self.max_extend_len = 0

    def init_forward_metadata(self, forward_batch) -> None:
        self.max_extend_len = max(forward_batch.extend_seq_lens_cpu)

    def forward(self, q: torch.Tensor, layer, forward_batch) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        translate = getattr(pool, "translate_layer_table", None)
        if translate is not None:
            req_to_token = translate(layer.layer_id, req_to_token)
        return paged_attention(
            q.contiguous(), pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id), req_to_token,
            forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.extend_prefix_lens,
            forward_batch.extend_seq_lens, forward_batch.extend_start_loc, self.max_extend_len, layer.scaling,
            layer.sliding_window, layer.logit_cap, layer.v_head_dim,
        )


Backend = TritonAttnBackend
