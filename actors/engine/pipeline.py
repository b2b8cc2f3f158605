"""Pipeline parallelism: a worker's decoder layers split into stages (vLLM's
``--pipeline-parallel-size``, SGLang's ``--pp-size``).

A worker of ``tp_size × pp_size`` ranks is ``pp_size`` stages of one TP group each; global rank
``stage · tp_size + tp_rank``. Stage s holds a contiguous range of the decoder layers
(:func:`stage_layers`: vLLM's even split, the remainder on the stages before the last, which also
holds the final norm and ``lm_head``; ``pp_layer_partition`` as ``VLLM_PP_LAYER_PARTITION``), stage
0 the embedding (and the last stage too when the embeddings are tied: its ``lm_head`` is that
weight). A module another stage holds is a :class:`PPMissingLayer` (vLLM's name): no parameters,
so the rank neither reads those checkpoint tensors nor sizes its memory for them, and the layers
keep their HF names and ``layer_id``. A stage's KV and Mamba pools hold its layers only: an MHA or MLA
pool the contiguous range from ``start_layer``, the sliding-window and hybrid pools the full-attention,
sliding-window and Mamba layer id lists cut to the stage (:meth:`~actors.engine.models.base.CausalLM.make_spec`),
a kind the stage has none of an empty sub-pool. Their slots are the same on every rank, so the radix caches
(SWA tombstones, Mamba checkpoints) stay on rank 0 and decide for every stage, as under TP.

Global rank 0 (stage 0, TP rank 0) schedules and broadcasts every batch to every rank, as under TP
alone (``pp_micro_batches`` of them in flight: :mod:`actors.engine.micro_batch`); stage s runs
its layers on the hidden states stage s-1's rank of the same TP rank sends it (every TP rank holds
them whole), and sends its own on; the last stage's TP rank 0 sends the forward's
:class:`~actors.engine.models.base.LogitsOutput` back to rank 0, which samples as before (every
sampling feature unchanged). The decoder layers return the whole hidden state (each adds its own
residual), so nothing else crosses a stage boundary but Qwen3-VL's DeepStack features: the first stage
computes them with the image embeddings, and each stage sends them on after the hidden states while a
later stage holds one of the first layers that add them (:meth:`PPGroup.send_deepstack`).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn


class PPMissingLayer(nn.Module):
    """A module of another pipeline stage: it holds nothing and is never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a module of another pipeline stage was called")


def stage_layers(num_layers: int, stage: int, pp_size: int, partition: Optional[Sequence[int]] = None) -> range:
    """The decoder layers of ``stage``: ``partition``'s counts in stage order when given (their sum
    must be ``num_layers``), else an even split whose remainder goes one layer each to the stages
    just before the last (vLLM's ``get_pp_indices``). ValueError naming the field otherwise, or for
    a stage left without a layer."""
    if partition is not None:
        if len(partition) != pp_size or sum(partition) != num_layers or min(partition) < 1:
            raise ValueError(f"pp_layer_partition={list(partition)} must be pp_size={pp_size} counts of at least 1 "
                             f"summing to num_hidden_layers={num_layers}")
        counts = list(partition)
    else:
        if pp_size > num_layers:
            raise ValueError(f"pp_size={pp_size} must be at most num_hidden_layers={num_layers}")
        counts = [num_layers // pp_size] * pp_size
        for i in range(num_layers % pp_size):
            counts[-2 - i] += 1
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def to_device(output, device: torch.device):
    """``output`` (a NamedTuple of tensors, None and nested NamedTuples) with its tensors on ``device``."""
    if isinstance(output, torch.Tensor):
        return output.to(device)
    if isinstance(output, tuple) and hasattr(output, "_fields"):
        return type(output)(*(to_device(value, device) for value in output))
    return output


@dataclass(frozen=True)
class PPGroup:
    """This rank's pipeline stage. ``ranks``: the worker's group of every rank (a
    :class:`~actors.engine.parallel.TPGroup` whose ``rank`` is the global one; ``None`` with one
    stage), over whose device group the hidden states go and whose control group carries the
    forward's output back to rank 0."""

    rank: int = 0
    size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    partition: Optional[Tuple[int, ...]] = None
    ranks: Any = None
    sending: List[Any] = field(default_factory=list, compare=False, repr=False)  # (send_output's)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layers(self, num_layers: int) -> range:
        return stage_layers(num_layers, self.rank, self.size, self.partition)

    def all_min(self, value: int) -> int:
        """The smallest ``value`` over every rank of every stage."""
        return value if self.size == 1 else self.ranks.all_min(value)

    @property
    def output_rank(self) -> int:
        """The global rank that sends rank 0 the forward's output: the last stage's TP rank 0."""
        return (self.size - 1) * self.tp_size

    def _peer(self, stage: int) -> int:
        """The global rank of this TP rank in ``stage``."""
        return stage * self.tp_size + self.tp_rank

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """To this TP rank of the next stage."""
        torch.distributed.send(hidden.contiguous(), self._peer(self.rank + 1), group=self.ranks.group)

    def recv_hidden(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """From this TP rank of the previous stage."""
        hidden = torch.empty(shape, dtype=dtype, device=device)
        torch.distributed.recv(hidden, self._peer(self.rank - 1), group=self.ranks.group)
        return hidden

    def send_deepstack(self, deepstack: Optional[Tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype,
                       device: torch.device) -> None:
        """To this TP rank of the next stage, after the hidden states: a batch's DeepStack features
        (``ForwardBatch.deepstack_embeds``, its image tokens' flat indices and ``[n, layers, hidden]`` rows;
        None: the batch computes no image token), their count first."""
        index, rows = deepstack if deepstack is not None else (None, None)
        n, layers = (0, 0) if rows is None else rows.shape[:2]
        self.send_hidden(torch.tensor([n, layers], dtype=torch.int64, device=device))
        if n:
            self.send_hidden(index.to(torch.int64))
            self.send_hidden(rows.to(dtype))

    def recv_deepstack(self, hidden_size: int, dtype: torch.dtype,
                       device: torch.device) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """From this TP rank of the previous stage: what its :meth:`send_deepstack` sent."""
        n, layers = self.recv_hidden((2,), torch.int64, device).tolist()
        if not n:
            return None
        index = self.recv_hidden((n,), torch.int64, device)
        return index, self.recv_hidden((n, layers, hidden_size), dtype, device)

    def send_output(self, output) -> None:
        """The last stage's TP rank 0: the forward's output to rank 0 (pickled, on the CPU), its size
        first. Sent without waiting for rank 0 to take it: with micro-batches rank 0 broadcasts the
        next batch before it receives this one's output (a blocking send would wait for it there,
        and rank 0's broadcast for this rank). The sends still going are kept (their tensors must
        live until they end); rank 0 takes every output, in order."""
        data = torch.frombuffer(bytearray(pickle.dumps(to_device(output, torch.device("cpu")))), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        works = [torch.distributed.isend(t, 0, group=self.ranks.cpu_group) for t in (size, data)]
        self.sending[:] = [sent for sent in self.sending if not all(w.is_completed() for w in sent[0])]
        self.sending.append((works, size, data))

    def end_sends(self) -> None:
        """Before leaving the group: wait for the outputs still being sent (rank 0 took them all before
        its STOP) and drop them (a send's handle outliving its process group ends the process)."""
        for works, *_ in self.sending:
            for work in works:
                work.wait()
        self.sending.clear()

    def recv_output(self, device: torch.device):
        """Rank 0: the oldest forward's output not yet received, from the last stage's TP rank 0."""
        size = torch.empty(1, dtype=torch.int64)
        torch.distributed.recv(size, self.output_rank, group=self.ranks.cpu_group)
        data = torch.empty(int(size), dtype=torch.uint8)
        torch.distributed.recv(data, self.output_rank, group=self.ranks.cpu_group)
        return to_device(pickle.loads(data.numpy().tobytes()), device)


SINGLE_STAGE = PPGroup()
