"""The default memory split on a CUDA device leaves the steps' vocabulary-sized buffers
room beside the KV pools (``Engine._gpu_tokens``, ``step_workspace_bytes``); a fraction the
user gives is kept. ``torch.cuda.mem_get_info`` is stood in for: no GPU needed."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from unimem.engine import api
from unimem.engine.pools import tokens_for_budget
from unimem.models.config import memory_spec
from unimem.models.presets import preset

GIB = 2**30


@pytest.fixture
def spec():
    return memory_spec(preset("tiny"), 16)


def gpu_tokens(monkeypatch, spec, free, fraction, workspace):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    fake = SimpleNamespace(args=SimpleNamespace(mem_fraction_static=fraction))
    return api.Engine._gpu_tokens(fake, spec, 8, 0, torch.device("cuda"), workspace)


def test_workspace_counts_every_logit_of_the_largest_step():
    one = api.step_workspace_bytes(1, 1000)
    assert api.step_workspace_bytes(2048, 262144) - one == (2048 * 262144 - 1000) * (
        api.STEP_BYTES_PER_LOGIT
    )
    # Gemma 3's vocabulary, 256 requests verifying 8 rows: more than 15 % of 80 GiB
    assert api.step_workspace_bytes(256 * 8, 262144) > 0.15 * 80 * GIB


def test_default_split_leaves_the_workspace(monkeypatch, spec, caplog):
    free = 80 * GIB
    small = gpu_tokens(monkeypatch, spec, free, None, 1 * GIB)  # 15 % already covers it
    assert small == tokens_for_budget(spec, int(free * api.DEFAULT_MEM_FRACTION_STATIC), 8)
    with caplog.at_level(logging.INFO, logger=api.__name__):
        big = gpu_tokens(monkeypatch, spec, free, None, 20 * GIB)
    assert big == tokens_for_budget(spec, free - 20 * GIB, 8) < small
    assert "stay for the steps' vocabulary-sized buffers" in caplog.text


def test_default_split_fails_at_start_when_the_workspace_does_not_fit(monkeypatch, spec):
    with pytest.raises(ValueError, match="vocabulary-sized buffers need about 90.0 GiB"):
        gpu_tokens(monkeypatch, spec, 80 * GIB, None, 90 * GIB)


def test_a_given_fraction_is_kept_with_a_warning(monkeypatch, spec, caplog):
    free = 80 * GIB
    with caplog.at_level(logging.WARNING, logger=api.__name__):
        got = gpu_tokens(monkeypatch, spec, free, 0.9, 20 * GIB)
    assert got == tokens_for_budget(spec, int(free * 0.9), 8)
    assert "mem_fraction_static 0.90 leaves 8.0 GiB" in caplog.text
