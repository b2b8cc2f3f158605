"""The autoscaler: starts and stops prefill and decode workers by their load, each side on its own
(Ray Serve LLM's per-deployment ``autoscaling_config``; Dynamo Planner's prefill and decode
scaling), for the sides whose config has ``autoscaling`` (:class:`cluster.config.AutoscalingConfig`).

It is an asyncio task in the HTTP server's process, next to the client's heartbeats, not an actor
of its own: it acts through :class:`cluster.backend.PDBackend`'s ``add_worker`` / ``remove_worker``
— what ``POST /workers`` and ``DELETE /workers/{id}`` run — which own what a worker joining or
leaving takes: the rotation the client routes over, the router's registration and drain, a new
worker's catch-up on the weights, adapters and pause the cluster serves, and the drain that lets
a leaving worker's requests finish before its pools are freed. An actor would have to call back
into this process for all of that. Every ``metrics_interval_s`` it asks the workers' loads
(as ``/metrics`` does), counts the requests waiting for the server's admission, samples each side
(:class:`~cluster.autoscaling_policy.LoadSample`) and asks its
:class:`~cluster.autoscaling_policy.ScalingPolicy` where the side should be.

One change at a time per side, and no decision while it runs (as Dynamo's planner): a change
starts workers one after another up to the decided count (each placed by the side's custom
resources, ``placement.use_node_resources``), or drains and stops the idlest ones down to it. A
worker whose node does not exist yet waits for it in its placement group (up to the start
timeout): a pending placement group is the demand the Ray cluster autoscaler adds nodes for, as
for a pending Ray Serve replica. (``ray.autoscaler.sdk.request_resources`` is not called: it is
one cluster-wide request that the next caller's replaces, for pre-provisioning.) A start that
fails holds the side's next one back ``start_retry_backoff_s``, doubled per failure in a row;
after ``max_start_failures`` in a row the side stops scaling up (it still scales down) for
``start_failure_cooldown_s``, then tries one start again; one that succeeds clears the count. A
start the cluster's state refuses (:class:`~cluster.backend.WorkerNotAddedError`: its workers
sleep, or serve weights from tensors) is no failed start: the next is tried once the upscale delay
has run again.
A side's workers are those live and those a ``POST /workers`` is starting (``backend.starting``):
a manual add (an operator's, allowed past ``max_workers``) is not started again by a scale-up; one
that starts clears the side's failed starts (:meth:`Autoscaler.worker_added`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Dict, List, Optional

from cluster.autoscaling_policy import Decision, LoadSample, ScalingPolicy
from cluster.backend import WorkerNotAddedError, refresh_loads_briefly

logger = logging.getLogger(__name__)
STOP_TIMEOUT_S = 30.0  # the longest the server's shutdown waits for a change in flight


def load_sample(now: float, role: str, workers: List[Dict[str, Any]], queued: int = 0) -> LoadSample:
    """The load of one ``role`` side's live workers (``backend.workers()`` entries, their last reports)
    and of the ``queued`` requests waiting for the server's admission (a slot, or a pause's end): each is one more
    request for both sides (Ray Serve counts a request queued at the handle as ongoing), and waits for
    a prefill (Dynamo's prefill queue) before any batch of the decode side's."""
    loads = [w.get("load") or {} for w in workers]
    waiting = sum(x.get("waiting", 0) + x.get("prealloc", 0) for x in loads)
    return LoadSample(now, ongoing_requests=queued + sum(x.get("num_requests", 0) for x in loads),
                      waiting_requests=waiting + (queued if role == "prefill" else 0),
                      queued_prefill_tokens=sum(x.get("queued_prefill_tokens", 0) for x in loads),
                      kv_usage=sum(x.get("kv_usage", 0.0) for x in loads))


def live_workers(workers: List[Dict[str, Any]], role: str) -> List[Dict[str, Any]]:
    """The ``role`` workers in the rotation (one dead or draining is not: its side has one fewer)."""
    return [w for w in workers if w["role"] == role and w["alive"]]


def idlest(workers: List[Dict[str, Any]]) -> str:
    """The id of the worker to drain first: fewest requests held, then least KV in use, then the
    newest (the oldest keep the caches warmed longest)."""
    load = [w.get("load") or {} for w in workers]
    return workers[min(range(len(workers)), key=lambda i: (load[i].get("num_requests", 0),
                                                           load[i].get("kv_usage", 0.0), -i))]["id"]


class SideScaler:
    """One side's policy, its change in flight and what the last decision and change were."""

    def __init__(self, role: str, config):
        self.role, self.config = role, config
        self.policy = ScalingPolicy(config)
        self.change: Optional[asyncio.Task] = None
        self.decision: Optional[Decision] = None
        self.decided_at = 0.0
        self.last_change: Optional[Dict[str, Any]] = None  # action, from, to, reason, result, at (clock)
        self.start_failures = 0  # in a row
        self.next_start_at = 0.0  # (clock) no start before: the backoff after a failed one
        self.next_sample_at = 0.0

    def hold_back(self, decision: Decision, now: float) -> Optional[str]:
        """Why a scale-up of ``decision`` may not start now (None: it may)."""
        if decision.target <= decision.current or now >= self.next_start_at:
            return None
        if self.start_failures >= self.config.max_start_failures:
            return (f"scaling up stopped after {self.start_failures} failed starts in a row, tried again in "
                    f"{self.next_start_at - now:.1f}s")
        return f"the next start waits {self.next_start_at - now:.1f}s more after a failed one"

    def start_failed(self, now: float) -> None:
        """Hold the next start back: the backoff, doubled per failure in a row, or past
        ``max_start_failures`` the cool-down (a bad node or config is not tried every backoff)."""
        self.start_failures += 1
        cfg = self.config
        if self.start_failures >= cfg.max_start_failures:
            self.next_start_at = now + cfg.start_failure_cooldown_s
            logger.warning("autoscaler: %s: scaling up stopped after %d failed starts in a row, tried again in "
                           "%gs", self.role, self.start_failures, cfg.start_failure_cooldown_s)
        else:
            self.next_start_at = now + cfg.start_retry_backoff_s * 2 ** (self.start_failures - 1)

    def state(self, now: float) -> Dict[str, Any]:
        decision = self.decision
        last = dict(self.last_change) if self.last_change else None
        if last is not None:
            last["seconds_ago"] = round(now - last.pop("at"), 3)
        return {"min_workers": self.config.min_workers, "max_workers": self.config.max_workers,
                "current": decision.current if decision else None, "desired": decision.desired if decision else None,
                "reason": decision.reason if decision else "no decision yet", "changing": self.change is not None,
                "last_change": last, "start_failures": self.start_failures}


class Autoscaler:
    """The loop over a backend's sides (see the module docstring); ``clock``: monotonic seconds."""

    def __init__(self, backend, configs: Dict[str, Any], metrics=None, clock: Callable[[], float] = time.monotonic,
                 service=None):
        self.backend, self.metrics, self.clock, self.service = backend, metrics, clock, service
        self.sides = {role: SideScaler(role, config) for role, config in configs.items()}
        self._task: Optional[asyncio.Task] = None

    @classmethod
    def from_config(cls, backend, config, metrics=None, service=None) -> Optional["Autoscaler"]:
        """The autoscaler of a ClusterConfig's sides with ``autoscaling`` (None: no side has it, or
        ``backend`` has no cluster to start workers in); ``service``: the server's
        (:class:`cluster.openai_serving.GenerationService`), whose requests waiting for admission count as
        load: for a slot, or for generation to continue (/pause_generation), as ``/load`` counts them."""
        configs = {role: getattr(config, role).autoscaling for role in ("prefill", "decode")
                   if getattr(getattr(config, role, None), "autoscaling", None) is not None}
        if not configs or getattr(backend, "cluster", None) is None:
            return None
        return cls(backend, configs, metrics, service=service)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """No decision from now on; a change in flight ends first (a worker starting is not left
        half-known), for at most :data:`STOP_TIMEOUT_S`."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait((self._task,))
        changes = [side.change for side in self.sides.values() if side.change is not None]
        if changes:
            await asyncio.wait(changes, timeout=STOP_TIMEOUT_S)

    async def _run(self) -> None:
        interval = min(side.config.metrics_interval_s for side in self.sides.values())
        while True:
            try:
                await self.tick()
            except Exception:  # (a failed load refresh, say): the next tick tries again
                logger.exception("autoscaler: tick failed")
            await asyncio.sleep(interval)

    async def tick(self) -> None:
        """Sample each side due and decide for those with no change in flight. Not while the workers
        sleep (their memory released for a colocated trainer): no request runs, and no worker could
        start; a change wanted before waits its whole delay again on loads sampled awake (the rollouts
        that wake them are not met by a drain the last ones asked for)."""
        now = self.clock()
        if self.backend.is_sleeping:
            for side in self.sides.values():
                side.policy.restart_delay()
            return
        due = [side for side in self.sides.values() if now >= side.next_sample_at]
        if not due:
            return
        await refresh_loads_briefly(self.backend)
        workers = self.backend.workers()
        service = self.service
        queued = service.admission.waiting + service.num_paused if service is not None else 0
        for side in due:
            side.next_sample_at = now + side.config.metrics_interval_s
            live = live_workers(workers, side.role)
            side.policy.record(load_sample(now, side.role, live, queued))
            if side.change is None:
                self._decide(side, self._count(side, live), now)

    def _decide(self, side: SideScaler, current: int, now: float) -> None:
        decision = side.policy.decide(now, current)
        held_back = side.hold_back(decision, now)
        if held_back:
            decision = decision._replace(target=decision.current, reason=f"{decision.reason}; {held_back}")
        if side.decision is None or side.decision[:3] != decision[:3]:
            logger.info("autoscaler: %s: %d workers, desired %d, target %d (%s)", side.role, *decision)
        side.decision, side.decided_at = decision, now
        if self.metrics is not None:
            self.metrics.autoscaler_desired.labels(side.role).set(decision.desired)
        if decision.target != decision.current:
            side.change = asyncio.ensure_future(self._scale(side, decision))

    def _count(self, side: SideScaler, live: List[Dict[str, Any]]) -> int:
        """The side's workers: those live and those starting (a ``POST /workers`` under way is not
        started again: a manual add and a scale-up together stay within max_workers)."""
        return len(live) + self.backend.starting.get(side.role, 0)

    async def _scale(self, side: SideScaler, decision: Decision) -> None:
        """Start workers up to ``decision.target``, or drain and stop the idlest down to it, one at a time
        (a worker added or removed by hand meanwhile counts: the side stays within [min, max])."""
        up = decision.target > decision.current
        side.last_change = {"action": "up" if up else "down", "from": decision.current, "to": decision.target,
                            "reason": decision.reason, "result": "in progress", "at": self.clock()}
        logger.info("autoscaler: %s: scaling %s from %d to %d workers (%s)", side.role, side.last_change["action"],
                    decision.current, decision.target, decision.reason)
        try:
            for _ in range(abs(decision.target - decision.current)):
                # counted anew at each step: POST / DELETE /workers may have changed the side meanwhile
                live = live_workers(self.backend.workers(), side.role)
                count = self._count(side, live)
                if (count >= decision.target) if up else (count <= decision.target):
                    break
                if up:
                    await self.backend.add_worker(side.role)
                    side.start_failures = 0
                else:
                    await self.backend.remove_worker(idlest(live), side.config.drain_timeout_s)
            side.last_change["result"] = "done"
        except WorkerNotAddedError as exc:  # (the workers slept, say): no failed start, tried after the delay
            side.last_change["result"] = f"refused: {exc}"
            logger.warning("autoscaler: %s: scaling up refused: %s", side.role, exc)
        except Exception as exc:
            side.last_change["result"] = f"failed: {exc}"
            if up:
                side.start_failed(self.clock())
            logger.error("autoscaler: %s: scaling %s failed (%d failed starts in a row): %s", side.role,
                         side.last_change["action"], side.start_failures, exc)
        finally:
            side.change = None
            side.policy.restart_delay()
        logger.info("autoscaler: %s: scaling %s to %d workers %s", side.role, side.last_change["action"],
                    decision.target, side.last_change["result"])

    def worker_added(self, role: str) -> None:
        """A ``POST /workers`` started a ``role`` worker: starts work again, so the side's failed starts are
        forgotten and its next is not held back (an operator's start after the node or quota came back
        does not leave the side waiting out its cool-down)."""
        side = self.sides.get(role)
        if side is not None:
            side.start_failures, side.next_start_at = 0, 0.0

    def state(self) -> Dict[str, Any]:
        """Per side: its bounds, the last decision (current, desired, why), the change in flight or last."""
        now = self.clock()
        return {role: side.state(now) for role, side in self.sides.items()}
