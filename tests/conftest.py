"""Test-suite wiring shared by every test module.

* Without CUDA, Triton kernels run under the interpreter: ``TRITON_INTERPRET``
  must be set before any module defining a ``@triton.jit`` kernel is imported.
* Tests marked ``gpu`` are skipped cleanly when CUDA is absent.
* One intra-op thread per process (unless set): the suite runs engines, TP ranks and
  Ray actors side by side on a couple of cores, where each process's own thread pool
  only oversubscribes them (the tiny models gain nothing from it). Set before torch
  is imported, so the processes spawned from here inherit it.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(params=["torch", "triton"])
def alloc_backend(request):
    """Both implementations of the paged allocator's batched layout."""
    return request.param
