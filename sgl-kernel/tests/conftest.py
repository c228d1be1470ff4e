"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def triton_backend(monkeypatch):
    """The public entry points run their Triton kernels, on CPU too (the interpreter)."""
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
