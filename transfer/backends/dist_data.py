"""The payload half of a ``torch_dist`` pair: over the gloo pair itself, or over NCCL.

A pair's control messages (sizes, msgpack header) always go over its
two-rank gloo group; its payloads go over a *data channel*:

* ``gloo`` — the gloo group itself; payloads are host tensors (CUDA pools
  are gathered to host and scattered back);
* ``nccl`` — a two-rank ``ProcessGroupNCCL`` of its own (``PrefixStore
  pair/{k}/nccl`` on the decode agent's store); payloads stay on the pools'
  CUDA device from the gather to the scatter.

Which one a pair uses, per agent option ``data_transport``:

    agent side       auto                          gloo        nccl
    decode endpoint  "nccl" if it can, else "gloo"  "gloo"      "nccl" (else creation fails)
    prefill link     nccl if both can, else gloo    gloo        nccl if the endpoint says so, else TransferError

"Can" means: every pool buffer on one CUDA device and ``dist.is_nccl_available()``.
A decode agent takes gloo pairs in every mode (the prefill side chooses);
``nccl`` where it cannot work raises ``ValueError`` at agent creation.

CUDA streams: ProcessGroupNCCL runs an op on a stream of its own after
the thread's current stream (so after the gather). ``work.wait()`` only
orders the current stream after it, so :class:`NcclData` polls the op
until it finished on the device (``is_completed``, bounded by the
channel's timeout) before a send returns (the payload may be freed) or a
receive hands its payload on (another thread scatters it). A first op on a
pair also builds its NCCL communicator (both sides must be in it: the
receiver posts its receive as soon as the header arrived). Failures: an op
past its timeout raises :class:`TransferError` here, and its payload is
kept until the channel closes (the device may still write it); the NCCL
watchdog's own reaction to a dead peer follows torch's
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (its default tears the process down).
"""

from __future__ import annotations

import datetime
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from transfer.base import TransferError

DATA_TRANSPORTS = ("auto", "gloo", "nccl")


def nccl_device(mode: str, buffers: Dict[str, torch.Tensor]) -> Optional[torch.device]:
    """The CUDA device this agent's payloads may move from over NCCL, or ``None``
    (gloo only). Raises ValueError for an unknown ``mode``, or ``"nccl"`` where it
    cannot work (pools not on one CUDA device, or a torch without NCCL)."""
    if mode not in DATA_TRANSPORTS:
        raise ValueError(f"data_transport must be one of {', '.join(DATA_TRANSPORTS)}; got {mode!r}")
    devices = sorted({str(t.device) for t in buffers.values()})
    why = None
    if len(devices) != 1 or not devices[0].startswith("cuda"):
        why = f"the pools are on {', '.join(devices) or 'no device'}, not on one CUDA device"
    elif not dist.is_nccl_available():
        why = "this torch build has no NCCL"
    if why is not None:
        if mode == "nccl":
            raise ValueError(f"data_transport='nccl' needs NCCL between CUDA pools: {why}")
        return None
    return None if mode == "gloo" else torch.device(devices[0])


def choose_data_transport(mode: str, local_nccl: bool, peer_data: str) -> str:
    """The prefill side's pick for a pair: ``nccl`` when this side can and the decode
    endpoint advertises it; else ``gloo``, unless ``mode`` demands NCCL (TransferError)."""
    if local_nccl and peer_data == "nccl":
        return "nccl"
    if mode == "nccl":
        raise TransferError("data_transport='nccl', but the decode rank takes payloads over gloo only (its pools are "
                            "not on CUDA, it has no NCCL, or it runs data_transport='gloo')")
    return "gloo"


class GlooData:
    """Payloads as host tensors over the pair's gloo group."""

    transport = "gloo"
    device = torch.device("cpu")

    def __init__(self, pg: dist.ProcessGroup, rank: int):
        self.pg, self.peer = pg, 1 - rank

    def send(self, payload: torch.Tensor) -> None:
        if payload.numel():
            self.pg.send([payload], self.peer, 0).wait()

    def recv(self, nbytes: int) -> torch.Tensor:
        payload = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            self.pg.recv([payload], self.peer, 0).wait()
        return payload

    def close(self) -> None:
        pass


class NcclData:
    """Payloads as device tensors over a two-rank NCCL group bound to ``device``."""

    transport = "nccl"

    def __init__(self, store: dist.Store, k: int, rank: int, device: torch.device, timeout_s: float):
        self.device, self.peer, self.timeout_s = device, 1 - rank, timeout_s
        # the watchdog's limit lies past ours: a stuck op fails here (and the channel is aborted) first
        timeout = datetime.timedelta(seconds=2 * timeout_s + 60)
        self.pg = dist.ProcessGroupNCCL(dist.PrefixStore(f"pair/{k}/nccl", store), rank, 2, timeout)
        self._unfinished: List[torch.Tensor] = []  # payloads of ops that timed out: the device may still use them

    def send(self, payload: torch.Tensor) -> None:
        if not payload.numel():
            return
        with torch.cuda.device(self.device):  # NCCL P2P runs on the thread's current device
            self._finish(self.pg.send([payload], self.peer, 0), payload, "send")

    def recv(self, nbytes: int) -> torch.Tensor:
        with torch.cuda.device(self.device):
            payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            if nbytes:
                self._finish(self.pg.recv([payload], self.peer, 0), payload, "receive")
        return payload

    def _finish(self, work, payload: torch.Tensor, what: str) -> None:
        """Return once ``work`` finished on the device (its exception, if any, raised)."""
        deadline, delay = time.monotonic() + self.timeout_s, 0.0001
        while not work.is_completed():  # queries the op's end event; never blocks
            if time.monotonic() > deadline:
                self._unfinished.append(payload)
                raise TransferError(f"NCCL {what} of {payload.numel()} bytes unfinished after {self.timeout_s:.1f}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.001)
        work.wait()

    def close(self) -> None:
        try:
            self.pg.abort()  # immediate: no op of a closed pair is waited for
        except Exception:
            pass
        self._unfinished.clear()


def open_data_channel(transport: str, pg: dist.ProcessGroup, store: dist.Store, k: int, rank: int,
                      device: Optional[torch.device], timeout_s: float):
    """Pair ``k``'s data channel for ``transport`` (``device``: this agent's NCCL device, if any)."""
    if transport == "gloo":
        return GlooData(pg, rank)
    if transport == "nccl" and device is not None:
        return NcclData(store, k, rank, device, timeout_s)
    raise TransferError(f"pair {k} asks for data transport {transport!r}, which this agent does not take")
