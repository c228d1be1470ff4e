"""The ``UNIMEM_*`` switches have one registry (``unimem_kernel.envs``): every read in
``python/unimem`` goes through it, and ``python -m unimem envs`` lists them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from unimem.__main__ import main
from unimem_kernel import envs

ROOT = Path(__file__).resolve().parents[1]


def _environment_reads(tree: ast.AST):
    """``(line, name)`` of every ``os.environ.get(KEY)``, ``os.environ[KEY]`` and
    ``os.getenv(KEY)`` in ``tree`` whose ``KEY`` is a ``"UNIMEM_..."`` literal or a module
    constant holding one."""
    constants = {
        t.id: node.value.value
        for node in getattr(tree, "body", [])
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            env_get = (
                isinstance(f, ast.Attribute)
                and f.attr == "get"
                and isinstance(f.value, ast.Attribute)
                and f.value.attr == "environ"
            )
            if env_get or (isinstance(f, ast.Attribute) and f.attr == "getenv"):
                key = node.args[0]
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "environ"
        ):
            key = node.slice
        if isinstance(key, ast.Name):
            key = ast.Constant(constants.get(key.id))
        if isinstance(key, ast.Constant) and str(key.value).startswith("UNIMEM_"):
            yield node.lineno, key.value


def test_no_module_reads_a_switch_from_the_environment_directly():
    reads = []
    for path in sorted((ROOT / "python" / "unimem").rglob("*.py")):
        for line, name in _environment_reads(ast.parse(path.read_text())):
            reads.append(f"{path.relative_to(ROOT)}:{line} {name}")
    assert not reads, "read these through unimem_kernel.envs.get:\n" + "\n".join(reads)


def test_the_scan_finds_a_direct_read():
    source = (
        'import os\nNAME = "UNIMEM_Y"\nx = os.environ.get("UNIMEM_FUSED_OPS")\n'
        'y = os.getenv("UNIMEM_X")\nz = os.environ[NAME]\n'
    )
    reads = [name for _, name in _environment_reads(ast.parse(source))]
    assert reads == ["UNIMEM_FUSED_OPS", "UNIMEM_X", "UNIMEM_Y"]


def test_envs_command_lists_every_switch(capsys):
    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    for name in envs.SWITCHES:
        assert name in out


def test_a_bad_switch_value_names_the_switch(monkeypatch):
    monkeypatch.setenv("UNIMEM_TP_CHECK_STATE", "maybe")
    with pytest.raises(ValueError, match="UNIMEM_TP_CHECK_STATE"):
        envs.get("UNIMEM_TP_CHECK_STATE")
