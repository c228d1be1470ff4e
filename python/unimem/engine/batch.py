"""One step's data: which requests a forward runs and how many tokens each consumes.

The scheduler plans a :class:`Batch`, the runner launches it, and the engine accounts its
results against it one step later (the host reads each step's results one step late).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from unimem.engine.prompt_logprobs import StagedPromptLogprobs
from unimem.engine.request import Request
from unimem.engine.step_io import StagedTopLogprobs
from unimem.models.forward_context import ForwardMode

__all__ = ["Batch"]


@dataclass
class Batch:
    """One forward of ``mode``: request ``reqs[i]`` consumes ``lens[i]`` tokens (verify: its
    write window of ``gamma + 1`` tokens, of which the step commits ``accepted + 1``).

    ``starts[i]``: where an extend chunk starts (the request's ``kv_len`` once its in-flight
    step is done; exact for extends). Decode and verify steps read the request's length and
    next token from the device. ``samples[i]``: whether the step produces an output token for
    request ``i`` (extend: the chunk reaches the end of the known tokens; decode and verify:
    always). ``epochs``: the requests' epochs when the batch was launched.
    ``prompt_logprobs``: an extend's prompt log-probabilities on their way to the host (set
    by the runner at launch, :mod:`unimem.engine.prompt_logprobs`), else None;
    ``top_logprobs``: the step's output rows' top log-probabilities, where a request asked
    for them (set by the runner at launch), else None."""

    mode: ForwardMode
    reqs: list[Request]
    lens: list[int]
    starts: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    prompt_logprobs: StagedPromptLogprobs | None = None
    top_logprobs: StagedTopLogprobs | None = None

    def __post_init__(self) -> None:
        self.mode = ForwardMode(self.mode)

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)
