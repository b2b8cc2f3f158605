"""How much KV (and Mamba state) fits on a device (seed 000 §8-10, reference §2).

SGLang sizes its pools once, at start-up, after the model weights are loaded:

* ``rest = available - total * (1 - mem_fraction_static)`` is what the static
  pools may take; ``available`` is the memory still free *after* the weights
  were loaded, and ``total * (1 - mem_fraction_static)`` is left unallocated
  for activations, CUDA graphs and allocator slack.
* A hybrid (Mamba / linear-attention) model first gives ``rest * r / (1 + r)``
  (``r = mamba_full_memory_ratio``) or exactly ``max_mamba_cache_size`` slots
  to the Mamba state pool, and under speculative decoding the slot-sized
  states of its verify scratch (``mamba_verify_states``: one per request row
  and verify token); the KV pool gets what they leave.
* KV tokens are ``kv_budget // cell_size``, capped by ``max_total_tokens`` and
  rounded down to whole pages. With a draft model (speculative decoding) a
  slot holds the draft's KV too, in a pool of its own indexed by the same
  slots (SGLang's draft worker): its bytes per token join the cell. The pools' extra dummy page is not budgeted,
  as in SGLang.

:func:`default_memory_args` reproduces SGLang's per-GPU-size defaults for
``chunked_prefill_size``, ``cuda_graph_max_bs`` and ``mem_fraction_static``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import psutil
import torch

GiB = 1 << 30
MAMBA_FULL_MEMORY_RATIO = 0.9  # SGLang's mamba_full_memory_ratio: Mamba state bytes per KV byte
UNBOUNDED_TOKENS = 2**31 - 1  # the KV slots of a rank that holds no KV layer: any count fits, int32 slot ids


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class KVCacheShape:
    """What one token costs in the KV pool (and, for hybrid models, one Mamba slot).

    MLA when ``kv_lora_rank`` is set: then ``num_kv_heads`` / ``head_dim`` /
    ``v_head_dim`` are ignored and may be left ``None``.
    """

    num_attention_layers: int
    """Layers that keep KV: every layer, or only the full-attention ones of a hybrid model (none: a
    pipeline stage of its Mamba layers only)."""
    num_kv_heads: Optional[int] = None
    """Total KV heads of the model (before TP sharding); required for MHA."""
    head_dim: Optional[int] = None
    """Key head size; required for MHA."""
    v_head_dim: Optional[int] = None
    """Value head size; defaults to ``head_dim``."""
    kv_lora_rank: Optional[int] = None
    """MLA compressed latent size; setting it makes the shape MLA."""
    qk_rope_head_dim: Optional[int] = None
    """MLA decoupled RoPE key size; required with ``kv_lora_rank``."""
    mamba_state_bytes_per_slot: Optional[int] = None
    """Bytes of the conv + temporal state of ALL Mamba layers for one slot; makes the shape hybrid (0: a
    pipeline stage of its attention layers only)."""

    def __post_init__(self) -> None:
        # (a hybrid model's pipeline stage may hold its Mamba layers only, or its attention layers only)
        if not (self.is_hybrid and self.num_attention_layers == 0):
            _check_positive_int("num_attention_layers", self.num_attention_layers)
        if self.is_mla:
            _check_positive_int("kv_lora_rank", self.kv_lora_rank)
            _check_positive_int("qk_rope_head_dim", self.qk_rope_head_dim)
        else:
            if self.qk_rope_head_dim is not None:
                raise ValueError("qk_rope_head_dim is an MLA field: set kv_lora_rank too, or drop it")
            _check_positive_int("num_kv_heads", self.num_kv_heads)
            _check_positive_int("head_dim", self.head_dim)
            if self.v_head_dim is None:
                object.__setattr__(self, "v_head_dim", self.head_dim)
            _check_positive_int("v_head_dim", self.v_head_dim)
        if self.is_hybrid and not (self.mamba_state_bytes_per_slot == 0 and self.num_attention_layers > 0):
            _check_positive_int("mamba_state_bytes_per_slot", self.mamba_state_bytes_per_slot)

    @property
    def is_mla(self) -> bool:
        """True when the KV is MLA's compressed latent plus RoPE key."""
        return self.kv_lora_rank is not None

    @property
    def is_hybrid(self) -> bool:
        """True when the model also keeps per-request Mamba state."""
        return self.mamba_state_bytes_per_slot is not None


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of a torch dtype (fp8 kinds are 1)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    return dtype.itemsize


def cell_size_bytes(shape: KVCacheShape, kv_dtype: torch.dtype, tp_size: int = 1) -> int:
    """KV bytes of one token on one TP rank.

    MHA shards KV heads over TP; with fewer heads than ranks each rank keeps a
    replica of one head (``max(1, heads // tp)``). MLA's latent is not sharded.
    """
    _check_positive_int("tp_size", tp_size)
    if shape.is_mla:
        per_layer = shape.kv_lora_rank + shape.qk_rope_head_dim
    else:
        heads_per_rank = max(1, shape.num_kv_heads // tp_size)
        per_layer = heads_per_rank * (shape.head_dim + shape.v_head_dim)
    return per_layer * shape.num_attention_layers * dtype_size(kv_dtype)


def get_device_memory(device: Union[str, torch.device]) -> Tuple[int, int]:
    """``(available_bytes, total_bytes)`` of a CUDA device or of host memory for ``cpu``.

    On CUDA the caching allocator's free blocks go back to the driver first (SGLang's
    ``get_available_gpu_memory(empty_cache=True)``): blocks freed while loading (per-expert tensors
    stacked for the fused MoE, a dtype cast) would otherwise count as used and shrink the KV pool."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    if device.type == "cpu":
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    raise ValueError(f"get_device_memory: unsupported device type {device.type!r}")


@dataclass(frozen=True)
class MemoryBudget:
    """The outcome of :func:`profile_max_num_tokens`."""

    max_total_num_tokens: int
    """KV token slots of the pool (a whole number of pages)."""
    cell_size: int
    """KV bytes per token on this rank (a draft model's included)."""
    kv_bytes: int
    """Bytes the KV pool takes: ``max_total_num_tokens * cell_size``."""
    max_mamba_cache_size: int
    """Mamba state slots; 0 when the model is not hybrid."""
    mamba_bytes: int
    """Bytes the Mamba pool takes: ``(max_mamba_cache_size + mamba_verify_states) * mamba_state_bytes_per_slot``."""
    rest_bytes: int
    """Memory the static pools were allowed, before the split."""
    draft_cell_size: int = 0
    """The draft model's KV bytes per token, part of ``cell_size``; 0 without one."""
    mamba_verify_states: int = 0
    """Slot-sized states of the Mamba pool's verify scratch (speculative decoding), part of ``mamba_bytes``."""

    def describe(self) -> str:
        """One log line with the numbers."""
        line = (
            f"KV cache: {self.max_total_num_tokens} tokens x {self.cell_size} B = "
            f"{self.kv_bytes / GiB:.2f} GiB"
        )
        if self.draft_cell_size:
            line += f" ({self.draft_cell_size} B/token of it the draft model's)"
        if self.max_mamba_cache_size:
            scratch = f" + {self.mamba_verify_states} verify states" if self.mamba_verify_states else ""
            line += f"; mamba: {self.max_mamba_cache_size} slots{scratch} = {self.mamba_bytes / GiB:.2f} GiB"
        return line + f"; static budget {self.rest_bytes / GiB:.2f} GiB"


def static_budget_bytes(available_bytes: int, total_bytes: int, mem_fraction_static: float) -> int:
    """What the static pools may take (``rest``); ValueError naming mem_fraction_static when nothing."""
    if not 0.0 < mem_fraction_static <= 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static}")
    if total_bytes <= 0 or not 0 <= available_bytes <= total_bytes:
        raise ValueError(
            f"need 0 <= available_bytes <= total_bytes and total_bytes > 0, got {available_bytes}, {total_bytes}"
        )
    reserved = round(total_bytes * (1.0 - mem_fraction_static))
    rest = available_bytes - reserved
    if rest <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {available_bytes / GiB:.2f} GiB available after the weights, "
            f"but {reserved / GiB:.2f} GiB of {total_bytes / GiB:.2f} GiB is kept free by "
            f"mem_fraction_static={mem_fraction_static}; raise mem_fraction_static"
        )
    return rest


def _mamba_slots(shape: KVCacheShape, rest: int, ratio: float, max_mamba_cache_size: Optional[int]) -> int:
    per_slot = shape.mamba_state_bytes_per_slot
    if max_mamba_cache_size is not None:
        _check_positive_int("max_mamba_cache_size", max_mamba_cache_size)
        if max_mamba_cache_size * per_slot >= rest:
            raise ValueError(
                f"max_mamba_cache_size={max_mamba_cache_size} needs {max_mamba_cache_size * per_slot} B, "
                f"the static budget is {rest} B: lower it or raise mem_fraction_static"
            )
        return max_mamba_cache_size
    if ratio <= 0:
        raise ValueError(f"mamba_full_memory_ratio must be > 0, got {ratio}")
    slots = int(rest * ratio / (1 + ratio)) // per_slot
    if slots == 0:
        raise ValueError(f"no Mamba slot fits ({per_slot} B each, budget {rest} B): raise mem_fraction_static")
    return slots


def max_mamba_rows(
    shape: KVCacheShape,
    rest_bytes: int,
    mamba_states: Callable[[int], int],
    most: int,
    mamba_full_memory_ratio: float = MAMBA_FULL_MEMORY_RATIO,
) -> int:
    """The most request rows, up to ``most``, whose Mamba states — ``mamba_states(rows)`` slot-sized
    states, non-decreasing in ``rows``: the pool's slots and a verify scratch's — take at most the
    Mamba share of the static budget, ``rest * r / (1 + r)``, so the KV pool keeps the rest; 0
    when one row's do not.

    A default for ``max_running_requests`` on a hybrid model: under speculative decoding every row
    holds a state per verify token beside its slots, so a fixed default can ask more than the
    device holds. SGLang solves the same split for its Mamba pool and verify scratch together (its
    ``max_mamba_cache_size`` from ``mamba_full_memory_ratio``) and caps its running requests by
    the slots that gives.
    """
    _check_positive_int("most", most)
    if not shape.is_hybrid:
        raise ValueError("max_mamba_rows needs a hybrid shape (mamba_state_bytes_per_slot)")
    if mamba_full_memory_ratio <= 0:
        raise ValueError(f"mamba_full_memory_ratio must be > 0, got {mamba_full_memory_ratio}")
    share = int(rest_bytes * mamba_full_memory_ratio / (1 + mamba_full_memory_ratio))
    rows = range(1, most + 1)  # (the rows that fit are a prefix of it: count them)
    return bisect.bisect_left(rows, True, key=lambda n: mamba_states(n) * shape.mamba_state_bytes_per_slot > share)


def profile_max_num_tokens(
    shape: KVCacheShape,
    kv_dtype: torch.dtype,
    available_bytes: int,
    total_bytes: int,
    mem_fraction_static: float,
    page_size: int = 1,
    tp_size: int = 1,
    mamba_full_memory_ratio: float = MAMBA_FULL_MEMORY_RATIO,
    max_total_tokens: Optional[int] = None,
    max_mamba_cache_size: Optional[int] = None,
    draft_shape: Optional[KVCacheShape] = None,
    mamba_verify_states: int = 0,
) -> MemoryBudget:
    """Size the KV (and Mamba) pools of one rank the way SGLang does.

    ``available_bytes`` is the device memory free *after* the model weights
    were loaded (``get_device_memory`` called then); ``total_bytes`` is the
    device's capacity. ``draft_shape``: a draft model's KV, in a pool of as
    many slots (not sharded: the draft runs whole, on TP rank 0 only).
    ``mamba_verify_states``: slot-sized states of a hybrid model's verify
    scratch, taken with the Mamba pool's. Raises ValueError when nothing fits.
    """
    _check_positive_int("page_size", page_size)
    if max_total_tokens is not None:
        _check_positive_int("max_total_tokens", max_total_tokens)
    if (max_mamba_cache_size is not None or mamba_verify_states) and not shape.is_hybrid:
        raise ValueError("max_mamba_cache_size and mamba_verify_states need a hybrid shape "
                         "(mamba_state_bytes_per_slot)")
    rest = static_budget_bytes(available_bytes, total_bytes, mem_fraction_static)
    slots = _mamba_slots(shape, rest, mamba_full_memory_ratio, max_mamba_cache_size) if shape.is_hybrid else 0
    mamba_bytes = (slots + mamba_verify_states) * (shape.mamba_state_bytes_per_slot or 0)
    draft_cell = 0 if draft_shape is None else cell_size_bytes(draft_shape, kv_dtype)
    cell = cell_size_bytes(shape, kv_dtype, tp_size) + draft_cell
    # (no KV layer, a pipeline stage of Mamba layers only: its slots cost nothing, the other stages' pools bound them)
    tokens = (rest - mamba_bytes) // cell if cell else (UNBOUNDED_TOKENS if rest > mamba_bytes else 0)
    if max_total_tokens is not None:
        tokens = min(tokens, max_total_tokens)
    tokens = tokens // page_size * page_size
    if tokens <= 0:
        scratch = (f" or lower max_running_requests x (speculative_num_draft_tokens + 1), the "
                   f"{mamba_verify_states} Mamba states of the verify scratch") if mamba_verify_states else ""
        raise ValueError(
            f"not one page of KV fits: {rest - mamba_bytes} B for {cell} B/token x page_size {page_size}; "
            f"raise mem_fraction_static or free memory{scratch}"
        )
    return MemoryBudget(tokens, cell, tokens * cell, slots, mamba_bytes, rest, draft_cell, mamba_verify_states)


@dataclass(frozen=True)
class ServerMemoryDefaults:
    """SGLang's memory-related server defaults for one device size."""

    chunked_prefill_size: int
    """Most prompt tokens one prefill chunk may hold."""
    cuda_graph_max_bs: int
    """Largest batch captured as a CUDA graph (0: no graphs, e.g. on CPU)."""
    reserved_mem_mb: float
    """MB kept out of the static pools for activations, graphs and parallelism."""
    mem_fraction_static: float
    """Fraction of device memory for weights + static pools."""


# (upper bound in GB, chunked_prefill_size, cuda_graph_max_bs if tp < 4, if tp >= 4)
_GPU_TABLE = (
    (20, 2048, 8, 8),
    (35, 2048, 24, 80),
    (60, 4096, 32, 160),
    (90, 8192, 256, 512),
    (160, 8192, 256, 512),
)
_ABOVE_160GB = (16384, 512)


def _table_row(device_memory_gb: float, tp_size: int) -> Tuple[int, int]:
    for upper_gb, chunked, bs_small_tp, bs_large_tp in _GPU_TABLE:
        if device_memory_gb < upper_gb:
            return chunked, bs_small_tp if tp_size < 4 else bs_large_tp
    return _ABOVE_160GB


def default_memory_args(
    device_memory_gb: float,
    tp_size: int = 1,
    pp_size: int = 1,
    is_cuda: bool = True,
    *,
    chunked_prefill_size: Optional[int] = None,
    cuda_graph_max_bs: Optional[int] = None,
    reserved_mem_mb: Optional[float] = None,
    mem_fraction_static: Optional[float] = None,
) -> ServerMemoryDefaults:
    """SGLang's defaults for a device of ``device_memory_gb`` GB (GiB, as SGLang counts).

    Keyword overrides replace the computed values; the derived ones
    (``reserved_mem_mb``, then ``mem_fraction_static``) are recomputed from
    the overrides unless overridden themselves.
    """
    if device_memory_gb <= 0:
        raise ValueError(f"device_memory_gb must be > 0, got {device_memory_gb}")
    _check_positive_int("tp_size", tp_size)
    _check_positive_int("pp_size", pp_size)
    table_chunked, table_bs = _table_row(device_memory_gb, tp_size)
    chunked = table_chunked if chunked_prefill_size is None else chunked_prefill_size
    bs = cuda_graph_max_bs if cuda_graph_max_bs is not None else (table_bs if is_cuda else 0)
    if reserved_mem_mb is None:
        reserved_mem_mb = 512 + max(chunked, 2048) * 1.5 + bs * 2 + tp_size * pp_size / 8 * 1024
    if mem_fraction_static is None:
        gpu_mem_mb = device_memory_gb * 1024
        mem_fraction_static = round((gpu_mem_mb - reserved_mem_mb) / gpu_mem_mb, 3)
        if mem_fraction_static <= 0:
            raise ValueError(
                f"{device_memory_gb} GB is less than the {reserved_mem_mb:.0f} MB reserved: "
                "pass a smaller chunked_prefill_size or mem_fraction_static"
            )
    return ServerMemoryDefaults(chunked, bs, reserved_mem_mb, mem_fraction_static)
