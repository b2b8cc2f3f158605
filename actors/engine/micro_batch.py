"""Pipeline micro-batches: up to ``pp_micro_batches`` batches in flight (SGLang's PP event loop and
its ``running_mbs``).

With one batch in flight, stage 0 idles while the later stages run it, and they idle while rank 0
samples and schedules the next: PP scales memory, not throughput. Here rank 0 launches a batch
(:meth:`~actors.engine.model_runner.ModelRunner.launch`: stage 0's layers, the hidden states sent on)
and schedules and launches the next while the later stages run it; once ``pp_micro_batches`` are in
flight (or nothing else can run) it takes the oldest one's output (``recv_output``: the last stage
sends them in launch order) and processes it — sampling, finishing, caching — as a step does.

The micro-batches' requests are disjoint: a batch's requests are in no queue while it is in
flight (``in_flight``, where a failed step's path finds them), so a request is scheduled again only
after its last token is known, and is never retracted while its forward runs; a chunked prompt's
next chunk waits for its chunk (``chunked_req`` is empty meanwhile). Their rows count against
``max_running_requests`` and their future decode tokens against the admission's room. Slots freed
while a batch is in flight (an abort, a finish, an eviction) may go to a batch launched later:
every stage runs the batches in launch order, so that batch writes them after every earlier one
read them. Decode micro-batches split the running requests in ``pp_micro_batches`` shares, so
every stage has one to run. An aborted request in flight ends when its batch's output comes back,
all its slots freed (nothing of what the batch wrote is cached).

What overlaps today: rank 0's scheduling and sampling with the later stages' forwards, not the
stages' forwards with each other. Rank 0 broadcasts each batch to every rank (``TPModelWorker._step``),
a collective the last stage joins only once its forward of the batch before is done, so stage 0's
forward of batch k+1 starts after stage 1's of batch k ends. SGLang's stages overlap because each
hands its batch on to the next point to point (with the hidden states); sending the batch message
that way is the next step (scripts/bench_pp.py measures it).
"""

from __future__ import annotations

import math
from typing import List, NamedTuple

from actors.engine.forward_batch import ForwardBatch
from actors.engine.req import Req
from actors.engine.schedule_batch import logits_rows


class MicroBatch(NamedTuple):
    """A batch launched, its output not yet processed."""

    reqs: List[Req]
    forward_batch: ForwardBatch
    is_prefill: bool


class MicroBatchMixin:
    """The scheduler's step with micro-batches in flight. Reads the scheduler's queues, its prefill
    and decode planning (``_next_prefill``, ``_next_decode``) and its result processing."""

    def _init_micro_batches(self) -> None:
        self.micro_batches: List[MicroBatch] = []  # launched, oldest first
        self.pp_micro_batches = self.config.pp_micro_batches if self.config.pp_size > 1 else 1

    def _decoding_reqs(self) -> List[Req]:
        """(The admission's decode reserve) those in flight too."""
        return super()._decoding_reqs() + [r for r in self.in_flight if not r.finished]

    def _rows_held_elsewhere(self) -> int:
        """(The admission's row budget) those in flight too."""
        return super()._rows_held_elsewhere() + len(self.in_flight)

    def _step_micro_batches(self) -> List[Req]:
        """Launch a batch if one more may be in flight and one can run; take the oldest output when
        ``pp_micro_batches`` are in flight or nothing was launched."""
        launched = len(self.micro_batches) < self.pp_micro_batches and self._launch_micro_batch()
        if self.micro_batches and (not launched or len(self.micro_batches) == self.pp_micro_batches):
            return self._land_micro_batch()
        return []

    def _launch_micro_batch(self) -> bool:
        self.end_orphan_prefetches()
        reqs, forward_batch = self._next_prefill()
        is_prefill = forward_batch is not None
        if not is_prefill and self.running:
            reqs, forward_batch = self._next_decode_share()
        if forward_batch is None:
            return False
        self.in_flight += reqs  # out of every queue until processed
        self.runner.launch(forward_batch)
        self.micro_batches.append(MicroBatch(reqs, forward_batch, is_prefill))
        return True

    def _next_decode_share(self):
        """A decode step of the first of the running requests not in flight, a ``pp_micro_batches``-th
        of all decoding; they leave ``running`` until processed."""
        in_flight = sum(len(mb.reqs) for mb in self.micro_batches if not mb.is_prefill)
        share = math.ceil((len(self.running) + in_flight) / self.pp_micro_batches)
        running, rest = self.running[:share], self.running[share:]
        self.running = running
        try:
            reqs, forward_batch = self._next_decode()  # (may retract some of the share, never one in flight)
        finally:
            self.running += rest
        if forward_batch is not None:
            taken = {id(r) for r in reqs}
            self.running = [r for r in self.running if id(r) not in taken]
        return reqs, forward_batch

    def _land_micro_batch(self) -> List[Req]:
        """The oldest batch's output, processed: its aborted requests released, the others sampled."""
        mb = self.micro_batches[0]
        output = self.runner.recv_output()
        self.micro_batches.pop(0)
        reqs = mb.reqs
        if mb.is_prefill:
            self._add_input_logprobs(reqs, mb.forward_batch, output.input_logprobs)
            self._add_embeddings(reqs, output.embeddings, output.classifier_logits)
        rows = logits_rows(reqs)
        kept = [i for i, r in enumerate(reqs) if not r.finished]
        logits = output.next_token_logits[[rows[i] for i in kept if i in rows]]
        aborted = self._release_in_flight_aborts([r for r in reqs if r.finished])
        kept_reqs = [reqs[i] for i in kept]
        if mb.is_prefill:
            out = self._process_prefill(kept_reqs, logits)
        else:
            self.running += kept_reqs  # (where _process_decode drops those it finishes from)
            out = self._process_decode(kept_reqs, [[pick] for pick in self._pick_tokens(kept_reqs, logits)])
        landed = {id(r) for r in reqs}
        self.in_flight = [r for r in self.in_flight if id(r) not in landed]
        return aborted + out

    def _release_in_flight_aborts(self, reqs: List[Req]) -> List[Req]:
        """Requests aborted while their batch ran: every slot they hold freed, the one it wrote too,
        nothing cached (as a failed step's requests)."""
        for req in reqs:
            req.kv_committed_len = max(req.kv_committed_len, req.kv_allocated_len)
            self.tree_cache.cache_finished_req(req, is_insert=False)
            if req.mm_inputs is not None:
                req.mm_inputs.release_embeddings()
        return reqs
