"""unimem: one memory arena for hybrid LLM serving (FULL + SWA + recurrent state).

``unimem.Engine(model_path=..., ...)`` is the offline API (:mod:`unimem.engine.api`)."""

from __future__ import annotations

__all__ = ["Engine"]


def __getattr__(name: str):
    # Engine pulls in torch and the model stack: import it on first use only.
    if name == "Engine":
        from unimem.engine.api import Engine

        return Engine
    raise AttributeError(f"module 'unimem' has no attribute {name!r}")
