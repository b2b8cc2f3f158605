"""The order admission tries the waiting requests in (SGLang's ``SchedulePolicy.calc_priority``).

Cache-agnostic policies: ``fcfs`` (arrival order; a retracted request first, where retraction
put it), ``lof`` (longest output first: the most ``max_new_tokens``) and ``random``.
Cache-aware ones match each waiting request against the tree cache: ``lpm`` (longest cached
prefix first) and ``dfs-weight`` (a depth-first walk of the tree that enters first the subtree
holding the most waiting requests, and takes a node's requests after its subtree's, so
requests sharing a prefix are admitted together while it is cached). Matching every waiting
request at every step costs too much on a long queue: above ``CACHE_AWARE_MAX_WAITING`` they
order as fcfs.

lpm's in-batch prefix caching (SGLang's): of the requests with little cached
(``IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD`` tokens or fewer), one that shares at least
``IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD`` leading tokens with one of them ahead of
it goes last this round: admitted together, both would compute the shared prefix; a round
later it finds the prefix cached. The shared prefixes are found in a small radix tree of those
requests' tokens, built anew each round.

With priority scheduling the policy's order holds within a priority: higher ``Req.priority``
values first (lower ones with ``schedule_low_priority_values_first``).
"""

from __future__ import annotations

import bisect
import random
from collections import Counter, defaultdict
from typing import Callable, Dict, List, Optional

from actors.engine.config import CACHE_AWARE_POLICIES
from actors.engine.req import Req
from mem_cache.radix_cache import RadixCache
from mem_cache.radix_key import RadixKey

CACHE_AWARE_MAX_WAITING = 128
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32


class SchedulePolicy:
    """``order(waiting)``: the waiting requests in the order admission tries them (a new list;
    a cache-aware policy leaves each request's unlocked match in ``prefix_indices`` /
    ``last_node``, which admission matches again). ``match(req)`` is the scheduler's match of a
    request against ``tree_cache``."""

    def __init__(self, config, tree_cache, match: Callable[[Req], object]):
        self.tree_cache, self.match = tree_cache, match
        self._order = _POLICIES[config.schedule_policy]
        self._cache_aware = config.schedule_policy in CACHE_AWARE_POLICIES
        self.priority_sign: Optional[int] = None  # rank = priority × sign, the smallest first
        if config.enable_priority_scheduling:
            self.priority_sign = 1 if config.schedule_low_priority_values_first else -1
        self._rng = random.Random(config.random_seed)

    def order(self, waiting: List[Req]) -> List[Req]:
        if self._cache_aware and len(waiting) > CACHE_AWARE_MAX_WAITING:
            ordered = list(waiting)
        else:
            ordered = self._order(self, waiting)
        if self.priority_sign is not None:
            ordered.sort(key=self.rank)  # (stable: the policy's order within a priority)
        return ordered

    def rank(self, req: Req) -> int:
        """Where ``req``'s priority puts it: the smaller, the sooner (0 without priority scheduling)."""
        return 0 if self.priority_sign is None else req.priority * self.priority_sign

    def enqueue(self, queue: List[Req], req: Req) -> None:
        """Add ``req`` to a queue served from its head (a decode worker's reservations): behind
        the requests of its priority and above, ahead of those below."""
        queue.insert(bisect.bisect_right(queue, self.rank(req), key=self.rank), req)

    # ---- the policies ---------------------------------------------------------------
    def _fcfs(self, waiting: List[Req]) -> List[Req]:
        return list(waiting)

    def _lof(self, waiting: List[Req]) -> List[Req]:
        return sorted(waiting, key=lambda r: -r.sampling_params.max_new_tokens)

    def _random(self, waiting: List[Req]) -> List[Req]:
        shuffled = list(waiting)
        self._rng.shuffle(shuffled)
        return shuffled

    def _lpm(self, waiting: List[Req]) -> List[Req]:
        in_batch = RadixCache(None, None)  # the tokens of the little-cached requests (no pool: SGLang's simulated tree)
        deprioritized = set()
        for req in waiting:
            self.match(req)
            if len(req.prefix_indices) > IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD:
                continue
            key = RadixKey(req.all_ids(), req.extra_key)
            if len(in_batch.match_prefix(key).device_indices) >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                deprioritized.add(id(req))
            else:
                in_batch.insert(key)
        return sorted(waiting, key=lambda r: float("inf") if id(r) in deprioritized else -len(r.prefix_indices))

    def _dfs_weight(self, waiting: List[Req]) -> List[Req]:
        at_node: Dict[object, List[Req]] = defaultdict(list)
        for req in waiting:
            self.match(req)
            at_node[req.last_node].append(req)
        weight: Counter = Counter()  # waiting requests matched at a node or below it
        for node, reqs in at_node.items():
            while node is not None:
                weight[node] += len(reqs)
                node = node.parent
        ordered: List[Req] = []
        stack = [(self.tree_cache.root_node, False)]
        while stack:  # (iterative: a deep conversation tree would exceed the recursion limit)
            node, subtree_done = stack.pop()
            if subtree_done:
                ordered += at_node.get(node, ())
                continue
            stack.append((node, True))
            children = sorted((c for c in node.children.values() if weight[c]), key=lambda c: -weight[c])
            stack += [(child, False) for child in reversed(children)]
        return ordered


_POLICIES = {
    "fcfs": SchedulePolicy._fcfs,
    "lof": SchedulePolicy._lof,
    "random": SchedulePolicy._random,
    "lpm": SchedulePolicy._lpm,
    "dfs-weight": SchedulePolicy._dfs_weight,
}
