"""The capture-stable step buffers: padded lanes, the device request state's padding row,
the pinned result ring, the batch buckets of the CUDA-graph runner."""

from __future__ import annotations

import pytest
import torch

from unimem.engine.cuda_graphs import default_buckets
from unimem.engine.step_io import DeviceRequestState, ResultRing, StepLanes, StepOutputs
from unimem.validate.protocol import ValidateConfig, validate

CPU = torch.device("cpu")


def test_lanes_are_padded_to_the_captured_width():
    lanes = StepLanes(8, CPU)
    lanes.buffer.fill_(99)
    lanes.stage([3, 5], [7, 9], [1, 2], width=4)
    assert lanes.rows(4).tolist() == [3, 5, 0, 0]
    assert lanes.vslots(4).tolist() == [7, 9, -1, -1]
    assert lanes.rids(4).tolist() == [1, 2, -1, -1]
    assert lanes.buffer[:, 4:].eq(99).all()  # lanes past the width are not touched
    with pytest.raises(ValueError, match="padded to"):
        lanes.stage([1, 2, 3], [1, 2, 3], [1, 2, 3], width=2)


def test_padding_row_of_the_device_state_never_changes():
    state = DeviceRequestState(5, CPU)
    rows = torch.tensor([2, 0, 4, 0], dtype=torch.int32)
    state.write(rows, torch.tensor([10, 77, 30, 88]), torch.tensor([5, 6, 7, 8]))
    assert state.seq_lens.tolist() == [0, 0, 10, 0, 30]
    assert state.next_tokens.tolist() == [0, 0, 5, 0, 7]
    lens, toks = state.read(torch.tensor([4, 0, 2], dtype=torch.int32))
    assert lens.tolist() == [30, 0, 10] and toks.tolist() == [7, 0, 5]


def test_result_ring_alternates_host_buffers():
    ring = ResultRing(4, 3, CPU)
    out = StepOutputs.allocate(4, 3, CPU)
    out.tokens[:2] = torch.tensor([[1, 2, 3], [4, 5, 6]])
    out.counts[:2] = torch.tensor([3, 1], dtype=torch.int32)
    first = ring.stage(out, 2)
    out.tokens[:1] = 9
    out.counts[:1] = 2
    second = ring.stage(out, 1)
    assert first.read() == ([[1, 2, 3], [4, 5, 6]], [3, 1], None)  # not overwritten by step 2
    assert second.read() == ([[9, 9, 9]], [2], None)
    third = ring.stage(out, 1)  # reuses the first set, which has been read
    assert third.tokens.data_ptr() == first.tokens.data_ptr()


@pytest.mark.parametrize(
    "max_bs, want",
    [(1, (1,)), (3, (1, 2, 3)), (8, (1, 2, 4, 8)), (20, (1, 2, 4, 8, 16, 20)),
     (48, (1, 2, 4, 8, 16, 24, 32, 40, 48))],
)  # fmt: skip
def test_default_buckets(max_bs, want):
    assert default_buckets(max_bs) == want


def test_impossible_gpu_configurations_fail_before_any_work():
    with pytest.raises(ValueError, match="CUDA graphs need the fa4 backend"):
        ValidateConfig(device="cuda", backend="torch", cuda_graphs="on")
    with pytest.raises(ValueError, match="CUDA graphs need --device cuda"):
        ValidateConfig(device="cpu", backend="torch", cuda_graphs="on")
    with pytest.raises(ValueError, match="fa4 backend needs --device cuda"):
        ValidateConfig(device="cpu", backend="fa4")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="fa4 backend needs a bf16/fp16 model"):
            validate(ValidateConfig(device="cuda", preset="tiny", backend="fa4"))
