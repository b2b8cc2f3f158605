"""Transfer backends; importing this package registers every one of them.

* ``fake`` — moves nothing (warm-up, scheduling tests);
* ``shm`` — same node, CPU: writes into the decode rank's shared-memory pools;
* ``cuda_ipc`` — same node, CUDA: writes into the decode rank's IPC-mapped pools;
* ``torch_dist`` — across nodes: a pairwise gloo process group per rank pair (headers, and
  host-staged payloads), plus a pairwise NCCL group for payloads when both pools are on CUDA.
"""

from typing import Optional

from transfer.backends import cuda_ipc, fake, shm, torch_dist  # noqa: F401
from transfer.base import known_backends


def select_backend(same_node: bool, device: str, override: Optional[str] = None) -> str:
    """The backend for a (prefill, decode) rank pair: ``override`` if given (it
    must be registered), else by placement and device — same node on CPU →
    ``shm``, same node on CUDA → ``cuda_ipc``, different nodes → ``torch_dist``."""
    if override:
        if override not in known_backends():
            raise ValueError(f"unknown transfer backend {override!r}; known: {', '.join(known_backends())}")
        return override
    if not same_node:
        return "torch_dist"
    kind = str(device).split(":")[0]
    if kind == "cpu":
        return "shm"
    if kind == "cuda":
        return "cuda_ipc"
    raise ValueError(f"no same-node transfer backend for device {device!r} (cpu or cuda)")
