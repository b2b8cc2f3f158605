"""The documented deployment path: a Ray head with its dashboard (the job server),
then ``ray job submit --working-dir . -- python -m cluster.launch --config ...``.
Cluster and client share one ``RAY_AUTH_MODE`` (token: the client reads the
head's token file)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ.get('PATH', '')}", RAY_AUTH_MODE="token",
               RAYDIX_HOME=str(tmp_path_factory.mktemp("raydix-home")))
    env.pop("RAY_ADDRESS", None)
    gcs, dashboard = free_port(), free_port()
    start = [str(bin_dir / "ray"), "start", "--head", f"--port={gcs}", "--num-cpus=4",
             "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
             "--disable-usage-stats"]
    subprocess.run(start, env=env, check=True, capture_output=True, timeout=120)
    try:
        yield env, f"http://127.0.0.1:{dashboard}"
    finally:
        subprocess.run([str(bin_dir / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_ray_job_submit_runs_the_pd_cluster(ray_head):
    env, address = ray_head
    submit = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", address,
              "--working-dir", ".", "--", "python", "-m", "cluster.launch", "--config", "configs/local_cpu.yaml",
              "--prompt", "What is a radix tree?", "--max-new-tokens", "8"]
    out = subprocess.run(submit, env=env, cwd=REPO, capture_output=True, text=True, timeout=400)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "workers idle, integrity checks passed" in log, log[-3000:]
    assert "succeeded" in log.lower(), log[-3000:]
