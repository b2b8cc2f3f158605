"""Phi-3 (Phi-3 mini/medium, Phi-3.5-mini, Phi-4-mini): Llama's layer with HF's fused checkpoint tensors,
``qkv_proj`` (q | k | v rows) and ``gate_up_proj`` (gate | up rows), a partial rotary dim
(``partial_rotary_factor``: Phi-4-mini's 0.75) and LongRoPE (``rope_type`` "longrope", the 128k
checkpoints).

Under TP a fused tensor is cut per part, never as a whole: a rank's ``qkv_proj`` rows are its query
heads' rows of q, then its KV heads' rows of k and of v (a :class:`ColumnParallelLinear` of three
ranges, read from the checkpoint in that order), its ``gate_up_proj`` rows its slice of gate then of
up; an even split of the fused rows would hand rank 0 all of q and rank 1 k and v. A LoRA adapter of a
fused projection (PEFT's, vLLM's packed modules) is one B over the fused rows: its rows are cut alike; one of
its parts (q_proj ...) is stacked into such a pair first (:mod:`actors.engine.lora_packed`).
"""

from __future__ import annotations

import torch
from torch import nn

from actors.engine.layers import RadixAttention, RotaryEmbedding, get_activation
from actors.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, layer_window, rope_settings
from actors.engine.parallel import (
    SINGLE, ColumnParallelLinear, RowParallelLinear, TPGroup, attention_heads, shard_ranges,
)


def phi3_rope(config, head_dim: int):
    """``(rotary_dim, theta, rope_type, params)``: the rotary dim ``partial_rotary_factor`` of the head's."""
    theta, rope_type, params = rope_settings(config)
    return int(head_dim * params.get("partial_rotary_factor", 1.0)), theta, rope_type, params


class Phi3Attention(nn.Module):
    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__()
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        self.heads = attention_heads(tp, num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads = len(self.heads.q), len(self.heads.kv)  # this rank's
        d, q, kv = self.head_dim, self.heads.q, self.heads.kv
        k_start, v_start = num_heads * d, (num_heads + num_kv_heads) * d  # the fused rows: q | k | v
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [
            range(q.start * d, q.stop * d),
            range(k_start + kv.start * d, k_start + kv.stop * d),
            range(v_start + kv.start * d, v_start + kv.stop * d),
        ])
        self.o_proj = RowParallelLinear(num_heads * d, config.hidden_size, tp, "num_attention_heads")
        self.rotary = RotaryEmbedding(*phi3_rope(config, d))
        self.attn = RadixAttention(layer_id, self.num_heads, d, self.num_kv_heads, d**-0.5,
                                   sliding_window=layer_window(config, layer_id))

    def forward(self, positions, x, forward_batch):
        tokens, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k = self.rotary(positions, q.view(tokens, self.num_heads, d), k.view(tokens, self.num_kv_heads, d))
        return self.o_proj(self.attn(q, k, v.view(tokens, self.num_kv_heads, d), forward_batch))


class Phi3MLP(nn.Module):
    """``down(act(gate) * up)`` with gate and up one fused projection (HF's ``gate_up_proj``)."""

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size,
                                                 shard_ranges([size, size], tp, "intermediate_size"))
        self.down_proj = RowParallelLinear(size, config.hidden_size, tp, "intermediate_size")
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Phi3Attention

    def build_mlp(self, config, layer_id: int, tp: TPGroup) -> nn.Module:
        return Phi3MLP(config, tp)


class Phi3ForCausalLM(LlamaForCausalLM):
    # a fused projection's adapter is one A and one B over its fused rows, cut per part under TP as its weight
    # (its parts' adapters stacked into one)
    supported_lora_modules = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    packed_modules_mapping = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    layer_cls = Phi3DecoderLayer
