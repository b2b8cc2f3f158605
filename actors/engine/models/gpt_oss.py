"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): alternating sliding-window and full attention layers with
attention sinks, and a mixture of clamped-SwiGLU experts in every layer.

Attention is Llama's (:class:`LlamaAttention`: q/k/v/o biases, YaRN RoPE from ``rope_parameters``)
with a learned sink logit per head (``self_attn.sinks``) in each query's softmax denominator. The
layers' ``layer_types`` alternate ``sliding_attention`` and ``full_attention``: the spec kind is
"swa", as Gemma 3's, so the sliding layers' KV lives in the SWA pool and leaves it as tokens slide
out of the window.

The MoE (HF's ``GptOssMLP``): a router linear with a bias, top-k of its logits, softmax over the
chosen ones; each expert ``swiglu(x @ gate_up + b) @ down + b`` with HF's 3-D parameters
(``experts.gate_up_proj`` [experts, hidden, 2 × intermediate], gate and up interleaved column by
column; ``experts.down_proj`` [experts, intermediate, hidden]) and its clamped SwiGLU:
``gate = min(gate, limit)``, ``up = clamp(up, ±limit)``, ``(up + 1) · gate · sigmoid(alpha · gate)``.
Released checkpoints store the experts' matrices in MXFP4 (``*_blocks`` + ``*_scales``): the loader
dequantizes them (``actors.engine.mxfp4``).

Under TP each rank holds its heads (and their sinks) and, of every expert, a slice of the
intermediate dim: the interleaved gate/up columns ``[2·start, 2·stop)`` are contiguous, and the
matching rows of ``down_proj``; rank 0 alone adds the down bias, and one all-reduce sums the
experts' partial outputs. Under EP each rank holds its share of the experts whole (every 3-D tensor
sliced along the expert dim) and adds their down biases: each expert's, once, on the one rank that
holds it; the same all-reduce sums the ranks' experts.

LoRA: the attention's q/k/v/o and the experts' ``gate_up_proj`` and ``down_proj``, in PEFT's ``target_parameters``
form (``actors.engine.lora_experts``): an expert's gate_up delta lands on its interleaved columns before the
clamped SwiGLU (a TP rank's slot holds B's rows of its columns), its down delta before the bias and the
routing weight (a TP rank's slot holds A's columns of its intermediate slice).
"""

from __future__ import annotations

import torch
from torch import nn

from actors.engine.fused_moe import FusableExperts, FusedExperts, StackedWeight
from actors.engine.layers import RMSNorm
from actors.engine.models.base import LORA_ATTENTION, CausalLM, DecoderModel
from actors.engine.models.gemma3 import swa_layers
from actors.engine.models.llama import LlamaAttention
from actors.engine.models.moe import routed_pairs
from actors.engine.models.spec import KVCacheSpec
from actors.engine.parallel import SINGLE, TPGroup, shard_param


class GptOssExperts(FusableExperts):
    """The experts' weights as HF stores them (3-D, one slice an expert): under TP every expert's share
    of the intermediate dim, under EP this rank's experts (``held``) whole; ``forward`` runs each held
    expert chosen over its tokens, in expert order, and sums the weighted outputs in the model's dtype,
    as HF's eager experts do — or, fused (:meth:`fuse`), in fp32, cast to it once. LoRA adapters take its 3-D
    parameters as two projections an expert (``projections``; ``actors.engine.lora_experts``)."""

    projections = ("gate_up_proj", "down_proj")
    is_transposed = True  # (HF's [experts, in, out])

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        hidden = config.hidden_size
        self.held = tp.experts(config.num_local_experts, "num_local_experts")
        part = tp.expert_tp.split(config.intermediate_size, "intermediate_size")
        gate_up = range(2 * part.start, 2 * part.stop)  # (gate, up) pairs side by side
        self.gate_up_proj = nn.Parameter(torch.empty(len(self.held), hidden, len(gate_up)))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(len(self.held), len(gate_up)))
        self.down_proj = nn.Parameter(torch.empty(len(self.held), len(part), hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(len(self.held), hidden))
        if tp.expert_parallel:
            for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
                shard_param(self, name, 0, [self.held])
        else:
            shard_param(self, "gate_up_proj", 2, [gate_up])
            shard_param(self, "gate_up_proj_bias", 1, [gate_up])
            shard_param(self, "down_proj", 1, [part])
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        # (the down bias is added once over the ranks' sum: by every expert's only holder under EP)
        self.tp, self.adds_down_bias = tp, tp.expert_parallel or tp.is_leader

    def fuse(self) -> None:
        """Run the experts as :class:`FusedExperts` over their tensors as stored (no copy): the kernels
        read each 3-D weight transposed and add its biases (the down bias where this rank adds it)."""
        self.fused = FusedExperts(
            StackedWeight(self.gate_up_proj.transpose(1, 2), self.gate_up_proj_bias),
            StackedWeight(self.down_proj.transpose(1, 2), self.down_proj_bias if self.adds_down_bias else None),
            self.swiglu)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x`` [tokens, hidden]; ``indices``, ``weights`` [tokens, top_k]: each token's experts and their weights.
        A token under a LoRA adapter (``lora``) gets its expert's gate_up delta before the SwiGLU and its down
        delta after."""
        if self.fused is not None:
            return self.tp.all_reduce(self.fused(x, indices - self.held.start, weights, self.lora).to(x.dtype))
        out, lora = torch.zeros_like(x), self.lora
        top_k, pair_weights = indices.shape[1], weights.flatten()
        for e, pairs, groups in routed_pairs(self.held, indices, lora):
            token, i = pairs // top_k, e - self.held.start  # (i: its place in this rank's tensors)
            rows = x[token]
            gate_up = rows @ self.gate_up_proj[i] + self.gate_up_proj_bias[i]
            h = self.swiglu(lora.add(0, gate_up, rows, groups) if groups else gate_up)
            y = h @ self.down_proj[i]
            y = lora.add(lora.down, y, h, groups) if groups else y
            if self.adds_down_bias:
                y = y + self.down_proj_bias[i]
            out.index_add_(0, token, (y * pair_weights[pairs, None]).to(x.dtype))
        return self.tp.all_reduce(out)


class GptOssMLP(nn.Module):
    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=True)  # replicated
        self.experts = GptOssExperts(config, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, indices = torch.topk(self.router(x), self.top_k, dim=-1)
        return self.experts(x, indices, torch.softmax(top, dim=-1))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, tp)
        self.mlp = GptOssMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fp32_weight=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fp32_weight=True)

    def forward(self, positions, x, forward_batch):
        x = x + self.self_attn(positions, self.input_layernorm(x), forward_batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssForCausalLM(CausalLM):
    supported_lora_modules = LORA_ATTENTION + ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

    def __init__(self, config, tp: TPGroup = SINGLE):
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fp32_weight=True)
        super().__init__(config, DecoderModel(config, GptOssDecoderLayer, norm, tp=tp))

    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self.model.layers[self.model.stage_layers.start].self_attn  # (this pipeline stage's first)
        return self.make_spec(kind="swa", num_layers=self.config.num_hidden_layers, **swa_layers(self.config),
                              num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                              kv_head_start=attn.heads.kv.start, total_kv_heads=attn.heads.total_kv)
