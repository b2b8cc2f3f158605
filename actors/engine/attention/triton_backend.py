"""Attention with the Triton paged kernel (compiled on CUDA, interpreted on CPU)."""

from __future__ import annotations

import torch

from actors.engine.attention.triton_kernels import paged_attention
from mem_cache.alloc_kernels import triton_device_error


class TritonAttnBackend:
    def __init__(self, device=None, **_):
        error = triton_device_error(torch.device(device or "cpu"), "attention_backend='triton'")
        if error:
            raise ValueError(error)
        self.max_extend_len = 0
        self.batch_rows = self.batch_row_ids = None

    def init_forward_metadata(self, forward_batch) -> None:
        self.max_extend_len = max(forward_batch.extend_seq_lens_cpu)
        self.batch_rows = self.batch_row_ids = None
        if hasattr(forward_batch.token_to_kv_pool, "translate_layer_table"):
            # layers with their own slot space (SWA): translate only this batch's rows, once a layer
            rows = forward_batch.req_to_token_pool.req_to_token[forward_batch.req_pool_indices]
            self.batch_rows = rows[:, : max(forward_batch.seq_lens_cpu)].contiguous()
            self.batch_row_ids = torch.arange(len(rows), device=rows.device)

    def init_forward_metadata_capture(self, forward_batch) -> None:
        """A decode batch about to be captured as a CUDA graph (``cuda_graph_runner``): one query
        token a request (the grid's last dimension). The kernel reads every per-request array from
        the batch, which the graph runner keeps in static buffers; nothing here reads the device.
        An SWA pool's translated rows (sized by the longest sequence) are never captured."""
        self.max_extend_len = 1
        self.batch_rows = self.batch_row_ids = None

    def init_forward_metadata_replay(self, forward_batch) -> None:
        """Before a captured decode batch's replay: what :meth:`init_forward_metadata_capture` set (an
        eager forward in between may have changed it; the graph itself holds no host state)."""
        self.init_forward_metadata_capture(forward_batch)

    def forward(self, q: torch.Tensor, layer, forward_batch, sinks=None) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        req_to_token, row_ids = forward_batch.req_to_token_pool.req_to_token, forward_batch.req_pool_indices
        if self.batch_rows is not None:
            req_to_token, row_ids = pool.translate_layer_table(layer.layer_id, self.batch_rows), self.batch_row_ids
        return paged_attention(
            q.contiguous(), pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id), req_to_token,
            row_ids, forward_batch.seq_lens, forward_batch.extend_prefix_lens,
            forward_batch.extend_seq_lens, forward_batch.extend_start_loc, self.max_extend_len, layer.scaling,
            layer.sliding_window, layer.logit_cap, layer.v_head_dim, sinks,
        )


Backend = TritonAttnBackend
