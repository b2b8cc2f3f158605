"""Qwen3-Next: gated delta-net (linear attention) layers + gated full attention + MoE.

Linear-attention layers keep, per request, a conv state (the last ``kernel-1``
inputs of the causal depthwise conv) and a recurrent state ``[v_heads, k_dim,
v_dim]`` in the request's MambaPool slot; full-attention layers keep paged KV
in HybridLinearKVPool. A forward reads each request's state, runs its tokens
through the recurrence and writes the state back, so the slot always holds
the state after the request's last committed token. A verify forward
(speculative decoding) leaves the slot as it is: it writes the state after
each of its tokens to the pool's verify scratch, and the scheduler copies the
last accepted one's into the slot (``MambaPool.commit_verify_states``), so a
rejected draft leaves nothing in it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from actors.engine.layers import GatedMLP, RadixAttention, RMSNorm, RotaryEmbedding
from actors.engine.models.base import LORA_ATTENTION, LORA_EXPERTS, LORA_MLP, CausalLM, DecoderModel
from actors.engine.models.moe import SparseMoeBlock, is_sparse_layer
from actors.engine.models.spec import KVCacheSpec
from actors.engine.parallel import (
    SINGLE, ColumnParallelLinear, RowParallelLinear, TPGroup, attention_heads, head_ranges, shard_param, shard_ranges,
)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_recurrence(q, k, v, g, beta, state, snapshots_after=()):
    """Token-by-token gated delta rule (fp32). q,k: [n, H, K]; v: [n, H, V];
    g, beta: [n, H]; state: [H, K, V] → (out [n, H, V], new state, the states
    after the tokens ``snapshots_after``, in their order)."""
    q = l2norm(q.float()) / (q.shape[-1] ** 0.5)
    k, v, g, beta = l2norm(k.float()), v.float(), g.float(), beta.float()
    out = torch.empty_like(v)
    state, snapshots, wanted = state.float(), {}, set(snapshots_after)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - (state * k[t][:, :, None]).sum(dim=-2)) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = (state * q[t][:, :, None]).sum(dim=-2)
        if t in wanted:
            snapshots[t] = state
    return out, state, [snapshots[t] for t in snapshots_after]


def _track_index(forward_batch, i: int):
    """How many of request ``i``'s tokens in this forward precede its checkpoint, or None."""
    lens = forward_batch.mamba_track_lens
    if lens is None or lens[i] is None:
        return None
    return lens[i] - forward_batch.extend_prefix_lens_cpu[i]


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, gate):
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(dtype) * F.silu(gate.float())).to(dtype)


def delta_heads(config, tp: TPGroup):
    """This rank's linear-attention key heads, its count of value heads and its conv channels (q, k and v)."""
    k_heads = tp.split(config.linear_num_key_heads, "linear_num_key_heads")
    num_v_heads = len(k_heads) * (config.linear_num_value_heads // config.linear_num_key_heads)
    conv_dim = 2 * config.linear_key_head_dim * len(k_heads) + config.linear_value_head_dim * num_v_heads
    return k_heads, num_v_heads, conv_dim


class GatedDeltaNet(nn.Module):
    """Under TP each rank holds a share of the key heads (and their value heads):
    its rows of the per-key-head ``in_proj_qkvz`` / ``in_proj_ba`` blocks, its
    q, k and v conv channels, its heads' state; ``out_proj`` is row parallel."""

    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.layer_id = layer_id
        self.k_heads, self.num_v_heads, self.conv_dim = delta_heads(config, tp)  # this rank's
        ratio = config.linear_num_value_heads // config.linear_num_key_heads
        v_heads = range(self.k_heads.start * ratio, self.k_heads.stop * ratio)
        self.num_k_heads = len(self.k_heads)
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_size, self.value_size = self.k_dim * self.num_k_heads, self.v_dim * self.num_v_heads
        self.kernel = config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False,
                                padding=self.kernel - 1)
        total_key, total_value = self.k_dim * config.linear_num_key_heads, self.v_dim * config.linear_num_value_heads
        conv_channels = shard_ranges([total_key, total_key, total_value], tp, "linear_num_key_heads")  # q | k | v
        shard_param(self.conv1d, "weight", 0, conv_channels)
        hidden = config.hidden_size
        qkvz_per_head = 2 * self.k_dim + 2 * ratio * self.v_dim
        self.in_proj_qkvz = ColumnParallelLinear(hidden, head_ranges(self.k_heads, qkvz_per_head))
        self.in_proj_ba = ColumnParallelLinear(hidden, head_ranges(self.k_heads, 2 * ratio))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        shard_param(self, "dt_bias", 0, [v_heads])
        shard_param(self, "A_log", 0, [v_heads])
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(total_value, hidden, tp, "linear_num_key_heads")

    def _split(self, x):
        """HF's per-key-head interleaved layout → q, k, v, z, b, a."""
        n, ratio = x.shape[0], self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(n, self.num_k_heads, 2 * self.k_dim + 2 * ratio * self.v_dim)
        q, k, v, z = qkvz.split([self.k_dim, self.k_dim, ratio * self.v_dim, ratio * self.v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(n, self.num_k_heads, 2 * ratio).split([ratio, ratio], dim=-1)
        v, z = v.reshape(n, self.num_v_heads, self.v_dim), z.reshape(n, self.num_v_heads, self.v_dim)
        return q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1), z, b.reshape(n, -1), a.reshape(n, -1)

    def forward(self, x, forward_batch):
        pool = forward_batch.req_to_token_pool
        mamba, m = pool.mamba_pool, pool.mamba_map[self.layer_id]
        q, k, v, z, b, a = self._split(x)
        mixed = torch.cat([q, k, v], dim=-1)
        beta, g = b.sigmoid(), -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = torch.empty(x.shape[0], self.num_v_heads, self.v_dim, dtype=x.dtype, device=x.device)
        weight = self.conv1d.weight.squeeze(1)
        verify = forward_batch.forward_mode.is_target_verify
        for i in range(forward_batch.batch_size):
            start, n = int(forward_batch.extend_start_loc[i]), forward_batch.extend_seq_lens_cpu[i]
            slot = int(forward_batch.mamba_pool_indices[i])
            span = slice(start, start + n)
            # window column j holds the conv input at position prefix - (K-1) + j
            window = torch.cat([mamba.conv[0][m, slot].to(x.dtype), mixed[span].t()], dim=-1)  # [C, K-1+n]
            track = _track_index(forward_batch, i)
            conv = F.silu(F.conv1d(window[None], weight[:, None, :], groups=self.conv_dim)[0]).t()  # [n, C]
            qi, ki, vi = conv.split([self.key_size, self.key_size, self.value_size], dim=-1)
            ratio = self.num_v_heads // self.num_k_heads
            qi = qi.reshape(n, self.num_k_heads, self.k_dim).repeat_interleave(ratio, dim=1)
            ki = ki.reshape(n, self.num_k_heads, self.k_dim).repeat_interleave(ratio, dim=1)
            o, state, snapshots = gated_delta_recurrence(
                qi, ki, vi.reshape(n, self.num_v_heads, self.v_dim), g[span], beta[span], mamba.temporal[m, slot],
                snapshots_after=range(n) if verify else [] if track is None else [track - 1],
            )
            if verify:  # every position's state to the scratch; the slot keeps the committed one
                row = int(forward_batch.req_pool_indices[i])
                mamba.verify_states[0][m, row, :n] = window.unfold(-1, self.kernel - 1, 1)[:, 1:].transpose(0, 1)
                mamba.verify_states[-1][m, row, :n] = torch.stack(snapshots).to(mamba.temporal.dtype)
            else:
                mamba.conv[0][m, slot] = window[:, -(self.kernel - 1):]
                mamba.temporal[m, slot] = state.to(mamba.temporal.dtype)
            if track is not None:  # checkpoint: state and conv inputs after ``track`` of this forward's tokens
                dst = forward_batch.mamba_track_slots[i]
                mamba.temporal[m, dst] = snapshots[0].to(mamba.temporal.dtype)
                mamba.conv[0][m, dst] = window[:, track : track + self.kernel - 1]
            out[span] = o.to(x.dtype)
        out = self.norm(out.reshape(-1, self.v_dim), z.reshape(-1, self.v_dim)).view(x.shape[0], -1)
        return self.out_proj(out)


class GatedAttention(nn.Module):
    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.head_dim = config.head_dim
        self.heads = attention_heads(tp, config.num_attention_heads, config.num_key_value_heads)
        self.num_heads, self.num_kv_heads = len(self.heads.q), len(self.heads.kv)  # this rank's
        hidden, bias = config.hidden_size, config.attention_bias
        # per head [q_h; gate_h]
        self.q_proj = ColumnParallelLinear(hidden, head_ranges(self.heads.q, 2 * self.head_dim), bias=bias)
        self.k_proj = ColumnParallelLinear(hidden, head_ranges(self.heads.kv, self.head_dim), bias=bias)
        self.v_proj = ColumnParallelLinear(hidden, head_ranges(self.heads.kv, self.head_dim), bias=bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, hidden, tp, "num_attention_heads",
                                        bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=1.0)
        params = config.rope_parameters
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        self.rotary = RotaryEmbedding(int(self.head_dim * factor), float(params["rope_theta"]),
                                      params.get("rope_type", "default"), params)
        self.attn = RadixAttention(layer_id, self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5)

    def forward(self, positions, x, forward_batch):
        n = x.shape[0]
        q, gate = self.q_proj(x).view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, forward_batch) * torch.sigmoid(gate.reshape(n, -1))
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.is_linear = config.layer_types[layer_id] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer_id, tp)
        else:
            self.self_attn = GatedAttention(config, layer_id, tp)
        if is_sparse_layer(config, layer_id):
            self.mlp = SparseMoeBlock.qwen(config, tp)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0)

    def forward(self, positions, x, forward_batch):
        h = self.input_layernorm(x)
        h = self.linear_attn(h, forward_batch) if self.is_linear else self.self_attn(positions, h, forward_batch)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextForCausalLM(CausalLM):
    # vLLM's: the full-attention layers' q/k/v/o (q_proj's rows each head's query then gate, cut by heads as its
    # weight), the linear-attention layers' projections (in_proj_qkvz / in_proj_ba rows per key head, so a rank's
    # rows of B are its key heads' as its weight's; out_proj row parallel), the dense MLP / shared expert and the
    # routed experts. An adapter changes only the projections: the conv and recurrent state stay the layer's
    supported_lora_modules = LORA_ATTENTION + ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba",
                                               "linear_attn.out_proj") + LORA_MLP + tuple(
        f"mlp.shared_expert.{p}" for p in GatedMLP.projections) + LORA_EXPERTS

    def __init__(self, config, tp: TPGroup = SINGLE):
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0)
        super().__init__(config, DecoderModel(config, DecoderLayer, norm, tp=tp))

    def ignored_weight(self, name: str) -> bool:
        """The multi-token-prediction module ``mtp.*`` (speculative decoding only)."""
        return name.startswith("mtp.")

    def kv_cache_spec(self) -> KVCacheSpec:
        """This rank's share: its KV heads, its linear-attention heads' conv and temporal state (from the
        config: a pipeline stage may hold no layer of either kind)."""
        c, tp = self.config, self.model.tp
        types = c.layer_types
        heads = attention_heads(tp, c.num_attention_heads, c.num_key_value_heads)
        k_heads, num_v_heads, conv_dim = delta_heads(c, tp)
        return self.make_spec(
            kind="hybrid_mamba", num_layers=types.count("full_attention"), num_kv_heads=len(heads.kv),
            head_dim=c.head_dim, kv_head_start=heads.kv.start, total_kv_heads=heads.total_kv,
            full_attention_layer_ids=[i for i, t in enumerate(types) if t == "full_attention"],
            mamba_layer_ids=[i for i, t in enumerate(types) if t == "linear_attention"],
            conv_state_shapes=[(conv_dim, c.linear_conv_kernel_dim - 1)],
            temporal_state_shape=(num_v_heads, c.linear_key_head_dim, c.linear_value_head_dim),
            mamba_head_start=k_heads.start, total_mamba_heads=c.linear_num_key_heads,
        )
