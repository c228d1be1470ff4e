"""Where the kernel tests run, shared by the test modules (pytest puts this folder on
``sys.path``; they import it by name): ``DEVICES`` parametrises a test over the CPU — the
Triton interpreter, only with ``TRITON_INTERPRET=1`` (the root conftest sets it) — and a CUDA
device (``gpu``-marked, skipped without one)."""

from __future__ import annotations

import os

import pytest

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether the Triton kernels run in the interpreter here."""

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
