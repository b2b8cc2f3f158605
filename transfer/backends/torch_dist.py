"""Across nodes: a pairwise ``torch.distributed`` process group per (prefill, decode) pair.

No global default group is involved: each decode agent runs a ``TCPStore``
server (its endpoint: host, port, agent id, and a fresh tag per hand-off);
a prefill agent's first push to it opens a pair — a two-rank gloo group for
the messages' sizes and headers, and a data channel for their payloads —
and the decode agent answers it with a reader thread that hands each message
to its hand-off's landing, so ``expect`` has nothing left to post; it records
which buffers and heads the hand-off still misses. Opening, serving, keeping
alive and closing pairs, and the messages' framing, are
:mod:`transfer.backends.dist_pairs`'s (its mixin, :class:`PairConnections`).

A sender that fails (``abort``) sends a header-only message naming its tag; the
reader marks that hand-off failed, so its receiver fails at its next poll.

A push gathers every planned buffer's rows (one slice copy per run of
consecutive source slots) into one contiguous uint8 payload and sends it in
one message; with chunked prefill a hand-off takes one message per chunk
(and per prefill rank when TP sizes differ), each naming its row range.
``landed`` (polled by the receiver, never blocking) is true once every
needed head of every needed row of every needed buffer arrived, and then
scatters the payloads into this rank's buffers, one slice copy per run of
consecutive destination slots — on the decode loop's thread, so bytes for a
request that was cancelled meanwhile never touch slots given to another.

Payloads over gloo are host tensors (CUDA pools are gathered into host
memory and scattered back); over NCCL they stay on the pools' device: the
gather, the send, the receive and the scatter all run there. The endpoint
advertises ``"data": "nccl" | "gloo"``; agent option ``data_transport``
(``auto`` | ``gloo`` | ``nccl``) and the rules are in ``dist_data``;
``link_transports`` records, per peer agent, what a pair uses. The CPU
suite runs gloo between CPU pools (in-process and across processes) and the
transport negotiation; gpu tests cover CUDA pools staged through host (one
GPU) and the NCCL path (two GPUs: NCCL refuses two ranks on one device, so
a pair of ranks sharing a GPU must use ``data_transport: gloo`` or
``cuda_ipc``); the NCCL test has not yet run on a machine with two GPUs.
RDMA is not here.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import logging
import threading
import time
import uuid
import weakref
from typing import Dict, List, Optional

import msgpack
import torch
import torch.distributed as dist

from transfer.backends.dist_data import choose_data_transport, nccl_device
from transfer.backends.dist_pairs import PairConnections, default_host
from transfer.backends.landing import Landing, pack_rows
from transfer.base import KVHandoff, TransferAgent, TransferError, register_backend
from transfer.plan import plan_copies

logger = logging.getLogger(__name__)

_LIVE: "weakref.WeakSet[TorchDistAgent]" = weakref.WeakSet()


@atexit.register
def _close_live_agents() -> None:
    """Say goodbye on every open pair before the interpreter goes: a pair torn
    down during finalisation makes the peer's blocked receive throw in a
    thread that can no longer handle it."""
    agents = list(_LIVE)
    for agent in agents:
        agent.close()
    deadline = time.monotonic() + 1.0  # readers whose peer is in this process get their goodbye now
    for agent in agents:
        for reader in agent._readers:
            reader.join(timeout=max(0.0, deadline - time.monotonic()))


@register_backend("torch_dist")
class TorchDistAgent(PairConnections, TransferAgent):
    writes_in_place = False  # bytes land in ``landed``, on the decode loop: a cancelled hand-off's never do

    def __init__(
        self, layout, buffers, tp_rank: int = 0, tp_size: int = 1, allocators=(),
        host: Optional[str] = None, port: int = 0, timeout_s: float = 30.0, connect_timeout_s: float = 10.0,
        data_transport: str = "auto", keepalive_s: float = 5.0, keepalive_misses: int = 3,
    ):
        super().__init__(layout, buffers, tp_rank, tp_size, allocators)
        if keepalive_s <= 0 or keepalive_misses < 1:
            raise ValueError(f"keepalive_s must be > 0 and keepalive_misses >= 1; got {keepalive_s}, {keepalive_misses}")
        self.keepalive_s, self.keepalive_misses = keepalive_s, keepalive_misses
        self.data_transport = data_transport
        self._nccl_device = nccl_device(data_transport, buffers)  # None: payloads go over gloo only
        self.link_transports: Dict[str, str] = {}  # peer agent id -> "gloo" | "nccl", both sides
        self.agent_id = uuid.uuid4().hex
        self.host, self.port = host or default_host(), port
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._lock = threading.Condition()
        self._store: Optional[dist.TCPStore] = None
        self._tags = itertools.count()
        self._landing: Dict[str, Landing] = {}
        self._links: Dict[str, _Link] = {}
        self._opening: Dict[str, List] = {}  # peer agent id -> [its connect lock, pushes using it]
        self._closed = False
        self._acceptor: Optional[threading.Thread] = None
        self._readers: List[threading.Thread] = []
        self._keepalives: Optional[threading.Thread] = None
        _LIVE.add(self)

    # ---- decode side ----------------------------------------------------------------
    def endpoint(self) -> Dict:
        with self._lock:
            if self._store is None:
                self._store = dist.TCPStore(
                    "0.0.0.0", self.port, None, True, datetime.timedelta(seconds=self.connect_timeout_s),
                    wait_for_workers=False,
                )
                self.port = self._store.port
                self._acceptor = threading.Thread(target=self._accept, name="raydix-kv-accept", daemon=True)
                self._acceptor.start()
        return {"host": self.host, "port": self.port, "agent_id": self.agent_id,
                "tag": f"{self.agent_id[:8]}.{next(self._tags)}", "data": "gloo" if self._nccl_device is None else "nccl"}

    def expect(self, handoff: KVHandoff) -> None:
        landing = Landing(self.layout, handoff)
        with self._lock:
            self._landing[handoff.endpoint["tag"]] = landing

    def landed(self, handoff: KVHandoff) -> bool:
        tag = handoff.endpoint["tag"]
        with self._lock:
            landing = self._landing.get(tag)
            if landing is None:
                raise TransferError(f"no transfer expected under tag {tag} (cancelled or already landed)")
            if landing.error:
                self._landing.pop(tag, None)
                raise TransferError(landing.error)
            if not landing.complete():
                return False
            self._landing.pop(tag, None)
        landing.scatter(self.buffers)
        return True

    def missing(self, handoff: KVHandoff) -> str:
        with self._lock:
            landing = self._landing.get(handoff.endpoint.get("tag"))
            return landing.missing() if landing is not None else "nothing (no longer expected)"

    def failed(self, handoff: KVHandoff) -> Optional[str]:
        with self._lock:
            landing = self._landing.get(handoff.endpoint.get("tag"))
            return landing.error if landing is not None else None

    def cancel(self, handoff: KVHandoff) -> None:
        with self._lock:
            self._landing.pop(handoff.endpoint.get("tag"), None)

    def _deliver(self, raw_header: bytes, payload: torch.Tensor) -> None:
        """Hand one message to its landing. Never raises: the message framing is intact,
        so a message this side cannot take fails its hand-off (or, naming none, is
        dropped) and the pair's reader goes on."""
        try:
            header = msgpack.unpackb(raw_header, raw=False)
            tag = header["tag"]
        except Exception as exc:
            logger.warning("dropped a KV message without a readable tag (%s: %s)", type(exc).__name__, exc)
            return
        with self._lock:
            landing = self._landing.get(tag) if isinstance(tag, str) else None
            if landing is None:  # cancelled, or timed out: drop the bytes
                return
            if "abort" in header:  # (no payload) its sender failed: see ``abort``
                landing.error = landing.error or f"the prefill side gave up: {header['abort']}"
                return
            try:
                landing.add(header, payload)
            except Exception as exc:
                landing.error = landing.error or f"malformed message from the prefill side: {type(exc).__name__}: {exc}"
            self._lock.notify_all()

    # ---- prefill side ----------------------------------------------------------------
    def push(self, handoff: KVHandoff, src_slots, src_state_slot: Optional[int], src_swa_slots, offset: int = 0) -> int:
        ep = handoff.endpoint
        with_state = src_state_slot is not None and handoff.dst_state_slot is not None
        copies = plan_copies(self.layout, handoff.layout, self.tp_rank, self.tp_size, handoff.tp_rank, with_state)
        transport = choose_data_transport(self.data_transport, self._nccl_device is not None, ep.get("data", "gloo"))
        device = self._nccl_device if transport == "nccl" else "cpu"
        header, payload = pack_rows(self.layout, self.buffers, copies, src_slots, src_state_slot, src_swa_slots, offset,
                                    device=device)
        if not payload.numel():
            return 0
        header["tag"] = ep["tag"]
        link = self._link(ep, transport)
        try:
            link.send(msgpack.packb(header, use_bin_type=True), payload)
        except Exception as exc:
            self._drop_link(ep["agent_id"], link, exc)
            raise TransferError(f"sending to {ep['host']}:{ep['port']} failed: {exc}") from exc
        return int(payload.numel())

    def abort(self, handoff: KVHandoff, reason: str) -> None:
        """A header-only message naming the hand-off's tag, over the pair already open to its
        agent (none open: nothing was pushed there, the error notice tells it) and only if no
        push holds the pair now; a send that fails drops the pair, as a push's does."""
        ep = handoff.endpoint
        with self._lock:
            link = self._links.get(ep.get("agent_id"))
        if link is None or not link.lock.acquire(blocking=False):
            return
        try:
            link.send_locked(msgpack.packb({"tag": ep["tag"], "abort": reason}, use_bin_type=True),
                             torch.empty(0, dtype=torch.uint8))
            return
        except Exception as exc:
            error = exc
        finally:
            link.lock.release()
        self._drop_link(ep["agent_id"], link, error)

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
            self._closed = True
            self._lock.notify_all()
            self._store = None  # the acceptor holds the server until it has seen _closed
            self._landing.clear()
        for link in links:
            try:
                link.bye()
            except Exception:
                pass
            link.data.close()
        for thread in (self._acceptor, self._keepalives):
            if thread is not None:
                thread.join(timeout=1.0)

