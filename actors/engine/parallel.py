"""Tensor parallelism: the rank's group and the sharded linear layers.

A TP group of ``size`` ranks splits every attention / MLP / MoE layer the
Megatron way: the first linear of a pair is *column parallel* (each rank
computes its own slice of the output features — its heads, its part of the
intermediate dim; no communication), the second *row parallel* (each rank
multiplies its slice of the input features, then one all-reduce sums the
partial outputs). Norms are replicated.

The embedding and ``lm_head`` are split by vocabulary, as SGLang's
``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary is padded up
to a multiple of ``VOCAB_PADDING × size`` (:func:`padded_vocab_size`) and
each rank holds one contiguous range of its rows (:meth:`TPGroup.vocab_shard`;
rows past the real vocabulary are zeros, and a rank may hold only those). A
lookup reads the ids in the rank's range (the others give zeros) and one
all-reduce sums them; ``lm_head`` computes the rank's range of logits and one
all-gather gives every rank the whole padded vocabulary, cut back to
``vocab_size``. The all-reduce adds only zeros to a token's row and the
all-gather only concatenates: the split itself changes no value. Tied
embeddings share the one sharded weight.

Weights are sharded when loaded: a module names, in ``param_shards``, which
rows (dim 0), columns (dim 1) or slices of another dim (GPT-OSS's 3-D experts)
of each full checkpoint tensor it holds, as a list of ranges cut out in order
and concatenated (a vocabulary shard's
range may run past the tensor's end: zeros there); ``model_loader`` reads
only those slices from the safetensors files.

Expert parallelism (``expert_parallel``: vLLM's ``--enable-expert-parallel``, SGLang's ``--ep-size``
equal to the TP size) shards a MoE layer's experts instead: rank r holds experts ``[r·E/N, (r+1)·E/N)``
whole (:meth:`TPGroup.experts`; their intermediate dims unsplit, :attr:`TPGroup.expert_tp`), the rest of
the model stays TP. Activations are replicated in TP, so every rank routes every token, runs its own
experts on the tokens routed to them, and the block's one all-reduce sums the ranks' contributions as
it sums the slices under TP.

The linear layers (:class:`LinearBase`) may hold their weight in block FP8 with its scales
(:mod:`.fp8`), packed in GPTQ's / AWQ's int words with their scales and zeros (:mod:`.wna16`), or as a
compressed-tensors checkpoint stores it (:mod:`.compressed_tensors`: FP8, int8, packed ints), each sharded
alike: the weight is dequantized in each forward (a GPTQ / AWQ one on CUDA tile by tile, inside
its GEMM).

With ``size == 1`` (:data:`SINGLE`) every collective is a no-op and every
layer holds the whole tensor (the vocabulary is not padded), so the models
have one code path.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from actors.engine import compressed_tensors, fp8, wna16
from actors.engine.pipeline import SINGLE_STAGE, PPGroup

# SGLang's DEFAULT_VOCAB_PADDING_SIZE: under TP each rank's share of the vocabulary is a multiple of it
VOCAB_PADDING = 64


class ParamShard(NamedTuple):
    """A rank's slice of a checkpoint tensor: ``ranges`` of dim ``dim``, cut out in order and
    concatenated. ``zero_fill``: the ranges may run past the tensor's end (a vocabulary padded
    to split evenly); what lies there is zeros. Otherwise a range must lie inside the tensor."""

    dim: int
    ranges: List[range]
    zero_fill: bool = False


# followers block on the control group while the engine is idle: no practical timeout there
CONTROL_TIMEOUT = datetime.timedelta(days=365)
# the group's start-up rendezvous and every collective inside a forward
DEVICE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group.

    ``group`` carries the device collectives of the forward (NCCL on CUDA,
    gloo on CPU); ``cpu_group`` (gloo) carries the control messages: the
    broadcast batches, the start-up agreement on pool sizes.
    ``expert_parallel``: MoE layers shard their experts over the group, not
    every expert's intermediate dim (:meth:`experts`). ``pp``: the pipeline
    stage this group is (:mod:`.pipeline`): its layers, and its neighbours.
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    cpu_group: Any = None
    expert_parallel: bool = False
    pp: PPGroup = SINGLE_STAGE

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # ---- collectives -----------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place (no-op with one rank)."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` (all of one shape), concatenated along ``dim`` in rank order,
        on every rank (``x`` itself with one rank)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def all_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (every rank gets it)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.cpu_group)
        return int(t)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled over the control group)."""
        if self.size == 1:
            return obj
        box = [obj if self.is_leader else None]
        torch.distributed.broadcast_object_list(box, src=self._global(0), group=self.cpu_group)
        return box[0]

    def gather_objects(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's ``obj`` on rank 0 (in rank order); ``None`` elsewhere."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size if self.is_leader else None
        torch.distributed.gather_object(obj, out, dst=self._global(0), group=self.cpu_group)
        return out

    def _global(self, group_rank: int) -> int:
        if self.cpu_group is None:
            return group_rank
        return torch.distributed.get_global_rank(self.cpu_group, group_rank)

    # ---- sharding ------------------------------------------------------------------------
    def split(self, total: int, field: str) -> range:
        """This rank's even share of ``total`` units; ``field`` names the config value in the error."""
        if total % self.size:
            raise ValueError(f"tp_size={self.size} must divide {field}={total}")
        n = total // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def experts(self, num_experts: int, field: str) -> range:
        """The experts of a MoE layer this rank holds: all of them under TP (each one's
        intermediate dim split over :attr:`expert_tp`), its even share whole under EP."""
        if not self.expert_parallel:
            return range(num_experts)
        if num_experts % self.size:
            raise ValueError(f"tp_size={self.size} must divide {field}={num_experts} with "
                             "enable_expert_parallel (each rank holds whole experts)")
        return self.split(num_experts, field)

    @property
    def expert_tp(self) -> "TPGroup":
        """The group each held expert's intermediate dim is split over: this one under TP, none
        (:data:`SINGLE`: whole experts, no reduce of their own) under EP."""
        return SINGLE if self.expert_parallel else self

    def vocab_shard(self, vocab_size: int) -> range:
        """This rank's rows of the vocabulary padded to :func:`padded_vocab_size`; the
        part at or past ``vocab_size`` (possibly all of it) is padding."""
        n = padded_vocab_size(vocab_size, self.size) // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self, num_kv_heads: int, field: str = "num_key_value_heads") -> range:
        """This rank's KV heads. With at least as many heads as ranks they are split
        evenly; with fewer (GQA, ``tp_size > num_kv_heads``) every rank keeps a
        replica of the one head its query heads read, as SGLang does."""
        if self.size <= num_kv_heads:
            return self.split(num_kv_heads, field)
        if self.size % num_kv_heads:
            raise ValueError(f"tp_size={self.size} must divide or be a multiple of {field}={num_kv_heads}")
        head = self.rank // (self.size // num_kv_heads)
        return range(head, head + 1)


SINGLE = TPGroup()


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``VOCAB_PADDING * tp_size`` (SGLang's
    padding: every rank gets an equal, aligned share); unpadded with one rank."""
    if tp_size == 1:
        return vocab_size
    multiple = VOCAB_PADDING * tp_size
    return -(-vocab_size // multiple) * multiple


def init_tp_group(rank: int, size: int, init_method: str, device: torch.device,
                  timeout: datetime.timedelta = DEVICE_TIMEOUT) -> TPGroup:
    """Join the TP group of ``size`` processes (this process's default
    ``torch.distributed`` group): NCCL for CUDA tensors, gloo otherwise, plus a
    gloo control group for pickled messages."""
    if size == 1:
        return SINGLE
    dist = torch.distributed
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(rank, size, dist.group.WORLD, cpu_group)


def init_stage_group(ranks: TPGroup, tp_size: int, pp_size: int,
                     partition: Optional[Sequence[int]] = None) -> TPGroup:
    """This rank's TP group within its pipeline stage, from ``ranks``, the worker's group of
    ``tp_size × pp_size`` ranks (:func:`init_tp_group`'s): ``ranks`` itself with one stage. Every
    rank makes every stage's groups, in the same order (torch.distributed's rule for new groups)."""
    if pp_size == 1:
        return ranks
    dist = torch.distributed
    stage, tp_rank = divmod(ranks.rank, tp_size)
    for s in range(pp_size):
        members = list(range(s * tp_size, (s + 1) * tp_size))
        groups = dist.new_group(members, timeout=DEVICE_TIMEOUT), dist.new_group(members, backend="gloo",
                                                                                 timeout=CONTROL_TIMEOUT)
        if s == stage:
            group, cpu_group = groups
    pp = PPGroup(stage, pp_size, tp_rank, tp_size, None if partition is None else tuple(partition), ranks)
    return TPGroup(tp_rank, tp_size, group, cpu_group, pp=pp)


def shard_ranges(sizes: Sequence[int], tp: TPGroup, field: str) -> List[range]:
    """An output dim made of consecutive segments of ``sizes`` (e.g. a conv's q | k | v
    channels), each split evenly: this rank's range in every segment, in order."""
    ranges, offset = [], 0
    for size in sizes:
        part = tp.split(size, field)
        ranges.append(range(offset + part.start, offset + part.stop))
        offset += size
    return ranges


def head_ranges(heads: range, head_dim: int) -> List[range]:
    """The rows of heads ``heads`` in a ``[num_heads * head_dim, ...]`` weight."""
    return [range(heads.start * head_dim, heads.stop * head_dim)]


@dataclass(frozen=True)
class AttentionHeads:
    """This rank's query heads and KV heads (of ``total_kv`` in the model)."""

    q: range
    kv: range
    total_kv: int


def attention_heads(tp: TPGroup, num_heads: int, num_kv_heads: int) -> AttentionHeads:
    """Query heads split evenly; KV heads split or replicated (:meth:`TPGroup.kv_heads`).
    Rank r's query heads read exactly rank r's KV heads."""
    return AttentionHeads(tp.split(num_heads, "num_attention_heads"), tp.kv_heads(num_kv_heads), num_kv_heads)


def shard_param(module: nn.Module, name: str, dim: int, ranges: Sequence[range], zero_fill: bool = False) -> None:
    """Declare that ``module.<name>`` holds only ``ranges`` of dim ``dim`` of the checkpoint
    tensor (``zero_fill``: see :class:`ParamShard`)."""
    shards: Dict[str, ParamShard] = module.__dict__.setdefault("param_shards", {})
    shards[name] = ParamShard(dim, list(ranges), zero_fill)


class LinearBase(nn.Linear):
    """A linear layer whose weight may be held in block FP8 (:func:`fp8.quantize_linear` sets
    ``weight_block_size`` and adds ``weight_scale_inv``), packed GPTQ / AWQ ints (:func:`wna16.quantize_linear`
    sets ``packed``, its tensors in place of ``weight``) or as compressed-tensors stores it
    (:func:`compressed_tensors.quantize_linear` sets ``scheme``): then each forward dequantizes it to the
    input's dtype first (weight-only)."""

    weight_block_size: Optional[Tuple[int, int]] = None
    packed: Optional[wna16.PackedConfig] = None
    scheme: Optional[compressed_tensors.Scheme] = None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight to multiply inputs of ``dtype`` by."""
        if self.packed is not None:
            return wna16.dequantize(self, dtype)
        if self.scheme is not None:
            return compressed_tensors.dequantize(self, dtype)
        if self.weight_block_size is None:
            return self.weight
        return fp8.dequantize(self.weight, self.weight_scale_inv, self.weight_block_size, dtype)

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` times the weight, plus ``bias``: a packed layer's through :func:`wna16.linear` (one fused
        kernel on CUDA), never its dense weight in memory there."""
        if self.packed is not None:
            return wna16.linear(self, x, bias)
        return F.linear(x, self.dense_weight(x.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (DeepSeek-V3's latent projections)."""


class ColumnParallelLinear(LinearBase):
    """Holds the output rows ``ranges`` of the full weight (and bias); no communication."""

    def __init__(self, in_features: int, ranges: Sequence[range], bias: bool = False):
        super().__init__(in_features, sum(len(r) for r in ranges), bias=bias)
        shard_param(self, "weight", 0, ranges)
        if bias:
            shard_param(self, "bias", 0, ranges)

    @classmethod
    def split(cls, in_features: int, out_features: int, tp: TPGroup, field: str, bias: bool = False):
        """Output features split evenly over the ranks."""
        return cls(in_features, shard_ranges([out_features], tp, field), bias)


class RowParallelLinear(LinearBase):
    """Holds an even slice of the input features; sums the partial outputs with
    one all-reduce (``reduce=False`` leaves the sum to the caller, who then
    reduces several partial results at once — the MoE does). The bias is added
    once, after the sum (or by rank 0 only when not reducing)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, field: str,
                 bias: bool = False, reduce: bool = True):
        part = tp.split(in_features, field)
        super().__init__(len(part), out_features, bias=bias)
        shard_param(self, "weight", 1, [part])
        self.tp, self.reduce = tp, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        return self.reduced(self.matmul(x))

    def reduced(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output from this rank's partial product ``y`` (x's slice times the weight's,
        plus whatever else is summed over the ranks: a LoRA delta): the all-reduce, then the bias."""
        if self.reduce:
            y = self.tp.all_reduce(y)
        if self.bias is not None and (self.reduce or self.tp.is_leader):
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Embedding):
    """Holds rows ``tp.vocab_shard(vocab_size)`` of the embedding (zeros past ``vocab_size``).
    A lookup reads the ids in that range, zeros the other tokens' rows, and one all-reduce
    sums the ranks' rows: every id lies in exactly one rank's range, so each token gets its
    row bit for bit."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        self.shard = tp.vocab_shard(vocab_size)
        super().__init__(len(self.shard), hidden_size)
        shard_param(self, "weight", 0, [self.shard], zero_fill=True)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.shard.start
        outside = (local < 0) | (local >= len(self.shard))
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Linear):
    """Holds the same rows of ``lm_head`` as :class:`VocabParallelEmbedding` (so a tied
    pair shares one weight); each rank computes the logits of its vocabulary range and one
    all-gather gives every rank all of them, padding cut off: ``[..., vocab_size]``."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup):
        self.shard = tp.vocab_shard(vocab_size)
        super().__init__(hidden_size, len(self.shard), bias=False)
        shard_param(self, "weight", 0, [self.shard], zero_fill=True)
        self.tp, self.vocab_size = tp, vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(super().forward(x), dim=-1)
        return logits[..., : self.vocab_size]

    def token_logits(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The logits of the vocabulary ids ``ids`` ``[n, k]`` only, for rows ``x`` ``[n, hidden]``:
        ``[n, k]``, on every rank. Each rank dots the ``lm_head`` rows it holds (an id another rank
        holds gives zeros here) and one all-reduce sums them: ``k`` rows per request, not the vocabulary."""
        local = ids - self.shard.start
        held = (local >= 0) & (local < len(self.shard))
        rows = self.weight[local.clamp(0, len(self.shard) - 1)] * held[..., None].to(self.weight.dtype)
        return self.tp.all_reduce(torch.einsum("nh,nkh->nk", x, rows))
