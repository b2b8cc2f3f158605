"""The GPU session's benchmark scripts run on the CPU, in their smallest settings, as
``scripts/gpu_session.sh run`` calls them (a script, its own process): bench_decode.py's eager
decode of the tiny model, bench_wna16.py's packed layers, their tables and plots, and bench_moe.py's
packed experts (its kernels interpreted). The figures
are the GPU session's; here the scripts' paths and arithmetic must hold (a script that fails
there loses its figures until the next session)."""

import importlib.util
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run_script(name: str, *args: str) -> str:
    """``scripts/name args`` on the CPU (no CUDA visible, Triton's interpreter off): its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def table_rows(out: str):
    """The markdown table's rows (past its header and rule) as lists of cells."""
    lines = [line for line in out.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def check_plot(out: str, path: pathlib.Path) -> None:
    if HAS_MATPLOTLIB:
        assert path.stat().st_size > 0 and f"plot written to {path}" in out
    else:
        assert "no plot written" in out


def test_bench_decode_runs_eager_on_the_cpu(tmp_path):
    plot = tmp_path / "decode.png"
    out = run_script("bench_decode.py", "--batches", "1", "2", "--steps", "2", "--plot", str(plot))
    assert "graphs: not run (no CUDA" in out
    rows = table_rows(out)
    assert [row[0] for row in rows] == ["1", "2"]
    for _, ms, tokens_per_s in rows:  # eager alone: batch, ms a step, tokens/s
        assert float(ms) > 0 and float(tokens_per_s.replace(",", "")) > 0
    check_plot(out, plot)


def test_bench_wna16_runs_the_torch_path_on_the_cpu(tmp_path):
    plot = tmp_path / "wna16.png"
    out = run_script("bench_wna16.py", "--layers", "128x64", "--rows", "1", "2", "--iters", "1", "--plot", str(plot))
    rows = table_rows(out)
    assert [(row[1], row[2]) for row in rows] == [(m, fmt) for fmt in ("gptq", "awq", "compressed") for m in "12"]
    for layer, _, fmt, *times, _, err in rows:
        assert layer == "128x64"
        if fmt == "compressed":  # (its served path is the dequant one)
            assert times[0] == times[3] == err == "—"
        else:  # linear is the dequant path on the CPU: the same output
            assert float(err) == 0
        assert all(float(t) > 0 for t in times if t != "—")
    check_plot(out, plot)


def test_bench_moe_runs_packed_experts_interpreted():
    """GPTQ experts eager (each one's packed linear) and fused (the packed grouped GEMM, interpreted): the
    same output."""
    out = run_script("bench_moe.py", "--shapes", "tiny", "--tokens", "13", "--iters", "1", "--quant", "gptq")
    assert "gptq 4-bit, group 128" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("tiny")]
    assert [row[3] for row in rows] == ["13"]
    (_, _, _, _, eager, fused, _, error), = rows
    assert float(eager) > 0 and float(fused) > 0 and float(error) < 1e-5
