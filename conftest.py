"""Repository-wide pytest setup.

Without CUDA, Triton kernels run through the interpreter: ``TRITON_INTERPRET`` must be set
before ``triton`` is imported, so it is set here, at the root, before any test module loads.
Tests marked ``gpu`` are skipped cleanly when no CUDA device is present. Without CUDA, torch
runs single-threaded (see below).
"""

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The tests' tensors are tiny: on a 2-core machine torch's intra-op threads cost far more
    # than they save (scattered index writes run ~100x slower with 2 threads than with 1).
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
