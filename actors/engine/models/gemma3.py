"""Gemma 3 (text): interleaved sliding-window and full attention layers.

Differences from Llama that matter for exact outputs: embeddings scaled by
``sqrt(hidden)``, ``(1 + w)`` RMSNorms in fp32, per-head q/k norms, a norm
before and after both the attention and the MLP, attention scaled by
``query_pre_attn_scalar ** -0.5``, separate RoPE bases for sliding and full
layers, optional attention and final-logit soft caps.

KV: the spec kind is "swa": the engine keeps the full layers' KV in the full
half of an ``SWAKVPool`` and the sliding layers' in its smaller SWA half,
whose slots are freed once tokens slide out of the window; sliding layers
mask keys older than the window (``key_pos > query_pos - sliding_window``).
"""

from __future__ import annotations

from torch import nn

from actors.engine.layers import GatedMLP, RadixAttention, RMSNorm, RotaryEmbedding
from actors.engine.models.base import LORA_ATTENTION, LORA_MLP, CausalLM, DecoderModel
from actors.engine.models.spec import KVCacheSpec
from actors.engine.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TPGroup, attention_heads, head_ranges


def swa_layers(config) -> dict:
    """The :class:`KVCacheSpec` fields that split the layers into full and sliding-window ones."""
    types = config.layer_types
    return dict(
        full_attention_layer_ids=[i for i, t in enumerate(types) if t == "full_attention"],
        swa_attention_layer_ids=[i for i, t in enumerate(types) if t == "sliding_attention"],
        sliding_window=config.sliding_window,
    )


def layer_rope(config, layer_type: str):
    """``(theta, rope_type, params)`` of ``layer_type``'s RoPE: its own ``rope_parameters`` entry
    (sliding layers: the local base, unscaled). A per-layer yarn ``truncate`` is dropped: HF reads
    ``truncate`` from the top level of ``rope_parameters`` only, so it always truncates here."""
    params = {k: v for k, v in config.rope_parameters[layer_type].items() if k != "truncate"}
    return float(params["rope_theta"]), params.get("rope_type", "default"), params


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__()
        layer_type = config.layer_types[layer_id]
        self.head_dim = config.head_dim
        self.heads = attention_heads(tp, config.num_attention_heads, config.num_key_value_heads)
        self.num_heads, self.num_kv_heads = len(self.heads.q), len(self.heads.kv)  # this rank's
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = ColumnParallelLinear(hidden, head_ranges(self.heads.q, self.head_dim), bias=bias)
        self.k_proj = ColumnParallelLinear(hidden, head_ranges(self.heads.kv, self.head_dim), bias=bias)
        self.v_proj = ColumnParallelLinear(hidden, head_ranges(self.heads.kv, self.head_dim), bias=bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, hidden, tp, "num_attention_heads",
                                        bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=1.0)
        self.rotary = RotaryEmbedding(self.head_dim, *layer_rope(config, layer_type))
        window = config.sliding_window if layer_type == "sliding_attention" else None
        self.attn = RadixAttention(
            layer_id, self.num_heads, self.head_dim, self.num_kv_heads, config.query_pre_attn_scalar**-0.5,
            sliding_window=window, logit_cap=config.attn_logit_softcapping,
        )

    def forward(self, positions, x, forward_batch):
        tokens = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(tokens, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, forward_batch))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_id, tp)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_activation, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset=1.0)

    def forward(self, positions, x, forward_batch):
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), forward_batch))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(CausalLM):
    supported_lora_modules = LORA_ATTENTION + LORA_MLP

    def __init__(self, config, tp: TPGroup = SINGLE):
        if getattr(config, "use_bidirectional_attention", False):  # HF lets sliding layers see ahead in the window
            raise ValueError("Gemma 3 with use_bidirectional_attention=True (an encoder) is not served: "
                             "generation here is causal")
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0)
        model = DecoderModel(config, Gemma3DecoderLayer, norm, embed_scale=config.hidden_size**0.5, tp=tp)
        super().__init__(config, model, final_logit_softcap=config.final_logit_softcapping)

    def kv_cache_spec(self) -> KVCacheSpec:
        c, heads = self.config, self.model.layers[self.model.stage_layers.start].self_attn.heads
        return self.make_spec(kind="swa", num_layers=c.num_hidden_layers, **swa_layers(c), num_kv_heads=len(heads.kv),
                              head_dim=c.head_dim, kv_head_start=heads.kv.start, total_kv_heads=heads.total_kv)
