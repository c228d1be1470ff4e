"""No module imports a package above it (docs/structures.md): walk every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# lowest first; a module may import its own layer and those before it
LAYERS = [
    "unimem_kernel",
    "unimem.data",
    "unimem.memory",
    "unimem.attention",
    "unimem.cache",
    "unimem.models",
    "unimem.speculative",
    "unimem.engine",
    "unimem.training",
    "unimem.validate",
    "unimem.serve",
    "unimem.bench",
    "unimem.__main__",
]


def _layer(module: str) -> int | None:
    for i, name in enumerate(LAYERS):
        if module == name or module.startswith(name + "."):
            return i
    return None


def _modules():
    for base in (ROOT / "python", ROOT / "sgl-kernel" / "python"):
        for path in base.rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_every_import_goes_down():
    upward = []
    checked = 0
    for module, path in _modules():
        own = _layer(module)
        if own is None:
            continue  # the package roots (unimem/__init__.py exposes the API lazily)
        for imported in _imports(path):
            layer = _layer(imported)
            checked += 1
            if layer is not None and layer > own:
                upward.append(f"{module} imports {imported}")
    assert checked > 100
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_layer_table_finds_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from unimem.engine.core import EngineCore\n")
    assert _layer("unimem.memory.pool") < _layer(next(_imports(bad)))
