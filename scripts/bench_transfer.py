"""Page-transfer bandwidth of every transfer backend available here, as a
fraction of a plain memcpy of the same bytes (reference §9.3).

The pool is one attention layer shaped like the reference's calibration: K
and V of 8 KV heads × 128 dims in fp16, so a 16-token page is 64 KiB (K+V).
Each measurement moves ``--tokens`` tokens (default 4096 = 16 MiB) from a
prefill pool into a decode pool, with slot lists that are sequential (one
run) or random pages (runs of one page), at page sizes 1, 16 and 64:

* ``shm``: in-process (this process maps the decode pool's shared memory)
  and cross-process (a spawned decode rank owns the pool);
* ``torch_dist``: gloo between this process and the spawned decode rank —
  gather into one message, send, the decode rank scatters (time until landed);
* ``cuda_ipc``: when CUDA is present (in-process);
* ``naive``: ``dst[dst_idx] = src[src_idx]`` per buffer (fancy indexing,
  gathers into a temporary), against the run-merged copy of ``shm``.

``memcpy`` is ``torch`` ``copy_`` of one contiguous tensor of the same bytes,
timed right before every push ("of memcpy" divides the two medians). Times are medians of ``--repeat`` pushes, with one
torch intra-op thread by default (``--threads``): on a shared 2-core machine
that is what gives repeatable numbers, and a transfer runs on one thread.

    python scripts/bench_transfer.py [--tokens 4096] [--page-sizes 1 16 64] [--repeat 7] [--plot out.png]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mem_cache.buffer_allocator import LocalBufferAllocator, SharedMemoryBufferAllocator  # noqa: E402
from mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from transfer import KVHandoff, KVPoll, KVReceiver, KVSender, create_agent, pool_allocators, pool_layout  # noqa: E402

HEADS, HEAD_DIM = 8, 128


def build(page_size: int, num_tokens: int, shared: bool, device: str = "cpu"):
    """One-layer MHA pool of ``num_tokens`` slots: ``(pool, layout, tensors)``."""
    if device == "cuda":
        from mem_cache.buffer_allocator import CudaIpcBufferAllocator

        alloc = CudaIpcBufferAllocator("cuda")
    else:
        alloc = SharedMemoryBufferAllocator(prefix="bench") if shared else LocalBufferAllocator()
    pool = MHATokenToKVPool(num_tokens, page_size, torch.float16, HEADS, HEAD_DIM, 1, device=device, buffer_allocator=alloc)
    layout, tensors = pool_layout(pool)
    for t in tensors.values():
        t.normal_()
    return pool, layout, tensors


def slots(rng, page_size: int, pool_tokens: int, tokens: int, sequential: bool) -> np.ndarray:
    pages = tokens // page_size
    first = np.arange(1, pages + 1) if sequential else rng.choice(np.arange(1, pool_tokens // page_size + 1), pages, replace=False)
    return (first[:, None] * page_size + np.arange(page_size)).reshape(-1)


def median_s(fn: Callable[[], None], repeat: int, sync=lambda: None, baseline: Callable[[], None] = None):
    """Median seconds of ``fn`` — and, with ``baseline``, of the baseline timed
    right before each call (so a shared machine's load hits both alike)."""
    fn()
    sync()
    times, base_times = [], []
    for _ in range(repeat):
        for f, out in ((baseline, base_times), (fn, times)):
            if f is None:
                continue
            t0 = time.perf_counter()
            f()
            sync()
            out.append(time.perf_counter() - t0)
    return (statistics.median(times), statistics.median(base_times)) if baseline else statistics.median(times)


# ---- the spawned decode rank ------------------------------------------------------------
def decode_rank(conn, pool_tokens: int) -> None:
    torch.set_num_threads(1)
    pools, receiver = {}, None
    while True:
        cmd, args = conn.recv()
        if cmd == "stop":
            return
        if cmd == "handoff":
            backend, page_size, dst = args
            if (backend, page_size) not in pools:
                pool, layout, tensors = build(page_size, pool_tokens, shared=True)
                agent = create_agent(backend, layout, tensors, allocators=pool_allocators(pool))
                pools[(backend, page_size)] = (pool, agent)
            receiver = KVReceiver(pools[(backend, page_size)][1], "bench", 0)
            conn.send(receiver.send_metadata(dst).to_bytes())
        elif cmd == "land":
            receiver.mark_done()
            conn.send((int(receiver.wait()), receiver.failure_reason()))


class Remote:
    def __init__(self, pool_tokens: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=decode_rank, args=(child, pool_tokens), daemon=True)
        self.proc.start()

    def call(self, cmd: str, *args):
        self.conn.send((cmd, args))
        return self.conn.recv()

    def stop(self) -> None:
        self.conn.send(("stop", ()))
        self.proc.join(10)


# ---- measurements --------------------------------------------------------------------------
def push_fn(agent, wire: bytes, src: np.ndarray, remote: "Remote | None" = None) -> Callable[[], None]:
    handoff = KVHandoff.from_bytes(wire)

    def run():
        sender = KVSender(agent, "bench")
        sender.init(handoff)
        sender.send(src)
        assert sender.poll() == KVPoll.Success, sender.failure_reason()
        if remote is not None and handoff.backend == "torch_dist":
            state, reason = remote.call("land")
            assert state == KVPoll.Success, reason

    return run


def bench(args) -> List[Dict]:
    rng = np.random.default_rng(0)
    rows: List[Dict] = []
    remote = Remote(args.pool_tokens)
    try:
        for page_size in args.page_sizes:
            _, layout, src_tensors = build(page_size, args.pool_tokens, shared=False)
            nbytes = args.tokens * sum(t[0].nbytes for t in src_tensors.values())
            a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
            a.random_(0, 255)
            memcpy_s = median_s(lambda: b.copy_(a), args.repeat)
            rows.append(dict(method="memcpy", page_size=page_size, pattern="-", bytes=nbytes, seconds=memcpy_s, memcpy_s=memcpy_s))
            dst_pool, dst_layout, dst_tensors = build(page_size, args.pool_tokens, shared=True)
            decode = create_agent("shm", dst_layout, dst_tensors, allocators=pool_allocators(dst_pool))
            for pattern in ("sequential", "random"):
                src = slots(rng, page_size, args.pool_tokens, args.tokens, pattern == "sequential")
                dst = slots(rng, page_size, args.pool_tokens, args.tokens, pattern == "sequential")
                methods = {}
                shm = create_agent("shm", layout, src_tensors)
                methods["shm (in-process)"] = push_fn(shm, KVReceiver(decode, "bench", 0).send_metadata(dst).to_bytes(), src)
                methods["shm (cross-process)"] = push_fn(shm, remote.call("handoff", "shm", page_size, dst.tolist()), src)
                dist_agent = create_agent("torch_dist", layout, src_tensors)
                methods["torch_dist gloo (cross-process)"] = _fresh_torch_dist(dist_agent, remote, page_size, dst, src)
                s_idx, d_idx = torch.as_tensor(src), torch.as_tensor(dst)

                def naive():
                    for name, t in src_tensors.items():
                        dst_tensors[name][d_idx] = t[s_idx]

                methods["naive fancy indexing (in-process)"] = naive
                for method, fn in methods.items():
                    seconds, memcpy_s = median_s(fn, args.repeat, baseline=lambda: b.copy_(a))
                    rows.append(dict(method=method, page_size=page_size, pattern=pattern, bytes=nbytes, seconds=seconds, memcpy_s=memcpy_s))
                    print(_fmt(rows[-1]), flush=True)
                dist_agent.close()
            if torch.cuda.is_available():
                rows.extend(_bench_cuda(args, page_size, rng, nbytes))
    finally:
        remote.stop()
    return rows


def _fresh_torch_dist(agent, remote, page_size, dst, src) -> Callable[[], None]:
    """A landing is waited for once, so every push takes a fresh hand-off (one
    control round trip to the peer, inside the timed region)."""

    def run():
        push_fn(agent, remote.call("handoff", "torch_dist", page_size, dst.tolist()), src, remote)()

    return run


def _bench_cuda(args, page_size, rng, nbytes) -> List[Dict]:
    rows = []
    sync = torch.cuda.synchronize
    a, b = torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    memcpy_s = median_s(lambda: b.copy_(a), args.repeat, sync)
    rows.append(dict(method="memcpy (cuda)", page_size=page_size, pattern="-", bytes=nbytes, seconds=memcpy_s, memcpy_s=memcpy_s))
    src_pool, layout, src_tensors = build(page_size, args.pool_tokens, shared=True, device="cuda")
    dst_pool, dst_layout, dst_tensors = build(page_size, args.pool_tokens, shared=True, device="cuda")
    prefill = create_agent("cuda_ipc", layout, src_tensors)
    decode = create_agent("cuda_ipc", dst_layout, dst_tensors, allocators=pool_allocators(dst_pool))
    for pattern in ("sequential", "random"):
        src = slots(rng, page_size, args.pool_tokens, args.tokens, pattern == "sequential")
        dst = slots(rng, page_size, args.pool_tokens, args.tokens, pattern == "sequential")
        fn = push_fn(prefill, KVReceiver(decode, "bench", 0).send_metadata(dst).to_bytes(), src)
        seconds, memcpy_s = median_s(fn, args.repeat, sync, baseline=lambda: b.copy_(a))
        rows.append(dict(method="cuda_ipc (in-process)", page_size=page_size, pattern=pattern, bytes=nbytes, seconds=seconds, memcpy_s=memcpy_s))
        print(_fmt(rows[-1]), flush=True)
    return rows


def _fmt(row: Dict) -> str:
    gbs = row["bytes"] / row["seconds"] / 1e9
    return (f"| {row['method']} | {row['page_size']} | {row['pattern']} | {row['bytes'] / 2**20:.0f} | "
            f"{row['seconds'] * 1e3:.2f} | {gbs:.2f} | {row['memcpy_s'] / row['seconds']:.0%} |")


def plot(rows: List[Dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({r["method"] for r in rows if r["pattern"] != "-"})
    keys = sorted({(r["page_size"], r["pattern"]) for r in rows if r["pattern"] != "-"})
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        vals = [next((r["memcpy_s"] / r["seconds"] for r in rows if r["method"] == method and (r["page_size"], r["pattern"]) == k), 0) for k in keys]
        ax.bar(np.arange(len(keys)) + i * width, vals, width, label=method)
    ax.set_xticks(np.arange(len(keys)) + 0.4 - width / 2, [f"page {p}\n{pat}" for p, pat in keys])
    ax.set_ylabel("fraction of memcpy of the same bytes")
    ax.set_title("KV page transfer bandwidth (8 KV heads × 128 × fp16, K+V)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens moved per push")
    parser.add_argument("--pool-tokens", type=int, default=16384, help="slots per pool")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--plot", help="write a bar chart here")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: stable on a shared 2-core box)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CUDA {torch.cuda.is_available()}")
    print("| method | page size | slots | MiB | ms | GB/s | of memcpy |\n|---|---:|---|---:|---:|---:|---:|")
    rows = bench(args)
    for row in rows:
        if row["method"].startswith("memcpy"):
            print(_fmt(row))
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
