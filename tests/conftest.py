"""Test-suite wiring shared by every test module.

* Without CUDA, Triton kernels run under the interpreter: ``TRITON_INTERPRET``
  must be set before any module defining a ``@triton.jit`` kernel is imported.
* Tests marked ``gpu`` are skipped cleanly when CUDA is absent.
"""

import os

import pytest
import torch

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
