"""OLMo 2 (``Olmo2ForCausalLM``): Llama's attention and MLP with q/k RMSNorms over each whole
projection, not per head, and the norms after each block (``post_attention_layernorm``,
``post_feedforward_layernorm``) in place of Llama's before it; every norm multiplies its weight in fp32.

Under TP a rank holds some heads of q and k, but their norm's statistic is of all of them: each rank
sums the squares of its part and one all-reduce gives every rank the whole sum
(:class:`ProjectionRMSNorm`), a ``[tokens, 1]`` all-reduce per norm.
"""

from __future__ import annotations

import torch
from torch import nn

from actors.engine.layers import GatedMLP, RMSNorm
from actors.engine.models.llama import LlamaAttention, LlamaForCausalLM
from actors.engine.parallel import SINGLE, TPGroup, head_ranges, shard_param


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over the ``total_heads × head_dim`` features of a projection of which this rank holds
    ``heads`` (its weight their slice). With KV heads replicated (fewer than ranks: ``TPGroup.kv_heads``)
    each head's squares reach the sum from every rank holding it, so the sum counts them that many times."""

    def __init__(self, heads: range, total_heads: int, head_dim: int, eps: float, tp: TPGroup = SINGLE):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(len(heads) * head_dim))
        shard_param(self, "weight", 0, head_ranges(heads, head_dim))
        self.eps, self.tp = eps, tp
        self.num_summed = total_heads * head_dim * max(1, tp.size // total_heads)  # (replicas counted)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        variance = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True)) / self.num_summed
        return (self.weight.float() * (x32 * torch.rsqrt(variance + self.eps))).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__(config, layer_id, tp)
        eps, d = config.rms_norm_eps, self.head_dim
        self.q_norm = ProjectionRMSNorm(self.heads.q, config.num_attention_heads, d, eps, tp)
        self.k_norm = ProjectionRMSNorm(self.heads.kv, config.num_key_value_heads, d, eps, tp)

    def forward(self, positions, x, forward_batch):
        tokens, d = x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(x)).view(tokens, self.num_heads, d)
        k = self.k_norm(self.k_proj(x)).view(tokens, self.num_kv_heads, d)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, self.v_proj(x).view(tokens, self.num_kv_heads, d), forward_batch))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Olmo2Attention(config, layer_id, tp)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act, tp)
        self.post_attention_layernorm = RMSNorm(hidden, eps, fp32_weight=True)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, fp32_weight=True)

    def forward(self, positions, x, forward_batch):
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, forward_batch))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(LlamaForCausalLM):
    layer_cls = Olmo2DecoderLayer
    fp32_norm_weight = True
