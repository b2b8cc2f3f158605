"""Throughput of the KV slot allocators: alloc_extend, alloc_decode and free.

For every implementation available on this machine (the vectorised PyTorch
reference on CPU — and on CUDA when present —, the Triton kernels when CUDA
is present) and every page size × batch size, it times one call of each
operation on a realistic batch (prefixes of 0–2 pages, extends of 1–256
tokens) and prints calls per second and µs per call. Allocation state is
snapshot/restored around each call, so every call sees the same free list.

    python scripts/bench_mem_cache.py [--batch-sizes 1 64 256 1024] [--page-sizes 1 16 64]
                                      [--markdown results.md]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mem_cache.allocator import PagedTokenToKVPoolAllocator  # noqa: E402


@dataclass
class Row:
    impl: str
    device: str
    page_size: int
    batch_size: int
    op: str
    us_per_call: float

    @property
    def calls_per_s(self) -> float:
        return 1e6 / self.us_per_call


def make_batch(bs: int, page_size: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 2 * page_size + 1, (bs,), generator=gen)
    extend = torch.randint(1, 257, (bs,), generator=gen)
    seq = prefix + extend
    # prefixes live in pages bs+1.. (one run of pages per request), apart from the free list
    pages_per_req = (prefix + page_size - 1) // page_size
    first_page = 1 + torch.cumsum(pages_per_req, 0) - pages_per_req
    last_loc = torch.where(prefix > 0, first_page * page_size + prefix - 1, -1)
    return prefix, seq, last_loc, int(extend.sum()), int(pages_per_req.sum())


def time_call(fn: Callable[[], None], device: str, min_time: float) -> float:
    """Median-free simple timer: repeat until ``min_time`` seconds, return µs per call."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    n, start = 0, time.perf_counter()
    while True:
        for _ in range(10):
            fn()
        n += 10
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            return elapsed / n * 1e6


def bench_one(impl: str, device: str, page_size: int, bs: int, min_time: float) -> List[Row]:
    prefix, seq, last_loc, num_tokens, prefix_pages = make_batch(bs, page_size, device)
    need_pages = num_tokens // page_size + 2 * bs + prefix_pages + 8
    alloc = PagedTokenToKVPoolAllocator(need_pages * page_size, page_size, device=device, backend=impl)
    alloc.alloc(prefix_pages * page_size)  # the prefixes' pages (1..prefix_pages) are taken
    dev = [x.to(device) for x in (prefix, seq, last_loc)]
    state = alloc.backup_state()

    def extend():
        alloc.alloc_extend(*dev, num_tokens, prefix_lens_cpu=prefix, seq_lens_cpu=seq)
        alloc.restore_state(state)

    dec_seq, dec_last = seq + 1, (last_loc + 1).clamp_min(page_size)
    dec_seq_dev, dec_last_dev = dec_seq.to(device), dec_last.to(device)

    def decode():
        alloc.alloc_decode(dec_seq_dev, dec_last_dev, seq_lens_cpu=dec_seq)
        alloc.restore_state(state)

    out = alloc.alloc_extend(*dev, num_tokens, prefix_lens_cpu=prefix, seq_lens_cpu=seq)
    after_alloc = alloc.backup_state()

    def free():
        alloc.free(out)
        alloc.restore_state(after_alloc)

    return [
        Row(impl, device, page_size, bs, op, time_call(fn, device, min_time))
        for op, fn in (("alloc_extend", extend), ("alloc_decode", decode), ("free", free))
    ]


def implementations() -> List[tuple]:
    impls = [("torch", "cpu")]
    if torch.cuda.is_available():
        impls += [("torch", "cuda"), ("triton", "cuda")]
    return impls


def format_table(rows: List[Row]) -> str:
    header = "| impl | device | page_size | batch | op | calls/s | µs/call |"
    lines = [header, "|---|---|---:|---:|---|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r.impl} | {r.device} | {r.page_size} | {r.batch_size} | {r.op} "
            f"| {r.calls_per_s:,.0f} | {r.us_per_call:,.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per measurement")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)

    rows: List[Row] = []
    for impl, device in implementations():
        for ps in args.page_sizes:
            for bs in args.batch_sizes:
                rows.extend(bench_one(impl, device, ps, bs, args.min_time))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    title = f"raydix allocator benchmark — torch {torch.__version__}, CPU {platform.processor() or platform.machine()}, GPU {gpu}"
    table = format_table(rows)
    print(title)
    print(table)
    if args.markdown:
        args.markdown.write_text(f"{title}\n\n{table}\n")


if __name__ == "__main__":
    main()
