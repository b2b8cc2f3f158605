"""Building blocks shared by the model definitions (numerics match HF transformers)."""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from actors.engine.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TPGroup


class RMSNorm(nn.Module):
    """``w * x / rms(x)`` computed in fp32; ``offset`` = 1 for Gemma-style ``(1 + w)`` weights. The
    weight multiplies ``x / rms(x)`` after its cast to the model's dtype (Llama's), or before it, in
    fp32, with ``offset`` or ``fp32_weight`` (Gemma's, GPT-OSS's: HF keeps its norms in fp32)."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0, fp32_weight: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps = eps
        self.offset = offset
        self.fp32_weight = fp32_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset or self.fp32_weight:
            return (x32 * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding over the first ``rotary_dim`` dims of each head
    (``rotate_half`` convention, as HF Llama).

    ``scaling``: the config's RoPE parameters (``rope_parameters``), read for
    ``rope_type`` "linear" (positions divided by ``factor``), "llama3" (Llama 3.1's
    rescaling of the low-frequency band by ``factor``, the middle band interpolated) and
    "yarn" (see :func:`yarn_inv_freq`; cos and sin are also multiplied by its
    ``attention_factor``) and "longrope" (Phi-3's: :func:`longrope_inv_freq`); any other type is refused."""

    def __init__(self, rotary_dim: int, base: float, rope_type: str = "default", scaling: Optional[dict] = None):
        super().__init__()
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        self.rotary_dim = rotary_dim
        self.base = base
        self.rope_type = rope_type
        self.scaling = dict(scaling or {})
        inv_freq, self.attention_factor = self._inv_freq()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # longrope: the frequencies of a token at or past original_max_position_embeddings
        self.register_buffer("long_inv_freq", self._long_inv_freq(), persistent=False)

    def _inv_freq(self) -> Tuple[torch.Tensor, float]:
        """``(inv_freq, attention_factor)``: fp32 on the CPU; the factor scales cos and sin."""
        if self.rope_type == "longrope":
            return longrope_inv_freq(self.rotary_dim, self.base, self.scaling, "short_factor")
        if self.rope_type == "yarn":
            return yarn_inv_freq(self.rotary_dim, self.base, self.scaling)
        inv_freq = 1.0 / band_periods(self.rotary_dim, self.base)
        if self.rope_type == "linear":
            return inv_freq / self.scaling["factor"], 1.0
        if self.rope_type == "llama3":
            return llama3_inv_freq(inv_freq, self.scaling), 1.0
        return inv_freq, 1.0

    def _long_inv_freq(self) -> Optional[torch.Tensor]:
        if self.rope_type != "longrope":
            return None
        return longrope_inv_freq(self.rotary_dim, self.base, self.scaling, "long_factor")[0]

    def rebuild_buffers(self) -> None:
        """Recompute ``inv_freq`` in fp32 on the module's device (after meta init or a dtype cast)."""
        self.inv_freq = self._inv_freq()[0].to(self.inv_freq.device)
        if self.long_inv_freq is not None:
            self.long_inv_freq = self._long_inv_freq().to(self.inv_freq.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        if self.long_inv_freq is not None:  # (a token's own choice: no batch-mate changes its rotation)
            long = positions[:, None] >= self.scaling["original_max_position_embeddings"]
            freqs = torch.where(long, positions[:, None].float() * self.long_inv_freq[None, :], freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        # scaled in fp32, then cast (as HF); a factor of 1.0 changes nothing
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``q``: [tokens, heads, head_dim], ``k``: [tokens, kv_heads, head_dim]."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return self.apply(q, cos, sin), self.apply(k, cos, sin)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, cos, sin, self.rotary_dim)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen2-VL's, SGLang's ``MRotaryEmbedding``): positions ``[3, tokens]``
    (temporal, height, width), the frequency bands split by ``mrope_section`` (its sizes sum to
    ``rotary_dim / 2``), the i-th part turning with position row ``i % 3``; ``interleaved``
    (Qwen3-VL's ``mrope_interleaved``): band j turns with row j % 3 while that row has bands left
    (height's the first ``mrope_section[1]``, width's the first ``mrope_section[2]``), else with the
    temporal row. Positions ``[tokens]`` (every row the same: text) are plain RoPE."""

    def __init__(self, rotary_dim: int, base: float, mrope_section: List[int], rope_type: str = "default",
                 scaling: Optional[dict] = None, interleaved: bool = False):
        super().__init__(rotary_dim, base, rope_type, scaling)
        if sum(mrope_section) != rotary_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must sum to half the rotary dim ({rotary_dim // 2})")
        self.mrope_section = list(mrope_section)
        # each band's position row (a list: the module may be built on the meta device)
        self.band_rows = [i % 3 for i, size in enumerate(mrope_section) for _ in range(size)]
        if interleaved:
            self.band_rows = [j % 3 if j % 3 and j < 3 * mrope_section[j % 3] else 0 for j in range(rotary_dim // 2)]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        freqs = positions[..., None].float() * self.inv_freq  # [3, tokens, rotary_dim / 2]
        rows = torch.tensor(self.band_rows, device=freqs.device)
        freqs = freqs.gather(0, rows.expand(1, freqs.shape[1], -1))[0]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1's RoPE rescaling. With ``L = original_max_position_embeddings``, a frequency
    whose wavelength is under ``L / high_freq_factor`` is kept, over ``L / low_freq_factor``
    divided by ``factor``; between the two it is blended, with weight
    ``s = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)`` on the kept one."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    context = params["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    s = (context / wavelength - low) / (high - low)
    blended = (1 - s) * inv_freq / factor + s * inv_freq
    out = torch.where(wavelength > context / low, inv_freq / factor, blended)
    return torch.where(wavelength < context / high, inv_freq, out)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``factor`` times: ``1 + 0.1·mscale·ln(factor)``
    (1 when ``factor`` <= 1)."""
    return 1.0 if factor <= 1 else 1.0 + 0.1 * mscale * math.log(factor)


def yarn_attention_factor(params: dict) -> float:
    """The factor YaRN multiplies cos and sin by: ``attention_factor`` when given; else, with both
    DeepSeek's ``mscale`` and ``mscale_all_dim`` set (non-zero), ``yarn_mscale(factor, mscale) /
    yarn_mscale(factor, mscale_all_dim)``; else ``yarn_mscale(factor)``."""
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    factor, mscale, mscale_all_dim = params["factor"], params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def longrope_inv_freq(dim: int, base: float, params: dict, factors: str) -> Tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): ``(inv_freq, attention_factor)``, each band's period stretched by its entry of
    ``params[factors]`` (``short_factor`` or ``long_factor``); the factor is ``attention_factor`` when
    given, else ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` (1 when ``factor`` <= 1).

    HF picks the long factors for a whole forward once its longest sequence passes
    ``original_max_position_embeddings``, vLLM for a whole batch once any position does; here a token
    takes them at or past that position (:meth:`RotaryEmbedding.cos_sin`), so a request's rotation never
    depends on its batch or its chunks: equal to HF's while a sequence stays within the original
    length, and for the tokens past it."""
    context, factor = params["original_max_position_embeddings"], params.get("factor")
    if factor is None:  # HF derives it from max_position_embeddings: models.llama.rope_settings fills it in
        raise ValueError("rope_parameters.factor is required for rope_type 'longrope'")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(context))
    ext_factors = torch.tensor(params[factors], dtype=torch.float32, device="cpu")
    return 1.0 / (ext_factors * band_periods(dim, base)), attention_factor


def band_periods(dim: int, base: float) -> torch.Tensor:
    """``base ** (2i / dim)`` for ``i`` < ``dim / 2``, fp32 on the CPU (RoPE's inverse frequencies, inverted)."""
    return base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)


def yarn_inv_freq(dim: int, base: float, params: dict) -> Tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): ``(inv_freq, attention_factor)``.

    A band that turns more than ``beta_fast`` (default 32) times within
    ``L = original_max_position_embeddings`` positions keeps its frequency ("extrapolation"),
    one that turns fewer than ``beta_slow`` (default 1) times is divided by ``factor``
    ("interpolation"). The two turn counts map to fractional band indices
    ``dim · ln(L / (2π·turns)) / (2 ln base)`` — floored and ceiled unless ``truncate`` is false,
    clipped to ``[0, dim - 1]`` — and between them the interpolated share rises linearly
    over the band index ``i``."""
    if params.get("factor") is None:  # HF would derive it from max_position_embeddings (unseen here)
        raise ValueError("rope_parameters.factor is required for rope_type 'yarn'")
    factor, context = params["factor"], params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def band(turns: float) -> float:
        return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base))

    start, end = band(beta_fast), band(beta_slow)
    if params.get("truncate", True):
        start, end = math.floor(start), math.ceil(end)
    start, end = max(start, 0), min(end, dim - 1)
    if start == end:
        end += 0.001  # an empty ramp would divide by zero
    periods = band_periods(dim, base)
    index = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    interpolated_share = ((index - start) / (end - start)).clamp(0, 1)
    kept_share = 1 - interpolated_share  # spelled as HF's blend, so the fp32 rounding is the same
    inv_freq = (1.0 / (factor * periods)) * (1 - kept_share) + (1.0 / periods) * kept_share
    return inv_freq, yarn_attention_factor(params)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    cos, sin = cos[:, None, :], sin[:, None, :]
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: pairs ``(x0, x1), (x2, x3), ...`` each rotated by one
    frequency; the output is de-interleaved (evens' results, then odds')."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


def get_activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"hidden_act={name!r} is not supported; supported: {', '.join(ACTIVATIONS)}") from None


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with HF parameter names (``bias``: Llama's ``mlp_bias``).

    Under TP, gate/up are column parallel and down row parallel over the
    intermediate dim (``field`` names it in a sharding error); ``reduce=False``
    returns this rank's partial sum (an MoE reduces all its experts at once)."""

    projections = ("gate_proj", "up_proj", "down_proj")  # (an MoE's ExpertList.fuse stacks them)

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", tp: TPGroup = SINGLE,
                 reduce: bool = True, field: str = "intermediate_size", bias: bool = False):
        super().__init__()
        self.gate_proj = ColumnParallelLinear.split(hidden_size, intermediate_size, tp, field, bias=bias)
        self.up_proj = ColumnParallelLinear.split(hidden_size, intermediate_size, tp, field, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp, field, bias=bias, reduce=reduce)
        self.act = get_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class RadixAttention(nn.Module):
    """Attention over the paged KV cache for one layer.

    Holds no weights: it writes this forward's K/V at ``out_cache_loc`` and
    asks the batch's attention backend to attend each request's queries to
    its whole context, read through ``req_to_token``.
    """

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scaling: float,
        v_head_dim: Optional[int] = None,
        sliding_window: Optional[int] = None,
        logit_cap: Optional[float] = None,
    ):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scaling = scaling
        self.v_head_dim = v_head_dim or head_dim
        self.sliding_window = sliding_window
        self.logit_cap = logit_cap

    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], forward_batch,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``q`` [tokens, heads, head_dim]; returns [tokens, heads * v_head_dim]. ``sinks``: this rank's
        heads' sink logits (GPT-OSS), each joining its head's softmax denominator with no value."""
        if k is not None:
            forward_batch.token_to_kv_pool.set_kv_buffer(self.layer_id, forward_batch.out_cache_loc, k, v)
        out = forward_batch.attn_backend.forward(q, self, forward_batch, sinks)
        return out.reshape(q.shape[0], self.num_heads * self.v_head_dim)
