"""Across nodes: a pairwise ``torch.distributed`` process group per (prefill, decode) pair.

No global default group is involved: each decode agent runs a ``TCPStore``
server (its endpoint: host, port, agent id, and a fresh tag per hand-off);
a prefill agent's first push to it takes a pair number from the store
(``store.add``), announces itself under ``hello/{k}`` (its agent id and the
data transport it picked) and both sides build a two-rank
``ProcessGroupGloo`` (decode = rank 0) on ``PrefixStore(pair/{k})`` and the
pair's data channel (:mod:`transfer.backends.dist_data`: the gloo group
itself, or a two-rank ``ProcessGroupNCCL`` on ``pair/{k}/nccl`` when both
sides' pools are on CUDA). The decode agent answers each announcement with
a reader thread that receives, in order, ``[header_len, payload_len]``
(int64) and the msgpack header over gloo, then exactly ``payload_len``
payload bytes over the data channel — so ``expect`` has nothing left to
post; it records which buffers and heads the hand-off still misses.

Setup and teardown (as Mooncake's and SGLang's bootstrap: every wait bounded,
a failed setup fails only what needs it). The decode side watches every pair
number taken, not one after the other: a hello not there ``connect_timeout_s``
after its number was taken is given up (``compare_set`` writes a marker the
late prefill then reads, so it fails at once). Both sides build the pair's
group within ``timeout_s``. A pair may idle for hours, so the reader's wait for
the *next* message is bounded by keepalives instead: the prefill agent sends a
header-less message (``[0, 0]``) on every idle link at least once every
``keepalive_s`` (its hello names that interval), and the reader gives the pair up after
``keepalive_misses`` intervals without a message — a peer host that vanished
without closing its sockets (power loss, a partition) no longer leaves the
reader waiting; a peer process that died closes its sockets, which ends the
wait at once. A keepalive that cannot be sent drops the prefill side's link, so
the next push opens a fresh pair. One slow or unreachable decode agent holds up
only the pushes to itself (a connect lock per peer). When a pair ends
(goodbye, broken, silent) its reader deletes its ``hello/{k}`` and
``pair/{k}/...`` store keys.

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
import os
import socket
import threading
import time
import uuid
import weakref
from typing import Dict, List, Optional

import msgpack
import torch
import torch.distributed as dist

from transfer.backends.dist_data import choose_data_transport, nccl_device, open_data_channel
from transfer.backends.landing import Landing, pack_rows
from transfer.base import KVHandoff, TransferAgent, TransferError, register_backend
from transfer.plan import plan_copies

logger = logging.getLogger(__name__)

_IDLE = datetime.timedelta(days=365)  # a reader's wait for the next message of a peer that sends no keepalives
_BYE = -1
_KEEPALIVE = 0  # header length of a keepalive (a real header is never empty)
_GAVE_UP = b"\x00gave up"  # hello/{k} as the decode side leaves it when no hello came in time
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


def default_host() -> str:
    """This node's outbound address (``RAYDIX_TRANSFER_HOST`` overrides)."""
    configured = os.environ.get("RAYDIX_TRANSFER_HOST")
    if configured:
        return configured
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the routed interface
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class _Link:
    """Prefill side of one pair: the gloo group (control), the data channel and
    a lock that keeps a message's three parts together."""

    def __init__(self, store: dist.Store, pg: dist.ProcessGroup, data):
        self.store, self.pg, self.data, self.lock = store, pg, data, threading.Lock()
        self.last_sent = time.monotonic()

    def send(self, header: bytes, payload: torch.Tensor) -> None:
        with self.lock:
            self.send_locked(header, payload)

    def send_locked(self, header: bytes, payload: torch.Tensor) -> None:
        """(Holding ``lock``) one message."""
        sizes = torch.tensor([len(header), payload.numel()], dtype=torch.int64)
        self.pg.send([sizes], 0, 0).wait()
        self.pg.send([torch.frombuffer(bytearray(header), dtype=torch.uint8)], 0, 0).wait()
        self.data.send(payload)  # returns once the payload left (and may be freed)
        self.last_sent = time.monotonic()

    def keepalive(self, idle_s: float) -> None:
        """Send a keepalive if nothing went out for ``idle_s``; a push in progress is traffic
        enough (its lock is not waited for)."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            if time.monotonic() - self.last_sent >= idle_s:
                self.pg.send([torch.tensor([_KEEPALIVE, 0], dtype=torch.int64)], 0, 0).wait()
                self.last_sent = time.monotonic()
        finally:
            self.lock.release()

    def bye(self) -> None:
        with self.lock:
            self.pg.send([torch.tensor([_BYE, 0], dtype=torch.int64)], 0, 0).wait()


@register_backend("torch_dist")
class TorchDistAgent(TransferAgent):
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

    def _accept(self) -> None:
        """Answer every prefill agent's ``hello/{k}`` with a reader thread. Polls
        with ``check`` on the server's own store: a blocked ``wait`` would hold
        the store's connection that the pairs' rendezvous also needs, and extra
        client connections are what is slow to open. New pairs are rare, so the
        poll backs off to 50 ms when idle. Every pair number taken is watched
        at once, so a prefill that died before its hello holds up no other."""
        store, delay = self._store, 0.001
        waiting: Dict[int, float] = {}  # pair numbers taken without a hello yet -> when seen taken
        seen = 0
        while not self._closed:
            try:
                now, taken = time.monotonic(), store.add("peers", 0)
                busy = taken > seen
                waiting.update((k, now) for k in range(seen + 1, taken + 1))
                seen = max(seen, taken)
                for k, since in list(waiting.items()):
                    hello = self._hello(store, k, now - since > self.connect_timeout_s)
                    if hello is not None:
                        busy = True
                        del waiting[k]
                        self._start_reader(store, k, hello)
            except Exception:  # the store was torn down
                return
            delay = 0.001 if busy else min(delay * 2, 0.005 if waiting else 0.05)
            time.sleep(delay)

    def _hello(self, store: dist.Store, k: int, expired: bool) -> Optional[bytes]:
        """Pair ``k``'s hello, ``_GAVE_UP`` once ``expired`` (the prefill side reads the
        marker and fails), or None: still waiting."""
        key = f"hello/{k}"
        if store.check([key]):
            return store.get(key)
        if not expired:
            return None
        hello = store.compare_set(key, b"", _GAVE_UP)  # the hello, if it came just now
        if hello == _GAVE_UP:
            logger.warning("KV pair %d of agent %s: no hello %.1fs after the prefill side took its number; given up",
                           k, self.agent_id[:8], self.connect_timeout_s)
        return hello

    def _start_reader(self, store: dist.Store, k: int, hello: bytes) -> None:
        if hello == _GAVE_UP or self._closed:
            return
        reader = threading.Thread(target=self._serve, args=(store, k, hello), name=f"raydix-kv-recv-{k}", daemon=True)
        with self._lock:  # (finished readers go: the list holds the live ones, for the exit hook)
            self._readers = [t for t in self._readers if t.is_alive()] + [reader]
        reader.start()

    def _serve(self, store: dist.Store, k: int, hello: bytes) -> None:
        data = None
        try:
            peer = msgpack.unpackb(hello, raw=False)
            timeout = datetime.timedelta(seconds=self.timeout_s)  # the setup's waits, and a message's later parts
            pg = dist.ProcessGroupGloo(dist.PrefixStore(f"pair/{k}", store), 0, 2, timeout)
            data = open_data_channel(peer["data"], pg, store, k, 0, self._nccl_device, self.timeout_s)
            with self._lock:
                self.link_transports[peer["agent_id"]] = data.transport
            silence = peer.get("keepalive_s")
            idle = _IDLE if not silence else datetime.timedelta(seconds=silence * self.keepalive_misses)
            while not self._closed:
                sizes = torch.empty(2, dtype=torch.int64)
                try:
                    pg.recv([sizes], 1, 0).wait(idle)
                except Exception:
                    if idle is not _IDLE and not self._closed:
                        logger.warning("KV pair %d of agent %s: no message and no keepalive from prefill agent %s "
                                       "in %.1fs; pair closed", k, self.agent_id[:8], peer["agent_id"][:8],
                                       idle.total_seconds())
                    raise
                header_len, payload_len = sizes.tolist()
                if header_len == _BYE:
                    return
                if header_len == _KEEPALIVE:
                    continue
                header = torch.empty(header_len, dtype=torch.uint8)
                pg.recv([header], 1, 0).wait()
                payload = data.recv(payload_len)  # on the device once it returns (NCCL)
                self._deliver(header.numpy().tobytes(), payload)  # (a bad message fails its hand-off only)
        except Exception:  # the pair broke (the prefill process died): its pending hand-offs time out
            logger.info("KV pair %d of agent %s closed", k, self.agent_id[:8], exc_info=True)
            return
        finally:
            if data is not None:
                data.close()
            _forget_pair(store, k)

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

    def _link(self, ep: Dict, transport: str) -> _Link:
        """The pair with ``ep``'s agent, opened once even when two pushes need it at
        once; opening it holds up only the pushes to that agent."""
        peer = ep["agent_id"]
        with self._lock:
            link = self._links.get(peer)
            if link is not None:
                return link
            opening = self._opening.setdefault(peer, [threading.Lock(), 0])
            opening[1] += 1
        try:
            with opening[0]:
                with self._lock:
                    link = self._links.get(peer)
                if link is None:
                    link = self._connect(ep, transport)
                    with self._lock:
                        self._links[peer] = link
                        self.link_transports[peer] = transport
                        if self._keepalives is None:
                            self._keepalives = threading.Thread(target=self._keep_alive, name="raydix-kv-keepalive",
                                                                daemon=True)
                            self._keepalives.start()
                return link
        finally:
            with self._lock:
                opening[1] -= 1
                if not opening[1]:
                    del self._opening[peer]

    def _connect(self, ep: Dict, transport: str) -> _Link:
        try:
            store = dist.TCPStore(ep["host"], ep["port"], None, False, datetime.timedelta(seconds=self.connect_timeout_s))
            k = store.add("peers", 1)
            hello = msgpack.packb({"agent_id": self.agent_id, "data": transport, "keepalive_s": self.keepalive_s},
                                  use_bin_type=True)
            if store.compare_set(f"hello/{k}", b"", hello) != hello:  # the decode side's _GAVE_UP
                raise TransferError(f"it gave up on pair {k}: the hello came after its connect_timeout_s")
            timeout = datetime.timedelta(seconds=self.timeout_s)
            pg = dist.ProcessGroupGloo(dist.PrefixStore(f"pair/{k}", store), 1, 2, timeout)
            data = open_data_channel(transport, pg, store, k, 1, self._nccl_device, self.timeout_s)
        except Exception as exc:
            raise TransferError(f"cannot reach the decode rank at {ep['host']}:{ep['port']}: {str(exc).splitlines()[0]}") from exc
        return _Link(store, pg, data)

    def _keep_alive(self) -> None:
        """Every ``keepalive_s / 4``: a keepalive on each link idle for ``keepalive_s / 2``, so
        a message goes out at most ``3/4 keepalive_s`` after the last: every interval holds one
        (a reader allowing one silent interval, ``keepalive_misses=1``, closed healthy pairs
        when the check was every ``keepalive_s / 2`` for links idle ``keepalive_s``). A link
        whose keepalive fails (its decode side gave the pair up, or is gone) is dropped, so
        the next push to that agent opens a fresh pair instead of failing on this one."""
        with self._lock:
            while not self._closed:
                self._lock.wait(self.keepalive_s / 4)
                links = list(self._links.items())
                self._lock.release()
                try:
                    for peer, link in links:
                        try:
                            link.keepalive(self.keepalive_s / 2)
                        except Exception as exc:
                            self._drop_link(peer, link, f"keepalive failed: {exc}")
                finally:
                    self._lock.acquire()

    def _drop_link(self, peer: str, link: _Link, why: str) -> None:
        with self._lock:
            if self._links.get(peer) is link:
                del self._links[peer]
        logger.info("KV link to agent %s dropped (%s)", peer[:8], str(why).splitlines()[0])
        with link.lock:  # not under a push that took the link before it was dropped (NCCL: an abort)
            link.data.close()

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


def _forget_pair(store: dist.Store, k: int) -> None:
    """Delete pair ``k``'s keys (its hello, its groups' rendezvous) from the decode
    agent's store: the store holds the live pairs' keys only."""
    try:
        for key in store.list_keys():
            if key == f"hello/{k}" or key.startswith(f"pair/{k}/"):
                store.delete_key(key)
    except Exception:  # the store is gone with its agent
        pass
