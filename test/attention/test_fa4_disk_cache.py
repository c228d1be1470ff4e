"""FA4's persistent compile cache is on by default under unimem's cache directory, so a server
start reuses the kernel variants an earlier one compiled; a user's own FA4 setting wins, and
nothing changes once FA4 has been imported (it reads the variables then)."""

from __future__ import annotations

import os
import sys

import pytest

from unimem.attention.fa4_backend import FA4_CACHE_DIR, FA4_CACHE_SWITCH, enable_fa4_disk_cache


@pytest.fixture
def no_fa4(monkeypatch, tmp_path):
    monkeypatch.delenv(FA4_CACHE_SWITCH, raising=False)
    monkeypatch.delenv(FA4_CACHE_DIR, raising=False)
    monkeypatch.setenv("UNIMEM_CACHE_DIR", str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("flash_attn.cute")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


def test_on_by_default_under_the_unimem_cache(no_fa4, monkeypatch):
    assert enable_fa4_disk_cache()
    assert os.environ[FA4_CACHE_SWITCH] == "1"
    assert os.environ[FA4_CACHE_DIR] == str(no_fa4 / "fa4")


@pytest.mark.parametrize("name,value", [(FA4_CACHE_SWITCH, "0"), (FA4_CACHE_DIR, "/elsewhere")])
def test_a_users_own_setting_wins(no_fa4, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert not enable_fa4_disk_cache()
    assert os.environ[name] == value
    other = FA4_CACHE_DIR if name == FA4_CACHE_SWITCH else FA4_CACHE_SWITCH
    assert other not in os.environ


def test_too_late_once_fa4_is_imported(no_fa4, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", object())
    assert not enable_fa4_disk_cache()
    assert FA4_CACHE_SWITCH not in os.environ
