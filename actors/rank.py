"""One rank of a worker: its model shard, its pools, its transfer agents.

A worker of ``tp_size × pp_size`` ranks (:mod:`actors.engine.pipeline`): global rank
``stage · tp_size + tp_rank``, each holding its stage's layers' KV and pushing or
receiving that share; "TP follower" below means any rank > 0, of any stage.

Rank 0 of a worker (the ``PrefillWorker`` / ``DecodeWorker`` actor) schedules;
ranks > 0 are :class:`TPFollower` actors that run the batches rank 0
broadcasts (``actors.engine.tp_worker``) and answer the calls that move this
rank's share of a request's KV, in step with those batches:

    prefill follower  "push"         queue the step's chunks on its KVPusher (its heads, to the
                                     decode ranks it serves; copied on its transfer thread);
                                     replies with the requests its pusher finished since
                                     (not reported early, below)
                      "push_status"  only that reply (rank 0 asks while it waits on a follower)
                      "cancel_push"  stop pushing a request (or all); returns once none is copied
    decode follower   "expect"  reserve-time: a receiver on its own agent; its hand-off
                      "land"    after rank 0's share landed: which of the named requests' shares are in
                                this rank's pools (never blocking; a share still on its way is
                                left out of the reply and asked about at rank 0's next step)
                      "cancel"  the request failed or was aborted

With the asynchronous push a prefill follower's finished requests do not wait for
rank 0's next call: as the follower's share of a request ends, its transfer thread
reports it to rank 0 at once (``report_pushed(rank, [PushResult])``: the rank-0
actor's ``followers_pushed``, which runs beside its engine loop), and rank 0 sends the
completion notice as soon as every rank's share ended, while its forward in progress
still runs. A report that could not be sent (the hook raised) comes in a reply instead.

Every rank of a worker allocates the same slot numbers (only rank 0 allocates
and the tables are mirrored), so one slot list serves every rank.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Dict, List, Optional

import torch

import transfer.backends  # noqa: F401  (registers the backends)
from actors.engine.config import EngineConfig
from actors.engine.tp_worker import TPModelWorker
from actors.kv_push import KVPusher, PushChunk, PushResult
from mem_cache.buffer_allocator import create_buffer_allocator
from transfer.base import KVPoll, KVReceiver, create_agent
from transfer.layout import pool_allocators, pool_layout

logger = logging.getLogger(__name__)
SHAREABLE_BACKENDS = ("shm", "cuda_ipc")


# Set on CUDA rank actors (cluster.pd): Ray then leaves CUDA_VISIBLE_DEVICES alone, so every
# process on a node numbers its GPUs alike, and a CUDA IPC handle exported by a decode rank on
# one GPU opens in a prefill rank on another (with only its own GPU visible, as Ray makes it by
# default, the handle's device index means a different GPU, or none, in the peer).
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def assigned_gpu_index(gpu_ids: Optional[List[Any]] = None) -> Optional[int]:
    """This rank's CUDA device index when Ray left CUDA_VISIBLE_DEVICES alone: the
    position of the GPU Ray assigned it (``gpu_ids``, default ``ray.get_gpu_ids()``)
    among the visible ones. None when Ray isolated the process (its one GPU is
    ``cuda:0``) or assigned no GPU."""
    if os.environ.get(NOSET_CUDA_VISIBLE_DEVICES) != "1":
        return None
    if gpu_ids is None:
        import ray

        gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
    if not gpu_ids:
        return None
    gpu = str(gpu_ids[0])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return int(gpu)
    entries = [v.strip() for v in visible.split(",")]
    if gpu not in entries:
        raise RuntimeError(f"Ray assigned GPU {gpu}, which CUDA_VISIBLE_DEVICES={visible!r} does not show")
    return entries.index(gpu)


def resolve_backends(backend: str, device: str) -> List[str]:
    """The agents a worker keeps: ``auto`` means the same-node one of its device
    plus ``torch_dist`` for peers on other nodes (the router picks per pair)."""
    if backend != "auto":
        return [backend]
    return ["cuda_ipc" if device == "cuda" else "shm", "torch_dist"]


class RankHost:
    """The model shard, pools and transfer agents of one rank."""

    def __init__(self, role: str, config: EngineConfig, backend: str, worker_id: str, tp_rank: int = 0,
                 dist_init_method: Optional[str] = None, agent_options: Optional[Dict[str, Dict[str, Any]]] = None):
        """``agent_options``: extra ``create_agent`` keywords per backend name
        (``TransferConfig.agent_options``)."""
        self.role, self.worker_id, self.tp_rank = role, worker_id, tp_rank
        if role == "prefill":  # (it never decodes: no decode CUDA graphs, as SGLang's prefill server)
            config = config.model_copy(update={"disable_cuda_graph": True})
        self.backends = resolve_backends(backend, config.device)
        shareable = role == "decode" and any(b in SHAREABLE_BACKENDS for b in self.backends)
        prefix = f"{worker_id}-r{tp_rank}"
        gpu = assigned_gpu_index() if config.device == "cuda" else None
        if gpu is not None:  # before the pools: the shareable allocator takes the current device
            torch.cuda.set_device(gpu)
        self.buffer_allocator = create_buffer_allocator(config.device, shareable, prefix=prefix)
        self.tp_worker = TPModelWorker(config, tp_rank, dist_init_method, gpu_id=gpu,
                                       buffer_allocator=self.buffer_allocator)
        self.runner = self.tp_worker.runner
        spec = self.runner.spec
        layout, tensors = pool_layout(
            self.runner.token_to_kv_pool, getattr(spec, "kv_head_start", 0), getattr(spec, "total_kv_heads", None),
            self.runner.model_config.get_text_config().num_hidden_layers,
        )
        allocators = pool_allocators(self.runner.token_to_kv_pool)
        options = agent_options or {}
        # (the agent pairs by TP rank within its stage; its layout holds the stage's layers)
        self.agents = {name: create_agent(name, layout, tensors, tp_rank % config.tp_size, config.tp_size,
                                          allocators=allocators, **options.get(name, {}))
                       for name in self.backends}
        self.pusher = (KVPusher(self.agents, config.disaggregation_async_push, f"raydix-kv-push-{tp_rank}")
                       if role == "prefill" else None)

    def endpoints(self) -> Dict[str, Any]:
        """``{backend: (layout, endpoint)}`` of this rank (what a peer needs to reach it)."""
        return {name: (agent.layout, agent.endpoint()) for name, agent in self.agents.items()}

    def reset_agents(self) -> None:
        """This rank's pools were released or allocated anew (sleep mode): see :meth:`TransferAgent.reset`."""
        for agent in self.agents.values():
            agent.reset()

    def close(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
        for agent in self.agents.values():
            agent.close()
        self.buffer_allocator.close()


class TPFollower:
    """A rank > 0 of a prefill or decode worker (a Ray actor of its own)."""

    def __init__(self, role: str, model_path: str, engine_args: Dict[str, Any], backend: str, worker_id: str,
                 tp_rank: int, dist_init_method: str, waiting_timeout_s: float = 300.0,
                 report_pushed: Optional[Callable[[int, List[PushResult]], Any]] = None,
                 agent_options: Optional[Dict[str, Dict[str, Any]]] = None):
        """``report_pushed`` (prefill): how this rank's transfer thread tells rank 0 that its
        share of requests ended (not waited on; see the module docstring)."""
        config = EngineConfig(model_path=model_path, **engine_args)
        self.host = RankHost(role, config, backend, worker_id, tp_rank, dist_init_method, agent_options)
        pusher = self.host.pusher
        if report_pushed is not None and pusher is not None and pusher.asynchronous:
            pusher.on_finished = lambda result: report_pushed(tp_rank, [result])
        self.waiting_timeout_s = waiting_timeout_s
        self._receivers: Dict[str, KVReceiver] = {}
        self._landed: set = set()  # shares reported landed that rank 0 may still ask about
        self.host.tp_worker.memory.on_kv_moved = self.host.reset_agents  # (sleep mode)
        handlers = self.host.tp_worker.handlers
        handlers.update(push=self._push, push_status=self._push_status, cancel_push=self._cancel_push,
                        expect=self._expect, land=self._land, cancel=self._cancel)
        self._thread = threading.Thread(target=self._run, name=f"raydix-tp-follower-{tp_rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.host.tp_worker.follower_loop()
        except BaseException:  # rank 0 died (the group is gone), or this rank failed (a forward raised)
            logger.exception("TP follower %d of %s stopped", self.host.tp_rank, self.host.worker_id)
            # The process goes with its loop: its exit closes the group's connections, so rank 0's
            # collective in flight fails now (gloo: the peer closed) instead of at its 10-minute
            # timeout, and the worker's watch sees this rank gone. (Left alive, the process would keep
            # them open: nothing else would end the wait.)
            os._exit(1)

    def ready(self) -> int:
        return self.host.tp_rank

    def alive(self) -> bool:
        """Its loop runs and (prefill) no transfer lane of its is broken."""
        pusher = self.host.pusher
        return self._thread.is_alive() and not (pusher is not None and pusher.broken)

    # ---- prefill ranks ------------------------------------------------------------------
    def _push(self, chunks: List[PushChunk]) -> List[PushResult]:
        self.host.pusher.submit(chunks)
        return self.host.pusher.take_finished()

    def _push_status(self, _) -> List[PushResult]:
        return self.host.pusher.take_finished()

    def _cancel_push(self, push_id: Optional[str]) -> None:
        self.host.pusher.cancel(push_id)

    # ---- decode ranks ---------------------------------------------------------------------
    def _expect(self, payload) -> bytes:
        rid, room, backend, dst_slots, dst_state_slot, dst_prefix_len, dst_swa_slots = payload
        receiver = KVReceiver(self.host.agents[backend], rid, room, timeout_s=self.waiting_timeout_s)
        handoff = receiver.send_metadata(dst_slots, dst_state_slot, dst_prefix_len, dst_swa_slots)
        self._receivers[rid] = receiver
        self._landed.discard(rid)  # an id used again: an earlier request's share is not this one's
        return handoff.to_bytes()

    def _land(self, rids: List[str]) -> Dict[str, Optional[str]]:
        """``{rid: None (landed) or the error}`` for the requests whose share is no longer in
        flight; the others are left out. Rank 0 asks, at each step, about every request
        whose own share landed until every rank has answered it, so a share this rank
        reported landed is remembered (``_landed``) only while rank 0 still asks."""
        self._landed &= set(rids)
        reply: Dict[str, Optional[str]] = {}
        for rid in rids:
            if rid in self._landed:
                reply[rid] = None
                continue
            receiver = self._receivers.get(rid)
            if receiver is None:
                reply[rid] = f"rank {self.host.tp_rank}: no transfer expected for {rid}"
                continue
            receiver.mark_done()  # rank 0's share landed: the prefill side's notice came
            state = receiver.poll()
            if state == KVPoll.Success:
                del self._receivers[rid]
                self._landed.add(rid)
                reply[rid] = None
            elif state == KVPoll.Failed:
                del self._receivers[rid]
                reply[rid] = f"rank {self.host.tp_rank}: {receiver.failure_reason()}"
        return reply

    def _cancel(self, rid: str) -> None:
        self._landed.discard(rid)
        receiver = self._receivers.pop(rid, None)
        if receiver is not None:
            receiver.abort("cancelled by rank 0")

    def shutdown(self) -> None:
        self._thread.join(timeout=30)
        self.host.close()
