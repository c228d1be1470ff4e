"""Greedy acceptance of a drafted chain.

A verify step feeds the target ``[anchor, d_1 .. d_gamma]``; row ``j`` of its logits predicts
the token after row ``j``, so ``target_argmax[:, j]`` is the target's greedy choice for the
position of ``d_{j+1}`` (and ``target_argmax[:, gamma]`` the one after ``d_gamma``). The
longest prefix of drafts equal to the target's choices is accepted, and the target's choice
right after it is the *bonus* token: the step commits ``accepted + 1`` tokens,
``target_argmax[b, :accepted[b] + 1]`` — exactly what greedy non-speculative decoding would
have produced.

Pure torch on device tensors: no host read, no data-dependent shape, fixed-size outputs, so it
can be recorded in a CUDA graph with the verify step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["AcceptResult", "greedy_accept"]


class AcceptResult(NamedTuple):
    """``accepted [bs]`` int32 in ``0..gamma``: drafts accepted (the kept verify row is
    ``accepted``; ``accepted + 1`` tokens are committed); ``bonus [bs]`` int64: the target's
    token after the accepted drafts (``target_argmax[b, accepted[b]]``)."""

    accepted: torch.Tensor
    bonus: torch.Tensor


def greedy_accept(
    draft: torch.Tensor, target_argmax: torch.Tensor, limit: torch.Tensor | None = None
) -> AcceptResult:
    """Longest matching prefix of ``draft [bs, gamma]`` against ``target_argmax [bs, gamma+1]``
    plus the bonus token. Any integer dtypes; ``gamma >= 0``.

    ``limit [bs]`` (optional, a ragged verify of ``limit + 1`` rows per request): at most
    ``limit[b]`` drafts are accepted — drafts past it were not verified, and the bonus is then
    ``target_argmax[b, limit[b]]``; columns of ``target_argmax`` past ``limit`` are never
    read into the result."""
    if draft.dim() != 2 or target_argmax.dim() != 2:
        raise ValueError(
            f"need draft [bs, gamma] and target_argmax [bs, gamma + 1], got "
            f"{tuple(draft.shape)} and {tuple(target_argmax.shape)}"
        )
    bs, gamma = draft.shape
    if target_argmax.shape != (bs, gamma + 1):
        raise ValueError(
            f"target_argmax must be [{bs}, {gamma + 1}] for draft [{bs}, {gamma}], got "
            f"{tuple(target_argmax.shape)}"
        )
    match = draft.long() == target_argmax[:, :gamma].long()
    if limit is not None:
        cols = torch.arange(gamma, device=draft.device)
        match = match & (cols[None, :] < limit.long()[:, None])
    # cumprod keeps 1 while every earlier draft matched: its sum is the prefix length.
    accepted = match.to(torch.int32).cumprod(dim=1).sum(dim=1, dtype=torch.int32)
    bonus = target_argmax.long().gather(1, accepted.long()[:, None])[:, 0]
    return AcceptResult(accepted, bonus)
