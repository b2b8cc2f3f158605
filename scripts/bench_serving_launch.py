"""Helpers of scripts/bench_serving.py: raydix launched in a subprocess for one routing
policy, and the comparison plot."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

import httpx
import numpy as np


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LaunchedServer:
    """``raydix launch`` in a subprocess with one routing policy; stopped with SIGTERM (it drains)."""

    def __init__(self, config: str, policy: Optional[str], overrides: List[str], log_path: str, timeout_s: float):
        self.port = free_port()
        cmd = [sys.executable, "-m", "cluster.launch", "--config", config, "--port", str(self.port)]
        for item in overrides + ([f"router.prefill_policy={policy}", f"router.decode_policy={policy}"] if policy else []):
            cmd += ["--set", item]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"raydix launch exited with {self.proc.returncode}; see {log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"the server was not healthy within {timeout_s}s; see {log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def plot(summaries: Dict[str, Dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(summaries)
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for label in labels:
        values = np.sort(summaries[label]["ttft_ms_all"])
        axes[0].plot(values, np.arange(1, len(values) + 1) / max(1, len(values)), label=label)
    axes[0].set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    axes[0].legend()
    x = np.arange(len(labels))
    for offset, q in ((-0.2, "p50"), (0.2, "p99")):
        axes[1].bar(x + offset, [summaries[lb]["ttft_ms"][q] for lb in labels], 0.4, label=f"TTFT {q}")
    axes[1].set(xticks=x, xticklabels=labels, ylabel="ms", title="TTFT")
    axes[1].legend()
    axes[2].bar(x, [summaries[lb]["output_throughput"] for lb in labels])
    axes[2].set(xticks=x, xticklabels=labels, ylabel="output tok/s", title="throughput")
    axes[3].bar(x - 0.2, [summaries[lb]["cached_token_ratio"] for lb in labels], 0.4, label="cached (usage)")
    axes[3].bar(x + 0.2, [summaries[lb]["prefill_hit_ratio"] or 0.0 for lb in labels], 0.4, label="prefill hit")
    axes[3].set(xticks=x, xticklabels=labels, ylim=(0, 1), title="prefix cache")
    axes[3].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")
