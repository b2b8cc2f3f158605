"""What the kernel benchmarks share: a call's median time (bench_moe.py, bench_wna16.py) and the line
charts bench_decode.py and bench_wna16.py write with ``--plot``."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import torch

Series = Dict[str, Tuple[Sequence[float], Sequence[float]]]  # label → (xs, ys)


def median_ms(fn: Callable[[], torch.Tensor], iters: int, device: str) -> float:
    """Median ms of ``iters`` calls of ``fn`` (synchronised on CUDA) after a warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def write_plot(path: Path, title: str, xlabel: str, panels: List[Tuple[str, Series]]) -> None:
    """``panels``: (y label, its series: one line each, both axes log-scaled) side by side; nothing but a note
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot written)")
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (ylabel, series) in zip(axes[0], panels):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")
