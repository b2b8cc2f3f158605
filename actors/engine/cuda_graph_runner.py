"""Decode forwards replayed as CUDA graphs (SGLang's ``CudaGraphRunner``).

A decode step on a small batch is launch-bound: hundreds of small kernels, each a few
microseconds of launch for less of work. At start, once the KV pool is allocated, the runner
captures the model's decode forward (up to the logits; sampling stays outside, as SGLang's) for
each batch size of :func:`capture_batch_sizes`, largest first, all graphs in one memory pool
(``torch.cuda.graph_pool_handle``: a smaller graph reuses the larger ones' intermediates). A graph
reads its inputs from static buffers sized for the largest batch (token ids, positions, KV slots,
request rows, sequence lengths, and the extend arrays a decode batch carries: prefix lengths
``seq_len - 1``, one token each, each at its own index); the attention backend's per-forward state
is set by its ``init_forward_metadata_capture`` / ``_replay``, which change no shape and read
nothing from the device. The Triton kernel reads each request's context through its
``req_to_token`` row and these arrays, so the static buffers are its whole decode metadata.

:meth:`replay` pads a batch to the next captured size: padding rows read request row 0 with
``seq_len`` 1 and write their K/V to slot 0, the dummy slot (SGLang's padding), and their logits
are cut off. Without CUDA (the CPU) the same path runs with nothing captured: a "replay" runs the
forward on the static buffers, so the tests check padding and buffers on the CPU; only
``torch.cuda.CUDAGraph`` capture and replay are CUDA's.

What runs eagerly instead (:meth:`CudaGraphRunner.can_run`, :func:`graphs_off_reason`): extend and
verify batches, batches larger than the largest captured size, batches with input logprobs,
embeddings, M-RoPE positions (an image request) or a LoRA adapter (its token groups are built on the
host; a LoRA engine's base-model batches are captured, their adapter groups empty); and whole engines
whose forward reads the host or changes shapes within a step: the torch attention backend (its groups
and cascade are planned on the host), the eager MoE experts (a host read a layer), sliding-window and
hybrid (Mamba) models.

Memory: the graphs' pool comes out of the part of device memory the static budget leaves
(``1 - mem_fraction_static``), as SGLang's ``reserved_mem_mb`` holds ``cuda_graph_max_bs * 2`` MB for
them (the default ``mem_fraction_static``, ``actors.engine.model_runner.default_mem_fraction_static``);
the capture logs what it took. TP: every rank captures the same sizes (rank 0's
:func:`cuda_graph_max_bs`: a default from each rank's own memory could differ between GPUs) in the same
order, so the collectives inside (NCCL, which CUDA graphs capture) pair up; gloo (the CPU) never
captures. Weight updates copy into the parameters in place, so the graphs, which read the parameters'
memory, stay valid; :meth:`capture` again is for memory that moved (sleep mode's ``cuda_graph`` tag
releases the graphs, resuming captures them anew).
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

import torch

from actors.engine.forward_batch import ForwardBatch, ForwardMode
from actors.engine.fused_moe import FusableExperts
from actors.engine.models.base import LogitsOutput
from mem_cache.memory_budget import GiB, default_memory_args

logger = logging.getLogger(__name__)

# SGLang's capture sizes, those up to cuda_graph_max_bs taken
CAPTURE_BS = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 513, 16)]


def cuda_graph_max_bs(config, total_bytes: int) -> int:
    """The largest batch size captured: ``cuda_graph_bs``'s largest, ``cuda_graph_max_bs``, or SGLang's
    default by the device's memory (``total_bytes``) and ``tp_size``. The model runner takes TP rank 0's on
    every rank, and reserves memory for it in the default ``mem_fraction_static``."""
    if config.cuda_graph_bs is not None:
        return max(config.cuda_graph_bs, default=0)
    if config.cuda_graph_max_bs is not None:
        return config.cuda_graph_max_bs
    return default_memory_args(total_bytes / GiB, config.tp_size).cuda_graph_max_bs


def capture_batch_sizes(config, max_bs: int, max_running_requests: int) -> List[int]:
    """``cuda_graph_bs``, or :data:`CAPTURE_BS` up to ``max_bs`` (:func:`cuda_graph_max_bs`), none above
    ``max_running_requests``; ascending."""
    sizes = config.cuda_graph_bs if config.cuda_graph_bs is not None else [bs for bs in CAPTURE_BS if bs <= max_bs]
    return sorted({bs for bs in sizes if bs <= max_running_requests})


def graphs_off_reason(runner) -> Optional[str]:
    """Why ``runner``'s decode forwards cannot be captured, or None."""
    if runner.config.disable_cuda_graph:
        return "disable_cuda_graph"
    if runner.config.pp_size > 1:
        return "pipeline parallelism (a stage's forward sends and receives hidden states, and rank 0 the logits)"
    if runner.device.type != "cuda":
        return "no CUDA (the CPU runs every forward eagerly)"
    if not hasattr(runner.attn_backend, "init_forward_metadata_capture"):
        return "the torch attention backend plans its groups on the host each forward (attention_backend='triton')"
    if runner.spec.kind not in ("mha", "mla"):
        return f"a {runner.spec.kind} KV cache (its forward reads per-request lengths on the host)"
    if any(m.fused is None for m in runner.model.modules() if isinstance(m, FusableExperts)):
        return "eager MoE experts (a host read a layer; moe_backend='triton' fuses them)"
    return None


class CudaGraphRunner:
    def __init__(self, runner, capture_bs: List[int]):
        """``runner``: the :class:`ModelRunner` (its pools built); ``capture_bs``: the batch sizes,
        ascending. Nothing is captured until :meth:`capture`."""
        self.runner = runner
        self.capture_bs = capture_bs
        self.max_bs = capture_bs[-1]
        self.use_graphs = runner.device.type == "cuda"
        zeros = lambda: torch.zeros(self.max_bs, dtype=torch.int64, device=runner.device)  # noqa: E731
        self.input_ids, self.positions, self.out_cache_loc, self.req_pool_indices = zeros(), zeros(), zeros(), zeros()
        self.seq_lens, self.prefix_lens = zeros() + 1, zeros()
        self.extend_seq_lens = torch.ones_like(self.seq_lens)
        self.extend_start_loc = torch.arange(self.max_bs, device=runner.device)
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: Dict[int, LogitsOutput] = {}

    def static_batch(self, bs: int) -> ForwardBatch:
        """The decode batch of ``bs`` rows over the static buffers (no host-side lengths: a graph reads none)."""
        runner = self.runner
        return ForwardBatch(
            ForwardMode.DECODE, self.input_ids[:bs], self.positions[:bs], self.out_cache_loc[:bs],
            self.req_pool_indices[:bs], self.seq_lens[:bs], self.prefix_lens[:bs], self.extend_seq_lens[:bs],
            self.extend_start_loc[:bs], runner.req_to_token_pool, runner.token_to_kv_pool, runner.attn_backend,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool (on CUDA; else nothing to do). A host
        tier's layer waits are left out: a decode batch loads nothing from it (loads come with prefills),
        and a wait on an event recorded before the capture cannot be captured (a sleep's resume captures
        with the host tier's counter registered)."""
        if not self.use_graphs:
            return
        self.release()
        for buf in (self.input_ids, self.positions, self.out_cache_loc, self.req_pool_indices, self.prefix_lens):
            buf.zero_()  # (every row a padding row: the warm-ups write K/V to the dummy slot only)
        self.seq_lens.fill_(1)
        kv_pool, device = self.runner.token_to_kv_pool, self.runner.device
        counter, kv_pool.layer_transfer_counter = kv_pool.layer_transfer_counter, None
        memory_pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        stream.wait_stream(torch.cuda.current_stream(device))
        bs = None
        try:
            for bs in reversed(self.capture_bs):
                batch = self.static_batch(bs)
                self.runner.attn_backend.init_forward_metadata_capture(batch)
                with torch.cuda.stream(stream):
                    for _ in range(2):  # (warm-up: Triton's compiles and lazy inits happen outside the capture)
                        self._forward(batch)
                    stream.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=memory_pool, stream=stream, capture_error_mode="thread_local"):
                        self.outputs[bs] = self._forward(batch)
                self.graphs[bs] = graph
        except BaseException:  # (none kept: a batch padded to a size left uncaptured would find no graph)
            self.release()
            logger.error("CUDA graph capture failed at decode batch size %s: set engine.disable_cuda_graph "
                         "(SGLang's --disable-cuda-graph, vLLM's enforce_eager) to decode eagerly", bs)
            raise
        finally:
            kv_pool.layer_transfer_counter = counter
        torch.cuda.current_stream(device).wait_stream(stream)
        logger.info("CUDA graphs captured for decode batch sizes %s: %.0f MiB", self.capture_bs,
                    (free_before - torch.cuda.mem_get_info(device)[0]) / 2**20)

    def _forward(self, batch: ForwardBatch) -> LogitsOutput:
        """The model on ``batch``, a LoRA engine's adapter groups emptied first (an earlier eager batch's
        would otherwise add its adapters' deltas to these rows)."""
        if self.runner.lora is not None:
            self.runner.lora.prepare(batch)
        return self.runner.model(batch)

    def release(self) -> None:
        """Drop the graphs and their outputs (their pool's memory goes back once nothing holds it)."""
        self.graphs, self.outputs = {}, {}

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """A decode batch of at most ``max_bs`` rows with nothing a graph does not hold: no input
        logprobs, embeddings, M-RoPE positions or adapters (those run eagerly)."""
        fb = forward_batch
        return (fb.forward_mode.is_decode and fb.batch_size <= self.max_bs
                and (bool(self.graphs) or not self.use_graphs) and fb.input_logprob_indices is None
                and fb.embed_indices is None and fb.logits_indices is None and fb.mrope_positions is None
                and fb.lora_slots is None)

    def replay(self, forward_batch: ForwardBatch) -> LogitsOutput:
        """The logits of ``forward_batch`` (:meth:`can_run`'s), run as the graph of the next captured size."""
        raw_bs = forward_batch.batch_size
        bs = next(size for size in self.capture_bs if size >= raw_bs)
        # rows [0, raw_bs) the batch's; [raw_bs, bs) padding: request row 0, seq_len 1, K/V to the dummy slot 0
        for static, value in ((self.input_ids, forward_batch.input_ids), (self.positions, forward_batch.positions),
                              (self.out_cache_loc, forward_batch.out_cache_loc),
                              (self.req_pool_indices, forward_batch.req_pool_indices),
                              (self.seq_lens, forward_batch.seq_lens)):
            static[:raw_bs].copy_(value)
            static[raw_bs:bs].fill_(0)
        self.seq_lens[raw_bs:bs].fill_(1)
        torch.sub(self.seq_lens[:bs], 1, out=self.prefix_lens[:bs])
        batch = self.static_batch(bs)
        self.runner.attn_backend.init_forward_metadata_replay(batch)
        if self.use_graphs:
            self.graphs[bs].replay()
            logits = self.outputs[bs].next_token_logits
        else:
            logits = self._forward(batch).next_token_logits
        return LogitsOutput(logits[:raw_bs])
