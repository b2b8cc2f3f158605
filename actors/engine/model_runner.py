"""Loads the model, sizes and builds the memory pools, and runs forwards.

Pools are built once, at start-up, from the model's :class:`KVCacheSpec` and
the memory budget (``mem_cache.memory_budget``): the KV pool holds
``max_total_num_tokens`` slots, the request table ``max_running_requests``
rows. Nothing is allocated per request afterwards. With a draft model
(:mod:`actors.engine.draft_model`, TP rank 0 only) a second KV pool of as many
slots holds the draft's KV, and every forward but a verify is mirrored by it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch

from actors.engine.attention import create_attention_backend
from actors.engine.config import CHUNKED_PREFILL_DEFAULT, EngineConfig
from actors.engine.cuda_graph_runner import CudaGraphRunner, capture_batch_sizes, cuda_graph_max_bs, graphs_off_reason
from actors.engine.draft_model import DraftModel
from actors.engine.forward_batch import ForwardBatch, int64_tensor
from actors.engine.fused_moe import FusableExperts, fp8_unfused_reason, fuse_experts
from actors.engine.lora import LoRAAdapter, LoRAManager, read_adapter
from actors.engine.model_loader import DTYPES, ServedWeights, build_model, get_context_length, load_model
from actors.engine.models.base import LogitsOutput
from actors.engine.parallel import SINGLE, TPGroup
from mem_cache.alloc_kernels import triton_device_error
from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.buffer_allocator import BufferAllocator
from mem_cache.memory_budget import (GiB, KVCacheShape, cell_size_bytes, default_memory_args, get_device_memory,
                                     max_mamba_rows, profile_max_num_tokens, static_budget_bytes)
from mem_cache.mamba_pool import HybridLinearKVPool, HybridReqToTokenPool, MambaPool
from mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from mem_cache.req_to_token_pool import ReqToTokenPool
from mem_cache.swa_allocator import SWATokenToKVPoolAllocator
from mem_cache.swa_memory_pool import SWAKVPool

logger = logging.getLogger(__name__)

MAX_RUNNING_DEFAULT = 256  # request rows when max_running_requests is not set (fewer if the KV pool is small)
CPU_MEM_FRACTION_STATIC = 0.5  # mem_fraction_static when not set, on the CPU
KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def resolve_device(name: str) -> torch.device:
    """``name`` as a device with its index: a bare ``cuda`` is the GPU current in the calling
    thread, and the engine's other threads (its loop, a TP follower's) would take GPU 0 — with
    every GPU of a node visible to every rank, not the one this rank was given."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"device {name!r}: CUDA is not available here ({why}; torch {torch.__version__}); "
                         "use device 'cpu'")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def default_mem_fraction_static(config: EngineConfig, device_type: str, total_bytes: int,
                                cuda_graph_max_bs: int) -> float:
    """``mem_fraction_static``, SGLang's when not set on CUDA: the device's memory (``total_bytes``) less
    its ``reserved_mem_mb`` for a prefill chunk's activations (the engine's ``chunked_prefill_size``;
    ``max_prefill_tokens`` when chunking is off), the CUDA graphs (``cuda_graph_max_bs`` x 2 MB, 0 with
    graphs off) and the tp_size x pp_size ranks' buffers (``default_memory_args``). On the CPU 0.5: system
    memory is shared with everything else on the host (the Ray processes, the tokenizer, the page cache),
    and a reserve sized for a GPU's activations would hand the KV pool nearly all of it."""
    if config.mem_fraction_static is not None:
        return config.mem_fraction_static
    if device_type != "cuda":
        return CPU_MEM_FRACTION_STATIC
    chunk = config.chunked_prefill_size if config.chunked_prefill_size is not None else CHUNKED_PREFILL_DEFAULT
    return default_memory_args(total_bytes / GiB, config.tp_size, config.pp_size,
                               chunked_prefill_size=chunk if chunk > 0 else config.max_prefill_tokens,
                               cuda_graph_max_bs=cuda_graph_max_bs).mem_fraction_static


def _no_followers(forward_batch: ForwardBatch) -> ContextManager:
    return contextlib.nullcontext()


class ModelRunner:
    def __init__(self, config: EngineConfig, buffer_allocator: Optional[BufferAllocator] = None, tp: TPGroup = SINGLE):
        """``buffer_allocator``: where the KV and Mamba pools' buffers come from
        (a shareable one when a peer process writes them: the PD decode side).
        ``tp``: this rank's TP group (and pipeline stage, ``tp.pp``); the model holds (and the
        pools are sized for) this rank's shard of its stage's layers, every rank's pools have the
        same slot counts."""
        self.config = config
        self.buffer_allocator = buffer_allocator
        self.tp = tp
        self.device = resolve_device(config.device)
        torch.manual_seed(config.random_seed)
        self.model, self.model_config, self.dtype = load_model(
            config.model_path, config.dtype, config.device,
            dataclasses.replace(tp, expert_parallel=config.enable_expert_parallel), config.quantization)
        self._fuse_experts()  # (before the served weights are taken: the experts' become views of the stacks)
        self.weights = ServedWeights(self.model, self.model_config, config.model_path)  # (before LoRA wraps layers)
        self.lora = self._load_loras()  # (before the KV pool is sized: its buffers are device memory too)
        attention = config.attention_backend
        if attention == "auto":
            attention = "triton" if self.device.type == "cuda" else "torch"
        self.context_len = config.context_length or get_context_length(self.model_config)
        self.draft = self._load_draft(attention)  # (before the KV pool is sized, as the adapters)
        self.kv_dtype = KV_DTYPES.get(config.kv_cache_dtype, self.dtype)
        self.spec = self.model.kv_cache_spec()
        self.attn_backend = create_attention_backend(attention, device=self.device)
        # before the pools are sized: the default memory fraction keeps memory for the graphs
        self.cuda_graph_max_bs = 0 if graphs_off_reason(self) else self._rank0_cuda_graph_max_bs()
        total_bytes = get_device_memory(self.device)[1]
        self.mem_fraction_static = default_mem_fraction_static(config, self.device.type, total_bytes,
                                                               self.cuda_graph_max_bs)
        tokens, rows = self._profile_pools()
        # the same slots (and rows) on every rank: of its TP group, then of every pipeline stage
        self.max_total_num_tokens = tp.pp.all_min(tp.all_min(tokens))
        self.max_running_requests = config.max_running_requests or max(1, min(tp.pp.all_min(tp.all_min(rows)),
                                                                              self.max_total_num_tokens // 2))
        self._init_pools()
        self.graph_runner = self._init_cuda_graphs()
        # TP rank 0: sends the batch to the other ranks, around a forward in step with theirs
        self.tp_step: Callable[[ForwardBatch], ContextManager] = _no_followers
        self.tp_collect: Callable[[], ContextManager] = contextlib.nullcontext  # around recv_output (TPModelWorker)
        self.host_op_log: Optional[List[Tuple]] = None  # TP rank 0: host-tier copies the other ranks replay
        self.host_peers_loads: Optional[Callable[[], List]] = None  # ... and how their loads ended (asked after)
        # TP rank 0 with a file tier: the other ranks read these pages into these host slots (of this host
        # pool, a sliding-window model's index after them), answer how many
        self.storage_peers_read: Optional[Callable[..., List]] = None
        self.storage_peers_prefetch: Optional[Callable[[str, Any], List]] = None  # ... and prefetch them alike
        self.forward_time = 0.0  # seconds spent in model forwards (for overhead accounting)
        self.num_forwards = 0

    def _fuse_experts(self) -> None:
        """``moe_backend`` (auto: triton on CUDA, torch on the CPU or for experts the fused kernels do not
        take, :meth:`FusableExperts.unfused_reason`, or not on this GPU, :func:`fp8_unfused_reason`, on any
        rank: under EP each holds experts of its own, and ranks on different backends would disagree on CUDA
        graphs, one capturing collectives its peers never join): triton stacks every MoE layer's experts for the
        fused kernels; ValueError when Triton cannot run on the device or them."""
        backend = self.config.moe_backend
        experts = [m for m in self.model.modules() if isinstance(m, FusableExperts)]
        fp8_reason = fp8_unfused_reason(self.device, experts)
        if backend == "auto":
            unfused = fp8_reason or any(m.unfused_reason() for m in experts)
            backend = "triton" if self.tp.all_min(int(self.device.type == "cuda" and not unfused)) else "torch"
        if backend == "triton":
            error = triton_device_error(self.device, "moe_backend='triton'")
            if error:
                raise ValueError(error)
            if fp8_reason:
                raise ValueError(f"moe_backend='triton': {fp8_reason} (moe_backend='torch' serves them)")
            fuse_experts(self.model)

    # ---- LoRA -------------------------------------------------------------------
    def _load_loras(self) -> Optional[LoRAManager]:
        """The adapters of ``lora_paths`` in host memory (this rank's shards) and the device slots
        (None: LoRA is off — no lora_paths and no lora_target_modules, SGLang's rule)."""
        if not (self.config.lora_paths or self.config.lora_target_modules):
            return None
        adapters = [read_adapter(name, path) for name, path in (self.config.lora_paths or {}).items()]
        return LoRAManager(self.model, build_model(self.model_config, model_cls=type(self.model)), adapters,
                           self.config, self.dtype, self.device)

    def check_lora(self, name: str) -> str:
        """ValueError for an adapter this engine does not serve; else its requests' radix ``extra_key``."""
        if self.lora is None:
            raise ValueError(f"LoRA adapter {name!r}: this engine serves none (lora_paths)")
        self.lora.check(name)
        return self.lora.host[name].cache_key

    def read_lora(self, name: str, path: str) -> LoRAAdapter:
        """The adapter in ``path`` as ``name``, checked as at start and cut to this rank's shards
        (:meth:`LoRAManager.shard`): a runtime load's file read, which touches nothing the engine
        loop changes (it runs outside the loop's lock); :meth:`add_lora` then serves it."""
        if self.lora is None:  # (no start adapter nor lora_target_modules gave the slots' layers)
            raise ValueError(f"LoRA adapter {name!r}: this engine was started without LoRA (lora_paths, or "
                             "lora_target_modules with max_lora_rank), so it has no layers that take adapters")
        return self.lora.shard(read_adapter(name, path))

    def add_lora(self, adapter: LoRAAdapter, cache_key: Optional[str] = None) -> None:
        """Keep ``adapter`` (:meth:`read_lora`'s) in host memory, its requests' radix ``extra_key``
        ``cache_key`` (None: :meth:`LoRAManager.add`'s count); ValueError: its name is served already,
        or max_loaded_loras are."""
        self.lora.add(adapter, cache_key)

    def retire_lora(self, name: str) -> None:
        """Refuse new requests for adapter ``name`` (ValueError if it is not served); those in flight keep it."""
        self.check_lora(name)
        self.lora.retiring.add(name)

    def unload_lora(self, name: str) -> None:
        self.lora.remove(name)

    def lora_fields(self, reqs) -> Dict[str, Any]:
        """A forward batch's LoRA fields for ``reqs`` (:meth:`LoRAManager.batch_fields`)."""
        if self.lora is None:
            return {}
        return self.lora.batch_fields([r.lora_path for r in reqs])

    # ---- draft model --------------------------------------------------------------
    def _load_draft(self, attention: str) -> Optional[DraftModel]:
        """The draft model of draft_model speculative decoding, in the target's dtype (SGLang's draft
        worker takes the server's), on TP rank 0 only (:mod:`actors.engine.draft_model`); else None."""
        if self.config.speculative_algorithm != "draft_model" or not self.tp.is_leader:
            return None
        dtype = next(name for name, value in DTYPES.items() if value == self.dtype)
        return DraftModel(self.config.speculative_draft_model_path, dtype, self.device, attention,
                          self.model_config.get_text_config().vocab_size, self.context_len,
                          getattr(self.model_config, "image_token_id", None))

    # ---- memory ---------------------------------------------------------------
    @staticmethod
    def _kv_shape(spec, mamba_state_bytes_per_slot: Optional[int] = None) -> KVCacheShape:
        """``spec``'s per-token KV (a hybrid model's: its full-attention layers') and Mamba slot bytes."""
        if spec.kind == "mla":
            return KVCacheShape(
                num_attention_layers=spec.num_layers,
                kv_lora_rank=spec.kv_lora_rank,
                qk_rope_head_dim=spec.qk_rope_head_dim,
            )
        return KVCacheShape(
            num_attention_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            v_head_dim=spec.v_head_dim,
            mamba_state_bytes_per_slot=mamba_state_bytes_per_slot,
        )

    def _profile_pools(self) -> Tuple[int, int]:
        """KV slots, and request rows at most when max_running_requests is not set: sized from
        device memory unless max_total_tokens is set."""
        ps = self.config.page_size
        if self.config.max_total_tokens is not None:
            return max(ps, self.config.max_total_tokens // ps * ps), MAX_RUNNING_DEFAULT
        available, total = get_device_memory(self.device)
        fraction = self.mem_fraction_static
        hybrid = self.spec.kind == "hybrid_mamba"  # KV for the full-attention layers only; the Mamba pool comes first
        shape = self._kv_shape(self.spec, self._mamba_slot_bytes() if hybrid else None)
        rows, mamba_slots, verify_states = MAX_RUNNING_DEFAULT, None, 0
        if hybrid:
            fit = max_mamba_rows(shape, static_budget_bytes(available, total, fraction),
                                 lambda n: self._num_mamba_slots(n) + self._num_verify_states(n), MAX_RUNNING_DEFAULT)
            rows = self.config.max_running_requests or self._default_mamba_rows(fit)
            mamba_slots, verify_states = self._num_mamba_slots(rows), self._num_verify_states(rows)
        try:
            budget = profile_max_num_tokens(shape, self.kv_dtype, available, total, fraction, page_size=ps,
                                            max_mamba_cache_size=mamba_slots, mamba_verify_states=verify_states,
                                            draft_shape=None if self.draft is None else self._kv_shape(self.draft.spec))
        except ValueError as error:
            if mamba_slots is None or self.config.max_running_requests is None:
                raise
            raise ValueError(f"{error}. max_running_requests={rows} asks {mamba_slots} Mamba slots and {verify_states} "
                             f"states of the verify scratch; at most {fit} fit the budget's Mamba share") from None
        logger.info("memory budget: %s", budget.describe())
        tokens = budget.max_total_num_tokens
        return (self._swa_full_tokens(tokens) if self.spec.kind == "swa" else tokens), rows

    def _swa_full_tokens(self, tokens: int) -> int:
        """A sliding-window model's full-pool slots of a budget of ``tokens`` sized as if every layer were
        full: spread over both pools (the SWA one ``swa_full_tokens_ratio`` as large, SGLang's split) and a
        draft model's, which has a slot per full-pool slot (its bytes counted in target layers). Before the
        ranks' minimum: a pipeline stage's own full and SWA layers set its share."""
        spec, ratio = self.spec, self.config.swa_full_tokens_ratio
        num_full, num_swa = len(spec.full_attention_layer_ids), len(spec.swa_attention_layer_ids)
        draft = 0.0 if self.draft is None else (cell_size_bytes(self._kv_shape(self.draft.spec), self.kv_dtype)
                                                / cell_size_bytes(self._kv_shape(spec), self.kv_dtype) * spec.num_layers)
        return int(tokens * (num_full + num_swa + draft) / (num_full + ratio * num_swa + draft))

    def _default_mamba_rows(self, fit: int) -> int:
        """A hybrid model's request rows when max_running_requests is not set: the most whose Mamba
        states fit the budget's Mamba share (``max_mamba_rows``; under speculation a row's verify
        scratch is most of them), at least one."""
        rows = max(1, fit)
        if rows < MAX_RUNNING_DEFAULT:
            logger.info("max_running_requests not set: %d request rows, the most whose Mamba states (%d slots and "
                        "%d verify scratch states) fit the Mamba share of the memory budget", rows,
                        self._num_mamba_slots(rows), self._num_verify_states(rows))
        return rows

    def _num_mamba_slots(self, max_running_requests: int) -> int:
        """Working (+ two ping-pong with extra_buffer) slots per running request, plus room
        for the tree's checkpoints."""
        per_req = 3 if self.config.mamba_scheduler_strategy == "extra_buffer" else 1
        return max_running_requests * per_req + max(16, max_running_requests)

    def _num_verify_states(self, max_running_requests: int) -> int:
        """Slot-sized states of the verify scratch (0 without speculation)."""
        verify_shape = self._mamba_verify_shape(max_running_requests)
        return math.prod(verify_shape) if verify_shape else 0

    def _mamba_verify_shape(self, max_running_requests: int) -> Optional[Tuple[int, int]]:
        """The verify scratch of speculative decoding (``MambaPool``'s ``verify_shape``): a state per
        request row and verify token (its last sampled one and its draft's); None without speculation."""
        if self.config.speculative_algorithm is None:
            return None
        return max_running_requests, self.config.speculative_num_draft_tokens + 1

    def _mamba_slot_bytes(self) -> int:
        """One Mamba slot over every Mamba layer: conv states in the model dtype, the
        temporal (SSM) state in fp32 — as :class:`MambaPool` allocates them."""
        spec = self.spec
        conv = sum(math.prod(s) for s in spec.conv_state_shapes) * self.dtype.itemsize
        temporal = math.prod(spec.temporal_state_shape) * torch.float32.itemsize
        return len(spec.mamba_layer_ids) * (conv + temporal)

    def _init_hybrid_pools(self) -> None:
        """Mamba state slots (working + ping-pong per running request, plus room for the
        tree's checkpoints; with speculation, the verify scratch), request rows that own
        them, and KV for the attention layers."""
        cfg, spec = self.config, self.spec
        extra = cfg.mamba_scheduler_strategy == "extra_buffer"
        self.mamba_pool = MambaPool(
            self._num_mamba_slots(self.max_running_requests), spec.conv_state_shapes,
            spec.temporal_state_shape, len(spec.mamba_layer_ids), self.dtype, torch.float32, device=self.device,
            buffer_allocator=self.buffer_allocator,
            verify_shape=self._mamba_verify_shape(self.max_running_requests), layer_ids=spec.mamba_layer_ids,
        )
        self.req_to_token_pool = HybridReqToTokenPool(
            self.max_running_requests, self.context_len + 4, self.device, self.mamba_pool, spec.mamba_layer_ids, extra,
        )
        self.token_to_kv_pool = HybridLinearKVPool(
            self.max_total_num_tokens, cfg.page_size, self.kv_dtype, spec.num_kv_heads, spec.head_dim,
            spec.full_attention_layer_ids, self.mamba_pool, device=self.device, buffer_allocator=self.buffer_allocator,
        )

    def _init_swa_pools(self) -> None:
        """Sliding-window models: the full layers' KV in ``max_total_num_tokens`` slots
        (:meth:`_swa_full_tokens` of a budget from device memory), the SWA layers' in
        ``swa_full_tokens_ratio`` as many (SGLang's split)."""
        cfg, spec = self.config, self.spec
        ps = cfg.page_size  # both pools in whole pages: a paged allocator hands out no partial one
        self.max_total_num_tokens = max(ps, self.max_total_num_tokens // ps * ps)
        self.swa_max_total_num_tokens = max(ps, int(self.max_total_num_tokens * cfg.swa_full_tokens_ratio) // ps * ps)
        self.token_to_kv_pool = SWAKVPool(
            self.max_total_num_tokens, self.swa_max_total_num_tokens, cfg.page_size, self.kv_dtype, spec.num_kv_heads,
            spec.head_dim, spec.swa_attention_layer_ids, spec.full_attention_layer_ids, device=self.device,
            buffer_allocator=getattr(self, "buffer_allocator", None),
        )
        logger.info("SWA pool: %d tokens (full pool %d)", self.swa_max_total_num_tokens, self.max_total_num_tokens)

    def _attention_pool(self, spec, buffer_allocator: Optional[BufferAllocator]):
        """An MHA or MLA pool of ``spec``'s layers with ``max_total_num_tokens`` slots."""
        cfg = self.config
        if spec.kind == "mha":
            return MHATokenToKVPool(
                self.max_total_num_tokens, cfg.page_size, self.kv_dtype, spec.num_kv_heads, spec.head_dim,
                spec.num_layers, device=self.device, v_head_dim=spec.v_head_dim, start_layer=spec.start_layer,
                buffer_allocator=buffer_allocator,
            )
        return MLATokenToKVPool(
            self.max_total_num_tokens, cfg.page_size, self.kv_dtype, spec.kv_lora_rank, spec.qk_rope_head_dim,
            spec.num_layers, device=self.device, start_layer=spec.start_layer, buffer_allocator=buffer_allocator,
        )

    def _init_pools(self) -> None:
        cfg, spec = self.config, self.spec
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.context_len + 4, self.device)
        if spec.kind in ("mha", "mla"):
            self.token_to_kv_pool = self._attention_pool(spec, self.buffer_allocator)
        elif spec.kind == "hybrid_mamba":
            self._init_hybrid_pools()
        elif spec.kind == "swa":
            self._init_swa_pools()
        else:
            raise ValueError(f"KV cache kind {spec.kind!r} is not served yet")
        if spec.kind == "swa":
            self.allocator = SWATokenToKVPoolAllocator(
                self.max_total_num_tokens, self.swa_max_total_num_tokens, cfg.page_size, self.device,
                kvcache=self.token_to_kv_pool,
            )
        elif cfg.page_size == 1:
            self.allocator = TokenToKVPoolAllocator(self.max_total_num_tokens, self.device, self.token_to_kv_pool)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                self.max_total_num_tokens, cfg.page_size, self.device, self.token_to_kv_pool
            )
        logger.info(
            "KV pool: %d tokens, %d request rows, %.1f MiB",
            self.max_total_num_tokens, self.max_running_requests, self.token_to_kv_pool.mem_usage_bytes() / 2**20,
        )
        if self.draft is not None:  # (never transferred: a plain allocation, not the shareable one)
            self.draft.token_to_kv_pool = self._attention_pool(self.draft.spec, None)

    def _rank0_cuda_graph_max_bs(self) -> int:
        """TP rank 0's :func:`cuda_graph_max_bs` on every rank: a default from each rank's own device memory
        could differ between GPUs, and ranks capturing different graphs would hang in their NCCL collectives."""
        max_bs = cuda_graph_max_bs(self.config, get_device_memory(self.device)[1]) if self.tp.is_leader else None
        return self.tp.broadcast_object(max_bs)

    def _init_cuda_graphs(self) -> Optional[CudaGraphRunner]:
        """The decode graphs, captured now that the KV pool exists (None: off, and why is logged)."""
        reason = graphs_off_reason(self)
        sizes = [] if reason else capture_batch_sizes(self.config, self.cuda_graph_max_bs, self.max_running_requests)
        if reason or not sizes:
            logger.info("CUDA graphs off: %s", reason or "no capture size fits max_running_requests")
            return None
        graph_runner = CudaGraphRunner(self, sizes)
        graph_runner.capture()
        return graph_runner

    # ---- forward ----------------------------------------------------------------
    @property
    def awaits_output(self) -> bool:
        """Whether this rank's forward output comes from another rank: pipeline rank 0's, the last stage's."""
        return self.tp.pp.size > 1 and self.tp.pp.is_first and self.tp.is_leader

    def forward(self, forward_batch: ForwardBatch) -> LogitsOutput:
        """Logits of each request's last token, [bs, vocab] fp32, and the input logprobs the
        batch asks for."""
        output = self.launch(forward_batch)
        return self.recv_output() if self.awaits_output else output

    def recv_output(self) -> LogitsOutput:
        """Pipeline rank 0: the output of the oldest batch launched and not yet received (the last
        stage sends them in launch order)."""
        with self.tp_collect():
            return self.tp.pp.recv_output(self.device)

    @torch.inference_mode()
    def launch(self, forward_batch: ForwardBatch) -> LogitsOutput:
        """This rank's part of the forward; where it :attr:`awaits_output`, an empty output and the
        batch's own comes with :meth:`recv_output` (a pipeline's micro-batches: the next batch is
        launched before this one's output is back)."""
        start = time.perf_counter()
        with self.tp_step(forward_batch):
            forward_batch.req_to_token_pool = self.req_to_token_pool
            forward_batch.token_to_kv_pool = self.token_to_kv_pool
            forward_batch.attn_backend = self.attn_backend
            if self.graph_runner is not None and self.graph_runner.can_run(forward_batch):
                logits = self.graph_runner.replay(forward_batch)
            else:
                self.attn_backend.init_forward_metadata(forward_batch)
                if self.lora is not None:
                    self.lora.prepare(forward_batch)
                logits = self.model(forward_batch)
            if self.draft is not None and not forward_batch.forward_mode.is_target_verify:
                self.draft.mirror(forward_batch)  # (a verify's slots were written by the drafting)
            if self.device.type == "cuda":  # this stream only: a device-wide sync would also wait for the KV
                torch.cuda.current_stream(self.device).synchronize()  # pushes on their own streams (kv_push)
        self.forward_time += time.perf_counter() - start
        self.num_forwards += 1
        return logits

    def tensor(self, values) -> torch.Tensor:
        """A list of ints as an int64 tensor on this runner's device."""
        return int64_tensor(values, self.device)
