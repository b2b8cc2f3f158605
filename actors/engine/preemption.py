"""Priority preemption (SGLang's ``preempt_to_schedule``), mixed into the engine's
:class:`~actors.engine.scheduler.Scheduler` through
:class:`~actors.engine.schedule_policy.PrefillAdmissionMixin`: a waiting request that finds no
row or room may retract running requests of a much lower priority.

Reads the scheduler's ``config``, ``policy`` and ``running``, and the admission's room
accounting (``_request_reserve``); retracts with ``_retract``
(:mod:`actors.engine.schedule_batch`).
"""

from __future__ import annotations

import logging
from typing import List

from actors.engine.req import Req

logger = logging.getLogger(__name__)


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

    def _preempt_for(self, req: Req, short: int) -> bool:
        """Priority scheduling (SGLang's ``preempt_to_schedule``): retract :meth:`_preemptible`
        running requests, at least one (its row is then ``req``'s), until about ``short`` more
        slots come back (each gives back its decode reserve and the KV its row holds beyond the
        cache's). None is retracted unless all it takes are. True: some were (they wait again,
        their output kept)."""
        victims, room = [], 0
        for running in self._preemptible(req):
            if victims and room >= short:
                break
            victims.append(running)
            room += self._request_reserve(running, running.kv_allocated_len)
            room += running.kv_allocated_len - running.cache_protected_len
        if not victims or room < short:
            return False
        for running in victims:
            self._retract(running)
        logger.info("request %s (priority %d) preempted %s", req.rid, req.priority, [r.rid for r in victims])
        return True
