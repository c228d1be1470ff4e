"""The GDN prefill kernel choice (``unimem.models.gdn_prefill``) and fla's chunked extend on
arena slots.

CPU: which kernel ``prefill_kernel`` picks for each ``UNIMEM_GDN_CHUNKED_PREFILL`` mode, chunk
length, device and batch-invariant flag. GPU (``gpu`` marker; skipped without fla-core): the fla
extend equals the recurrent Triton extend to bf16 rounding on strided slot views (a ragged batch
with and without prior state, the ``small`` preset's heads and Qwen3-Next's grouped heads; conv
windows bitwise, SSM states to ~1e-2), and an engine whose prefills take fla gives identical
tokens over static and unified memory.
"""

from __future__ import annotations

import pytest
import torch

from unimem.models import gdn_prefill
from unimem.models.gdn_prefill import (
    FLA_FIXED_US,
    PREFILL_ENV,
    recurrent_extend_us,
)

CUDA = torch.device("cuda")
CPU = torch.device("cpu")
HEADS, DV = 16, 128  # the small preset's GDN value heads


def prefill_kernel(max_seqlen, device, batch_invariant, requests=1, value_heads=HEADS, dv=DV):
    return gdn_prefill.prefill_kernel(
        max_seqlen, device, batch_invariant, requests=requests, value_heads=value_heads,
        head_v_dim=dv,
    )  # fmt: skip


def shortest_fla_chunk(requests: int, value_heads: int = HEADS, dv: int = DV) -> int:
    """The fewest longest-chunk tokens for which ``auto`` takes fla."""
    return next(
        n
        for n in range(1, 1 << 20)
        if recurrent_extend_us(n, requests, value_heads, dv) >= FLA_FIXED_US
    )


@pytest.fixture
def with_fla(monkeypatch):
    """fla "importable" (a stand-in: the choice never calls it)."""
    monkeypatch.setattr(gdn_prefill, "fla_chunk_rule", lambda: lambda *a, **k: None)


@pytest.fixture
def fla_calls(monkeypatch):
    """Token counts of every ``gdn_extend_fla`` call (the runner's and the warm-up's)."""
    calls = []
    real = gdn_prefill.gdn_extend_fla

    def counting(*a, **k):
        calls.append(a[0].shape[0])
        return real(*a, **k)

    monkeypatch.setattr(gdn_prefill, "gdn_extend_fla", counting)
    return calls


@pytest.fixture
def without_fla(monkeypatch):
    monkeypatch.setattr(gdn_prefill, "fla_chunk_rule", lambda: None)


def test_default_is_auto(with_fla, monkeypatch):
    """fla for long chunks on a GPU, the recurrent kernel for short ones, on a CPU and in
    batch-invariant mode."""
    monkeypatch.delenv(PREFILL_ENV, raising=False)
    assert gdn_prefill.prefill_mode(CUDA) == "auto"
    assert prefill_kernel(32768, CUDA, False) == "fla"
    assert prefill_kernel(1024, CUDA, False) == "recurrent"
    assert prefill_kernel(32768, CPU, False) == "recurrent"
    assert prefill_kernel(32768, CUDA, True) == "recurrent"


def test_auto_matches_the_engine_measurements(with_fla, monkeypatch):
    """The H200 measurements behind the estimate (``bench_prefill.py``, small preset, two
    runs): one prompt of 1 024-2 048 tokens and 4 x 1 024-1 536 ran faster recurrent; 4 x 3 072,
    4 x 4 096 and 16 prompts of 1 024-2 048 (8 x 1 024 and 4 x 2 048 a step) faster through
    fla, one prompt of 4 096 tokens as fast or faster."""
    monkeypatch.setenv(PREFILL_ENV, "auto")
    for requests, tokens in [(1, 1024), (1, 2048), (4, 1024), (4, 1536)]:
        assert prefill_kernel(tokens, CUDA, False, requests) == "recurrent", (requests, tokens)
    for requests, tokens in [(1, 4096), (4, 3072), (4, 4096), (8, 1024), (4, 2048)]:
        assert prefill_kernel(tokens, CUDA, False, requests) == "fla", (requests, tokens)


def test_auto_is_monotonic_in_tokens_requests_and_heads(with_fla, monkeypatch):
    """Longer chunks, more requests or more heads never send an extend back to the recurrent
    kernel; the switch sits where the estimate reaches fla's fixed cost."""
    monkeypatch.setenv(PREFILL_ENV, "auto")
    for requests in (1, 2, 4, 8, 16, 48):
        n = shortest_fla_chunk(requests)
        assert prefill_kernel(n, CUDA, False, requests) == "fla"
        assert prefill_kernel(n - 1, CUDA, False, requests) == "recurrent"
        assert prefill_kernel(n, CUDA, False, requests + 1) == "fla"
        assert prefill_kernel(n, CUDA, False, requests, 2 * HEADS) == "fla"
        assert prefill_kernel(n, CUDA, False, requests, HEADS, 2 * DV) == "fla"
    # half-width heads: half the programs, so the knee comes at twice the requests
    assert shortest_fla_chunk(8, HEADS, DV // 2) == shortest_fla_chunk(4)
    firsts = [shortest_fla_chunk(r) for r in (1, 2, 4, 8, 16, 48)]
    assert firsts == sorted(firsts, reverse=True)
    # one chunk of n tokens bounds every extend of n tokens (the warm-up's question)
    for total in (512, 1024, 2048, 4096, 8192):
        for heads in (4, HEADS, 4 * HEADS):
            one = recurrent_extend_us(total, 1, heads, DV)
            for r in (2, 4, 8, 16):
                assert recurrent_extend_us(total // r, r, heads, DV) <= one + 1e-9


def test_warm_up_lengths_reach_every_l2norm_bucket():
    """One count per ceil(tokens * key heads / 65 536) bucket up to the extend size."""
    from unimem.models.gdn_prefill import warm_up_lengths

    assert warm_up_lengths(8192, 16) == [4096, 8192]
    assert warm_up_lengths(8192, 2) == [8192]
    assert warm_up_lengths(4097, 16) == [4096, 4097]
    assert warm_up_lengths(100, 16) == [100]
    per = 65536
    for max_tokens, hk in [(32768, 16), (12000, 4), (3000, 32)]:
        lens = warm_up_lengths(max_tokens, hk)
        buckets = {-(-t * hk // per) for t in lens}
        assert buckets == set(range(1, -(-max_tokens * hk // per) + 1))
        assert max(lens) == max_tokens
    with pytest.raises(ValueError, match="max_tokens"):
        warm_up_lengths(0, 16)


def test_warm_up_is_a_no_op_where_fla_never_runs(with_fla, monkeypatch):
    """CPU states and ``off``: nothing runs (``auto`` on a GPU asks :func:`prefill_kernel`
    whether one chunk of ``max_tokens`` tokens would take fla: the test above)."""
    conv = torch.zeros(2, 96, 3, dtype=torch.bfloat16)
    ssm = torch.zeros(2, 2, 16, 16)
    monkeypatch.delenv(PREFILL_ENV, raising=False)
    assert gdn_prefill.warm_up_fla(conv, ssm, max_tokens=8192) == []
    monkeypatch.setenv(PREFILL_ENV, "off")
    assert gdn_prefill.warm_up_fla(conv, ssm, max_tokens=8192) == []


def test_auto_takes_fla_for_long_chunks_on_gpu(with_fla, monkeypatch):
    monkeypatch.setenv(PREFILL_ENV, "auto")
    assert prefill_kernel(shortest_fla_chunk(1), CUDA, False) == "fla"
    assert prefill_kernel(shortest_fla_chunk(1) - 1, CUDA, False) == "recurrent"
    assert prefill_kernel(32768, CPU, False) == "recurrent"
    # batch-invariant mode: one rounding for extend, decode and verify
    assert prefill_kernel(32768, CUDA, True) == "recurrent"


def test_auto_without_fla_is_recurrent(without_fla, monkeypatch):
    monkeypatch.setenv(PREFILL_ENV, "auto")
    assert prefill_kernel(32768, CUDA, False) == "recurrent"


def test_explicit_modes(with_fla, monkeypatch):
    monkeypatch.setenv(PREFILL_ENV, "fla")
    assert prefill_kernel(3, CUDA, False) == "fla"
    assert prefill_kernel(3, CUDA, True) == "recurrent"
    monkeypatch.setenv(PREFILL_ENV, "triton")
    assert prefill_kernel(32768, CUDA, False) == "triton"
    monkeypatch.setenv(PREFILL_ENV, "off")
    assert prefill_kernel(32768, CUDA, False) == "recurrent"
    monkeypatch.setenv(PREFILL_ENV, "yes")
    with pytest.raises(ValueError, match=PREFILL_ENV):
        prefill_kernel(32768, CUDA, False)


def test_forced_fla_without_fla_names_the_package(without_fla, monkeypatch):
    monkeypatch.setenv(PREFILL_ENV, "fla")
    with pytest.raises(ValueError, match="fla-core"):
        prefill_kernel(32768, CUDA, False)


def test_a_bad_setting_fails_when_the_engine_starts(monkeypatch):
    """The runner checks the variable at construction: no engine starts that would fail at
    its first prefill."""
    from unimem.attention.torch_backend import TorchReferenceBackend
    from unimem.engine.core import EngineCore
    from unimem.memory.static import StaticMemory
    from unimem.models.config import memory_spec
    from unimem.models.presets import preset
    from unimem.models.synthetic import HybridModel

    cfg = preset("tiny")
    model = HybridModel(cfg, seed=0)
    pool = StaticMemory(memory_spec(cfg, 16), 8, 8, 2, 2, cfg.max_context)
    monkeypatch.setenv(PREFILL_ENV, "on")
    with pytest.raises(ValueError, match=PREFILL_ENV):
        EngineCore(model, pool, TorchReferenceBackend(), 2, 32)
    monkeypatch.setenv(PREFILL_ENV, "triton")
    EngineCore(model, pool, TorchReferenceBackend(), 2, 32)


def test_chunk_indices_label_every_chunk_by_sequence_and_position():
    """fla's varlen layout: one row (sequence, chunk within it) per 64-token chunk."""
    cu = torch.tensor([0, 1500, 2200, 2264, 2265])
    rows = gdn_prefill._chunk_indices(cu, CPU)
    assert rows.dtype == torch.int64 and rows.shape == (24 + 11 + 1 + 1, 2)
    expect = [(0, i) for i in range(24)] + [(1, i) for i in range(11)] + [(2, 0), (3, 0)]
    assert [tuple(r) for r in rows.tolist()] == expect


# ----------------------------------------------------------------------------------- GPU


def _needs_fla():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if gdn_prefill.fla_chunk_rule() is None:
        pytest.skip("needs fla-core")


def _slot_views(num_slots, conv_dim, kw, h, dk, dv):
    """Conv ``[N, conv_dim, kw - 1]`` bf16 and SSM ``[N, H, Dk, Dv]`` fp32 strided views of one
    uint8 arena (per slot: conv block, then SSM block, 256-byte aligned), random contents."""
    conv_bytes = conv_dim * (kw - 1) * 2
    ssm_off = -(-conv_bytes // 256) * 256
    slot_bytes = ssm_off + h * dk * dv * 4
    arena = torch.empty(num_slots * slot_bytes, dtype=torch.uint8, device=CUDA)
    conv = torch.as_strided(
        arena.view(torch.bfloat16), (num_slots, conv_dim, kw - 1),
        (slot_bytes // 2, kw - 1, 1),
    )  # fmt: skip
    ssm = torch.as_strided(
        arena[ssm_off:].view(torch.float32), (num_slots, h, dk, dv),
        (slot_bytes // 4, dk * dv, dv, 1),
    )  # fmt: skip
    conv.copy_(torch.randn(conv.shape, device=CUDA).bfloat16())
    ssm.copy_(0.1 * torch.randn(ssm.shape, device=CUDA))
    return conv, ssm


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.gpu
@pytest.mark.parametrize("hk, h, d", [(16, 16, 128), (4, 8, 128)])
def test_fla_extend_matches_recurrent_on_slots(hk, h, d):
    """A ragged extend (1 500, 700, 64 and 1 token; the third request starts from a zeroed
    slot) through fla and through the recurrent Triton kernel, from the same slots."""
    _needs_fla()
    from unimem_kernel import gdn as gdn_ops

    torch.manual_seed(0)
    kw = 4
    conv_dim = hk * 2 * d + h * d
    lens = [1500, 700, 64, 1]
    slots = torch.tensor([5, 1, 3, 0], dtype=torch.int32, device=CUDA)
    conv, ssm = _slot_views(8, conv_dim, kw, h, d, d)
    conv[3].zero_()
    ssm[3].zero_()
    t = sum(lens)
    cu_host = [0]
    for n in lens:
        cu_host.append(cu_host[-1] + n)
    cu = torch.tensor(cu_host, dtype=torch.int32, device=CUDA)
    x = torch.randn(t, conv_dim, device=CUDA).bfloat16()
    w = (0.5 * torch.randn(conv_dim, kw, device=CUDA)).bfloat16()
    g = -torch.rand(t, h, device=CUDA) * 0.5 - 0.01  # log-decay
    beta = torch.rand(t, h, device=CUDA)
    conv0, ssm0 = conv.clone(), ssm.clone()
    ref = gdn_ops.gdn_forward(
        "extend", x, w, g, beta, conv, ssm, slots, cu, max_seqlen=max(lens), num_k_heads=hk
    )
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    conv.copy_(conv0)
    ssm.copy_(ssm0)
    out = gdn_prefill.gdn_extend_fla(
        x, w, g, beta, conv, ssm, slots, cu, max_seqlen=max(lens),
        varlen=gdn_prefill.fla_varlen(cu, cu_host),
        num_k_heads=hk,
    )  # fmt: skip
    torch.cuda.synchronize()
    from fla.ops.utils.index import prepare_chunk_indices

    cu_long = torch.tensor(cu_host, device=CUDA)
    fla_rows = prepare_chunk_indices(cu_long, gdn_prefill.FLA_CHUNK)
    assert torch.equal(gdn_prefill._chunk_indices(cu_long.cpu(), CUDA), fla_rows)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 2e-2
    for b, (lo, hi) in enumerate(zip(cu_host[:-1], cu_host[1:], strict=True)):
        assert _rel(out[lo:hi], ref[lo:hi]) < 3e-2, b
    live = slots.long()
    assert torch.equal(conv[live], conv_ref[live])  # the same conv kernel
    assert _rel(ssm[live], ssm_ref[live]) < 1e-2
    others = [i for i in range(8) if i not in live.tolist()]
    assert torch.equal(ssm[others], ssm0[others]) and torch.equal(conv[others], conv0[others])


@pytest.mark.gpu
def test_engine_prefills_through_fla_static_equals_unified(monkeypatch, fla_calls):
    """Prompts of 1 100 tokens (chunked prefill of 512: the last chunk is shorter, the first
    two take fla under ``fla``) then DSPARK verify steps: identical tokens over static and
    unified memory, and fla was used."""
    _needs_fla()
    pytest.importorskip("flash_attn.cute", reason="FA4 not installed")
    from unimem.attention.fa4_backend import FA4Backend
    from unimem.engine.core import EngineCore
    from unimem.memory.static import StaticMemory
    from unimem.memory.unified import UnifiedMemory
    from unimem.models.config import memory_spec
    from unimem.models.presets import preset
    from unimem.models.synthetic import HybridModel
    from unimem.speculative.chain import DsparkChain
    from unimem.speculative.drafter import DsparkDrafter, draft_config_for

    monkeypatch.setenv(PREFILL_ENV, "fla")
    cfg = preset("gpu_test")
    model = HybridModel(cfg, seed=3, device=CUDA)
    drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=5)
    g = torch.Generator().manual_seed(9)
    prompts = torch.randint(0, cfg.vocab_size, (4, 1100), generator=g).tolist()
    spec = memory_spec(cfg, 16, drafter.config.lanes())
    outs = []
    for kind in ("static", "unified"):
        pages = 4 * -(-(1100 + 40 + 16) // 16)
        pool = (
            StaticMemory(spec, pages, pages, 4, 4, cfg.max_context, CUDA)
            if kind == "static"
            else UnifiedMemory(spec, 256 << 20, 4, cfg.max_context, CUDA)
        )
        eng = EngineCore(
            model, pool, FA4Backend(), 4, 512, chain=DsparkChain(drafter, 3), cuda_graphs=True
        )
        warmed = len(fla_calls)  # the runner's warm-up extends
        for p in prompts:
            eng.submit(p, 40)
        outs.append({r.rid: r.output for r in eng.run()})
        assert len(fla_calls) > warmed, f"no extend took fla ({kind})"
    assert outs[0] == outs[1]
    assert all(len(o) == 40 for o in outs[0].values())


def _fla_kernel_state() -> set[tuple[str, str]]:
    """Every compiled variant and every autotuned key of fla's Triton kernels loaded so far:
    ``(kernel, key)`` pairs from the JIT functions' per-device caches and the autotuners'
    result caches."""
    import sys

    seen: set[tuple[str, str]] = set()
    visited: set[int] = set()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            while obj is not None and id(obj) not in visited:
                visited.add(id(obj))
                label = getattr(obj, "__name__", type(obj).__name__)
                for cache in getattr(obj, "device_caches", {}).values():
                    seen |= {(label, "jit:" + str(k)) for k in cache[0]}
                tuned = getattr(obj, "cache", None)
                if isinstance(tuned, dict) and hasattr(obj, "configs"):
                    seen |= {(label, "tuned:" + str(k)) for k in tuned}
                obj = getattr(obj, "fn", None)
    return seen


@pytest.mark.gpu
def test_engine_start_warms_fla_so_prefills_compile_nothing(monkeypatch, fla_calls):
    """The default mode (``auto``) with 4 096-token extends: the runner warms fla up at
    construction; then 2 600-token prompts (long enough for ``auto`` to take fla) prefill
    through fla without compiling or autotuning any fla kernel, and the step loop (prefill
    chunks, CUDA-graph decode) runs under ``torch.cuda.set_sync_debug_mode("error")``."""
    _needs_fla()
    pytest.importorskip("flash_attn.cute", reason="FA4 not installed")
    from unimem.attention.fa4_backend import FA4Backend
    from unimem.engine.core import EngineCore
    from unimem.memory.static import StaticMemory
    from unimem.models.config import memory_spec
    from unimem.models.presets import preset
    from unimem.models.synthetic import HybridModel

    monkeypatch.delenv(PREFILL_ENV, raising=False)
    cfg = preset("gpu_test")
    model = HybridModel(cfg, seed=3, device=CUDA)
    prompt_len = 2600
    assert prefill_kernel(prompt_len, CUDA, False, 1, cfg.gdn_heads, cfg.gdn_head_dim_v) == "fla"
    pages = 3 * -(-(prompt_len + 24) // 16)
    pool = StaticMemory(memory_spec(cfg, 16), pages, pages, 3, 3, cfg.max_context, CUDA)
    eng = EngineCore(model, pool, FA4Backend(), 3, 4096, cuda_graphs=True)
    assert eng.runner.fla_warm_up_tokens, "the runner did not warm fla up"
    warmed = len(fla_calls)
    warm = _fla_kernel_state()
    assert warm, "no fla kernel state found"
    g = torch.Generator().manual_seed(11)
    for p in torch.randint(0, cfg.vocab_size, (3, prompt_len), generator=g).tolist():
        eng.submit(p, 8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        done = eng.run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(fla_calls) > warmed, "no prefill took fla"
    assert _fla_kernel_state() == warm
    assert sorted(len(r.output) for r in done) == [8, 8, 8]
