"""The generation requests in flight, by the ids a client can name them with (SGLang's
``rid_to_state``): what SGLang's /abort_request and /pause_generation's abort mode end.

A request is named by its ``X-Request-Id`` (the client's, or the one the server made; vLLM's)
and by its ``rid`` (/generate's ``meta_info.id``: SGLang's body ``rid``, or the one the server
made). Several requests may share an ``X-Request-Id`` (vLLM serves them all; an abort names them
all), never a body ``rid`` (SGLang's "Duplicate request ID": a 400). A request is entered on its
arrival, before it waits for a pause or an admission slot (as SGLang's tokenizer manager enters its
state before its pause): an abort reaches it there too, and it ends aborted without reaching a worker.
"""

from __future__ import annotations

import asyncio
from typing import Dict, List, NamedTuple, Optional, Sequence, Set

from cluster.api_errors import APIError

ABORT_WAIT_POLL_S = 0.01  # how often :meth:`RequestTable.wait_ended` looks


class _Entry(NamedTuple):
    names: Sequence[str]
    rid: Optional[str]  # the client's own


class RequestTable:
    def __init__(self):
        self._entries: Dict[asyncio.Event, _Entry] = {}  # by each request's abort event
        self._by_name: Dict[str, List[asyncio.Event]] = {}
        self._rids: Set[str] = set()  # the body rids in flight

    def add(self, names: Sequence[str], rid: Optional[str] = None) -> asyncio.Event:
        """Enter a request under ``names`` (and the client's own ``rid``, which no other request in
        flight may have: 400); returns the event that aborts it, to :meth:`remove` it by."""
        if rid is not None:
            if rid in self._rids:
                raise APIError(400, f"rid: duplicate request id {rid!r}: a request under it is in flight",
                               param="rid", code="duplicate_request_id")
            self._rids.add(rid)
        aborted = asyncio.Event()
        entry = _Entry(tuple(dict.fromkeys((*names, *([rid] if rid is not None else [])))), rid)
        self._entries[aborted] = entry
        for name in entry.names:
            self._by_name.setdefault(name, []).append(aborted)
        return aborted

    def remove(self, aborted: asyncio.Event) -> None:
        """The request ended (its workers' clean-up done): its names are free."""
        entry = self._entries.pop(aborted)
        for name in entry.names:
            events = self._by_name[name]
            events.remove(aborted)
            if not events:
                del self._by_name[name]
        self._rids.discard(entry.rid)

    def abort(self, name: str) -> List[asyncio.Event]:
        """Abort every request named ``name`` (none: nothing, as SGLang's); returns their events."""
        events = list(self._by_name.get(name, ()))
        for event in events:
            event.set()
        return events

    def abort_all(self) -> List[asyncio.Event]:
        events = list(self._entries)
        for event in events:
            event.set()
        return events

    async def wait_ended(self, events: Sequence[asyncio.Event]) -> None:
        """Until every request of ``events`` has ended (removed: its workers freed what it held)."""
        while any(event in self._entries for event in events):
            await asyncio.sleep(ABORT_WAIT_POLL_S)

    def __len__(self) -> int:
        return len(self._entries)
