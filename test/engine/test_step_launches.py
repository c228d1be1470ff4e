"""Kernel launches per decoder layer of one eager decode step (:mod:`unimem.bench.launches`),
on the CPU with the Triton kernels forced through the interpreter, so that the count is the
GPU path's: a tiny Gemma 3 checkpoint and the Qwen3-Next-shaped synthetic hybrid model (GDN,
full and sliding attention, SwiGLU), each at most 12 launches per layer (the attention
backend's call counts as one). A fusion that regresses into torch glue fails here.

Also: the fused Gemma 3 step body (interpreter) decodes the same greedy tokens as its torch
reference path, with log-probabilities within float32 rounding."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "test" / "models"))

import tiny_gemma3  # noqa: E402
import tiny_tokenizer  # noqa: E402

import unimem  # noqa: E402
from unimem.attention.torch_backend import TorchReferenceBackend  # noqa: E402
from unimem.bench.launches import OUTSIDE, count_step_launches  # noqa: E402
from unimem.engine.core import EngineCore  # noqa: E402
from unimem.memory.static import StaticMemory  # noqa: E402
from unimem.models.config import memory_spec  # noqa: E402
from unimem.models.presets import preset  # noqa: E402
from unimem.models.synthetic import HybridModel  # noqa: E402

MAX_PER_LAYER = 12
MAX_OUTSIDE = 24  # embedding, RoPE tables, first / final norm, LM head, pick, metadata, tail


def _tiny_checkpoint(path, build, **kw):
    """A tiny checkpoint of ``build`` (a ``tiny_*`` module's) with its tokenizer in ``path``."""
    hf = build(path, **kw)
    tiny_tokenizer.save(path, hf.config.vocab_size)
    return path


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    return _tiny_checkpoint(tmp_path_factory.mktemp("gemma3_launches"), tiny_gemma3.build,
                            num_hidden_layers=2,
                            layer_types=["sliding_attention", "full_attention"])  # fmt: skip


def _decoding(core, prompts, out_len=12):
    for p in prompts:
        core.submit(p, out_len)
    for _ in range(4):  # prefill, then decode steps
        core.step()
    running = core.scheduler.running
    assert len(running) == len(prompts) and all(r.output for r in running)  # decoding
    return core


def _check(counts, name):
    per = counts.per_layer()
    print(name, counts.summary())
    assert per and all(n > 0 for n in per), per
    assert max(per) <= MAX_PER_LAYER, f"{name}: {per} launches per layer\n{counts.summary()}"
    assert counts.by_layer[OUTSIDE] <= MAX_OUTSIDE, counts.summary()


@pytest.mark.parametrize("body", ["small", "layered"])
def test_gemma3_decode_step_launches_per_layer(gemma_path, monkeypatch, body):
    """The small-batch body (norm_linear): q/k/v, RoPE + K/V store, attention, o, gate/up,
    down — 6 launches a layer; the layer-by-layer body (UNIMEM_NORM_LINEAR_ROWS=0): every
    norm one launch, no torch reduction or elementwise op inside a layer."""
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("UNIMEM_NORM_LINEAR_ROWS", "16" if body == "small" else "0")
    eng = unimem.Engine(model_path=str(gemma_path), device="cpu", dtype="float32", page_size=4)
    core = _decoding(eng.core, [list(range(5, 14)), list(range(7, 17))])
    counts = count_step_launches(core)
    _check(counts, "gemma3")
    for i in range(2):
        names = counts.layer_names(i)
        if body == "small":
            assert names == {"attention": 1, "triton._norm_linear_kernel": 4,
                             "triton._rope_store_kernel": 1}, names  # fmt: skip
        else:
            assert set(names) <= {"aten.mm", "attention", "triton._rope_store_kernel",
                                  "triton._norm_add_rms_norm_kernel", "triton._gated_act_kernel",
                                  "triton._add_rms_norm_kernel"}, names  # fmt: skip


def test_gpt_oss_decode_step_has_no_torch_router_or_bias_glue(tmp_path, monkeypatch):
    """gpt-oss's layer: q/k/v one GEMM with its biases, the router's top-k and softmax one
    launch (router_topk), the experts' gate/up biases inside the activation and their down
    biases inside the combine. A routed-experts layer needs more launches than a dense one
    (routing, two grouped GEMMs, the combine): at most 15 here, none of them the torch
    router or bias gathers and adds."""
    import tiny_gpt_oss

    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    path = _tiny_checkpoint(tmp_path, tiny_gpt_oss.build)
    eng = unimem.Engine(model_path=str(path), device="cpu", dtype="float32", page_size=4)
    counts = count_step_launches(_decoding(eng.core, [list(range(5, 11)), list(range(7, 14))]))
    per = counts.per_layer()
    assert per and max(per) <= 15, counts.summary()
    for i in range(len(per) - 1):  # the last layer adds its MLP output to the stream alone
        names = counts.layer_names(i)
        assert not {"aten.topk", "aten._softmax", "aten.sort", "aten.add"} & set(names), names
        assert names.get("aten.index", 0) <= 1 and names.get("aten.addmm", 0) <= 3, names


SAMPLED_VERIFY_EXTRA = 95
"""Launches a sampled DSPARK verify step (gamma 7) may add to the greedy one: the drafter's
per-column draws and the accept (82 on the tiny Gemma 3 below). Each set of noise keys
derived with torch integer ops cost ~80 launches and each draft column's draw ~30: ~930 more
than greedy, 4.0 ms against 1.4 ms of GPU at ~30 requests on an H100; the last token's draw
from materialised rows (the filtered row, the proposal scattered to the target's vocabulary,
the residual, its draw) ~35 more."""


FILTERED_VERIFY_EXTRA = 190
"""Launches a sampled DSPARK verify step (gamma 7) under top-k 20 / top-p 0.9 may add to the
greedy one (168 on the tiny Gemma 3 below): each cut-off — one per draft column and one for
the verify rows — is the leading values (one ``torch.topk`` over this tiny vocabulary; over a
262 144-token one the select by chunk maxima adds three launches a cut-off), a few ops to find
them among the logits, and one ``sorted_cut`` launch. Before that kernel, with the cut-off's
whole-row softmax and tempered copy, the step took ~360 more than greedy."""


def _verify_step_launches(path, **sampling):
    """The launches of one DSPARK verify step of two requests of the tiny Gemma 3 at
    ``path``, greedy (no ``sampling``) or sampled with those options."""
    from unimem.engine.sampling import SamplingOptions

    eng = unimem.Engine(
        model_path=str(path), device="cpu", dtype="float32", page_size=4,
        speculative_algorithm="DSPARK",
    )  # fmt: skip
    core = eng.core
    for i, p in enumerate([list(range(5, 14)), list(range(7, 17))]):
        core.submit(p, 40, sampling=SamplingOptions(seed=i, **sampling) if sampling else None)
    for _ in range(2):  # prefill, then a verify step: the requests are verifying
        core.step()
    counts = count_step_launches(core)
    eng.shutdown()
    return counts


@pytest.fixture(scope="module")
def greedy_verify_launches(gemma_path):
    """The greedy verify step's launches (the baseline of the sampled ones), counted once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UNIMEM_KERNEL_BACKEND", "triton")
        return _verify_step_launches(gemma_path)


def test_dspark_filtered_verify_step_launches(gemma_path, greedy_verify_launches, monkeypatch):
    """Top-k 20 / top-p 0.9 at temperature 0.7: at most ``FILTERED_VERIFY_EXTRA`` launches
    more than greedy, one ``sorted_cut`` per cut-off (7 draft columns, the verify rows), and
    no softmax or sort of whole rows."""
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    greedy = greedy_verify_launches
    filtered = _verify_step_launches(gemma_path, temperature=0.7, top_k=20, top_p=0.9)
    assert filtered.total - greedy.total <= FILTERED_VERIFY_EXTRA, filtered.summary()

    def launches(name: str) -> int:
        return sum(c for (_, n), c in filtered.names.items() if n == name)

    assert launches("triton._sorted_cut_kernel") == 8, filtered.summary()
    assert launches("aten._softmax") == 0 and launches("aten.sort") == 0, filtered.summary()


def test_dspark_sampled_verify_step_launches(gemma_path, greedy_verify_launches, monkeypatch):
    """A sampled verify step (temperature 0.7: every filter off) launches at most
    ``SAMPLED_VERIFY_EXTRA`` kernels more than the greedy one, none of them the torch integer
    ops of noise keys (one ``position_keys`` launch per set of keys)."""
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    greedy = greedy_verify_launches
    sampled = _verify_step_launches(gemma_path, temperature=0.7)
    assert sampled.total - greedy.total <= SAMPLED_VERIFY_EXTRA, sampled.summary()
    names = {n for _, n in sampled.names}
    assert (
        not {"aten.bitwise_xor", "aten.bitwise_and", "aten.__rshift__", "aten.__lshift__"} & names
    )
    keys = sum(c for (_, n), c in sampled.names.items() if n == "triton._position_keys_kernel")
    assert 1 <= keys <= 3, sampled.summary()  # draft, accept and residual streams
    draws = sum(c for (_, n), c in sampled.names.items() if n == "triton._draw_write_kernel")
    assert draws == 7, sampled.summary()  # one fused draw per draft column
    last = sum(c for (_, n), c in sampled.names.items() if n == "triton._residual_pick_kernel")
    assert last == 1, sampled.summary()  # the last token: one draw over the logits
    softmax = sum(c for (_, n), c in sampled.names.items() if n == "aten._softmax")
    assert softmax == 0, sampled.summary()  # no distribution is materialised for the draw


@pytest.fixture(
    scope="module",
    params=[
        # the fast tier's checkpoint: one GDN layer, then the full-attention one
        pytest.param({"num_hidden_layers": 2, "full_attention_interval": 2}, id="gdn-full"),
        # the default tiny shape (GDN, GDN, GDN, full attention): 3x the GDN layers' cost
        pytest.param({}, id="gdn3-full", marks=pytest.mark.slow),
    ],
)
def qwen3_5_path(request, tmp_path_factory):
    import tiny_qwen3_5

    path = tmp_path_factory.mktemp("qwen3_5_launches")
    return _tiny_checkpoint(path, tiny_qwen3_5.build, **request.param)


def test_qwen3_5_small_body_launches_and_tokens(qwen3_5_path, monkeypatch):
    """Qwen3.5 (dense): a small step's MLP is two norm_linear launches (the residual add,
    the zero-centred pre-norm, gate/up and SwiGLU; down) instead of add + norm, a GEMM,
    SwiGLU and a GEMM; the same greedy tokens as the layer-by-layer body (float32). The fast
    tier's checkpoint has one layer of each kind; the slow tier's the default four."""
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    outs = {}
    for rows in ("16", "0"):
        monkeypatch.setenv("UNIMEM_NORM_LINEAR_ROWS", rows)
        eng = unimem.Engine(model_path=str(qwen3_5_path), device="cpu", dtype="float32",
                            page_size=4)  # fmt: skip
        counts = count_step_launches(_decoding(eng.core, [list(range(5, 12)), [9, 8, 7, 6]]))
        _check(counts, "qwen3_5")
        for i in range(len(counts.per_layer())):
            names = counts.layer_names(i)
            assert names.get("triton._norm_linear_kernel", 0) == (2 if rows == "16" else 0)
            if rows == "16":
                assert "triton._gated_act_kernel" not in names, names
        got = eng.generate(input_ids=[[5, 6, 7, 8, 9], [11, 3, 4]],
                           sampling_params={"max_new_tokens": 6, "temperature": 0.0})  # fmt: skip
        outs[rows] = [o["output_ids"] for o in got]
    assert outs["16"] == outs["0"]


SYNTHETIC_PROMPTS = [list(range(5, 11)), list(range(9, 16))]
SYNTHETIC_LAYERS = ("gdn", "swa", "gdn", "full")


def _synthetic_core(layers=SYNTHETIC_LAYERS):
    cfg = dataclasses.replace(
        preset("tiny"), dtype=torch.float32, d_model=64, n_q_heads=2, n_kv_heads=1,
        head_dim_k=16, head_dim_v=16, ffn_dim=64, gdn_heads=2, gdn_head_dim_k=16,
        gdn_head_dim_v=16, layer_pattern=layers, window=8,
    )  # fmt: skip
    model = HybridModel(cfg, seed=0)
    pool = StaticMemory(memory_spec(cfg, 4, ()), 16, 16, 2, 2, cfg.max_context, "cpu")
    return EngineCore(model, pool, TorchReferenceBackend(), 2, 8192, cuda_graphs=False)


@pytest.mark.parametrize("body", ["small", "layered"])
def test_qwen3_next_shaped_synthetic_decode_step_launches_per_layer(monkeypatch, body):
    """Small steps (UNIMEM_NORM_LINEAR_ROWS) run the MLP as two norm_linear launches (the
    residual add, the pre-norm, gate/up and SwiGLU; down): no separate activation or
    add + norm before it, no vendor GEMM there."""
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("UNIMEM_NORM_LINEAR_ROWS", "16" if body == "small" else "0")
    counts = count_step_launches(_decoding(_synthetic_core(), SYNTHETIC_PROMPTS))
    _check(counts, "synthetic")
    for i in range(4):
        names = counts.layer_names(i)
        if body == "small":
            assert names.get("triton._norm_linear_kernel") == 2, names
            assert "triton._gated_act_kernel" not in names, names
            # only the layer's last add + the next layer's norm stays on its own
            assert names.get("triton._add_rms_norm_kernel", 0) <= 1, names
        else:
            assert "triton._norm_linear_kernel" not in names, names


@pytest.mark.parametrize(
    "layers",
    [
        # every layer kind, a stream passed from attention to GDN and from GDN to attention
        pytest.param(("swa", "gdn", "full"), id="swa-gdn-full"),
        pytest.param(SYNTHETIC_LAYERS, id="gdn-swa-gdn-full", marks=pytest.mark.slow),
    ],
)
def test_synthetic_small_body_decodes_as_the_layered_one(monkeypatch, layers):
    """The norm_linear MLP (interpreter) and the layer-by-layer one give the same greedy
    tokens, float32."""
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    outs = {}
    for rows in ("16", "0"):
        monkeypatch.setenv("UNIMEM_NORM_LINEAR_ROWS", rows)
        core = _synthetic_core(layers)
        reqs = [core.submit(p, 6) for p in SYNTHETIC_PROMPTS]
        core.run()
        outs[rows] = [list(r.output) for r in reqs]
    assert outs["16"] == outs["0"]
    assert all(len(o) == 6 for o in outs["16"])


def test_gemma3_fused_step_body_decodes_as_the_reference(gemma_path, monkeypatch):
    prompts = [list(range(5, 14)), list(range(30, 41))]
    outs = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", backend)
        eng = unimem.Engine(model_path=str(gemma_path), device="cpu", dtype="float32",
                            page_size=4)  # fmt: skip
        outs[backend] = eng.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": 6, "temperature": 0.0},
            return_logprob=True,
        )
    for ref, got in zip(outs["reference"], outs["triton"], strict=True):
        assert got["output_ids"] == ref["output_ids"]
        a = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
        b = [lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def test_fp8_decode_step_counts_the_quantisation_as_one_launch(monkeypatch):
    """Online FP8 (interpreter): each FP8 linear is one activation quantisation and one GEMM
    launch; the interpreter's float32 -> e4m3 cast after the quantisation kernel (the compiled
    kernel stores e4m3 itself) is not counted as a launch of its own."""
    from unimem.models.fp8_convert import quantize_model_online

    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    core = _synthetic_core()
    quantize_model_online(core.model)
    counts = count_step_launches(_decoding(core, SYNTHETIC_PROMPTS))
    for i in range(len(counts.per_layer())):
        names = counts.layer_names(i)
        assert names.get("triton._fp8_gemm_kernel", 0) >= 2, names
        assert names.get("triton._quant_groups_kernel") == names["triton._fp8_gemm_kernel"], names
        assert "aten._to_copy" not in names, names
