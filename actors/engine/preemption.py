"""Priority preemption (SGLang's ``preempt_to_schedule``), mixed into the engine's
:class:`~actors.engine.scheduler.Scheduler` through
:class:`~actors.engine.schedule_policy.PrefillAdmissionMixin`: a waiting request that finds no
row or room may retract running requests of a much lower priority.

Reads the scheduler's ``config``, ``policy``, ``running``, ``runner``, ``tree_cache`` and
model kind (``swa``, ``hybrid``), and the admission's room accounting (``_request_reserve``,
``_swa_reserve``, ``_paged_after``); retracts with ``_retract``
(:mod:`actors.engine.schedule_batch`) and counts the requests preempted in ``num_preemptions``.
A PD decode worker's reservations preempt through it too (:mod:`actors.pd_decode_prealloc`).
"""

from __future__ import annotations

import logging
from typing import List, NamedTuple

from actors.engine.req import Req

logger = logging.getLogger(__name__)


class Room(NamedTuple):
    """Request rows, full-pool KV slots, SWA KV slots and Mamba state slots (0 for a pool the
    model does not have): what a request lacks, or what retractions give back."""

    rows: int
    full: int
    swa: int
    states: int


class PreemptionMixin:
    """The running requests a waiting one may preempt, and their retraction for it."""

    def _preemptible(self, req: Req) -> List[Req]:
        """The running requests ``req`` may preempt (priority scheduling): those whose priority is
        more than ``priority_scheduling_preemption_threshold`` below its own, in the order
        preemption takes them — the lowest first, the latest of a priority first."""
        if not self.config.enable_priority_scheduling:
            return []
        threshold, rank = self.config.priority_scheduling_preemption_threshold, self.policy.rank
        ordered = sorted(self.running, key=lambda r: (-rank(r), -r.created_time))
        return [r for r in ordered if rank(r) - rank(req) > threshold]

    def _preempt_for(self, req: Req, short: Room) -> bool:
        """Priority scheduling (SGLang's ``preempt_to_schedule``): retract the fewest
        :meth:`_preemptible` running requests, in their order, whose retraction gives back all
        ``req`` lacks of each resource (``short``: a row, full and SWA slots, state slots). None is
        retracted unless all it takes are. The count is exact (:meth:`_freed_by`): counted in one
        pool for a shortage in another, a request was retracted in vain, or not for one it would
        have made room for. True: some were (they wait again, their output kept)."""
        preemptible = self._preemptible(req)
        for n in range(1, len(preemptible) + 1):
            if all(freed >= lack for freed, lack in zip(self._freed_by(preemptible[:n]), short)):
                break
        else:
            return False
        for running in preemptible[:n]:
            self._retract(running)
        self.num_preemptions += n  # (each counts in ``num_retractions`` too)
        logger.info("request %s (priority %d) preempted %s", req.rid, req.priority, [r.rid for r in preemptible[:n]])
        return True

    def _freed_by(self, victims: List[Req]) -> Room:
        """What retracting ``victims`` adds to the plan's room (:meth:`_prefill_room`,
        :meth:`_free_states`): each one's row and decode reserve; the whole pages of its row past
        the cache's prefix (in the SWA pool, those past what slid out of its window); a hybrid
        model's state slots of its row; and what of the tree only their locks hold, evictable once
        they are gone (the cache's ``released_by_unlock``; the arrival's own prefix, locked by it
        too, stays protected)."""
        full = swa = states = 0
        per_row = self.runner.req_to_token_pool.mamba_slots_per_row if self.hybrid else 0
        for running in victims:
            reserve = self._request_reserve(running, running.kv_allocated_len)
            # [0, protected)               the tree's (locked: released_by_unlock)
            # [protected, committed)       the row's full KV: freed
            # [swa_evicted, committed)     the row's SWA KV (before it slid out of the window: freed already)
            committed, protected = running.kv_committed_len, running.cache_protected_len
            full += reserve + self._paged_after(protected, committed - protected)
            if self.swa:
                start = max(running.swa_evicted_seqlen, protected)
                swa += self._swa_reserve(reserve) + self._paged_after(start, committed - start)
            states += per_row
        tree = self.tree_cache.released_by_unlock(victims)
        return Room(len(victims), full + tree.full, swa + tree.swa, states + tree.states)
