"""The protocol's model and requests: the seeded preset or a checkpoint (with ``tp``, this
rank's shard), and its prompts — random token ids from the seed, or the lines of a
``--prompts`` file encoded by the checkpoint's tokenizer.
"""

from __future__ import annotations

import os

import torch

from unimem.engine.distributed import TPGroups
from unimem.models import fp8_convert
from unimem.models.base import CausalLM
from unimem.models.loader import load_checkpoint
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.models.tensor_parallel import SINGLE
from unimem.validate.config import PACKAGE_PROMPTS, ValidateConfig


def make_prompts(cfg: ValidateConfig, vocab_size: int) -> list[list[int]]:
    """Fixed synthetic prompts: ``requests`` x ``input_len`` token ids drawn from the seed; the
    first ``shared_prefix_len`` of them are the same in every prompt."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    ids = torch.randint(0, vocab_size, (cfg.requests, cfg.input_len), generator=g)
    if cfg.shared_prefix_len:
        g = torch.Generator().manual_seed(cfg.seed + 2)
        ids[:, : cfg.shared_prefix_len] = torch.randint(
            0, vocab_size, (cfg.shared_prefix_len,), generator=g
        )
    return ids.tolist()


def read_prompts_file(path: str) -> list[str]:
    """The prompts of ``--prompts``: :data:`~unimem.validate.config.PACKAGE_PROMPTS` (and no
    file of that name) names the package's short real prompts; a ``.json`` file holds a list
    of strings (prompts may span lines); any other file holds one prompt per non-empty
    line."""
    if path == PACKAGE_PROMPTS and not os.path.exists(path):
        from unimem.data.prompts import short_prompts

        return short_prompts()
    if path.endswith(".json"):
        import json

        with open(path) as f:
            prompts = json.load(f)
        if not (isinstance(prompts, list) and all(isinstance(p, str) and p for p in prompts)):
            raise ValueError(f"--prompts {path}: expected a JSON list of non-empty strings")
        return prompts
    with open(path) as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def build_model_and_prompts(
    cfg: ValidateConfig, device: torch.device, tp: TPGroups | None = None
) -> tuple[CausalLM, list[list[int]]]:
    """The model (the seeded preset, or the checkpoint of ``model_path``; with ``tp``, this
    rank's shard) and the prompts: ``--prompts`` lines encoded by the checkpoint's
    tokenizer, else random token ids from the seed (below the tokenizer's size when there is
    one)."""
    shard = tp.tensor_parallel() if tp is not None else SINGLE
    if cfg.model_path is None:
        model_cfg = preset(cfg.preset)
        model = HybridModel(model_cfg, seed=cfg.seed, device=device, tp=shard)
        if cfg.quantization == "fp8":
            fp8_convert.quantize_model_online(model)
        return model, make_prompts(cfg, model_cfg.vocab_size)
    ckpt = load_checkpoint(
        cfg.checkpoint_dir, dtype=cfg.dtype, device=device, tp=shard, quantization=cfg.quantization
    )
    model = ckpt.model
    vocab = model.config.vocab_size
    if ckpt.tokenizer is not None:
        vocab = min(vocab, len(ckpt.tokenizer))
    if cfg.prompts_file is None:
        return model, make_prompts(cfg, vocab)
    if ckpt.tokenizer is None:
        raise ValueError(f"--prompts: the checkpoint {cfg.model_path} has no tokenizer")
    lines = read_prompts_file(cfg.prompts_file)
    if len(lines) < cfg.requests:
        raise ValueError(f"--prompts has {len(lines)} prompts, --requests asks for {cfg.requests}")
    return model, [ckpt.tokenizer.encode(t) for t in lines[: cfg.requests]]
