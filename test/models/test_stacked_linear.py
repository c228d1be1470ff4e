"""``StackedRows``: several projections of one input as one GEMM over row ranges of one
tensor. The products equal the parts' own ``F.linear`` (float64, exact arithmetic per row);
parameter names, shapes and ``load_state_dict`` are unchanged and keep the stack; a moved or
re-pointed part is noticed and the parts then run one GEMM each, still correct; the real
models' stacks survive loading a checkpoint (so the one-GEMM path is the one that runs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from unimem.models.stacked_linear import StackedRows, stacks_of


class _Part(nn.Module):
    def __init__(self, n: int, k: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(n, k, generator=g, dtype=torch.float64),
                                   requires_grad=False)  # fmt: skip


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router, self.gate, self.up = _Part(3, 8, 1), _Part(5, 8, 2), _Part(5, 8, 3)
        self.stack = StackedRows(self.router, self.gate, self.up)


def _x() -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def test_one_gemm_equals_the_parts_and_names_stay():
    block = _Block()
    assert [n for n, _ in block.named_parameters()] == ["router.weight", "gate.weight",
                                                         "up.weight"]  # fmt: skip
    assert block.stack.stacked()
    outs = block.stack.linear(_x())
    for out, part in zip(outs, (block.router, block.gate, block.up), strict=True):
        torch.testing.assert_close(out, _x() @ part.weight.T, rtol=0, atol=1e-12)


def test_loading_writes_into_the_stack():
    block = _Block()
    new = {
        k: torch.full_like(v, float(i + 1)) for i, (k, v) in enumerate(block.state_dict().items())
    }
    block.load_state_dict(new)
    assert block.stack.stacked()
    with torch.no_grad():
        block.gate.weight.copy_(torch.zeros(5, 8, dtype=torch.float64))  # a loader's copy_
    router, gate, up = block.stack.linear(_x())
    assert block.stack.stacked() and torch.equal(gate, torch.zeros(6, 5, dtype=torch.float64))
    torch.testing.assert_close(up, _x().sum(-1, keepdim=True).expand(6, 5) * 3)


def test_a_moved_part_falls_back_to_one_gemm_each():
    block = _Block().to(torch.float32)
    assert not block.stack.stacked()
    x = _x().float()
    for out, part in zip(block.stack.linear(x), (block.router, block.gate, block.up),
                         strict=True):  # fmt: skip
        torch.testing.assert_close(out, x @ part.weight.T)
    block = _Block()
    block.up.weight.data = torch.ones(5, 8, dtype=torch.float64)  # re-pointed, not copied
    assert not block.stack.stacked()
    torch.testing.assert_close(block.stack.linear(_x())[2], _x().sum(-1, keepdim=True).expand(6, 5))


def test_mismatched_parts_are_named():
    with pytest.raises(ValueError, match=r"stacked weights must be \[N, 8\]"):
        StackedRows(_Part(3, 8, 1), _Part(2, 4, 2))
    with pytest.raises(ValueError, match="at least one module"):
        StackedRows()


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_loaded_models_keep_their_stacks(tmp_path, arch):
    import importlib

    from unimem.models.loader import load_model

    importlib.import_module(f"tiny_{arch}").build(tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    stacks = list(stacks_of(model))
    assert stacks and all(s.stacked() for s in stacks)
    # the gated attention's q (with its gate), k and v: one GEMM
    from unimem.models.qwen_common import GatedAttention

    attn = [m for m in model.modules() if isinstance(m, GatedAttention)]
    assert attn and all(m.qkv.stacked() for m in attn)


class _BiasedPart(_Part):
    def __init__(self, n: int, k: int, seed: int) -> None:
        super().__init__(n, k, seed)
        g = torch.Generator().manual_seed(seed + 100)
        self.bias = nn.Parameter(torch.randn(n, generator=g, dtype=torch.float64),
                                 requires_grad=False)  # fmt: skip


def test_biases_stack_with_their_weights():
    """gpt-oss's q/k/v: one GEMM adds the stacked biases; loading in place keeps the stack;
    a re-pointed bias is noticed (one GEMM and one add per part, still right); a stack with
    biases is no single weight for norm_linear; biases all or none."""
    parts = [_BiasedPart(n, 8, seed) for n, seed in ((4, 1), (2, 2), (2, 3))]
    stack = StackedRows(*parts)
    assert stack.stacked() and stack.single_weight() is None
    want = [_x() @ p.weight.T + p.bias for p in parts]
    for out, ref in zip(stack.linear(_x()), want, strict=True):
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    with torch.no_grad():
        parts[1].bias.copy_(torch.arange(2, dtype=torch.float64))  # a loader's in-place copy
    assert stack.stacked()
    want_1 = _x() @ parts[1].weight.T + torch.arange(2, dtype=torch.float64)
    torch.testing.assert_close(stack.linear(_x())[1], want_1, rtol=0, atol=1e-12)
    parts[2].bias = nn.Parameter(torch.zeros(2, dtype=torch.float64), requires_grad=False)
    outs = stack.linear(_x())
    assert not stack.stacked()
    torch.testing.assert_close(outs[2], _x() @ parts[2].weight.T, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="all have a bias or none"):
        StackedRows(_BiasedPart(2, 8, 4), _Part(2, 8, 5))
