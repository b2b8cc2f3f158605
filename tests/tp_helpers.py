"""Tensor parallelism inside one process: every rank of an Engine's TP group is a thread.

:func:`thread_ranks` (with pytest's ``monkeypatch``) makes each ``Engine(tp_size=N)`` (and
``pp_size``: every stage's ranks) of the test start :class:`ThreadTPGroup` instead of spawning processes: rank 0 is the
caller's thread, ranks > 0 run ``follower_loop`` on threads of their own, and the
collectives are exchanged through a barrier (:class:`ThreadGroup`). The ranks run the
same TPModelWorker code — sharded loading, the broadcast batches, op replay, the
all-reduces in every row-parallel layer and the embedding, the logits' all-gather — in a second, not in process start-ups.
(The spawned gloo group itself is tested by ``test_engine_tp``'s TP 2 engines.)
:func:`pd_worker_ranks` makes a PD worker of TP and PP ranks the same way (:func:`pd_worker_tp2`
at TP 2): its follower ranks ``TPFollower`` s whose loops run on threads.
"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import queue
import random
import threading
from typing import Any, Dict, List

import torch

from actors.engine import engine as engine_module
from actors.engine import fused_moe, lora_experts, tp_worker
from actors.engine.parallel import SINGLE, TPGroup
from actors.engine.pipeline import PPGroup, to_device
from actors.rank import TPFollower

BARRIER_TIMEOUT_S = 120.0
_hubs: Dict[str, "Hub"] = {}  # by the group's init method
_ids = itertools.count()
# Triton's interpreter swaps triton.language's functions for its own while a kernel runs: two ranks'
# threads interpreting kernels at once break each other's runs, so the fused MoE's launches (and its LoRA's)
# take turns
_interpreter_lock = threading.Lock()


class Hub:
    """Where one group's ranks meet: each puts its value in, every rank reads them all. A worker's
    hub also holds its pipeline stages' hubs and the queues between two ranks (:class:`ThreadStage`)."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=BARRIER_TIMEOUT_S)
        self.slots: List[Any] = [None] * size
        self.lock = threading.Lock()
        self.stages: Dict[int, "Hub"] = {}
        self.queues: Dict[tuple, queue.Queue] = {}

    def exchange(self, rank: int, value: Any) -> List[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # (nobody writes the next exchange's values before all have read these)
        return out

    def stage(self, stage: int, size: int) -> "Hub":
        with self.lock:
            return self.stages.setdefault(stage, Hub(size))

    def channel(self, src: int, dst: int) -> queue.Queue:
        with self.lock:
            return self.queues.setdefault((src, dst), queue.Queue())

    def abort(self) -> None:
        """Every collective of the worker's ranks fails now, as a peer process's exit makes them."""
        self.barrier.abort()
        for hub in list(self.stages.values()):
            hub.barrier.abort()

    def receive(self, src: int, dst: int) -> Any:
        """The next value ``src`` put for ``dst``; BrokenBarrierError once the worker's ranks are aborted."""
        channel, waited = self.channel(src, dst), 0.0
        while True:
            if self.barrier.broken:
                raise threading.BrokenBarrierError
            try:
                return channel.get(timeout=0.05)
            except queue.Empty:
                waited += 0.05
                if waited > BARRIER_TIMEOUT_S:
                    raise TimeoutError(f"rank {dst}: nothing from rank {src}") from None


@dataclasses.dataclass(frozen=True)
class ThreadGroup(TPGroup):
    """A rank whose collectives go through ``hub``; sums are taken in rank order on every rank."""

    hub: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.hub.exchange(self.rank, x.clone())
        x.copy_(torch.stack(parts).sum(0))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self.hub.exchange(self.rank, x.clone()), dim=dim)

    def all_min(self, value: int) -> int:
        return min(self.hub.exchange(self.rank, value))

    def broadcast_object(self, obj: Any = None) -> Any:
        return self.hub.exchange(self.rank, obj)[0]

    def gather_objects(self, obj: Any):
        replies = self.hub.exchange(self.rank, obj)
        return replies if self.is_leader else None


@dataclasses.dataclass(frozen=True)
class ThreadStage(PPGroup):
    """A pipeline stage whose sends are puts on the worker hub's queues (``ranks.hub``)."""

    def _me(self) -> int:
        return self._peer(self.rank)

    def send_hidden(self, hidden: torch.Tensor) -> None:
        self.ranks.hub.channel(self._me(), self._peer(self.rank + 1)).put(hidden.clone())

    def recv_hidden(self, shape, dtype, device) -> torch.Tensor:
        hidden = self.ranks.hub.receive(self._peer(self.rank - 1), self._me())
        assert hidden.shape == shape and hidden.dtype == dtype
        return hidden.to(device)

    def send_output(self, output) -> None:
        self.ranks.hub.channel(self._me(), 0).put(to_device(output, torch.device("cpu")))

    def recv_output(self, device):
        return to_device(self.ranks.hub.receive(self.output_rank, 0), device)


def _init_stage_group(ranks: TPGroup, tp_size: int, pp_size: int, partition=None) -> TPGroup:
    if pp_size == 1:
        return ranks
    stage, tp_rank = divmod(ranks.rank, tp_size)
    pp = ThreadStage(stage, pp_size, tp_rank, tp_size, None if partition is None else tuple(partition), ranks)
    return ThreadGroup(tp_rank, tp_size, hub=ranks.hub.stage(stage, tp_size), pp=pp)


def _init_tp_group(rank: int, size: int, init_method: str, device, timeout=None) -> TPGroup:
    return ThreadGroup(rank, size, hub=_hubs[init_method]) if size > 1 else SINGLE


def _leave_group() -> None:
    """(``destroy_process_group``) nothing to leave."""


class ThreadTPGroup:
    """:class:`~actors.engine.tp_worker.LocalTPGroup`'s interface, every rank a thread."""

    def __init__(self, config):
        tp_worker.check_tp_shardable(config)
        self.init_method = init_method = f"thread://{next(_ids)}"
        _hubs[init_method] = self.hub = Hub(config.num_ranks)
        self.followers: List[tp_worker.TPModelWorker] = [None] * (config.num_ranks - 1)  # (by rank)
        self._started = [threading.Event() for _ in self.followers]
        self.threads = [threading.Thread(target=self._follow, args=(config, rank, init_method), daemon=True,
                                         name=f"raydix-tp-thread-{rank}") for rank in range(1, config.num_ranks)]
        for thread in self.threads:
            thread.start()
        self.worker = tp_worker.TPModelWorker(config, 0, init_method)
        for started in self._started:  # (rank 0's start can end before a follower's thread has kept its worker)
            started.wait(60)

    def _follow(self, config, rank: int, init_method: str) -> None:
        try:
            self.followers[rank - 1] = worker = tp_worker.TPModelWorker(config, rank, init_method)
            self._started[rank - 1].set()
            worker.follower_loop()
        except BaseException:
            self._started[rank - 1].set()
            self.hub.abort()  # the other ranks' collectives fail now, as a peer process's exit does
            raise

    def shutdown(self, timeout: float = 30.0) -> None:
        try:
            self.worker.shutdown()
        finally:
            if self.worker.broken:
                self.hub.abort()
            for thread in self.threads:
                thread.join(timeout)
            _hubs.pop(self.init_method, None)


def thread_ranks(monkeypatch) -> None:
    """Engines made from now on in the test run their TP ranks as threads."""
    monkeypatch.setattr(engine_module, "LocalTPGroup", ThreadTPGroup)
    monkeypatch.setattr(tp_worker, "init_tp_group", _init_tp_group)
    monkeypatch.setattr(tp_worker, "init_stage_group", _init_stage_group)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", _leave_group)
    locked = _one_at_a_time(fused_moe.grouped_gemm)
    monkeypatch.setattr(fused_moe, "grouped_gemm", locked)
    monkeypatch.setattr(lora_experts, "grouped_gemm", locked)


def pickled_broadcasts(monkeypatch) -> List[Any]:
    """The followers get rank 0's broadcasts pickled, as over gloo or Ray, not its objects (an image
    item without rank 0's embedding, see ``ImageItem.__getstate__``). ``sent`` counts what was pickled."""
    sent: List[Any] = []

    def broadcast_object(self, obj: Any = None) -> Any:
        data = self.hub.exchange(self.rank, pickle.dumps(obj) if self.is_leader else None)[0]
        if self.is_leader:
            sent.append(obj)
        return obj if self.is_leader else pickle.loads(data)

    monkeypatch.setattr(ThreadGroup, "broadcast_object", broadcast_object)
    return sent


def _one_at_a_time(launch):
    def locked(*args, **kwargs):
        with _interpreter_lock:
            return launch(*args, **kwargs)
    return locked


class ThreadFollower(TPFollower):
    """A TP follower rank (the Ray actor's class) whose loop runs on a thread of this process:
    its loop failing breaks the group's barrier, as the rank actor's exit closes its
    connections, instead of ending the process."""

    def _run(self) -> None:
        try:
            self.host.tp_worker.follower_loop()
        except BaseException:
            self.host.tp_worker.tp.hub.abort()
            raise


def pd_worker_ranks(cls, path: str, engine_args: Dict[str, Any], report=None, **kwargs):
    """A ``PrefillWorker`` or ``DecodeWorker`` (``cls``) of ``engine_args``' ``tp_size × pp_size``
    ranks in this process over shared memory: rank 0 is the worker, every other rank (of every
    pipeline stage) a TPFollower on threads (:func:`thread_ranks` first).
    ``report(worker, rank, results)``: how a prefill follower's transfer thread reaches rank 0
    (default: ``worker.followers_pushed``, as the Ray message does). Returns (worker, followers);
    ``worker.shutdown()`` then each ``follower.shutdown()`` stop them."""
    num_ranks = engine_args.get("tp_size", 1) * engine_args.get("pp_size", 1)
    init = f"thread://{next(_ids)}"
    _hubs[init] = hub = Hub(num_ranks)
    worker_id, made = f"{cls.role}-r{num_ranks}-{random.getrandbits(32):08x}", {}
    report = report or (lambda worker, rank, results: worker.followers_pushed(rank, results))

    def follow(rank: int) -> None:
        try:
            made[rank] = ThreadFollower(
                cls.role, path, engine_args, "shm", worker_id, rank, init,
                report_pushed=lambda rank, results: report(made["worker"], rank, results))
        except BaseException:
            hub.abort()  # rank 0's start fails now, not at the barrier's timeout
            raise

    threads = [threading.Thread(target=follow, args=(rank,), name=f"raydix-tp-follower-start-{rank}", daemon=True)
               for rank in range(1, num_ranks)]
    for thread in threads:
        thread.start()
    try:
        made["worker"] = cls(path, engine_args, "shm", worker_id, init, **kwargs)
    finally:
        for thread in threads:
            thread.join(BARRIER_TIMEOUT_S)
        _hubs.pop(init, None)  # (the ranks hold their hub)
    return made["worker"], [made[rank] for rank in range(1, num_ranks)]


def pd_worker_tp2(cls, path: str, engine_args: Dict[str, Any], report=None, **kwargs):
    """:func:`pd_worker_ranks` at TP 2: returns (worker, its follower)."""
    worker, (follower,) = pd_worker_ranks(cls, path, dict(engine_args, tp_size=2), report, **kwargs)
    return worker, follower
