"""Bringing up the PD workers as Ray actors.

``PDCluster(config).start()`` applies ``ray.remote`` to the plain worker
classes of ``actors.workers``, places them (by the custom node resources
``prefill`` / ``decode`` when the config asks; a worker's ranks, of every
pipeline stage, packed in one placement group), and waits until every one
answers its health check.
``cluster.client()`` gives the driver-side :class:`~cluster.pd_client.PDClient`
and ``start_router()`` the router actor that picks its pairs.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import uuid
from typing import Any, Dict, List, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.engine.config import EngineConfig
from actors.engine.tp_worker import check_tp_shardable, tp_init_method
from actors.rank import NOSET_CUDA_VISIBLE_DEVICES, TPFollower
from actors.router import Router
from actors.routing_policies import RouterSettings
from actors.workers import DecodeWorker, PrefillWorker
from cluster.backend import UnknownWorkerError
from cluster.pd_client import PDClient, WorkerRef

__all__ = ["PDCluster", "PDClient", "WorkerRef", "WorkerStartError", "router_settings", "stop_worker"]

logger = logging.getLogger(__name__)


def _rank_bundle(options: Dict[str, Any]) -> Dict[str, float]:
    """What one rank actor asks of its node."""
    bundle = {"CPU": max(options["num_cpus"], 0.01)}
    if options.get("num_gpus"):
        bundle["GPU"] = options["num_gpus"]
    bundle.update(options.get("resources", {}))
    return bundle


def _shortfall(asks: Dict[str, float]) -> str:
    """The resources of ``asks`` (totals) the cluster does not have in all, as text ("" if none:
    then only resources in use hold a start up). An autoscaler adds nodes on demand, so a
    shortfall is waited out, not refused."""
    total = ray.cluster_resources()
    return ", ".join(f"{name} {need:g} (the cluster has {total.get(name, 0):g})"
                     for name, need in sorted(asks.items()) if total.get(name, 0) < need)


def _tp_placement_group(options: Dict[str, Any], num_ranks: int, strategy: str, worker_id: str, timeout_s: float,
                        lacks: str = ""):
    """One bundle per rank (what each rank actor asks for; every pipeline stage's), packed as
    configured. ``lacks``: what the cluster lacked at the start (named if the group never fits)."""
    bundle = _rank_bundle(options)
    pg = placement_group([dict(bundle) for _ in range(num_ranks)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)  # left pending, it would take the resources once they appear, for no actor
        raise WorkerStartError(f"{worker_id}: no room for its {num_ranks} ranks ({bundle} each, {strategy}) after "
                               f"{timeout_s:.0f}s" + (f"; the cluster lacks {lacks}" if lacks else "")) from None
    except BaseException:
        remove_placement_group(pg)
        raise
    return pg


def _in_bundle(pg, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


@ray.remote(num_cpus=0)
def _rendezvous() -> str:
    """A free ``tcp://ip:port`` on this node (run in rank 0's bundle): the TP group meets there."""
    return tp_init_method(ray.util.get_node_ip_address())


class WorkerStartError(RuntimeError):
    """A worker (one of its TP ranks) failed to start or did not start in time."""


def _cause(exc: BaseException) -> str:
    """``Type: message`` of what ended an actor (the last line of Ray's wrapping)."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        exc = exc.as_instanceof_cause()
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else text}"


def _await_started(workers: List[WorkerRef], timeout_s: float, lacks: str = "") -> None:
    """Wait until every rank of every worker is constructed, failing fast.

    Each rank is watched on its own: a follower whose actor dies while starting
    (a bad shard, no memory, an import error) ends start-up at once, naming it,
    instead of leaving rank 0 blocked in the TP rendezvous until its timeout.
    Sets each worker's ``node_id`` (rank 0's node). ``lacks``: what the cluster lacked for
    them at the start (named if they time out).
    """
    pending = {}
    for worker in workers:
        pending[worker.handle.node_id.remote()] = (worker, 0)
        for rank, follower in enumerate(worker.followers, start=1):
            pending[follower.ready.remote()] = (worker, rank)
    deadline = time.monotonic() + timeout_s
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            late = sorted({f"{w.worker_id} rank {r}" for w, r in pending.values()})
            raise WorkerStartError(f"not started after {timeout_s:.0f}s: {', '.join(late[:6])}"
                                   + (f"; the cluster lacks {lacks}" if lacks else ""))
        worker, rank = pending.pop(done[0])
        try:
            value = ray.get(done[0])
        except Exception as exc:
            raise WorkerStartError(f"{worker.worker_id} rank {rank} failed to start: {_cause(exc)}") from exc
        if rank == 0:
            worker.node_id = value


def _report_pushed(leader, rank: int, results) -> None:
    """A prefill follower's transfer thread tells rank 0 that its share of ``results`` ended
    (``PrefillWorker.followers_pushed``; not waited on: the thread goes on to the next chunk)."""
    leader.followers_pushed.remote(rank, results)


def _watch_followers(worker: WorkerRef) -> None:
    """Rank 0 watches its TP followers for the worker's life (a call that ends when one is gone)."""
    if worker.followers:
        worker.watcher = worker.handle.watch_followers.remote(worker.followers)


def stop_worker(worker: WorkerRef, graceful: bool = True) -> None:
    """Free a worker's pools (rank 0 releases its followers), then end its actors.
    ``graceful=False`` only kills them (a worker that never finished starting
    cannot answer; the next worker started on its node unlinks its shared-memory
    segments as stale)."""
    if graceful:
        try:
            ray.get(worker.handle.shutdown.remote(), timeout=30)
        except Exception:  # already dead: nothing to free
            pass
    for handle in [worker.handle] + worker.followers:
        ray.kill(handle)
    if worker.placement_group is not None:
        remove_placement_group(worker.placement_group)


def _actor_options(config, role: str) -> Dict[str, Any]:
    group = config.group(role)
    options: Dict[str, Any] = {
        "num_cpus": group.num_cpus_per_rank,
        "num_gpus": group.gpus_per_rank,
        "max_concurrency": 1000,
        "max_restarts": 0,
    }
    if group.device == "cuda":  # every GPU of the node visible to each rank: CUDA IPC across GPUs
        options["runtime_env"] = {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}  # (actors.rank)
    placement = config.placement
    if placement.use_node_resources:
        resource = placement.prefill_resource if role == "prefill" else placement.decode_resource
        options["resources"] = {resource: placement.resource_per_rank}
    return options


def check_pd_layout(model_path: str, prefill_tp: int, decode_tp: int) -> None:
    """Refuse, before any actor starts, a layout no KV hand-off could serve: a hybrid (Mamba)
    model's state moves whole from each prefill rank to the decode rank of the same index, so
    both sides need the same TP size (the hand-off would refuse every request)."""
    if prefill_tp == decode_tp:
        return
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    layer_types = config.get("layer_types") or (config.get("text_config") or {}).get("layer_types") or []
    if "linear_attention" in layer_types:
        raise ValueError(f"decode.tp_size: a hybrid (Mamba) model needs the same TP size on prefill and decode "
                         f"(prefill.tp_size={prefill_tp}, decode.tp_size={decode_tp})")


class PDCluster:
    """The prefill and decode worker actors of one config."""

    follower_cls = TPFollower  # the actor class of TP ranks > 0

    def __init__(self, config, model_path: Optional[str] = None):
        self.config = config
        self.model_path = model_path or config.model.resolve_model_path()
        self.prefill: List[WorkerRef] = []
        self.decode: List[WorkerRef] = []
        self._removing: set = set()  # ids of the workers remove_worker is draining

    def _start_worker(self, role: str, index: int, deadline: float, lacks: str = "") -> WorkerRef:
        """Rank 0 (the worker actor) and, for ``tp_size × pp_size > 1``, its follower rank actors
        (global rank ``stage · tp_size + tp_rank``: every pipeline stage's), packed into one
        placement group (ready by ``deadline``, a monotonic time) and joined at a rendezvous on
        rank 0's node. ``lacks``: see :meth:`_lacks`."""
        cfg = self.config
        group = cfg.group(role)
        worker_id = f"{role}-{index}-{uuid.uuid4().hex[:6]}"
        engine_args = self._engine_args(role)
        options = _actor_options(cfg, role)
        placement, dist_init_method, handles = None, None, []
        try:
            if group.ranks_per_worker > 1:
                placement = _tp_placement_group(options, group.ranks_per_worker, cfg.placement.tp_group_strategy,
                                                worker_id, max(0.0, deadline - time.monotonic()), lacks)
                dist_init_method = ray.get(_rendezvous.options(scheduling_strategy=_in_bundle(placement, 0)).remote())
            agent_options = cfg.transfer.agent_options()
            kwargs = dict(model_path=self.model_path, engine_args=engine_args, backend=cfg.transfer.backend,
                          worker_id=worker_id, dist_init_method=dist_init_method, agent_options=agent_options,
                          waiting_timeout_s=cfg.transfer.waiting_timeout_s)  # (prefill: its longest inflight wait)
            if role == "decode":
                kwargs.update(num_reserved_decode_tokens=cfg.transfer.num_reserved_decode_tokens)
            cls = PrefillWorker if role == "prefill" else DecodeWorker
            rank_options = dict(options, scheduling_strategy=_in_bundle(placement, 0)) if placement else options
            handles.append(ray.remote(cls).options(name=worker_id, **rank_options).remote(**kwargs))
            report_pushed = functools.partial(_report_pushed, handles[0]) if role == "prefill" else None
            for rank in range(1, group.ranks_per_worker):
                handles.append(ray.remote(self.follower_cls).options(name=f"{worker_id}-rank{rank}", **dict(
                    options, max_concurrency=4, scheduling_strategy=_in_bundle(placement, rank))).remote(
                    role, self.model_path, engine_args, cfg.transfer.backend, worker_id, rank, dist_init_method,
                    cfg.transfer.waiting_timeout_s, report_pushed, agent_options))
        except BaseException:  # half a worker: nobody else knows of its actors and placement group
            for started in handles:
                ray.kill(started)
            if placement is not None:
                remove_placement_group(placement)
            raise
        handle, followers = handles[0], handles[1:]
        return WorkerRef(worker_id, role, handle, node_id="", followers=followers, placement_group=placement)

    def _lacks(self, workers: Dict[str, int], timeout_s: float) -> str:
        """What the cluster lacks in all for ``workers`` (count per role) next to what runs
        already, warned of at once: a start that can only wait for an autoscaler says so."""
        asks: Dict[str, float] = {}
        for role, side in (("prefill", self.prefill), ("decode", self.decode)):
            # (running ones hold theirs)
            ranks = self.config.group(role).ranks_per_worker * (len(side) + workers.get(role, 0))
            for name, need in _rank_bundle(_actor_options(self.config, role)).items():
                asks[name] = asks.get(name, 0) + need * ranks
        lacks = _shortfall(asks)
        if lacks:
            logger.warning("the workers ask for more than this Ray cluster has: %s; waiting up to %.0fs for "
                           "nodes that have it (an autoscaler adds them on demand)", lacks, timeout_s)
        return lacks

    def _engine_args(self, role: str) -> Dict[str, Any]:
        group = self.config.group(role)
        return dict(group.engine_overrides(), device=group.device, tokenizer_path=self.config.model.tokenizer_path,
                    tp_size=group.tp_size)  # the group's TP size (the YAML cannot set the engine's)

    def check_layout(self, roles=("prefill", "decode")) -> None:
        """Refuse, before any actor starts, TP and PP sizes that cannot shard or split the model (the
        error names the field) or that no KV hand-off could serve."""
        for role in roles:
            if self.config.group(role).ranks_per_worker > 1:
                check_tp_shardable(EngineConfig(model_path=self.model_path, **self._engine_args(role)))
        check_pd_layout(self.model_path, self.config.prefill.tp_size, self.config.decode.tp_size)

    def start(self, timeout_s: float = 300.0) -> "PDCluster":
        """Start every worker and wait until all are healthy; if one fails, stop
        them all (pools freed, placement groups removed) and raise
        :class:`WorkerStartError` naming it."""
        self.check_layout()
        deadline = time.monotonic() + timeout_s
        lacks = self._lacks({role: self.config.group(role).num_workers for role in ("prefill", "decode")}, timeout_s)
        try:
            for role in ("prefill", "decode"):
                side = self.prefill if role == "prefill" else self.decode
                for i in range(self.config.group(role).num_workers):
                    side.append(self._start_worker(role, i, deadline, lacks))
            workers = self.prefill + self.decode
            _await_started(workers, max(0.0, deadline - time.monotonic()), lacks)
            ray.get([w.handle.health.remote() for w in workers], timeout=timeout_s)
        except BaseException:  # (Ctrl-C too: a driver that lives on would keep them)
            for worker in self.prefill + self.decode:
                stop_worker(worker, graceful=False)
            self.prefill, self.decode = [], []
            raise
        for worker in self.prefill + self.decode:
            _watch_followers(worker)
        return self

    def add_worker(self, role: str, timeout_s: float = 300.0) -> WorkerRef:
        """Start one more ``role`` worker; it joins the rotation (the lists clients share) once healthy."""
        side = self.prefill if role == "prefill" else self.decode
        self.check_layout((role,))
        deadline = time.monotonic() + timeout_s
        lacks = self._lacks({role: 1}, timeout_s)
        worker = self._start_worker(role, len(side), deadline, lacks)
        try:
            _await_started([worker], max(0.0, deadline - time.monotonic()), lacks)
            ray.get(worker.handle.health.remote(), timeout=timeout_s)
        except BaseException:
            stop_worker(worker, graceful=False)
            raise
        _watch_followers(worker)
        side.append(worker)
        return worker

    def remove_worker(self, worker_id: str, timeout_s: float = 120.0) -> WorkerRef:
        """Take a worker out of the rotation, let its accepted requests finish, free its pools, stop it.
        ``UnknownWorkerError`` (a KeyError) for an id that is not there, or whose removal is already under way."""
        worker = next((w for w in self.prefill + self.decode if w.worker_id == worker_id), None)
        if worker is None or worker_id in self._removing:
            raise UnknownWorkerError(worker_id)
        self._removing.add(worker_id)
        try:
            worker.alive = False  # no new requests from here on
            try:
                ray.get(worker.handle.drain.remote(timeout_s), timeout=timeout_s + 5)
            except Exception as exc:  # already dead: nothing to drain
                logger.warning("remove %s: %s", worker_id, exc)
            stop_worker(worker)
            (self.prefill if worker.role == "prefill" else self.decode).remove(worker)
        finally:
            self._removing.discard(worker_id)
        return worker

    def start_router(self, name: Optional[str] = None, detached: bool = False, timeout_s: float = 120.0, **overrides):
        """A :class:`actors.router.Router` actor over this cluster's live workers, its event pulls and
        heartbeats running. ``detached`` outlives the driver; a new one (after a restart) indexes
        what the workers hold as they join it. ``overrides``: RouterSettings fields."""
        options: Dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1000, "max_restarts": 0}
        if name:
            options["name"] = name
        if detached:
            options["lifetime"] = "detached"
        handle = ray.remote(Router).options(**options).remote(router_settings(self.config, **overrides))
        ray.get([handle.add_worker.remote(w.worker_id, w.role, w.handle, w.node_id)
                 for w in self.prefill + self.decode if w.alive], timeout=timeout_s)
        ray.get(handle.start.remote(), timeout=timeout_s)
        return handle

    def client(self, tokenizer=None, router=None) -> "PDClient":
        t = self.config.transfer
        return PDClient(self.prefill, self.decode, backend=t.backend, tokenizer=tokenizer, device=self.config.decode.device, router=router,
                        bootstrap_timeout_s=t.bootstrap_timeout_s, waiting_timeout_s=t.waiting_timeout_s,
                        heartbeat_interval_s=t.heartbeat_interval_s, heartbeat_max_failures=t.heartbeat_max_failures,
                        router_timeout_s=self.config.router.client_timeout_s,
                        max_retries=self.config.router.max_retries)

    def context_len(self, timeout_s: float = 60.0) -> int:
        """The longest request (prompt + output) every decode worker takes: the model's context,
        or less where a decode worker's KV pool holds less for one request. A prefill worker
        holds the prompt only: its pool bounds :meth:`max_prompt_len`, not this."""
        return min(load["context_len"] for load in self._loads(self.decode, timeout_s))

    def max_prompt_len(self, timeout_s: float = 60.0) -> int:
        """The longest prompt every worker takes (shorter than each one's context length)."""
        return min(load["context_len"] for load in self._loads(self.prefill + self.decode, timeout_s)) - 1

    @staticmethod
    def _loads(workers: List[WorkerRef], timeout_s: float) -> List[Dict[str, Any]]:
        return ray.get([w.handle.load.remote() for w in workers if w.alive], timeout=timeout_s)

    def check_integrity(self) -> None:
        """Every live worker idle and leak-free (raises the first worker's error)."""
        ray.get([w.handle.check_integrity.remote() for w in self.prefill + self.decode if w.alive])

    def drain_and_shutdown(self, timeout_s: float = 120.0) -> None:
        """Refuse new requests, let accepted ones finish (decode after prefill), free the pools."""
        for side in (self.prefill, self.decode):
            refs = [w.handle.drain.remote(timeout_s) for w in side if w.alive]
            for ref in refs:
                try:
                    ray.get(ref, timeout=timeout_s + 5)
                except Exception as exc:  # a dead worker has nothing left to drain
                    logger.warning("drain: %s", exc)
        self.shutdown()

    def shutdown(self) -> None:
        for worker in self.prefill + self.decode:
            stop_worker(worker)


def router_settings(config, **overrides) -> RouterSettings:
    """The router's settings from a cluster config (the page size is the workers')."""
    fields = config.router.model_dump()
    fields.update(page_size=config.prefill.engine.page_size, heartbeat_interval_s=config.transfer.heartbeat_interval_s,
                  heartbeat_max_failures=config.transfer.heartbeat_max_failures, **overrides)
    return RouterSettings(**fields)
