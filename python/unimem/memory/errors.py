"""The error unimem raises when one of its own invariants is broken.

:class:`InternalError` means a bug inside unimem (a plan that overlaps bands, host counts
that disagree with the device stacks, a cache whose gauges drift), never bad input: bad input
raises ``ValueError`` naming the argument. Library code checks its invariants with
:func:`require`, which raises in every mode (``python -O`` removes ``assert`` statements,
never these checks).

Callers that serve many requests catch it around one request's allocator call and fail only
that request (the engine does; see :mod:`unimem.engine.scheduler`).
"""

from __future__ import annotations


class InternalError(RuntimeError):
    """A broken internal invariant of unimem (a bug); the message names what broke."""


def require(ok: bool, message: str) -> None:
    """Raise :class:`InternalError` with ``message`` unless ``ok``."""
    if not ok:
        raise InternalError(message)
