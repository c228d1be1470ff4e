"""The GDN mixer with ``batch_invariant=True``: a request's outputs and states are bitwise the
same whichever step kind computes its tokens (extend of the whole sequence, one decode step per
token, verify blocks committed by their scratch states) and whatever other requests share the
launch. CPU through the Triton interpreter at tiny sizes; on CUDA at the ``small`` preset's
head sizes (marked gpu)."""

from __future__ import annotations

import os

import pytest
import torch

from unimem_kernel import gdn
from unimem_kernel import gdn_reference as gr

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# (device, H, Hk, Dk, Dv): tiny on the interpreter; the small preset's GDN heads on a GPU
CASES = [
    pytest.param(
        ("cpu", 2, 1, 8, 16),
        marks=pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1"),
        id="cpu",
    ),
    pytest.param(("cuda", 16, 16, 128, 128), marks=pytest.mark.gpu, id="cuda-small"),
    pytest.param(("cuda", 32, 16, 128, 128), marks=pytest.mark.gpu, id="cuda-qwen3next"),
]
KW = 4
SEQ = 6
N_SLOTS = 6


class Layer:
    """One GDN layer's weights and a state arena of ``N_SLOTS`` slots."""

    def __init__(self, device: str, h: int, hk: int, dk: int, dv: int, dtype, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.h, self.hk, self.dk, self.dv = h, hk, dk, dv
        self.conv_dim = gr.mixed_qkv_dim(h, dk, dv, hk)
        self.dtype, self.device = dtype, device
        self.w = (torch.randn(self.conv_dim, KW, generator=g) * 0.5).to(device, dtype)
        self.conv = (torch.randn(N_SLOTS, self.conv_dim, KW - 1, generator=g)).to(device, dtype)
        self.ssm = (torch.randn(N_SLOTS, h, dk, dv, generator=g) * 0.1).to(device, torch.float32)

    def tokens(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, self.conv_dim, generator=g).to(self.device, self.dtype)
        gate = (-torch.rand(n, self.h, generator=g) * 0.5).to(self.device, torch.float32)
        beta = torch.rand(n, self.h, generator=g).to(self.device, torch.float32)
        return x, gate, beta

    def run(self, mode, x, gate, beta, slots, cu=None, t_len=None):
        kw = {}
        if mode == "verify":
            bs = len(slots)
            kw["conv_scratch"] = torch.full(
                (bs, t_len, self.conv_dim, KW - 1), float("nan"), device=self.device,
                dtype=self.dtype,
            )  # fmt: skip
            kw["ssm_scratch"] = torch.full(
                (bs, t_len, self.h, self.dk, self.dv), float("nan"), device=self.device
            )
        s = torch.tensor(slots, dtype=torch.int64, device=self.device)
        if cu is not None:
            cu = torch.tensor(cu, dtype=torch.int32, device=self.device)
        o = gdn.gdn_forward_triton(
            mode, x, self.w, gate, beta, self.conv, self.ssm, s, cu,
            num_k_heads=self.hk, batch_invariant=True, **kw,
        )  # fmt: skip
        return o, kw


@pytest.mark.parametrize("case", CASES)
def test_extend_decode_and_verify_agree_bitwise(case):
    """Slot 0 starts from the same state three times: the whole sequence as one extend, one
    decode step per token, and verify blocks of 3 whose last scratch entry is committed."""
    device, h, hk, dk, dv = case
    layer = Layer(device, h, hk, dk, dv, torch.bfloat16, seed=1)
    x, gate, beta = layer.tokens(SEQ, seed=2)
    conv0, ssm0 = layer.conv[0].clone(), layer.ssm[0].clone()

    def reset():
        layer.conv[0], layer.ssm[0] = conv0, ssm0

    o_ext, _ = layer.run("extend", x, gate, beta, [0], cu=[0, SEQ])
    state_ext = layer.ssm[0].clone()
    reset()
    o_dec = torch.cat([layer.run("decode", x[t : t + 1], gate[t : t + 1],
                                 beta[t : t + 1], [0])[0] for t in range(SEQ)])  # fmt: skip
    state_dec = layer.ssm[0].clone()
    reset()
    outs = []
    for start in range(0, SEQ, 3):
        sl = slice(start, start + 3)
        o, kw = layer.run("verify", x[sl], gate[sl], beta[sl], [0], t_len=3)
        outs.append(o)
        layer.conv[0] = kw["conv_scratch"][0, -1]
        layer.ssm[0] = kw["ssm_scratch"][0, -1]
    o_ver = torch.cat(outs)
    assert torch.equal(o_ext, o_dec) and torch.equal(o_ext, o_ver)
    assert torch.equal(state_ext, state_dec) and torch.equal(state_ext, layer.ssm[0])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["decode", "verify", "extend"])
def test_a_request_alone_equals_it_among_others(case, mode):
    """Request in slot 2 alone, then at lane 0 and lane 2 of batches of 3 and 5 (the other
    lanes random, one padded): its outputs are bitwise equal."""
    device, h, hk, dk, dv = case
    width = {"decode": 1, "verify": 4, "extend": 5}[mode]
    results = []
    for bs, lane in ((1, 0), (3, 0), (3, 2), (5, 2)):
        layer = Layer(device, h, hk, dk, dv, torch.bfloat16, seed=3)
        x, gate, beta = layer.tokens(bs * width, seed=4 + bs + lane)
        mine_x, mine_g, mine_b = layer.tokens(width, seed=99)
        rows = slice(lane * width, (lane + 1) * width)
        x[rows], gate[rows], beta[rows] = mine_x, mine_g, mine_b
        others = [s for s in (0, 1, 3, 4, 5)]
        slots = [others[i] if i != lane else 2 for i in range(bs)]
        if bs == 5:
            slots[4] = -1  # a padded lane
        cu = [i * width for i in range(bs + 1)] if mode == "extend" else None
        o, kw = layer.run(mode, x, gate, beta, slots, cu=cu, t_len=width)
        state = kw["ssm_scratch"][lane] if mode == "verify" else layer.ssm[2]
        results.append((o[rows].clone(), state.clone()))
    for o, state in results[1:]:
        assert torch.equal(o, results[0][0]) and torch.equal(state, results[0][1])
