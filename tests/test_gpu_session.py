"""What ``scripts/gpu_session.sh run`` needs of the test suite, checked on the CPU.

The device image has a CUDA torch but no Ray, FastAPI or OpenAI client, and nothing can
be installed there beyond the carried wheels. The script runs the ``gpu`` tests of the
files that hold them, so each such file must import without those packages (a file that
fails to import there ends the GPU session's tests before one has run).
"""

import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOT_ON_THE_IMAGE = ("ray", "fastapi", "uvicorn", "starlette", "openai")


def gpu_test_files():
    """The files the script selects: ``grep -l "mark\\.gpu" tests/test_*.py``."""
    return sorted(p for p in (ROOT / "tests").glob("test_*.py") if re.search(r"mark\.gpu", p.read_text()))


def test_files_with_gpu_tests_import_without_the_server_stack():
    files = gpu_test_files()
    assert "test_pd_workers.py" in {p.name for p in files}
    modules = [f"tests.{p.stem}" for p in files]
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, sys
        blocked = {NOT_ON_THE_IMAGE!r}

        class NotOnTheImage(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in blocked:
                    raise ImportError(f"{{name}} is not on the device image")

        sys.meta_path.insert(0, NotOnTheImage())
        for module in {modules!r}:
            importlib.import_module(module)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
