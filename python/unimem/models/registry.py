"""Which implementation serves which checkpoint: ``config.architectures[0]`` -> class.

Modules are imported on first use, so loading one architecture never imports the others.
"""

from __future__ import annotations

import importlib

from unimem.models.base import CausalLM

__all__ = ["model_class", "supported_architectures"]

_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "Qwen3NextForCausalLM": ("unimem.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("unimem.models.qwen3_5", "Qwen3_5ForCausalLM"),
    # multimodal checkpoint, text weights under model.language_model.* (vision is skipped)
    "Qwen3_5ForConditionalGeneration": ("unimem.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("unimem.models.qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    # multimodal checkpoint, text weights under model.language_model.* (vision is skipped)
    "Qwen3_5MoeForConditionalGeneration": ("unimem.models.qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    "GptOssForCausalLM": ("unimem.models.gpt_oss", "GptOssForCausalLM"),
    "Gemma3ForCausalLM": ("unimem.models.gemma3", "Gemma3ForCausalLM"),
    # multimodal checkpoint, text weights under language_model.* (the vision tower is skipped)
    "Gemma3ForConditionalGeneration": ("unimem.models.gemma3", "Gemma3ForCausalLM"),
}


def supported_architectures() -> tuple[str, ...]:
    """The HuggingFace architecture names unimem serves, sorted."""
    return tuple(sorted(_ARCHITECTURES))


def model_class(architecture: str) -> type[CausalLM]:
    """The class serving ``architecture``; ``ValueError`` listing the supported ones for any
    other name."""
    try:
        module, name = _ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())}"
        ) from None
    return getattr(importlib.import_module(module), name)
