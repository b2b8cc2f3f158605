"""GQA decoders: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm), Granite (:class:`GraniteForCausalLM`:
Llama's layer with its four multipliers); the MoE families
(``qwen3_moe``, ``mixtral``) subclass the layer and the model; their attention is GPT-OSS's too
(q/k/v/o biases, attention sinks)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from actors.engine.forward_batch import ForwardBatch
from actors.engine.layers import GatedMLP, RadixAttention, RMSNorm, RotaryEmbedding
from actors.engine.models.base import LORA_ATTENTION, LORA_MLP, CausalLM, DecoderModel
from actors.engine.models.spec import KVCacheSpec
from actors.engine.parallel import (
    SINGLE, ColumnParallelLinear, RowParallelLinear, TPGroup, attention_heads, head_ranges, shard_param,
)


def rope_settings(config):
    """``(theta, rope_type, params)`` of the config's RoPE (``params``: its ``rope_parameters``; a
    LongRoPE ``factor`` left out is HF's ``max_position_embeddings / original_max_position_embeddings``)."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", "default")
    if rope_type == "longrope" and params.get("factor") is None:
        params = dict(params, factor=config.max_position_embeddings / params["original_max_position_embeddings"])
    return float(theta), rope_type, params


def layer_window(config, layer_id: int):
    """The sliding window of layer ``layer_id``, or None for full attention: where HF's ``layer_types``
    marks the layers (Qwen2/Qwen3 ``use_sliding_window``: those from ``max_window_layers`` on), the
    sliding ones'; without it (Mistral, Mixtral, Qwen3-MoE) the config's ``sliding_window``, None or
    every layer's (HF's sliding causal mask). A sliding layer masks keys out of its window; their
    KV lives in the SWA pool (``kv_cache_spec``)."""
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return getattr(config, "sliding_window", None)
    kind = layer_types[layer_id]
    if kind == "full_attention":
        return None
    if kind == "sliding_attention":
        return config.sliding_window
    raise ValueError(f"layer_types[{layer_id}]={kind!r} is not supported for {config.model_type}")


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__()
        num_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        self.heads = attention_heads(tp, num_heads, config.num_key_value_heads)
        self.num_heads, self.num_kv_heads = len(self.heads.q), len(self.heads.kv)  # this rank's
        bias = getattr(config, "attention_bias", False) or config.model_type in ("qwen2", "qwen2_5_vl_text")
        hidden = config.hidden_size
        self.q_proj = ColumnParallelLinear(hidden, head_ranges(self.heads.q, self.head_dim), bias=bias)
        self.k_proj = ColumnParallelLinear(hidden, head_ranges(self.heads.kv, self.head_dim), bias=bias)
        self.v_proj = ColumnParallelLinear(hidden, head_ranges(self.heads.kv, self.head_dim), bias=bias)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, tp, "num_attention_heads",
                                        bias=getattr(config, "attention_bias", False))
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe", "qwen3_vl_text", "qwen3_vl_moe_text")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.sinks = None  # GPT-OSS: a learned logit per head in each query's softmax denominator
        if config.model_type == "gpt_oss":
            self.sinks = nn.Parameter(torch.empty(self.num_heads))
            shard_param(self, "sinks", 0, [self.heads.q])
        self.rotary = RotaryEmbedding(self.head_dim, *rope_settings(config))
        scale = config.attention_multiplier if config.model_type == "granite" else self.head_dim**-0.5
        self.attn = RadixAttention(layer_id, self.num_heads, self.head_dim, self.num_kv_heads, scale,
                                   sliding_window=layer_window(config, layer_id))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, forward_batch, self.sinks))


class LlamaDecoderLayer(nn.Module):
    """Attention, then the feed-forward (``mlp_name``: its checkpoint name), each after an RMSNorm and
    added to the residual. A subclass swaps the feed-forward (:meth:`build_mlp`: the MoE families) or
    the attention (``attention_cls``: Phi-3's fused projections)."""

    mlp_name = "mlp"
    attention_cls = LlamaAttention

    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_id, tp)
        self.add_module(self.mlp_name, self.build_mlp(config, layer_id, tp))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def build_mlp(self, config, layer_id: int, tp: TPGroup) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp,
                        bias=getattr(config, "mlp_bias", False))

    def forward(self, positions, x, forward_batch):
        x = x + self.self_attn(positions, self.input_layernorm(x), forward_batch)
        return x + getattr(self, self.mlp_name)(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    supported_lora_modules = LORA_ATTENTION + LORA_MLP
    layer_cls = LlamaDecoderLayer
    fp32_norm_weight = False  # the final norm's weight multiplied in fp32 (OLMo 2's): RMSNorm's fp32_weight

    def __init__(self, config, tp: TPGroup = SINGLE, embed_scale: Optional[float] = None, logits_scaling: float = 1.0):
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fp32_weight=self.fp32_norm_weight)
        model = DecoderModel(config, self.layer_cls, norm, embed_scale=embed_scale, tp=tp)
        super().__init__(config, model, logits_scaling=logits_scaling)

    def kv_cache_spec(self) -> KVCacheSpec:
        """Kind "mha", or "swa" where some layers slide (as Gemma 3): those layers' KV in the SWA pool,
        freed as tokens slide out of the window. A model whose every layer slides (Mistral's window)
        keeps no layer's KV in the full pool: there it is slot numbers only, what the tree indexes. The
        kind is the model's, not a pipeline stage's: a stage of full layers only (Qwen2/Qwen3 below
        ``max_window_layers``) keeps an SWA pool too, so rank 0's SWA radix cache decides for every stage."""
        attn = self.model.layers[self.model.stage_layers.start].self_attn  # (this pipeline stage's first layer)
        windows = {i: layer_window(self.config, i) for i in range(self.config.num_hidden_layers)}
        swa = {} if all(w is None for w in windows.values()) else dict(
            full_attention_layer_ids=[i for i, w in windows.items() if w is None],
            swa_attention_layer_ids=[i for i, w in windows.items() if w is not None],
            sliding_window=self.config.sliding_window,
        )
        return self.make_spec(
            kind="swa" if swa else "mha",
            num_layers=self.config.num_hidden_layers,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            kv_head_start=attn.heads.kv.start,
            total_kv_heads=attn.heads.total_kv,
            **swa,
        )


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Llama's, each block's output scaled by ``residual_multiplier`` before it joins the residual."""

    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__(config, layer_id, tp)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions, x, forward_batch):
        x = x + self.self_attn(positions, self.input_layernorm(x), forward_batch) * self.residual_multiplier
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3.x: Llama with the embeddings times ``embedding_multiplier``, the softmax scale
    ``attention_multiplier`` (:class:`LlamaAttention`), the residual branches times ``residual_multiplier``
    and the logits divided by ``logits_scaling``."""

    layer_cls = GraniteDecoderLayer

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__(config, tp, embed_scale=config.embedding_multiplier, logits_scaling=config.logits_scaling)
