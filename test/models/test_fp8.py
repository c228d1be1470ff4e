"""FP8 checkpoints and ``--quantization fp8`` on a tiny Qwen3-Next (CPU, float32 activations):
the hub layout written and read back, what stays unquantised, logits against the dequantised
model, online quantisation equal to loading the FP8 checkpoint, the synthetic presets, and the
engine (static == unified token for token).

Bounds. With the activations quantised the same way in float64 torch (per token and group of
128, e4m3) and the dequantised weights, the FP8 model's log-probs agree within 3e-3 (float32
rounding upstream can flip one activation across an e4m3 rounding boundary; a wrong layout or
scale gives differences of order 1): the loading, layouts and scales are right. Against the
dequantised model with unquantised activations the difference is the activation quantisation
itself (~2-3 % relative per GEMM input on this random model, compounded over 4 layers): mean
|delta log-prob| <= 0.25 and top-1 agreement >= 70 % here (on real trained models
tools/device/gpu_fp8.sh measures Gemma 3 270M)."""

from __future__ import annotations

import json

import pytest
import tiny_qwen3_5
import tiny_qwen3_next
import tiny_tokenizer
import torch
import torch.nn.functional as F

import unimem
from unimem.models import fp8_convert, fp8_linear
from unimem.models.fp8_checkpoint import write_fp8_checkpoint
from unimem.models.loader import load_model
from unimem.models.quant_config import Fp8Config, resolve_quantization
from unimem.models.stacked_linear import stacks_of
from unimem.models.synthetic import HybridModel
from unimem_kernel.fp8_gemm import FP8_DTYPE, fp8_quantize_groups_reference

LENGTHS = (10, 29, 47, 66)
OUT = 8


def _prompts(vocab: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=gen) for n in LENGTHS]


def _lp(x: torch.Tensor) -> torch.Tensor:
    return x.double().log_softmax(-1)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(bf16 checkpoint dir, FP8 checkpoint dir written from it)."""
    src = tmp_path_factory.mktemp("qwen3_next")
    hf = tiny_qwen3_next.build(src)
    tiny_tokenizer.save(src, hf.config.vocab_size)
    dst = tmp_path_factory.mktemp("qwen3_next_fp8")
    write_fp8_checkpoint(src, dst)
    return src, dst


def test_checkpoint_is_in_the_hub_layout(ckpts):
    from safetensors import safe_open

    _, dst = ckpts
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    kept = set(qc["modules_to_not_convert"])
    assert {"lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"} <= kept
    assert "model.layers.0.linear_attn.in_proj_ba" in kept
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        w = f.get_tensor("model.layers.3.self_attn.q_proj.weight")
        s = f.get_tensor("model.layers.3.self_attn.q_proj.weight_scale_inv")
        e = f.get_tensor("model.layers.0.mlp.experts.1.gate_proj.weight_scale_inv")
        assert w.dtype == FP8_DTYPE and tuple(s.shape) == (2, 1)  # [256, 64]: 2 x 1 blocks
        assert e.dtype == torch.float32 and tuple(e.shape) == (1, 1)
        assert f.get_tensor("model.layers.0.mlp.gate.weight").dtype == torch.float32
        assert f.get_tensor("lm_head.weight").dtype == torch.float32


def test_loaded_dtypes_follow_the_checkpoint(ckpts):
    _, dst = ckpts
    model = load_model(dst)
    params = dict(model.named_parameters())
    fp8 = {n for n, p in params.items() if p.dtype == FP8_DTYPE}
    for name in (
        "model.layers.0.linear_attn.in_proj_qkvz.weight",
        "model.layers.0.linear_attn.out_proj.weight",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.shared_expert.down_proj.weight",
        "model.layers.3.self_attn.o_proj.weight",
    ):
        assert name in fp8 and params[name + "_scale_inv"].dtype == torch.float32
    for name in (
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.shared_expert_gate.weight",
        "model.layers.0.linear_attn.in_proj_ba.weight",
        "model.layers.0.linear_attn.conv1d.weight",
    ):
        assert params[name].dtype == torch.float32
    # the MoE in_proj stack splits into the bf16 router and the FP8 shared-expert gate/up
    moe = model.model.layers[0].mlp
    assert [r.fp8 for r in moe.in_proj._runs] == [False, True] and moe.in_proj.stacked()


def _dequantised(model_dir, fp8_model):
    """The unquantised model of ``model_dir`` with the FP8 model's weights dequantised."""
    model = load_model(model_dir)
    with torch.no_grad():
        for name, p in fp8_model.named_parameters():
            if p.dtype == FP8_DTYPE:
                scale = fp8_model.get_parameter(name + fp8_linear.SCALE_SUFFIX)
                model.get_parameter(name).copy_(fp8_linear.dequantize(p, scale))
    return model


def _fake_quant_matmul(x, weight, scale, *, block_scales=None):
    """The FP8 product in float64 torch: activations quantised as the kernel does, both
    operands dequantised (the block table, if any, is the same scales)."""
    x2 = x.reshape(-1, x.shape[-1])
    q, s = fp8_quantize_groups_reference(x2)
    xd = fp8_linear.dequantize(q, s).double()
    y = xd @ fp8_linear.dequantize(weight, scale).double().t()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def test_logits_equal_the_dequantised_model(ckpts, monkeypatch):
    src, dst = ckpts
    fp8 = load_model(dst)
    ref = _dequantised(src, fp8)
    prompts = _prompts(fp8.config.vocab_size)
    got = fp8.reference_forward(prompts)
    plain = ref.reference_forward(prompts)
    diffs = torch.cat([(_lp(a) - _lp(b)).abs().flatten() for a, b in zip(got, plain, strict=True)])
    agree = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(got, plain, strict=True)])
    assert float(diffs.mean()) <= 0.25 and float(agree.float().mean()) >= 0.70
    # with the same activation quantisation in float64 torch (module docstring)
    monkeypatch.setattr(fp8_linear, "fp8_matmul", _fake_quant_matmul)
    faked = fp8.reference_forward(prompts)
    worst = max(float((_lp(a) - _lp(b)).abs().max()) for a, b in zip(got, faked, strict=True))
    assert worst < 3e-3


def test_online_quantization_equals_the_fp8_checkpoint(ckpts):
    src, dst = ckpts
    online = load_model(src, quantization="fp8")
    stored = load_model(dst)
    a, b = dict(online.named_parameters()), dict(stored.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name].float(), b[name].float())
    prompts = _prompts(online.config.vocab_size)[:2]
    got, want = online.reference_forward(prompts), stored.reference_forward(prompts)
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)


def test_quantization_config_errors():
    class Cfg:
        quantization_config = {"quant_method": "awq"}

    with pytest.raises(ValueError, match="quant_method 'awq'"):
        resolve_quantization(Cfg, None)
    Cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    with pytest.raises(ValueError, match="weight_block_size"):
        resolve_quantization(Cfg, "fp8")
    Cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128],
                               "activation_scheme": "static"}  # fmt: skip
    with pytest.raises(ValueError, match="activation_scheme"):
        resolve_quantization(Cfg, None)
    with pytest.raises(ValueError, match="quantization must be one of"):
        resolve_quantization(object(), "int4")
    assert resolve_quantization(object(), "fp8") == Fp8Config(from_checkpoint=False)
    assert resolve_quantization(object(), None) is None
    cfg = Fp8Config(from_checkpoint=False, ignored=("model.layers.1.mlp",))
    assert not cfg.online_quantizes("model.layers.1.mlp.down_proj.weight")
    assert cfg.online_quantizes("model.layers.2.mlp.down_proj.weight")
    assert not cfg.online_quantizes("lm_head.weight")


def test_synthetic_preset_quantizes_in_place():
    from unimem.models.presets import preset

    model = HybridModel(preset("tiny"), seed=0)
    names = fp8_convert.synthetic_fp8_names(model)
    assert names and all(n.rsplit(".", 1)[1] in fp8_convert.SYNTHETIC_LINEARS for n in names)
    x = torch.randn(5, model.config.d_model, dtype=model.config.dtype)
    mlp = model.layers[0].mlp
    w = mlp.gate_up.detach().clone()
    fp8_convert.quantize_in_place(model, names)
    assert mlp.gate_up.dtype == FP8_DTYPE
    y = fp8_linear.linear(x, mlp, "gate_up")
    ref = F.linear(x, w)
    assert float((y - ref).abs().max() / ref.abs().max()) < 0.08


def _block_tables(model) -> dict[str, torch.Tensor]:
    return {n: b for n, b in model.named_buffers() if n.endswith(fp8_linear.BLOCKS_SUFFIX)}


def _expected_block_tables(model) -> dict[str, torch.Tensor]:
    """What the block tables must be, found by other means: for each 2-D FP8 weight with
    ``K`` a multiple of 128 whose rows' scales repeat the first row of their 128-row block
    (the last block may be short), that first row of each block."""
    out = {}
    for name, p in model.named_parameters():
        if p.dtype != FP8_DTYPE or p.dim() != 2 or p.shape[1] % 128:
            continue
        rows = model.get_parameter(name + fp8_linear.SCALE_SUFFIX)
        firsts = rows[::128]
        if torch.equal(firsts.repeat_interleave(128, dim=0)[: rows.shape[0]], rows):
            out[name + fp8_linear.BLOCKS_SUFFIX] = firsts
    return out


def _strip_block_tables(model) -> None:
    """Remove every block table (modules' buffers and stacked runs'): the Triton path only."""
    for name in _block_tables(model):
        path, leaf = name.rsplit(".", 1)
        delattr(model.get_submodule(path), leaf)
    for stack in stacks_of(model):
        for run in stack._runs:
            run.block_scales = None


def _check_block_tables(model, present: list[str], absent: list[str]) -> None:
    """The tables are exactly the expected ones (and not vacuously: ``present`` are among
    them, ``absent`` not), buffers outside the state dict and the weight bytes."""
    tables, want = _block_tables(model), _expected_block_tables(model)
    assert tables.keys() == want.keys()
    for name, table in tables.items():
        assert table.is_contiguous() and torch.equal(table, want[name]), name
    assert set(present) <= tables.keys() and not set(absent) & tables.keys()
    assert not any(k.endswith(fp8_linear.BLOCKS_SUFFIX) for k in model.state_dict())
    params = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith(fp8_linear.BLOCKS_SUFFIX) for n in params)


def test_block_tables_of_the_synthetic_preset():
    """Online FP8 of a synthetic model (``quantize_model_online``) registers each
    block-uniform FP8 weight's ``[ceil(N/128), KG]`` block table (qkv's 448 rows end in a
    short block); the CPU logits (always the Triton / reference path) are those without
    them, and the weight bytes too."""
    from unimem.models.presets import preset

    model = HybridModel(preset("tiny"), seed=0)
    fp8_convert.quantize_model_online(model)
    _check_block_tables(
        model,
        present=["layers.0.mlp.gate_up_scale_blocks", "layers.0.mixer.o_proj_scale_blocks",
                 "layers.0.mixer.qkv_proj_scale_blocks"],
        absent=[],
    )  # fmt: skip
    prompts = _prompts(model.config.vocab_size)[:2]
    got, size = model.reference_forward(prompts), fp8_linear.weight_bytes(model)
    _strip_block_tables(model)
    for a, b in zip(got, model.reference_forward(prompts), strict=True):
        assert torch.equal(a, b)
    assert fp8_linear.weight_bytes(model) == size


def test_block_tables_at_load(tmp_path):
    """``load_model`` with ``--quantization fp8`` and from the FP8 checkpoint: the same block
    tables, on every module whose weight is block-uniform with ``K`` a multiple of 128 (a
    tiny Qwen3.5 of width 128; k_proj and in_proj_z end in a short block), and on the
    stacked runs whose stacks are (MLP gate/up: yes; q/k/v: no, k and v have a block scale
    each within one 128-row block of the stack); CPU logits unchanged."""
    src, dst = tmp_path / "bf16", tmp_path / "fp8"
    tiny_qwen3_5.build(src, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       full_attention_interval=2)  # fmt: skip
    write_fp8_checkpoint(src, dst)
    online, stored = load_model(src, quantization="fp8"), load_model(dst)
    layer = "model.layers.{}.{}.weight_scale_blocks"
    for model in (online, stored):
        _check_block_tables(
            model,
            present=[layer.format(1, "self_attn.q_proj"), layer.format(1, "self_attn.o_proj"),
                     layer.format(0, "mlp.down_proj"), layer.format(0, "linear_attn.in_proj_qkv"),
                     layer.format(1, "self_attn.k_proj"), layer.format(0, "linear_attn.in_proj_z")],
            absent=[layer.format(0, "linear_attn.out_proj")],  # K 64: not a multiple of 128
        )  # fmt: skip
        mlp, attn = model.model.layers[0].mlp, model.model.layers[1].self_attn
        gate_up = torch.cat([mlp.gate_proj.weight_scale_blocks, mlp.up_proj.weight_scale_blocks])
        assert torch.equal(mlp.gate_up._runs[0].block_scales, gate_up)
        assert attn.qkv._runs[0].fp8 and attn.qkv._runs[0].block_scales is None
    a, b = _block_tables(online), _block_tables(stored)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    prompts = _prompts(stored.config.vocab_size)[:2]
    got = stored.reference_forward(prompts)
    _strip_block_tables(stored)
    for x, y in zip(got, stored.reference_forward(prompts), strict=True):
        assert torch.equal(x, y)


def _engine(path, **kw):
    base = dict(model_path=str(path), device="cpu", dtype="float32", page_size=4)
    return unimem.Engine(**{**base, **kw})


def test_engine_static_equals_unified(ckpts):
    src, dst = ckpts
    prompts = [p.tolist() for p in _prompts(500)]
    params = {"max_new_tokens": OUT, "ignore_eos": True}
    outs = []
    for kw in (
        dict(max_total_tokens=1024, max_running_requests=4),
        dict(enable_unified_memory=True, max_total_tokens=64, max_running_requests=3,
             disable_radix_cache=True),
        dict(max_total_tokens=1024, max_running_requests=4, quantization="fp8", path=src),
    ):  # fmt: skip
        engine = _engine(kw.pop("path", dst), **kw)
        outs.append(engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True))
        engine.shutdown()
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            assert a["output_ids"] == b["output_ids"]
            la = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
            lb = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
            # (batch composition moves float32 rounding, which can flip an activation across
            # an e4m3 boundary: log-probs within 5e-3, tokens equal)
            assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) < 5e-3


@pytest.mark.gpu
def test_engine_on_cuda_graphs_and_deterministic(tmp_path):
    """On CUDA (bf16, FA4 with CUDA graphs: attention heads of 128): static == unified token
    for token; with deterministic inference a request's tokens do not depend on its batch."""
    src, dst = tmp_path / "bf16", tmp_path / "fp8"
    hf = tiny_qwen3_next.build(src, head_dim=128)
    tiny_tokenizer.save(src, hf.config.vocab_size)
    write_fp8_checkpoint(src, dst)
    prompts = [p.tolist() for p in _prompts(500)]
    params = {"max_new_tokens": OUT, "ignore_eos": True}
    base = dict(model_path=str(dst), device="cuda", dtype="bfloat16", page_size=4)
    outs = []
    for kw in (
        dict(max_total_tokens=1024, max_running_requests=4),
        dict(enable_unified_memory=True, max_total_tokens=1024, max_running_requests=4),
    ):
        engine = unimem.Engine(**base, **kw)
        outs.append(
            [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        )
        engine.shutdown()
    assert outs[0] == outs[1]
    engine = unimem.Engine(**base, max_total_tokens=1024, enable_deterministic_inference=True)
    batch = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    alone = engine.generate(input_ids=prompts[2], sampling_params=params)["output_ids"]
    engine.shutdown()
    assert alone == batch[2]


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "gemma3", "gpt_oss"])
def test_online_fp8_other_architectures(arch, tmp_path):
    """Qwen3.5-MoE (stacked experts, split GDN projections) and Gemma 3 run online FP8
    close to their bf16 selves; gpt-oss is refused by name."""
    import importlib

    builder = importlib.import_module(f"tiny_{arch}")
    builder.build(tmp_path)
    if arch == "gpt_oss":
        with pytest.raises(ValueError, match="not supported for GptOssForCausalLM"):
            load_model(tmp_path, quantization="fp8")
        return
    fp8 = load_model(tmp_path, quantization="fp8")
    plain = load_model(tmp_path)
    fp8_names = {n for n, p in fp8.named_parameters() if p.dtype == FP8_DTYPE}
    assert any(".mlp." in n for n in fp8_names) and any("_proj" in n for n in fp8_names)
    # Gemma 3 keeps gate/up/o in the model dtype online (quant_config.ONLINE_KEPT)
    kept = any(k in n for n in fp8_names for k in ("gate_proj", "up_proj", "o_proj"))
    assert kept == (arch != "gemma3")
    assert all(p.dtype != FP8_DTYPE for n, p in fp8.named_parameters() if "embed" in n)
    prompts = _prompts(fp8.config.vocab_size)[:2]
    got, want = fp8.reference_forward(prompts), plain.reference_forward(prompts)
    agree = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(got, want, strict=True)])
    assert float(agree.float().mean()) >= 0.6


def test_make_checkpoint_writes_the_80b_shape_layer_by_layer(tmp_path):
    """tools/make_checkpoint.py's direct FP8 writer (the one the 80B-shaped GPU run
    uses), on the tiny config: the hub layout, one shard per layer, and it loads."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from unimem.models.word_tokenizer import save_word_tokenizer

    script = Path(__file__).resolve().parents[2] / "tools" / "make_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_checkpoint", script)
    mc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mc)
    cfg = tiny_qwen3_next.config()
    cfg.architectures = ["Qwen3NextForCausalLM"]
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    mc.write_fp8_direct(meta, cfg, tmp_path, torch.device("cpu"), seed=0)
    save_word_tokenizer(tmp_path, cfg.vocab_size)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == cfg.num_hidden_layers + 1
    assert "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv" in index["weight_map"]
    model = load_model(tmp_path)
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == FP8_DTYPE
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16
    assert torch.isfinite(model.reference_forward([torch.arange(12)])[0]).all()


def test_make_checkpoint_spills_shards_past_a_full_disk(tmp_path, monkeypatch):
    """A checkpoint larger than --out's disk: the shards that would leave it under the
    margin go to the overflow directory, linked in place, and the checkpoint loads as one
    directory; without an overflow directory the writer stops with an error naming both
    ways out."""
    import collections
    import importlib.util
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    script = Path(__file__).resolve().parents[2] / "tools" / "make_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_checkpoint", script)
    mc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mc)
    out, spill = tmp_path / "ckpt", tmp_path / "spill"
    out.mkdir()
    usage = collections.namedtuple("usage", "total used free")

    def disk_usage(path):  # --out's disk fills after its first two shards
        if Path(path) == spill:
            return usage(1 << 40, 0, 1 << 40)
        written = sum(f.stat().st_size for f in out.glob("*.safetensors") if not f.is_symlink())
        return usage(1 << 30, written, (1 << 30) - written)

    cfg = tiny_qwen3_next.config()
    cfg.architectures = ["Qwen3NextForCausalLM"]
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    probe = tmp_path / "probe"  # the shards' sizes, written in name order
    probe.mkdir()
    mc.write_fp8_direct(meta, cfg, probe, torch.device("cpu"), 0)
    sizes = [f.stat().st_size for f in sorted(probe.glob("*.safetensors"))]
    keep_free = (1 << 30) - (sizes[0] + sizes[1] + sizes[2] // 2)  # room for two shards
    monkeypatch.setattr(mc.shutil, "disk_usage", disk_usage)
    with pytest.raises(SystemExit, match="--overflow-dir or fewer --layers"):
        mc.write_fp8_direct(meta, cfg, out, torch.device("cpu"), 0, keep_free=(1 << 30) + 1)
    mc.write_fp8_direct(meta, cfg, out, torch.device("cpu"), 0, spill, keep_free=keep_free)
    shards = sorted(out.glob("*.safetensors"))
    linked = [f for f in shards if f.is_symlink()]
    assert len(shards) == cfg.num_hidden_layers + 1
    assert [f.name for f in linked] == [f.name for f in shards[2:]]
    assert all(f.resolve().parent == spill.resolve() for f in linked)
    model = load_model(out)
    assert model.model.layers[-1].mlp.experts.gate_up_proj.dtype == FP8_DTYPE
    assert torch.isfinite(model.reference_forward([torch.arange(12)])[0]).all()


def test_device_drivers_run_on_the_cpu(ckpts, tmp_path):
    """The two FP8 drivers of ``tools/device/gpu_fp8.sh`` end to end on the CPU, so that a GPU
    run does not find their faults: ``fp8_agreement.py`` (online FP8 against the model,
    teacher-forced) and ``fp8_serve_big.py`` (``launch_server`` on an FP8 checkpoint under
    concurrent requests)."""
    import subprocess
    import sys
    from pathlib import Path

    src, dst = ckpts
    tools = Path(__file__).resolve().parents[2] / "tools" / "device"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nthe quick brown fox\none two three\n")
    agree = tmp_path / "agree.json"
    subprocess.run(
        [sys.executable, str(tools / "fp8_agreement.py"), "--model-path", str(src),
         "--prompts", str(prompts), "--requests", "3", "--tokens", "6", "--device", "cpu",
         "--goal", "0", "--json", str(agree)],
        check=True, timeout=300,
    )  # fmt: skip
    a = json.loads(agree.read_text())
    assert a["meets_goal"] and 0 <= a["top1_agreement"] <= 1
    served = tmp_path / "served.json"
    subprocess.run(
        [sys.executable, str(tools / "fp8_serve_big.py"), "--model-path", str(dst), "--device",
         "cpu", "--vocab", "64", "--requests", "4", "--concurrency", "2", "--prompt-tokens", "8",
         "--output-tokens", "4", "--json", str(served), "--", "--quantization", "fp8"],
        check=True, timeout=300,
    )  # fmt: skip
    s = json.loads(served.read_text())
    assert s["quantization"] == "fp8" and s["requests"] == 4 and s["output_tok_s"] > 0
    assert s["single_stream_ttft_s"] > 0 and s["single_stream_decode_tok_s"] > 0
    # where the load went (the server's start-up phases, its warm-up included)
    assert {"checkpoint", "pools", "step_loop", "warm_up"} <= s["startup_seconds"].keys()
