"""DeepSeek-V3, and DeepSeek-V2 / V2-Lite: multi-head latent attention (MLA) and a routed MoE.

V2 differs in its router alone (:class:`DeepseekV2Gate`: softmax scores, no correction bias);
V2-Lite also has no ``q_lora_rank`` (one ``q_proj``, as V3 with ``q_lora_rank`` None).

The KV cache holds one latent row per token, ``[c ; k_rot]`` (``kv_lora_rank
+ qk_rope_head_dim`` values, MLATokenToKVPool). Attention runs *absorbed*:
``kv_b_proj``'s key half is folded into the query and its value half applied
after attention, so MLA becomes multi-query attention with one KV head of
dim ``kv_lora_rank + rope`` and value dim ``kv_lora_rank`` — the same paged
backends serve it. For head ``h``::

    q_h · k_h   = q_nope_h · (W_UK_h c) + q_rot_h · k_rot = (W_UK_hᵀ q_nope_h) · c + q_rot_h · k_rot
    out_h       = W_UV_h (Σ p · c)

A LoRA adapter on ``kv_b_proj`` (``W + B A``, its scaling in ``A [r, kv_lora_rank]``, ``B``'s rows per head
``B_UK_h``, ``B_UV_h`` as the weight's) changes both factors for its requests' tokens alone, in rank ``r``::

    W_UK_hᵀ q_nope_h + Aᵀ (B_UK_hᵀ q_nope_h)        W_UV_h o_h + B_UV_h (A o_h)

so the cached latent rows stay the base model's, and a batch of base requests runs the path above as is.
"""

from __future__ import annotations

import torch
from torch import nn

from actors.engine.layers import GatedMLP, RadixAttention, RMSNorm, RotaryEmbedding, rotate_interleaved, yarn_mscale
from actors.engine.lora import absorbed_lora
from actors.engine.models.base import LORA_EXPERTS, LORA_MLP, CausalLM, DecoderModel
from actors.engine.models.llama import rope_settings
from actors.engine.models.moe import ExpertList, run_experts
from actors.engine.models.spec import KVCacheSpec
from actors.engine.parallel import (SINGLE, ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, TPGroup,
                                   head_ranges)


def softmax_scale(config, qk_head_dim: int) -> float:
    """``qk_head_dim ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` when the RoPE is
    scaled (any ``rope_type`` but "default", as HF) and ``mscale_all_dim`` is set (non-zero)."""
    params = getattr(config, "rope_parameters", None) or {}
    scale = qk_head_dim**-0.5
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        mscale = yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


class DeepseekV3Attention(nn.Module):
    """Under TP each rank holds its attention heads' slices of ``q(_b)_proj``,
    ``kv_b_proj`` and ``o_proj``; the latent projections (and so the cached
    latent rows) are replicated."""

    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__()
        heads = tp.split(config.num_attention_heads, "num_attention_heads")
        self.num_heads = len(heads)  # this rank's
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.interleave = getattr(config, "rope_interleave", True)
        qk_head_dim = self.nope_dim + self.rope_dim
        hidden, bias = config.hidden_size, getattr(config, "attention_bias", False)
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, head_ranges(heads, qk_head_dim))
        else:
            self.q_a_proj = ReplicatedLinear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, head_ranges(heads, qk_head_dim))
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, head_ranges(heads, self.nope_dim + self.v_head_dim))
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.v_head_dim, hidden, tp, "num_attention_heads",
                                        bias=bias)
        self.rotary = RotaryEmbedding(self.rope_dim, *rope_settings(config))  # both layouts use its cos/sin
        self.attn = RadixAttention(
            layer_id, self.num_heads, self.kv_lora_rank + self.rope_dim, 1, softmax_scale(config, qk_head_dim),
            v_head_dim=self.kv_lora_rank,
        )

    def _rope(self, positions, x):
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        return rotate_interleaved(x, cos, sin) if self.interleave else self.rotary.apply(x, cos, sin)

    def forward(self, positions, x, forward_batch):
        tokens = x.shape[0]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rot = self._rope(positions, q_rot)
        k_rot = self._rope(positions, k_rot[:, None, :])
        kv_b_proj, lora_groups = absorbed_lora(self.kv_b_proj)
        w = kv_b_proj.dense_weight(x.dtype)  # (dequantized when block FP8)
        w = w.view(self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        q_latent = torch.einsum("thd,hdc->thc", q_nope, w_uk)
        for index, a, b in lora_groups:  # an adapter's tokens: + Aᵀ (B_UK_hᵀ q_nope_h)
            b_uk = b.view(self.num_heads, -1, a.shape[0])[:, : self.nope_dim]
            q_latent = q_latent.index_add(0, index, torch.einsum("thd,hdr->thr", q_nope[index], b_uk) @ a)
        row = torch.cat([latent[:, None, :], k_rot], dim=-1)  # what the cache stores
        out_latent = self.attn(torch.cat([q_latent, q_rot], dim=-1), row, None, forward_batch)
        out_latent = out_latent.view(tokens, self.num_heads, self.kv_lora_rank)
        out = torch.einsum("thc,hvc->thv", out_latent, w_uv)
        for index, a, b in lora_groups:  # ... + B_UV_h (A o_h)
            b_uv = b.view(self.num_heads, -1, a.shape[0])[:, self.nope_dim :]
            out = out.index_add(0, index, torch.einsum("thr,hvr->thv", out_latent[index] @ a.t(), b_uv))
        return self.o_proj(out.reshape(tokens, -1))


def top_groups(group_scores: torch.Tensor, topk_group: int, group_size: int) -> torch.Tensor:
    """``[tokens, experts]`` bool: the experts of each token's ``topk_group`` best groups (by ``group_scores``,
    ``[tokens, n_group]``; the experts of a group are consecutive)."""
    keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1).indices, 1.0)
    return keep.bool().repeat_interleave(group_size, 1)


class DeepseekV3Gate(nn.Module):
    """Sigmoid scores + correction bias, group-limited top-k (noaux_tc routing)."""

    def __init__(self, config):
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_tok, config.n_routed_experts
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.scale = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))

    def forward(self, x):
        scores = torch.sigmoid(x.float() @ self.weight.float().t())
        choice = scores + self.e_score_correction_bias
        group_size = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, group_size).topk(2, dim=-1).values.sum(-1)
        choice = choice.masked_fill(~top_groups(group_scores, self.topk_group, group_size), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights * self.scale


class DeepseekV2Gate(nn.Module):
    """DeepSeek-V2's router: softmax scores over the experts and the ``top_k`` best, of them all
    (``topk_method`` "greedy": V2-Lite) or of each token's ``topk_group`` groups with the best expert
    (``group_limited_greedy``: V2), times ``routed_scaling_factor``; renormalised first with
    ``norm_topk_prob``, as DeepSeek's own code and vLLM (HF's V2 never does; the released configs say False)."""

    def __init__(self, config):
        super().__init__()
        if config.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method={config.topk_method!r} is not supported for DeepSeek-V2; "
                             "supported: greedy, group_limited_greedy")
        self.top_k, self.num_experts, self.topk_method = config.num_experts_per_tok, config.n_routed_experts, \
            config.topk_method
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.scale = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))

    def forward(self, x):
        scores = torch.softmax(x.float() @ self.weight.float().t(), dim=-1)
        if self.topk_method == "group_limited_greedy":
            group_size = self.num_experts // self.n_group
            group_scores = scores.view(-1, self.n_group, group_size).max(dim=-1).values
            scores = scores.masked_fill(~top_groups(group_scores, self.topk_group, group_size), 0.0)
        weights, idx = scores.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights * self.scale


class DeepseekV3MoE(nn.Module):
    """Under TP every expert's intermediate dim is split over the ranks (each
    rank runs every routed expert on its slice), under EP each rank holds its
    share of the routed experts whole; the shared experts stay TP either way.
    The routed and shared partial sums are reduced with one all-reduce."""

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.gate = DeepseekV2Gate(config) if config.model_type == "deepseek_v2" else DeepseekV3Gate(config)
        field = "moe_intermediate_size"
        self.experts = ExpertList(tp.experts(config.n_routed_experts, "n_routed_experts"), lambda: GatedMLP(
            config.hidden_size, config.moe_intermediate_size, config.hidden_act, tp.expert_tp, reduce=False,
            field=field))
        self.shared_experts = GatedMLP(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.hidden_act, tp,
            reduce=False, field=field,
        )

    def forward(self, x):
        idx, weights = self.gate(x)  # (fp32 weights, as HF's)
        out = run_experts(self.experts, x, idx, weights)
        return self.tp.all_reduce(out.to(x.dtype) + self.shared_experts(x))


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.self_attn = DeepseekV3Attention(config, layer_id, tp)
        if layer_id >= config.first_k_dense_replace:
            self.mlp = DeepseekV3MoE(config, tp)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, forward_batch):
        x = x + self.self_attn(positions, self.input_layernorm(x), forward_batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3ForCausalLM(CausalLM):
    fp32_buffers = ("e_score_correction_bias",)  # as HF's _keep_in_fp32_modules_strict
    # vLLM's: MLA's projections (q_proj, or q_a_proj / q_b_proj with a q_lora_rank), the dense layers' MLP and the
    # MoE layers' shared and routed experts. kv_a_proj_with_mqa is replicated, its delta in the cached latent row
    # (the radix cache keys an adapter's requests apart); kv_b_proj is read as a weight only (absorbed), its delta
    # applied in the attention's factors (DeepseekV3Attention)
    supported_lora_modules = ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj",
                              "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj") + LORA_MLP + tuple(
        f"mlp.shared_experts.{p}" for p in GatedMLP.projections) + LORA_EXPERTS

    def __init__(self, config, tp: TPGroup = SINGLE):
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        super().__init__(config, DecoderModel(config, DeepseekV3DecoderLayer, norm, tp=tp))

    def ignored_weight(self, name: str) -> bool:
        """The multi-token-prediction layers, saved as layers ``num_hidden_layers`` on (speculative decoding only)."""
        first_mtp, mtp = self.config.num_hidden_layers, getattr(self.config, "num_mtp_layers", 0) or 0
        return any(name.startswith(f"model.layers.{i}.") for i in range(first_mtp, first_mtp + mtp))

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.make_spec(
            kind="mla", num_layers=self.config.num_hidden_layers,
            kv_lora_rank=self.config.kv_lora_rank, qk_rope_head_dim=self.config.qk_rope_head_dim,
        )
