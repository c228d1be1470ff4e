"""Convert a GGUF checkpoint to a HuggingFace-format directory, cached per file content.

:func:`converted_checkpoint` returns a directory the ordinary loader
(:mod:`unimem.models.loader`) and transformers both read: ``config.json`` (the architecture's
config from the GGUF metadata), ``generation_config.json`` (bos/eos/pad ids: a GGUF carries no
sampling defaults), ``model.safetensors`` (every tensor dequantised to float32, which is exact
for every supported type, in HF names and conventions), ``tokenizer.json`` and
``tokenizer_config.json`` (:mod:`unimem.models.gguf.tokenizer`; ``chat_template`` when the file
has one), and ``unimem_gguf.json`` (the source file, its sha256, the converter version).

The cache lives under ``$UNIMEM_CACHE_DIR`` (default ``$XDG_CACHE_HOME/unimem``, else
``~/.cache/unimem``) in ``gguf/<file stem>-<key>``, where the key hashes the file's sha256 and
:data:`CONVERTER_VERSION`: a changed file (or converter) gets a new directory. A directory is
written under a temporary name and renamed into place, so concurrent loaders never see half a
conversion; the first to finish wins.

Supported architectures: ``gemma3`` (:mod:`unimem.models.gguf.gemma3`); any other is refused by
name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from unimem.models.gguf import gemma3
from unimem.models.gguf.dequant import dequantize
from unimem.models.gguf.reader import GGUFError, GGUFFile, read_gguf
from unimem.models.gguf.tokenizer import build_tokenizer
from unimem_kernel import envs

__all__ = ["CONVERTER_VERSION", "convert_gguf", "converted_checkpoint", "file_key"]

CONVERTER_VERSION = 2
SUPPORTED_ARCHITECTURES = (gemma3.ARCHITECTURE,)
PROVENANCE_FILE = "unimem_gguf.json"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def file_key(sha256: str) -> str:
    """The cache key of a file of content hash ``sha256`` under this converter version."""
    return hashlib.sha256(f"{sha256}:v{CONVERTER_VERSION}".encode()).hexdigest()[:16]


def _check_architecture(f: GGUFFile) -> str:
    arch = f.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{f.path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the HF-format directory of GGUF ``path`` to ``out_dir`` (created; module
    docstring) and return it. :class:`GGUFError` for an unsupported architecture, tensor
    type, tokenizer or tensor name."""
    from safetensors.torch import save_file

    f = read_gguf(path)
    _check_architecture(f)
    config = gemma3.hf_config_dict(f)
    tok = build_tokenizer(f)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in f.tensors.items():
        state[gemma3.hf_tensor_name(name)] = gemma3.hf_tensor(name, dequantize(tensor))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tok.tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok.config, indent=2))
    return out


def converted_checkpoint(
    path: str | os.PathLike,
    root: str | os.PathLike | None = None,
    expected_sha256: str | None = None,
) -> Path:
    """The cached HF-format directory of GGUF ``path``, converting it on first use (module
    docstring); with ``expected_sha256``, :class:`GGUFError` if the file's content differs."""
    src = Path(path).resolve()
    if not src.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    digest = file_sha256(src)
    if expected_sha256 is not None and digest != expected_sha256:
        raise GGUFError(
            f"{src}: sha256 {digest[:12]}… differs from the expected {expected_sha256[:12]}… "
            "(a damaged file: delete it and load again to reassemble it)"
        )
    base = Path(root) if root is not None else envs.cache_root()
    target = base / "gguf" / f"{src.stem}-{file_key(digest)}"
    if (target / PROVENANCE_FILE).is_file():
        return target
    base.joinpath("gguf").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{src.stem}-", dir=base / "gguf"))
    try:
        convert_gguf(src, tmp)
        provenance = {"source": str(src), "sha256": digest, "converter_version": CONVERTER_VERSION}
        # written last: its presence marks a complete directory
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / PROVENANCE_FILE).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
