"""A generation request as the engine tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from unimem.memory.pool import RequestMemory


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One request: ``prompt`` token ids, up to ``max_new_tokens`` greedy output tokens.

    ``kv_len`` counts the leading tokens of ``tokens`` whose K/V and recurrent state are in
    memory. The next forward of the request consumes ``tokens[kv_len:]``; when that reaches
    the end, its last logits give the next output token. A retracted request keeps its output
    and recomputes from ``kv_len = 0`` when readmitted.

    With chain speculative decoding, ``verify_steps`` counts its verify steps and
    ``verified_tokens`` the tokens they committed (``accepted + 1`` each, counted before
    truncation at ``max_new_tokens``): their ratio is the request's accept length.

    ``cached_tokens``: tokens admissions skipped on prefix-cache hits (summed over
    readmissions after retraction).
    """

    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    mem: RequestMemory | None = None
    kv_len: int = 0
    retractions: int = 0
    forward_steps: int = 0
    verify_steps: int = 0
    verified_tokens: int = 0
    cached_tokens: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def pending(self) -> int:
        """Tokens not yet in memory (1 for a request in decode)."""
        return self.num_tokens - self.kv_len

    @property
    def max_total_tokens(self) -> int:
        """Tokens whose K/V the request holds at most (the last output is never fed)."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens
