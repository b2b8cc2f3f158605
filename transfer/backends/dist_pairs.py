"""The pairs of a ``torch_dist`` agent: opening, serving, keeping alive and closing them (a
mixin of :class:`transfer.backends.torch_dist.TorchDistAgent`).

A prefill agent's first push to a decode agent takes a pair number from the
decode agent's ``TCPStore`` (``store.add``), announces itself under
``hello/{k}`` (its agent id and the data transport it picked) and both sides
build a two-rank ``ProcessGroupGloo`` (decode = rank 0) on
``PrefixStore(pair/{k})`` and the pair's data channel
(:mod:`transfer.backends.dist_data`: the gloo group itself, or a two-rank
``ProcessGroupNCCL`` on ``pair/{k}/nccl`` when both sides' pools are on
CUDA). The decode agent answers each announcement with a reader thread that
receives, in order, ``[header_len, payload_len]`` (int64) and the msgpack
header over gloo, then exactly ``payload_len`` payload bytes over the data
channel, and hands the message to the agent's ``_deliver``.

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

:class:`PairConnections` reads the agent's settings and keeps its pairs' state (both
declared on the class) under the agent's ``_lock``.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from typing import Dict, List, Optional

import msgpack
import torch
import torch.distributed as dist

from transfer.backends.dist_data import open_data_channel
from transfer.base import TransferError

logger = logging.getLogger("transfer.backends.torch_dist")  # the agent's: its pairs' logs keep their logger

_IDLE = datetime.timedelta(days=365)  # a reader's wait for the next message of a peer that sends no keepalives
_BYE = -1
_KEEPALIVE = 0  # header length of a keepalive (a real header is never empty)
_GAVE_UP = b"\x00gave up"  # hello/{k} as the decode side leaves it when no hello came in time


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


class PairConnections:
    """The pairs of a torch_dist agent, both sides (see the module docstring)."""

    agent_id: str
    timeout_s: float
    connect_timeout_s: float
    keepalive_s: float
    keepalive_misses: int
    link_transports: Dict[str, str]
    _nccl_device: Optional[torch.device]
    _lock: threading.Condition
    _store: Optional[dist.TCPStore]
    _links: Dict[str, _Link]
    _opening: Dict[str, List]
    _closed: bool
    _readers: List[threading.Thread]
    _keepalives: Optional[threading.Thread]

    # ---- decode side ----------------------------------------------------------------
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

    # ---- prefill side ----------------------------------------------------------------
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


def _forget_pair(store: dist.Store, k: int) -> None:
    """Delete pair ``k``'s keys (its hello, its groups' rendezvous) from the decode
    agent's store: the store holds the live pairs' keys only."""
    try:
        for key in store.list_keys():
            if key == f"hello/{k}" or key.startswith(f"pair/{k}/"):
                store.delete_key(key)
    except Exception:  # the store is gone with its agent
        pass
