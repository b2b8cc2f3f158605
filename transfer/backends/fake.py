"""A backend that moves nothing and completes at once (warm-up, scheduling tests).

It has the real backends' interface and state machine, so the workers'
control path (hand-off, completion notice, timeouts, aborts) runs unchanged;
only the bytes stay where they are.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

from transfer.base import KVHandoff, TransferAgent, register_backend


@register_backend("fake")
class FakeAgent(TransferAgent):
    def endpoint(self) -> Dict:
        return {}

    def push(
        self, handoff: KVHandoff, src_slots: Sequence[int], src_state_slot: Optional[int], src_swa_slots: Sequence[int],
        offset: int = 0,
    ) -> int:
        return 0
