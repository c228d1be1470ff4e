"""The GDN verify commit without per-position states (``gdn_forward(..., record=)`` +
``gdn_replay_commit``) against the per-position one (``conv_scratch`` + ``ssm_scratch`` +
``commit_states``):

- the verify outputs are bitwise equal, and the committed conv windows and SSM states are
  the per-position scratches' entries ``accepted`` for every accepted count ``1 .. T``, per
  lane — bitwise for the torch references and the Triton kernels under the interpreter; on a
  GPU the per-position verify is a separately compiled kernel, so its states agree to a few
  ulps; grouped key heads, a ragged lane (zero rows past its length, as the runner's packed
  layout leaves them) and arena slot views included;
- on a GPU, at the ``small`` sizes: decode, verify and the replay commit are one compiled
  kernel, so a verify's outputs equal a token-by-token decode's bitwise and every committed
  state equals the decode's state after that token bitwise (outputs do not depend on the
  accept pattern; the acceptance control needs that);
- padded lanes (slot < 0) and lanes with ``accepted`` outside ``[0, T)`` touch nothing: their
  slots keep their bytes and the padded lanes' record rows are never written;
- the Triton record and committed states match the references (to rounding); bad records
  and arguments are refused with errors naming them;
- an engine with DSPARK speculation through the Triton kernels commits the same states,
  bitwise, with either commit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel import gdn
from unimem_kernel import gdn_reference as gr
from unimem_kernel import state_commit as sc

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
KW = 4
NAN = float("nan")


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

    def record(self, bs, t_len):
        return gr.VerifyRecord.empty(bs, t_len, self.conv_dim, self.h, self.dtype, self.sdt,
                                     self.device, fill=NAN)  # fmt: skip

    def ssm_scratch(self, bs, t_len):
        return torch.full((bs, t_len, self.h, self.dk, self.dv), NAN, dtype=self.sdt,
                          device=self.device)  # fmt: skip

    def conv_scratch(self, bs, t_len):
        return torch.full((bs, t_len, self.conv_dim, KW - 1), NAN, dtype=self.dtype,
                          device=self.device)  # fmt: skip


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (NaNs compare equal, -0.0 != 0.0)."""
    return t.contiguous().view(torch.uint8)


def assert_rounding(a: torch.Tensor, b: torch.Tensor, what: str, ulps: int = 8) -> None:
    """``a`` equals ``b`` to ``ulps`` units in the last place of their dtype at ``b``'s
    largest magnitude (the GPU case of per-position verify against replay: two separately
    compiled kernels may contract their multiply-adds differently)."""
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
    """Verify once with the per-position scratches and once with a record (each from the
    same slot states, which verify leaves alone). Returns both outputs, the scratches and
    the record."""
    bs = slots.shape[0]
    old = {"conv_scratch": layer.conv_scratch(bs, t_len),
           "ssm_scratch": layer.ssm_scratch(bs, t_len)}  # fmt: skip
    record = layer.record(bs, t_len)
    fwd = gdn.gdn_forward_triton if triton_path else gr.gdn_forward
    extra = {"batch_invariant": batch_invariant} if triton_path else {}
    before = (layer.conv.clone(), layer.ssm.clone())
    outs = []
    for scratch in (old, {"record": record}):
        outs.append(fwd("verify", x, layer.weight, g, beta, layer.conv, layer.ssm, slots,
                        num_k_heads=layer.hk, **scratch, **extra))  # fmt: skip
        assert_bitwise(layer.conv, before[0], "verify wrote a conv slot")
        assert_bitwise(layer.ssm, before[1], "verify wrote an SSM slot")
    return outs, old, record


def check_commits(layer, slots, old, record, accepted_list, triton_path, batch_invariant=False):
    """For every accepted set: the per-position commit and the replay commit, each into a
    copy of the slot states, give the same bytes in every slot (skipped and unused slots
    unchanged). The replay runs the verify's tiles (the batch-invariant ones after a
    batch-invariant verify)."""
    for accepted in accepted_list:
        want = (layer.conv.clone(), layer.ssm.clone())
        got = (layer.conv.clone(), layer.ssm.clone())
        commit = sc.commit_states_triton if triton_path else sc.commit_states_reference
        for scratch, dest in zip((old["conv_scratch"], old["ssm_scratch"]), want, strict=True):
            commit(scratch, accepted, slots, None, dest)
        if triton_path:
            tiles = {}
            if batch_invariant:
                _, bv, nw = gdn._rule_config(layer.h, layer.dk, layer.dv, None, None,
                                             "batch_invariant")  # fmt: skip
                tiles = {"block_v": bv, "num_warps": nw}
            gdn.gdn_replay_commit_triton(record, accepted, *got, slots, layer.hk, **tiles)
        else:
            gr.gdn_replay_commit(record, accepted, *got, slots, layer.hk)
        what = f"accepted {accepted.tolist()}"
        assert_bitwise(got[0], want[0], f"committed conv window, {what}")
        if triton_path and got[1].is_cuda:
            assert_rounding(got[1], want[1], f"committed state, {what}")
        else:
            assert_bitwise(got[1], want[1], f"committed state, {what}")


HEADS = [(2, 2), (4, 2), (4, 1)]
SMALL = dict(dk=8, dv=16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtypes",
    [
        pytest.param((BF16, F32), id="bf16"),
        pytest.param((F64, F64), id="f64", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize(
    "heads",
    [
        pytest.param((2, 2), id="h2k2", marks=pytest.mark.slow),
        pytest.param((4, 2), id="h4k2"),
        pytest.param((4, 1), id="h4k1", marks=pytest.mark.slow),
    ],
)
def test_replay_commit_equals_state_scratch_commit(device, dtypes, heads):
    h, hk = heads
    gen = torch.Generator().manual_seed(10 * h + hk + (dtypes[1] == F64))
    t_len, lens = 4, [4, 4, 2, 4]
    layer = Layer(gen, h, hk, **SMALL, num_slots=6, dtype=dtypes[0], sdt=dtypes[1],
                  device=device)  # fmt: skip
    slots = torch.tensor([4, -1, 1, 2], dtype=torch.int32, device=device)  # lane 1 padded
    x, g, beta = layer.inputs(gen, 4, t_len, lens)
    (o_old, o_new), old, record = run_both(layer, slots, x, g, beta, t_len, True)
    if device == "cuda":
        assert_rounding(o_new, o_old, "verify output")
    else:
        assert_bitwise(o_new, o_old, "verify output")
    # the record holds the step's inputs; the padded lane's rows are never written (its
    # conv output rows, record.y, are zeros as every padded lane's output)
    live = [0, 2, 3]
    x3 = x.reshape(4, t_len, -1)
    assert_bitwise(record.x[live], x3[live], "record.x")
    assert_bitwise(record.g[live], g.reshape(4, t_len, -1)[live].to(record.g.dtype), "record.g")
    for t in (record.x, record.g, record.beta):
        assert t[1].isnan().all()
    assert (record.y[1] == 0).all()
    for t in (record.x, record.y, record.g, record.beta):
        assert t[live].isfinite().all()
    check_commits(layer, slots, old, record, accepted_sets(4, t_len, lens, device), True)


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
    (o_old, o_new), old, record = run_both(layer, slots, x, g, beta, t_len, False)
    assert_bitwise(o_new, o_old, "verify output")
    accepted = accepted_sets(3, t_len, lens, "cpu")
    check_commits(layer, slots, old, record, accepted, False)
    # a padded lane in the commit alone is skipped
    padded = torch.tensor([3, -1, 4], dtype=torch.int32)
    want = (layer.conv.clone(), layer.ssm.clone())
    got = (layer.conv.clone(), layer.ssm.clone())
    for scratch, dest in zip((old["conv_scratch"], old["ssm_scratch"]), want, strict=True):
        sc.commit_states_reference(scratch, accepted[0], padded, None, dest)
    gr.gdn_replay_commit(record, accepted[0], *got, padded, hk)
    assert_bitwise(got[0], want[0], "padded lane (conv)")
    assert_bitwise(got[1], want[1], "padded lane (SSM)")


@pytest.mark.parametrize("device", DEVICES)
def test_triton_record_and_replay_match_reference(device):
    gen = torch.Generator().manual_seed(11)
    layer = Layer(gen, 4, 2, **SMALL, num_slots=4, dtype=F32, sdt=F32, device=device)
    t_len = 3
    slots = torch.tensor([2, 0], dtype=torch.int32, device=device)
    x, g, beta = layer.inputs(gen, 2, t_len)
    records, states = [], []
    for fwd, commit in (
        (gdn.gdn_forward_triton, gdn.gdn_replay_commit_triton),
        (gr.gdn_forward, gr.gdn_replay_commit),
    ):
        record, conv, ssm = layer.record(2, t_len), layer.conv.clone(), layer.ssm.clone()
        fwd("verify", x, layer.weight, g, beta, conv, ssm, slots, num_k_heads=2,
            record=record)  # fmt: skip
        commit(record, torch.tensor([2, 1], dtype=torch.int32, device=device), conv, ssm,
               slots, 2)  # fmt: skip
        records.append(record)
        states.append((conv, ssm))
    for name in ("x", "y", "g", "beta"):
        a, b = getattr(records[0], name), getattr(records[1], name)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"record.{name}")
    assert_bitwise(states[0][0], states[1][0], "conv windows")
    torch.testing.assert_close(states[0][1], states[1][1], rtol=1e-4, atol=1e-4)
    assert_bitwise(states[0][1][[1, 3]], layer.ssm[[1, 3]], "unused slots")


def test_public_entries_and_bad_inputs(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    layer = Layer(gen, 2, 2, **SMALL, num_slots=3, dtype=F64, sdt=F64, device="cpu")
    slots = torch.tensor([1], dtype=torch.int32)
    x, g, beta = layer.inputs(gen, 1, 2)
    record = layer.record(1, 2)
    args = ("verify", x, layer.weight, g, beta, layer.conv, layer.ssm, slots)
    for fwd in (gdn.gdn_forward_triton, gr.gdn_forward):
        with pytest.raises(ValueError, match="a record or the scratches, not both"):
            fwd(*args, conv_scratch=layer.conv_scratch(1, 2), record=record,
                ssm_scratch=layer.ssm_scratch(1, 2))  # fmt: skip
        with pytest.raises(ValueError, match="needs a record, or conv_scratch and ssm_scratch"):
            fwd(*args, conv_scratch=layer.conv_scratch(1, 2))
        bad = gr.VerifyRecord(record.x, record.y, record.g.float(), record.beta)
        with pytest.raises(ValueError, match=r"VerifyRecord\.g must be"):
            fwd(*args, record=bad)
        with pytest.raises(ValueError, match="T == bs \\* Tv"):
            fwd(*args, record=layer.record(1, 3))
    with pytest.raises(ValueError, match="a record is for verify"):
        gdn.gdn_forward_triton("decode", x[:1], layer.weight, g[:1], beta[:1], *args[5:],
                               record=record)  # fmt: skip
    with pytest.raises(ValueError, match="conv output is record.y"):
        gdn.gdn_forward_triton(*args, record=record, conv_out=torch.empty_like(x))
    acc = torch.zeros(1, dtype=torch.int32)
    state = (layer.conv, layer.ssm)
    with pytest.raises(ValueError, match="accepted"):
        gdn.gdn_replay_commit_triton(record, acc[:0], *state, slots)
    with pytest.raises(ValueError, match=r"VerifyRecord\.x must be"):
        gdn.gdn_replay_commit_triton(layer.record(2, 2), acc, *state, slots)
    # CPU tensors: the public entry runs the reference unless told otherwise
    called = []
    real = gr.gdn_replay_commit
    monkeypatch.setattr(gr, "gdn_replay_commit", lambda *a: called.append(a) or real(*a))
    gdn.gdn_forward(*args, record=record)
    gdn.gdn_replay_commit(record, acc, *state, slots)
    assert len(called) == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "batch_invariant, n_layers",
    [
        pytest.param(False, 2, id="step"),
        pytest.param(False, 3, id="step-3_layers", marks=pytest.mark.slow),
        pytest.param(True, 3, id="batch_invariant", marks=pytest.mark.slow),
    ],
)
def test_replay_commit_of_all_layers_in_one_launch(device, batch_invariant, n_layers):
    """A ReplayCommitPlan commits every layer's first ``bs`` lanes in one launch per kernel,
    bitwise what one replay commit per layer gives (padded and skipped lanes untouched);
    a layer whose tensors do not line up with layer 0's makes the plan commit layer by
    layer, with the same result. (The fast tier: two layers; the slow tier: three.)"""
    gen = torch.Generator().manual_seed(31)
    h, hk, t_len, max_bs = 4, 2, 4, 5
    layers = [Layer(gen, h, hk, **SMALL, num_slots=7, dtype=BF16, sdt=F32, device=device)
              for _ in range(n_layers)]  # fmt: skip
    records = [ly.record(max_bs, t_len) for ly in layers]
    slots = torch.tensor([4, -1, 1, 6], dtype=torch.int32, device=device)  # lane 1 padded
    bs = slots.shape[0]  # a batch narrower than the records (a CUDA-graph bucket)
    for ly, rec in zip(layers, records, strict=True):
        x, g, beta = ly.inputs(gen, bs, t_len)
        gdn.gdn_forward_triton("verify", x, ly.weight, g, beta, ly.conv, ly.ssm, slots,
                               num_k_heads=hk, record=rec.lanes(bs),
                               batch_invariant=batch_invariant)  # fmt: skip
    plan = gdn.ReplayCommitPlan(records, [ly.conv for ly in layers], [ly.ssm for ly in layers])
    assert plan.stacked and plan.n_layers == n_layers
    before = [(ly.conv.clone(), ly.ssm.clone()) for ly in layers]
    tiles = {}
    if batch_invariant:
        _, bv, nw = gdn._rule_config(h, SMALL["dk"], SMALL["dv"], None, None, "batch_invariant")
        tiles = {"block_v": bv, "num_warps": nw}
    for accepted in ([3, 0, 1, 2], [0, 2, -1, 4]):  # lane 2 / lane 3 of the second skipped
        acc = torch.tensor(accepted, dtype=torch.int32, device=device)
        want = []
        for rec, (conv, ssm) in zip(records, before, strict=True):
            c, s_ = conv.clone(), ssm.clone()
            gdn.gdn_replay_commit_triton(rec.lanes(bs), acc, c, s_, slots, hk, **tiles)
            want.append((c, s_))
        for ly, (conv, ssm) in zip(layers, before, strict=True):
            ly.conv.copy_(conv)
            ly.ssm.copy_(ssm)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("UNIMEM_KERNEL_BACKEND", "triton")
            gdn.gdn_replay_commit_layers(plan, acc, slots, hk, batch_invariant=batch_invariant)
        for i, (ly, (c, s_)) in enumerate(zip(layers, want, strict=True)):
            assert_bitwise(ly.conv, c, f"layer {i} conv windows, accepted {accepted}")
            assert_bitwise(ly.ssm, s_, f"layer {i} SSM states, accepted {accepted}")
        for i, (ly, (conv, ssm)) in enumerate(zip(layers, before, strict=True)):
            for slot in (0, 2, 3, 5):  # no live lane's slot: untouched
                assert_bitwise(ly.ssm[slot], ssm[slot], f"layer {i} slot {slot}")
                assert_bitwise(ly.conv[slot], conv[slot], f"layer {i} slot {slot}")
            ly.conv.copy_(conv)
            ly.ssm.copy_(ssm)

    # a layer with other strides: the plan falls back to one commit per layer
    odd = Layer(gen, h, hk, **SMALL, num_slots=9, dtype=BF16, sdt=F32, device=device)
    odd_ssm = odd.ssm[:7]  # same shape, its own slot stride (a gap of 16)
    odd_ssm = odd_ssm.as_strided(odd_ssm.shape, (odd_ssm.stride(0) + 4, *odd_ssm.stride()[1:]))
    odd_ssm.copy_(layers[-1].ssm)  # the last layer's SSM states, in a view of its own
    mixed = gdn.ReplayCommitPlan(records, [ly.conv for ly in layers],
                                 [*(ly.ssm for ly in layers[:-1]), odd_ssm])  # fmt: skip
    assert not mixed.stacked
    acc = torch.tensor([3, 0, 1, 2], dtype=torch.int32, device=device)
    start = odd_ssm.clone()
    # the direct commit on the odd view itself (its strides are part of the compiled kernel)
    gdn.gdn_replay_commit_triton(records[-1].lanes(bs), acc, layers[-1].conv.clone(), odd_ssm,
                                 slots, hk, **tiles)  # fmt: skip
    want = odd_ssm.clone()
    odd_ssm.copy_(start)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UNIMEM_KERNEL_BACKEND", "triton")
        gdn.gdn_replay_commit_layers(mixed, acc, slots, hk, batch_invariant=batch_invariant)
    assert_bitwise(odd_ssm, want, "the odd layer's SSM states")


def test_replay_commit_plan_refuses_mismatched_lists():
    gen = torch.Generator().manual_seed(3)
    ly = Layer(gen, 2, 2, **SMALL, num_slots=3, dtype=F64, sdt=F64, device="cpu")
    with pytest.raises(ValueError, match="one record, conv state and SSM state per layer"):
        gdn.ReplayCommitPlan([ly.record(2, 3)], [ly.conv], [])
    with pytest.raises(ValueError, match="one record"):
        gdn.ReplayCommitPlan([], [], [])


@pytest.mark.gpu
@pytest.mark.parametrize("hk", [16, 8])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_small_preset_one_kernel_for_decode_verify_replay(hk, batch_invariant):
    """The ``small`` preset's GDN layer (16 heads of 128 x 128), 48 lanes x 8 tokens with
    padded and ragged lanes. Decode, verify and the replay commit run one compiled
    ``_rule_kernel``, so: the verify's outputs equal a token-by-token decode's bitwise, and
    the replay's committed states (every accepted count) equal the decode's states after
    that token bitwise; against the per-position verify (another compiled kernel) the
    states agree to a few ulps and the conv windows bitwise."""
    gen = torch.Generator().manual_seed(hk)
    bs, t_len = 48, 8
    layer = Layer(gen, 16, hk, 128, 128, num_slots=64, dtype=BF16, sdt=F32, device="cuda")
    slots_l = list(range(1, 64, 1))[:bs]
    slots_l[5] = slots_l[40] = -1
    slots = torch.tensor(slots_l, dtype=torch.int32, device="cuda")
    lens = [t_len - (b % 3) for b in range(bs)]
    x, g, beta = layer.inputs(gen, bs, t_len, lens)
    (o_old, o_new), old, record = run_both(layer, slots, x, g, beta, t_len, True, batch_invariant)
    assert_rounding(o_new, o_old, "verify output")
    check_commits(
        layer, slots, old, record, accepted_sets(bs, t_len, lens, "cuda"), True, batch_invariant
    )
    # decode token by token from copies of the slots
    conv, ssm = layer.conv.clone(), layer.ssm.clone()
    x3, g3, b3 = (t.reshape(bs, t_len, -1) for t in (x, g, beta))
    o3 = o_new.reshape(bs, t_len, *o_new.shape[1:])
    live = [b for b in range(bs) if slots_l[b] >= 0]
    after = []
    for t in range(t_len):
        o_t = gdn.gdn_forward_triton(
            "decode", x3[:, t].contiguous(), layer.weight, g3[:, t].contiguous(),
            b3[:, t].contiguous(), conv, ssm, slots, num_k_heads=hk,
            batch_invariant=batch_invariant,
        )  # fmt: skip
        assert_bitwise(o_t[live], o3[live, t], f"decode output, token {t}")
        after.append(ssm.clone())
    for accepted in accepted_sets(bs, t_len, lens, "cuda")[:t_len]:
        got = (layer.conv.clone(), layer.ssm.clone())
        tiles = {}
        if batch_invariant:
            _, bv, nw = gdn._rule_config(16, 128, 128, None, None, "batch_invariant")
            tiles = {"block_v": bv, "num_warps": nw}
        gdn.gdn_replay_commit_triton(record, accepted, *got, slots, hk, **tiles)
        for b in live:
            a = int(accepted[b])
            assert_bitwise(got[1][slots_l[b]], after[a][slots_l[b]], f"lane {b} accepted {a}")


# ------------------------------------------------------------------ engine (DSPARK, Triton)


def _engine_states(monkeypatch, replay: bool):
    """A DSPARK engine run (``tiny`` preset, float64) through the Triton kernels: outputs and
    every GDN layer's SSM slot states after each verify commit."""
    from unimem.attention.torch_backend import TorchReferenceBackend
    from unimem.engine.core import EngineCore
    from unimem.memory.static import StaticMemory
    from unimem.models.config import memory_spec
    from unimem.models.presets import preset
    from unimem.models.synthetic import HybridModel
    from unimem.speculative import verify_step as verify_mod
    from unimem.speculative.chain import DsparkChain
    from unimem.speculative.control import AcceptanceControl
    from unimem.speculative.drafter import DsparkDrafter, draft_config_for

    # the ``tiny`` preset's layer kinds at interpreter-friendly widths
    cfg = dataclasses.replace(preset("tiny"), d_model=32, ffn_dim=64, vocab_size=64,
                              head_dim_k=16, head_dim_v=8, gdn_heads=2, gdn_head_dim_k=8,
                              gdn_head_dim_v=16)  # fmt: skip
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

    monkeypatch.setattr(verify_mod, "GDN_REPLAY_COMMIT", replay)
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    spec = memory_spec(cfg, 16, draft_lanes=drafter.config.lanes())
    pool = StaticMemory(spec, 256, 256, 2, 2, cfg.max_context)
    eng = EngineCore(model, pool, TorchReferenceBackend(), 2, 64,
                     chain=DsparkChain(drafter, 3, control))  # fmt: skip
    verifier = eng.runner.verifier
    assert verifier.gdn_replay_commit is replay
    snaps, counts = [], []
    commit = verifier.commit_gdn

    def recording(accepted, vslots, slots):
        commit(accepted, vslots, slots)
        counts.extend(accepted.tolist())
        for i in sorted({*verifier.scratch, *verifier.records}):
            snaps.append(pool.state_cache(pool.spec.lane_of_layer(i))[1].clone())

    verifier.commit_gdn = recording
    reqs = [eng.submit(p, 8) for p in prompts]
    eng.run()
    assert len(set(counts)) > 1, counts  # several accepted counts were committed
    return [r.output for r in reqs], snaps, verifier


@pytest.mark.slow  # the fast tier: the two commits per layer above, and the engine's (references)
def test_engine_dspark_replay_commit_bitwise(monkeypatch):
    out_new, snaps_new, verifier = _engine_states(monkeypatch, True)
    out_old, snaps_old, verifier_old = _engine_states(monkeypatch, False)
    sizes = {i: rec.nbytes for i, rec in verifier.records.items()}
    sizes_old = {
        i: sum(t.numel() * t.element_size() for t in pair)
        for i, pair in verifier_old.scratch.items()
    }
    assert not verifier.scratch and not verifier_old.records
    assert out_new == out_old
    assert len(snaps_new) == len(snaps_old) > 0
    for a, b in zip(snaps_new, snaps_old, strict=True):
        assert_bitwise(a, b, "engine SSM states after a commit")
    assert sizes.keys() == sizes_old.keys() and all(sizes[i] < sizes_old[i] for i in sizes)
