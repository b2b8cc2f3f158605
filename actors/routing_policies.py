"""Routing policies: how the router picks one worker of a role for a request.

A policy sees the live workers of one role (``WorkerState``, the router's
view: what it dispatched itself plus the worker's last ``load()`` report) and
the request (``RouteRequest``: its length and the pages each prefill worker
holds of it). Policies live in a registry; an unknown name fails with the list
of known ones:

* ``cache_aware`` — prefill: the lowest cost
  ``w × uncached prompt tokens + queued prefill tokens``; decode: a worker with
  room for the prompt; among those within ``decode_affinity_slack`` requests of
  the least loaded, the one holding the longest prefix (of at least
  ``decode_affinity_min_tokens``) (its decode-side radix
  cache: only the rest of the KV moves), then the fewest requests, then the most
  free KV slots. Both under the per-request imbalance guard (see :class:`CacheAware`).
* ``round_robin``, ``random`` — blind to cache and load.
* ``power_of_two`` — two workers drawn at random, the less loaded one.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple, Type


@dataclass(frozen=True)
class RouterSettings:
    """Everything a router is tuned by (``cluster.config.RouterConfig`` fills it in)."""

    page_size: int = 1
    prefill_policy: str = "cache_aware"
    decode_policy: str = "cache_aware"
    uncached_token_weight: float = 2.0  # w in w × uncached + queued prefill tokens
    cache_threshold: float = 0.3  # a match below this fraction of the prompt counts as none
    balance_abs_threshold: int = 64  # guard: a worker this many requests above the least loaded ...
    balance_rel_threshold: float = 1.5  # ... and this many times its load is skipped
    decode_affinity_slack: int = 4  # decode: a prefix hit counts on workers at most this many requests above the least loaded
    decode_affinity_min_tokens: int = 64  # ... and only from this many matched tokens (a chat header saves nothing)
    approx_ttl_s: float = 30.0  # life of an index entry made from the router's own decision
    event_interval_s: float = 0.05  # how often KV events are pulled from the prefill workers
    max_events_per_pull: int = 4096
    heartbeat_interval_s: float = 5.0
    heartbeat_max_failures: int = 2
    call_timeout_s: float = 5.0  # a worker call of the router's own (events, load, snapshot)
    route_ttl_s: float = 3600.0  # a route never released (its client died) and no worker reports: no load after this
    # a route open this long that neither of its workers holds in two heartbeats in a row is dropped (its
    # release was lost); it covers route() → the client's first call landing on the decode worker
    route_grace_s: float = 30.0
    client_timeout_s: float = 30.0  # the clients' wait for route / release (cluster.pd_client.PDClient)
    max_retries: int = 2  # the clients' retries of a request whose worker died before its first output
    seed: int = 0

    def __post_init__(self):
        if not self.route_grace_s > 0:  # (0 would drop a route before its client's first call lands)
            raise ValueError(f"route_grace_s must be > 0, got {self.route_grace_s!r}")


@dataclass
class WorkerState:
    """One worker as the router sees it. Load counts from dispatch: ``inflight`` and
    ``pending_prefill_tokens`` rise in ``route`` and fall in ``release``; a heartbeat's report
    covers traffic from elsewhere, so each measure is the larger of the two."""

    worker_id: str
    role: str
    handle: Any
    node_id: str = ""
    alive: bool = True
    dead: bool = False  # its actor is gone (not alive for good; one only missing heartbeats may come back)
    draining: bool = False  # being removed: routed nothing new; its routes stay until its requests end
    missed_heartbeats: int = 0
    inflight: int = 0  # requests this router sent here and not released for this role
    pending_prefill_tokens: int = 0  # prefill: uncached prompt tokens sent here, not yet prefilled
    dispatched_tokens: int = 0  # decode: prompt tokens sent here since the last report
    cached_pages: int = 0  # prefill: pages the index says it holds
    event_cursor: int = 0  # prefill: the last KV event id applied
    report: Dict[str, Any] = field(default_factory=dict)  # the last load(), its ``rids`` left out
    held_rids: Optional[FrozenSet[str]] = None  # the requests the last load() said it holds (None: it names none)
    held_rooms: Dict[str, int] = field(default_factory=dict)  # ... the bootstrap room of those it names one of
    held_round: int = -1  # the router's heartbeat round that load() answered
    held_at: float = float("-inf")  # when (the router's clock) that round asked for it

    def load(self) -> int:
        """Requests queued or running here."""
        r = self.report
        reported = r.get("waiting", 0) + r.get("running", 0) + r.get("prealloc", 0) + r.get("transfer", 0)
        return max(self.inflight, reported)

    def queued_prefill_tokens(self) -> int:
        return max(self.pending_prefill_tokens, self.report.get("queued_prefill_tokens", 0))

    def free_slots(self) -> Optional[int]:
        """KV slots free after what was sent since the last report (None: no report yet)."""
        free = self.report.get("free_slots")
        return None if free is None else free - self.dispatched_tokens


@dataclass
class RouteRequest:
    rid: str
    prompt_tokens: int
    page_size: int
    matched_pages: Dict[str, int]  # prefill worker id → pages of the prompt it holds, from the first

    def matched_tokens(self, worker_id: str) -> int:
        return min(self.matched_pages.get(worker_id, 0) * self.page_size, self.prompt_tokens)


class Choice(NamedTuple):
    worker: WorkerState
    reason: str  # why: "hit", "miss", "guard" (affinity overruled by the imbalance guard), "rr", ...


class RoutingPolicy:
    """Picks one of ``workers`` (live, of one role, never empty) for ``req``; may keep state
    (a counter, a random generator); never changes the workers."""

    name = "policy"

    def __init__(self, settings: RouterSettings, seed: int = 0):
        self.settings = settings
        self.rng = random.Random(seed)

    def select(self, role: str, workers: Sequence[WorkerState], req: RouteRequest) -> Choice:
        raise NotImplementedError


_POLICIES: Dict[str, Type[RoutingPolicy]] = {}


def register_policy(name: str) -> Callable[[Type[RoutingPolicy]], Type[RoutingPolicy]]:
    def wrap(cls: Type[RoutingPolicy]) -> Type[RoutingPolicy]:
        cls.name = name
        _POLICIES[name] = cls
        return cls

    return wrap


def known_policies() -> List[str]:
    return sorted(_POLICIES)


def create_policy(name: str, settings: RouterSettings, seed: int = 0) -> RoutingPolicy:
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(known_policies())}")
    return cls(settings, seed)


@register_policy("round_robin")
class RoundRobin(RoutingPolicy):
    def __init__(self, settings: RouterSettings, seed: int = 0):
        super().__init__(settings, seed)
        self._next = itertools.count()

    def select(self, role: str, workers: Sequence[WorkerState], req: RouteRequest) -> Choice:
        return Choice(workers[next(self._next) % len(workers)], "rr")


@register_policy("random")
class Random(RoutingPolicy):
    def select(self, role: str, workers: Sequence[WorkerState], req: RouteRequest) -> Choice:
        return Choice(self.rng.choice(list(workers)), "random")


def _load_key(role: str, worker: WorkerState) -> Tuple:
    if role == "prefill":
        return worker.queued_prefill_tokens(), worker.load()
    free = worker.free_slots()
    return worker.load(), -(free if free is not None else 0)


@register_policy("power_of_two")
class PowerOfTwo(RoutingPolicy):
    def select(self, role: str, workers: Sequence[WorkerState], req: RouteRequest) -> Choice:
        pair = self.rng.sample(list(workers), 2) if len(workers) > 1 else list(workers)
        return Choice(min(pair, key=lambda w: _load_key(role, w)), "p2")


@register_policy("cache_aware")
class CacheAware(RoutingPolicy):
    """Prefill cost of worker ``i`` for a prompt of ``n`` tokens of which ``i`` holds ``m_i``::

        cost_i = w × (n − m_i) + q_i        (m_i counts as 0 when m_i < cache_threshold × n)

    ``q_i`` is the prefill tokens queued on ``i`` (the router's own dispatches since they were
    made, or the worker's report when larger); ``w = uncached_token_weight``. The cost is the
    prefill work the request waits for there, with the work it adds weighted by ``w``: ``w > 1``
    keeps a burst of similar requests together until the queue it builds outweighs recomputing
    the prefix elsewhere; ``w = 0`` is pure load balancing. Ties go to the less loaded worker, then
    the one holding fewer pages (spreading new prefixes), then in turn.

    Imbalance guard, per request: a worker whose in-flight requests exceed the least loaded
    worker's by more than ``balance_abs_threshold`` *and* ``balance_rel_threshold`` times is not a
    candidate. A request whose best worker is not overloaded keeps its affinity however skewed the
    rest of the fleet is; one whose best worker is overloaded goes to the cheapest of the others,
    which still counts their cached pages (reason ``"guard"``).

    Decode: a worker with room for the prompt's uncached part; among those at most
    ``decode_affinity_slack`` requests above the least loaded, the one holding the longest
    counted prefix in its own radix cache (the turns of one conversation return to the worker
    that decoded the previous one, and only the new tail's KV moves); then the fewest requests,
    then the most free slots. The slack bounds how uneven the decode batches may get for a hit:
    a hit saves a transfer and KV slots, not decode compute; a hit shorter than
    ``decode_affinity_min_tokens`` (say a chat template's header, which every worker holds
    anyway) saves too little to bend the balance at all.
    """

    def __init__(self, settings: RouterSettings, seed: int = 0):
        super().__init__(settings, seed)
        self._turn = itertools.count()

    def _overloaded(self, workers: Sequence[WorkerState]) -> List[bool]:
        s = self.settings
        loads = [w.load() for w in workers]
        low = min(loads)
        return [load - low > s.balance_abs_threshold and load > s.balance_rel_threshold * low for load in loads]

    def select(self, role: str, workers: Sequence[WorkerState], req: RouteRequest) -> Choice:
        turn, n = next(self._turn), len(workers)
        cost = self._prefill_cost if role == "prefill" else self._decode_cost
        least = min(w.load() for w in workers)
        keys = [cost(w, req, least) + (w.load(), w.cached_pages, (i - turn) % n) for i, w in enumerate(workers)]
        best = min(range(n), key=keys.__getitem__)
        overloaded = self._overloaded(workers)
        if not overloaded[best]:
            return Choice(workers[best], self._reason(role, workers[best], req))
        best = min((i for i in range(n) if not overloaded[i]), key=keys.__getitem__)
        return Choice(workers[best], "guard")

    def _counted_match(self, worker: WorkerState, req: RouteRequest) -> int:
        matched = req.matched_tokens(worker.worker_id)
        return matched if matched >= self.settings.cache_threshold * req.prompt_tokens else 0

    def _prefill_cost(self, worker: WorkerState, req: RouteRequest, least_load: int) -> Tuple:
        uncached = req.prompt_tokens - self._counted_match(worker, req)
        return (self.settings.uncached_token_weight * uncached + worker.queued_prefill_tokens(),)

    def _decode_cost(self, worker: WorkerState, req: RouteRequest, least_load: int) -> Tuple:
        """Room first; then a prefix hit, only where the load is within the slack
        (decode batches stay even: the hit saves moving KV, not compute); then load."""
        free = worker.free_slots()
        fits = free is None or free >= req.prompt_tokens - req.matched_tokens(worker.worker_id)
        s = self.settings
        hit = self._counted_match(worker, req)
        if hit < s.decode_affinity_min_tokens or worker.load() > least_load + s.decode_affinity_slack:
            hit = 0
        return (not fits, -hit, worker.load(), -(free or 0))

    def _reason(self, role: str, worker: WorkerState, req: RouteRequest) -> str:
        return "hit" if self._counted_match(worker, req) > 0 else ("miss" if role == "prefill" else "load")
