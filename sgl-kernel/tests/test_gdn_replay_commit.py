"""The GDN verify commit without per-position states (``gdn_forward(..., prep_scratch=)`` +
``gated_delta_rule_replay_commit``) against today's (``ssm_scratch`` + ``commit_states``):

- the verify outputs and conv scratch are bitwise equal, and the committed SSM state is
  the state scratch's entry ``accepted`` for every accepted count ``1 .. T``, per lane —
  bitwise for the torch references and the Triton kernels under the interpreter; on a GPU
  (the ``small`` sizes) to a few ulps, because the verify and the replay are compiled
  separately and the compiler may contract their multiply-adds differently; grouped key
  heads, a ragged lane (zero rows past its length, as the runner's packed layout leaves
  them) and arena slot views included;
- padded lanes (slot < 0) and lanes with ``accepted`` outside ``[0, T)`` touch nothing: their
  slots keep their bytes and the padded lanes' prepared-input rows are never written;
- the Triton prepared inputs and committed states match the references (to rounding);
- an engine with DSPARK speculation through the Triton kernels commits the same states,
  bitwise, with either commit.
"""

from __future__ import annotations

import os

import pytest
import torch

from unimem_kernel import gdn
from unimem_kernel import gdn_reference as gr
from unimem_kernel import state_commit as sc

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1")
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
KW = 4


class Layer:
    """One GDN layer's shapes, weights and slot states (arena-like strided slot views)."""

    def __init__(self, gen, h, hk, dk, dv, num_slots, dtype, sdt, device):
        self.h, self.hk, self.dk, self.dv = h, hk, dk, dv
        self.dtype, self.sdt, self.device = dtype, sdt, device
        self.conv_dim = gr.mixed_qkv_dim(h, dk, dv, hk)
        self.weight = (torch.randn(self.conv_dim, KW, generator=gen) * 0.5).to(device, dtype)
        self.conv = self._slots(gen, num_slots, (self.conv_dim, KW - 1), dtype)
        self.ssm = self._slots(gen, num_slots, (h, dk, dv), sdt)

    def _slots(self, gen, n, shape, dtype):
        """``[n, *shape]`` view whose slot stride leaves a gap (as the arena's envelopes)."""
        per = 1
        for d in shape:
            per *= d
        stride = per + 16
        buf = torch.randn(n * stride, generator=gen).to(self.device, dtype)
        strides = [stride]
        for i in range(len(shape)):
            s = 1
            for d in shape[i + 1 :]:
                s *= d
            strides.append(s)
        return buf.as_strided((n, *shape), strides)

    def inputs(self, gen, bs, t_len, lens=None):
        """Rows request-major; lane ``b``'s rows past ``lens[b]`` are zeros (a ragged lane in
        the runner's uniform layout)."""
        x = torch.randn(bs, t_len, self.conv_dim, generator=gen)
        g = -torch.rand(bs, t_len, self.h, generator=gen) * 2
        beta = torch.rand(bs, t_len, self.h, generator=gen)
        for b, n in enumerate(lens or []):
            for t in (x, g, beta):
                t[b, n:] = 0
        rows = bs * t_len
        to = self.device
        return (
            x.reshape(rows, -1).to(to, self.dtype),
            g.reshape(rows, -1).to(to, self.sdt),
            beta.reshape(rows, -1).to(to, self.sdt),
        )

    def prep_scratch(self, bs, t_len):
        dim = gr.prep_dim(self.h, self.dk, self.dv, self.hk)
        return torch.full((bs, t_len, dim), float("nan"), dtype=gr.prep_dtype(self.sdt),
                          device=self.device)  # fmt: skip

    def ssm_scratch(self, bs, t_len):
        return torch.full((bs, t_len, self.h, self.dk, self.dv), float("nan"), dtype=self.sdt,
                          device=self.device)  # fmt: skip

    def conv_scratch(self, bs, t_len):
        return torch.full((bs, t_len, self.conv_dim, KW - 1), float("nan"), dtype=self.dtype,
                          device=self.device)  # fmt: skip


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (NaNs compare equal, -0.0 != 0.0)."""
    return t.contiguous().view(torch.uint8)


def assert_rounding(a: torch.Tensor, b: torch.Tensor, what: str, ulps: int = 8) -> None:
    """``a`` equals ``b`` to ``ulps`` units in the last place of their dtype at ``b``'s
    largest magnitude (the GPU case of the replay commit: two separately compiled kernels
    running the same ``_delta_step`` may contract its multiply-adds differently; the H200
    measured at most 2 ulps)."""
    assert a.shape == b.shape and a.dtype == b.dtype, what
    bound = ulps * torch.finfo(b.dtype).eps * float(b.abs().max())
    diff = float((a.double() - b.double()).abs().max())
    assert diff <= bound, f"{what}: max diff {diff} > {bound}"


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(bits(a), bits(b)), f"{what}: max diff {(a - b).abs().nan_to_num().max()}"


def accepted_sets(bs, t_len, lens, device):
    """Accepted indices per lane covering every count ``1 .. T`` (``1 .. lens[b]``) on every
    lane, plus lanes skipped for ``accepted`` outside ``[0, T)``."""
    sets = []
    for shift in range(t_len):
        sets.append([(b + shift) % min(t_len, lens[b]) for b in range(bs)])
    sets.append([-1 if b % 2 else t_len for b in range(bs)])
    sets.append([t_len if b == 0 else min(t_len, lens[b]) - 1 for b in range(bs)])
    return [torch.tensor(s, dtype=torch.int32, device=device) for s in sets]


def run_both(layer, slots, x, g, beta, t_len, triton_path, batch_invariant=False):
    """Verify once with the state scratch and once with the prepared-input scratch (each from
    the same slot states, which verify leaves alone). Returns both outputs and scratches."""
    bs = slots.shape[0]
    conv = layer.conv_scratch
    old = {"conv_scratch": conv(bs, t_len), "ssm_scratch": layer.ssm_scratch(bs, t_len)}
    new = {"conv_scratch": conv(bs, t_len), "prep_scratch": layer.prep_scratch(bs, t_len)}
    fwd = gdn.gdn_forward_triton if triton_path else gr.gdn_forward
    extra = {"batch_invariant": batch_invariant} if triton_path else {}
    before = (layer.conv.clone(), layer.ssm.clone())
    outs = []
    for scratch in (old, new):
        outs.append(fwd("verify", x, layer.weight, g, beta, layer.conv, layer.ssm, slots,
                        num_k_heads=layer.hk, **scratch, **extra))  # fmt: skip
        assert_bitwise(layer.conv, before[0], "verify wrote a conv slot")
        assert_bitwise(layer.ssm, before[1], "verify wrote an SSM slot")
    return outs, old, new


def check_commits(layer, slots, old, new, accepted_list, triton_path, batch_invariant=False):
    """For every accepted set: today's commit and the replay commit, each into a copy of the
    slot states, give the same bytes in every slot (skipped and unused slots unchanged). The
    replay runs the verify's tiles (the batch-invariant ones after a batch-invariant verify)."""
    tiles = {}
    if batch_invariant:
        _, bv, nw = gdn._rule_config(layer.h, layer.dk, layer.dv, None, None, "batch_invariant")
        tiles = {"block_v": bv, "num_warps": nw}
    for accepted in accepted_list:
        want, got = layer.ssm.clone(), layer.ssm.clone()
        if triton_path:
            sc.commit_states_triton(old["ssm_scratch"], accepted, slots, None, want)
            gdn.gated_delta_rule_replay_commit_triton(
                new["prep_scratch"], accepted, got, slots, layer.hk, **tiles
            )
        else:
            sc.commit_states_reference(old["ssm_scratch"], accepted, slots, None, want)
            gr.gated_delta_rule_replay_commit(new["prep_scratch"], accepted, got, slots, layer.hk)
        what = f"committed state, accepted {accepted.tolist()}"
        if triton_path and got.is_cuda:
            assert_rounding(got, want, what)
        else:
            assert_bitwise(got, want, what)


HEADS = [(2, 2), (4, 2), (4, 1)]
SMALL = dict(dk=8, dv=16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", [(BF16, F32), (F64, F64)], ids=["bf16", "f64"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda hs: f"h{hs[0]}k{hs[1]}")
def test_replay_commit_equals_state_scratch_commit(device, dtypes, heads):
    h, hk = heads
    gen = torch.Generator().manual_seed(10 * h + hk + (dtypes[1] == F64))
    t_len, lens = 4, [4, 4, 2, 4]
    layer = Layer(gen, h, hk, **SMALL, num_slots=6, dtype=dtypes[0], sdt=dtypes[1],
                  device=device)  # fmt: skip
    slots = torch.tensor([4, -1, 1, 2], dtype=torch.int32, device=device)  # lane 1 padded
    x, g, beta = layer.inputs(gen, 4, t_len, lens)
    (o_old, o_new), old, new = run_both(layer, slots, x, g, beta, t_len, True)
    assert_bitwise(o_new, o_old, "verify output")
    assert_bitwise(new["conv_scratch"], old["conv_scratch"], "conv scratch")
    # the padded lane's rows are never written
    assert new["prep_scratch"][1].isnan().all()
    assert new["prep_scratch"][[0, 2, 3]].isfinite().all()
    check_commits(layer, slots, old, new, accepted_sets(4, t_len, lens, device), True)


@pytest.mark.parametrize("dtypes", [(F32, F32), (F64, F64)], ids=["f32", "f64"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda hs: f"h{hs[0]}k{hs[1]}")
def test_reference_replay_commit_equals_state_scratch_commit(dtypes, heads):
    gen = torch.Generator().manual_seed(3)
    h, hk = heads
    t_len, lens = 5, [5, 3, 5]
    layer = Layer(gen, h, hk, **SMALL, num_slots=5, dtype=dtypes[0], sdt=dtypes[1],
                  device="cpu")  # fmt: skip
    slots = torch.tensor([3, 0, 4], dtype=torch.int32)  # the reference has no padded lanes
    x, g, beta = layer.inputs(gen, 3, t_len, lens)
    (o_old, o_new), old, new = run_both(layer, slots, x, g, beta, t_len, False)
    assert_bitwise(o_new, o_old, "verify output")
    assert_bitwise(new["conv_scratch"], old["conv_scratch"], "conv scratch")
    accepted = accepted_sets(3, t_len, lens, "cpu")
    check_commits(layer, slots, old, new, accepted, False)
    # a padded lane in the commit alone is skipped
    padded = torch.tensor([3, -1, 4], dtype=torch.int32)
    want, got = layer.ssm.clone(), layer.ssm.clone()
    sc.commit_states_reference(old["ssm_scratch"], accepted[0], padded, None, want)
    gr.gated_delta_rule_replay_commit(new["prep_scratch"], accepted[0], got, padded, hk)
    assert_bitwise(got, want, "padded lane")


@pytest.mark.parametrize("device", DEVICES)
def test_triton_prep_and_replay_match_reference(device):
    gen = torch.Generator().manual_seed(11)
    layer = Layer(gen, 4, 2, **SMALL, num_slots=4, dtype=F32, sdt=F32, device=device)
    t_len = 3
    slots = torch.tensor([2, 0], dtype=torch.int32, device=device)
    x, g, beta = layer.inputs(gen, 2, t_len)
    preps, states = [], []
    for fwd, commit in (
        (gdn.gdn_forward_triton, gdn.gated_delta_rule_replay_commit_triton),
        (gr.gdn_forward, gr.gated_delta_rule_replay_commit),
    ):
        prep, ssm = layer.prep_scratch(2, t_len), layer.ssm.clone()
        fwd("verify", x, layer.weight, g, beta, layer.conv, ssm, slots, num_k_heads=2,
            conv_scratch=layer.conv_scratch(2, t_len), prep_scratch=prep)  # fmt: skip
        commit(prep, torch.tensor([2, 1], dtype=torch.int32, device=device), ssm, slots, 2)
        preps.append(prep)
        states.append(ssm)
    torch.testing.assert_close(preps[0], preps[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[0], states[1], rtol=1e-4, atol=1e-4)
    assert_bitwise(states[0][[1, 3]], layer.ssm[[1, 3]], "unused slots")


def test_public_entries_and_bad_inputs(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    layer = Layer(gen, 2, 2, **SMALL, num_slots=3, dtype=F64, sdt=F64, device="cpu")
    slots = torch.tensor([1], dtype=torch.int32)
    x, g, beta = layer.inputs(gen, 1, 2)
    prep = layer.prep_scratch(1, 2)
    args = ("verify", x, layer.weight, g, beta, layer.conv, layer.ssm, slots)
    for fwd in (gdn.gdn_forward_triton, gr.gdn_forward):
        with pytest.raises(ValueError, match="one of ssm_scratch, prep_scratch"):
            fwd(*args, conv_scratch=layer.conv_scratch(1, 2), prep_scratch=prep,
                ssm_scratch=layer.ssm_scratch(1, 2))  # fmt: skip
        with pytest.raises(ValueError, match="prep_scratch"):
            fwd(*args, conv_scratch=layer.conv_scratch(1, 2), prep_scratch=prep.float())
    acc = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="prep_scratch"):
        gdn.gated_delta_rule_replay_commit_triton(prep[..., :-1], acc, layer.ssm, slots)
    with pytest.raises(ValueError, match="accepted"):
        gdn.gated_delta_rule_replay_commit_triton(prep, acc[:0], layer.ssm, slots)
    # CPU tensors: the public entry runs the reference unless told otherwise
    called = []
    real = gr.gated_delta_rule_replay_commit
    monkeypatch.setattr(
        gr, "gated_delta_rule_replay_commit", lambda *a: called.append(a) or real(*a)
    )
    gdn.gdn_forward(*args, conv_scratch=layer.conv_scratch(1, 2), prep_scratch=prep)
    gdn.gated_delta_rule_replay_commit(prep, acc, layer.ssm, slots)
    assert len(called) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("hk", [16, 8])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_replay_commit_small_preset_bitwise(hk, batch_invariant):
    """The ``small`` preset's GDN layer (16 heads of 128 x 128), 48 lanes x 8 tokens with
    padded and ragged lanes: bitwise equal verify outputs, equal committed states for every
    accepted count. (In a one-warp ``BV = 32`` tile the two verify variants compiled to
    different multiply-add contractions on the H200 and their outputs differed by ulps: see
    ``gdn._rule_config``.)"""
    gen = torch.Generator().manual_seed(hk)
    bs, t_len = 48, 8
    layer = Layer(gen, 16, hk, 128, 128, num_slots=64, dtype=BF16, sdt=F32, device="cuda")
    slots_l = list(range(1, 64, 1))[:bs]
    slots_l[5] = slots_l[40] = -1
    slots = torch.tensor(slots_l, dtype=torch.int32, device="cuda")
    lens = [t_len - (b % 3) for b in range(bs)]
    x, g, beta = layer.inputs(gen, bs, t_len, lens)
    (o_old, o_new), old, new = run_both(layer, slots, x, g, beta, t_len, True, batch_invariant)
    assert_bitwise(o_new, o_old, "verify output")
    assert_bitwise(new["conv_scratch"], old["conv_scratch"], "conv scratch")
    assert new["prep_scratch"][[5, 40]].isnan().all()
    check_commits(
        layer, slots, old, new, accepted_sets(bs, t_len, lens, "cuda"), True, batch_invariant
    )


# ------------------------------------------------------------------ engine (DSPARK, Triton)


def _engine_states(monkeypatch, replay: bool):
    """A DSPARK engine run (``tiny`` preset, float64) through the Triton kernels: outputs and
    every GDN layer's SSM slot states after each verify commit."""
    from unimem.attention.torch_backend import TorchReferenceBackend
    from unimem.engine import runner as runner_mod
    from unimem.engine.core import EngineCore
    from unimem.engine.draft_runner import draft_config_for
    from unimem.memory.static import StaticMemory
    from unimem.models.config import memory_spec
    from unimem.models.presets import preset
    from unimem.models.synthetic import HybridModel
    from unimem.speculative.chain import DsparkChain
    from unimem.speculative.control import AcceptanceControl
    from unimem.speculative.drafter import DsparkDrafter

    cfg = preset("tiny")
    model = HybridModel(cfg, seed=5)
    drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=9)
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, cfg.vocab_size, (2, 12), generator=gen).tolist()
    # the non-speculative outputs (references), for an acceptance control accepting ~60%
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "reference")
    plain = StaticMemory(memory_spec(cfg, 16), 256, 256, 2, 2, cfg.max_context)
    eng = EngineCore(model, plain, TorchReferenceBackend(), 2, 64)
    reqs = [eng.submit(p, 10) for p in prompts]
    eng.run()
    refs = {r.rid: p + r.output for r, p in zip(reqs, prompts, strict=True)}
    control = AcceptanceControl(0.6, 0, refs)

    monkeypatch.setattr(runner_mod, "GDN_REPLAY_COMMIT", replay)
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    spec = memory_spec(cfg, 16, draft_lanes=drafter.config.lanes())
    pool = StaticMemory(spec, 256, 256, 2, 2, cfg.max_context)
    eng = EngineCore(model, pool, TorchReferenceBackend(), 2, 64,
                     chain=DsparkChain(drafter, 3, control))  # fmt: skip
    assert eng.runner.gdn_replay_commit is replay
    snaps, counts = [], []
    commit = eng.runner._commit_gdn

    def recording(accepted, vslots, slots):
        commit(accepted, vslots, slots)
        counts.extend(accepted.tolist())
        for i in eng.runner.verify_scratch:
            snaps.append(pool.state_cache(pool.spec.lane_of_layer(i))[1].clone())

    eng.runner._commit_gdn = recording
    reqs = [eng.submit(p, 8) for p in prompts]
    eng.run()
    assert len(set(counts)) > 1, counts  # several accepted counts were committed
    return [r.output for r in reqs], snaps, eng.runner


def test_engine_dspark_replay_commit_bitwise(monkeypatch):
    out_new, snaps_new, runner = _engine_states(monkeypatch, True)
    out_old, snaps_old, runner_old = _engine_states(monkeypatch, False)
    sizes, sizes_old = (
        {i: p.numel() * p.element_size() for i, (_, p) in r.verify_scratch.items()}
        for r in (runner, runner_old)
    )
    assert out_new == out_old
    assert len(snaps_new) == len(snaps_old) > 0
    for a, b in zip(snaps_new, snaps_old, strict=True):
        assert_bitwise(a, b, "engine SSM states after a commit")
    assert sizes.keys() == sizes_old.keys() and all(sizes[i] < sizes_old[i] for i in sizes)
