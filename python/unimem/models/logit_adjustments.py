"""Per-lane logit adjustments of a step: additive biases on some tokens, and stop tokens
suppressed (``-inf``) in the rows that produce a token before a given index — the device side
of requests' ``logit_bias`` and ``min_tokens`` (:mod:`unimem.engine.logit_bias` plans them).
Pure tensor work: the steps call :func:`apply` on the logits rows they pick from, before the
pick."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LaneAdjustments", "apply"]


@dataclass(frozen=True)
class LaneAdjustments:
    """One step's adjustments, lane by lane (``W`` lanes; padding lanes adjust nothing):
    ``bias_ids / bias_values [W, M]`` (int64 / float32; padding entries bias token 0 by 0),
    ``stop_ids / stop_values [W, S]`` (the stop tokens and ``-inf``; padding 0 and 0) and
    ``stop_until [W]`` int64 (a row producing token index ``i`` suppresses its lane's stops
    while ``i < stop_until``; 0: never). Host tensors from
    :func:`unimem.engine.logit_bias.plan`, device ones from :meth:`upload`."""

    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    stop_ids: torch.Tensor
    stop_values: torch.Tensor
    stop_until: torch.Tensor

    def upload(self, device: torch.device) -> LaneAdjustments:
        """Device copies in two non-blocking copies (from pinned memory on CUDA)."""
        ints = torch.cat([self.bias_ids, self.stop_ids, self.stop_until[:, None]], dim=1)
        floats = torch.cat([self.bias_values, self.stop_values], dim=1)
        if device.type == "cuda":
            ints = ints.pin_memory().to(device, non_blocking=True)
            floats = floats.pin_memory().to(device, non_blocking=True)
        else:
            ints, floats = ints.to(device), floats.to(device)
        m = self.bias_ids.shape[1]
        bias, stops = (ints[:, :m], floats[:, :m]), (ints[:, m:-1], floats[:, m:])
        return LaneAdjustments(*bias, *stops, ints[:, -1])


def apply(
    logits: torch.Tensor, lanes: torch.Tensor, produced: torch.Tensor, adj: LaneAdjustments
) -> None:
    """Adjust ``logits [R, V]`` in place: row ``r`` belongs to lane ``lanes[r]`` and produces
    the token at index ``produced[r]`` of its request's prompt + output (both ``[R]`` int64
    device tensors); ``adj`` on the same device. Device work only."""
    lanes = lanes.long()
    logits.scatter_add_(1, adj.bias_ids[lanes], adj.bias_values[lanes].to(logits.dtype))
    suppress = produced.long() < adj.stop_until[lanes]
    values = torch.where(suppress[:, None], adj.stop_values[lanes], 0.0)
    logits.scatter_add_(1, adj.stop_ids[lanes], values.to(logits.dtype))
