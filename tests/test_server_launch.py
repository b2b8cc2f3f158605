"""``raydix launch`` in serve mode, as a user runs it: a subprocess that serves the
OpenAI API on the configured port, answers the openai client, and on SIGTERM stops
accepting, drains, frees its workers and exits 0."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.test_ray_job import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def test_serve_mode_answers_then_drains_on_sigterm(tmp_path):
    port = free_port()
    env = dict(os.environ, RAYDIX_HOME=str(tmp_path / "home"))
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "cluster.launch", "--config", "configs/local_cpu.yaml", "--port", str(port),
           "--num-cpus", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        out = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log[-3000:]
    assert "Application shutdown complete" in log, log[-3000:]
