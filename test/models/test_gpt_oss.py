"""gpt-oss (``unimem.models.gpt_oss``) against transformers' own implementation on tiny random
checkpoints (``tiny_gpt_oss.build``): float32 on the CPU, HF in eager attention and the eager
per-expert MoE path.

What is checked: every-position logits of the dense oracle (``reference_forward``), a
:class:`DenseContext` run (batched extend, decode, verify + commit), greedy generation, the
RoPE tables (default and YaRN variants), MXFP4 dequantisation (round trip and through
``load_weights`` / ``load_model``), and that wrong mappings, shapes, names and unsupported
configs fail.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from tiny_gpt_oss import DEFAULT_ROPE, build

from unimem.models.forward_context import DenseCache, DenseContext
from unimem.models.gpt_oss import (
    GptOssForCausalLM,
    dequantize_mxfp4,
    rope_inv_freq,
    rope_parameters,
)
from unimem.models.loader import load_model

TOL = 1e-4
PROMPT_LENS = (9, 12, 17, 23, 30, 41)  # all longer than the window (8)


def _prompts(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in PROMPT_LENS]


def _logprob_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().log_softmax(-1) - b.double().log_softmax(-1)).abs().max())


@torch.no_grad()
def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids[None]).logits[0].float()


@pytest.fixture(scope="module", params=["yarn", "default"])
def pair(request, tmp_path_factory):
    """(HF model, our model loaded through ``load_model``, checkpoint dir)."""
    path = tmp_path_factory.mktemp(f"gpt_oss_{request.param}")
    overrides = {"rope_parameters": dict(DEFAULT_ROPE)} if request.param == "default" else {}
    hf = build(path, **overrides)
    ours = load_model(path, dtype=torch.float32)
    assert isinstance(ours, GptOssForCausalLM)
    return hf, ours, path


@pytest.fixture(scope="module")
def yarn_pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_yarn_only")
    hf = build(path)
    return hf, load_model(path, dtype=torch.float32), path


# ---------------------------------------------------------------------- config


def test_hybrid_config(yarn_pair):
    _, ours, _ = yarn_pair
    c = ours.config
    assert c.layer_pattern == ("swa", "full", "swa", "full")
    assert c.window == 8
    assert (c.n_q_heads, c.n_kv_heads, c.head_dim_k, c.head_dim_v) == (4, 2, 16, 16)
    assert (c.ffn_dim, c.d_model, c.vocab_size, c.max_context) == (32, 64, 500, 128)
    assert (c.gdn_heads, c.gdn_head_dim_k, c.gdn_head_dim_v) == (0, 0, 0)
    assert c.rope_theta == 10000.0 and c.rms_eps == 1e-5 and c.attn_scale is None
    assert ours.model.layers[0].self_attn.sinks.dtype == torch.float32
    assert ours.model.norm.weight.dtype == torch.float32


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 150000.0},
        {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },  # truncate defaults to True
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "original_max_position_embeddings": 64,
        },
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "attention_factor": 1.3,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_tables_equal_hf(params):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    hf_cfg = GptOssConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        num_hidden_layers=2,
        max_position_embeddings=256,
        rope_parameters=dict(params),
    )
    rot = GptOssRotaryEmbedding(hf_cfg)
    inv_freq, factor = rope_inv_freq(rope_parameters(hf_cfg), 16, 256)
    assert torch.equal(inv_freq, rot.inv_freq)
    assert factor == rot.attention_scaling
    if params["rope_type"] == "yarn":
        plain, _ = rope_inv_freq(
            {"rope_type": "default", "rope_theta": params["rope_theta"]}, 16, 0
        )
        assert not torch.equal(inv_freq, plain)


# ---------------------------------------------------------------------- numerics vs HF


def test_reference_forward_matches_hf(pair):
    hf, ours, _ = pair
    prompts = _prompts(ours.config.vocab_size)
    got = ours.reference_forward(prompts)
    worst = max(_logprob_diff(g, _hf_logits(hf, p)) for g, p in zip(got, prompts, strict=True))
    print(f"reference_forward vs HF: max |dlogprob| = {worst:.2e}")
    assert worst <= TOL


def test_dense_context_extend_decode_verify(pair):
    hf, ours, _ = pair
    prompts = _prompts(ours.config.vocab_size, seed=1)[2:5]  # lengths 17, 23, 30
    full = [_hf_logits(hf, p) for p in prompts]
    cache = DenseCache(ours.config, max_requests=len(prompts))
    slots = [cache.alloc() for _ in prompts]
    prefix = [9, 11, 10]  # extend prefixes of different lengths (> window)
    done = [0, 0, 0]
    worst = 0.0

    def run(n_tokens: list[int], mode: str) -> tuple[DenseContext, torch.Tensor]:
        ids = torch.cat([p[d : d + n] for p, d, n in zip(prompts, done, n_tokens, strict=True)])
        ctx = DenseContext(cache, slots, n_tokens, mode)
        return ctx, ours(ids, ctx)

    _, logits = run(prefix, "extend")
    for i, n in enumerate(prefix):
        worst = max(worst, _logprob_diff(logits[i], full[i][n - 1]))
        done[i] = n
    for _ in range(3):  # decode
        _, logits = run([1, 1, 1], "decode")
        for i in range(3):
            worst = max(worst, _logprob_diff(logits[i], full[i][done[i]]))
            done[i] += 1
    ctx, logits = run([4, 4, 4], "verify")
    for i in range(3):
        rows = logits[4 * i : 4 * i + 4]
        worst = max(worst, _logprob_diff(rows, full[i][done[i] : done[i] + 4]))
    kept = [1, 4, 2]
    ctx.commit(kept)
    for i in range(3):
        done[i] += kept[i]
    for _ in range(2):  # decode after the partial commit
        _, logits = run([1, 1, 1], "decode")
        for i in range(3):
            worst = max(worst, _logprob_diff(logits[i], full[i][done[i]]))
            done[i] += 1
    print(f"DenseContext vs HF: max |dlogprob| = {worst:.2e}")
    assert worst <= TOL


def test_greedy_generation_matches_hf(yarn_pair):
    hf, ours, _ = yarn_pair
    new = 12
    for prompt in _prompts(ours.config.vocab_size, seed=2)[:3]:
        want = hf.generate(
            prompt[None],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        cache = DenseCache(ours.config, max_requests=1)
        slot = cache.alloc()
        logits = ours(prompt, DenseContext(cache, [slot], [len(prompt)], "extend"))
        got = []
        for _ in range(new):
            tok = int(logits[-1].argmax())
            got.append(tok)
            logits = ours(torch.tensor([tok]), DenseContext(cache, [slot], [1], "decode"))
        assert got == want


# ---------------------------------------------------------------------- wrong mappings fail


def _fresh(hf) -> GptOssForCausalLM:
    return GptOssForCausalLM.from_hf_config(hf.config, dtype=torch.float32, device="cpu")


def _hf_state(hf) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in hf.state_dict().items()}


def test_state_dict_loads_fully_and_matches(yarn_pair):
    hf, ours, _ = yarn_pair
    model = _fresh(hf)
    filled = model.load_weights(_hf_state(hf).items())
    assert filled == set(dict(model.named_parameters()))
    prompt = _prompts(500)[3]
    assert _logprob_diff(model.reference_forward([prompt])[0], _hf_logits(hf, prompt)) <= TOL


@pytest.mark.parametrize(
    "wrong", ["swap_k_v", "gate_up_not_interleaved", "gate_up_transposed", "no_sinks", "no_clamp"]
)
def test_wrong_mapping_changes_logits(yarn_pair, wrong):
    hf, _, _ = yarn_pair
    state = _hf_state(hf)
    p = "model.layers.1."
    if wrong == "swap_k_v":
        for leaf in ("weight", "bias"):
            k, v = f"{p}self_attn.k_proj.{leaf}", f"{p}self_attn.v_proj.{leaf}"
            state[k], state[v] = state[v], state[k]
    elif wrong == "gate_up_not_interleaved":  # [gate | up] columns read as interleaved
        w = state[f"{p}mlp.experts.gate_up_proj"]
        state[f"{p}mlp.experts.gate_up_proj"] = torch.cat([w[..., ::2], w[..., 1::2]], dim=-1)
    elif wrong == "gate_up_transposed":  # d == 2I here: a transposed tensor fits the shape
        w = state[f"{p}mlp.experts.gate_up_proj"]
        state[f"{p}mlp.experts.gate_up_proj"] = w.transpose(1, 2).contiguous()
    elif wrong == "no_sinks":
        state[f"{p}self_attn.sinks"] = torch.full_like(state[f"{p}self_attn.sinks"], -1e4)
    model = _fresh(hf)
    model.load_weights(state.items())
    if wrong == "no_clamp":  # the SwiGLU clamps are reached in this checkpoint
        for layer in model.model.layers:
            layer.mlp.experts.limit = float("inf")
    prompt = _prompts(500)[4]
    diff = _logprob_diff(model.reference_forward([prompt])[0], _hf_logits(hf, prompt))
    print(f"{wrong}: max |dlogprob| = {diff:.2e}")
    assert diff > 1e-2, diff


def test_wrong_shape_and_unknown_name_raise(yarn_pair):
    hf, _, _ = yarn_pair
    model = _fresh(hf)
    bad = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=bad):
        model.load_weights([(bad, torch.zeros(64, 63))])
    bad = "model.layers.0.mlp.experts.gate_up_proj"
    with pytest.raises(ValueError, match=bad):
        model.load_weights([(bad, torch.zeros(4, 64, 32))])
    bad = "model.layers.0.mlp.experts.down_proj_blocks"
    with pytest.raises(ValueError, match=bad):
        model.load_weights([(bad, torch.zeros(4, 64, 2, 16, dtype=torch.uint8))])
    for unknown in (
        "model.layers.9.self_attn.q_proj.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.self_attn.q_proj_blocks",
    ):
        with pytest.raises(ValueError, match=f"unexpected tensor {unknown}"):
            model.load_weights([(unknown, torch.zeros(1))])


@pytest.mark.parametrize(
    "override,field",
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ],
)
def test_unsupported_config_raises(override, field):
    from transformers import GptOssConfig

    kwargs = dict(hidden_size=64, num_attention_heads=4, head_dim=16, num_hidden_layers=2)
    cfg = GptOssConfig(
        **{k: v for k, v in {**kwargs, **override}.items() if k != "quantization_config"}
    )
    if "quantization_config" in override:
        cfg.quantization_config = override["quantization_config"]
    with pytest.raises(ValueError, match=field):
        GptOssForCausalLM.from_hf_config(cfg, dtype=torch.float32, device="cpu")


# ---------------------------------------------------------------------- MXFP4

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1 = torch.cat([_E2M1, -_E2M1])  # code -> value; bit 3 is the sign


def _representable(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random weights exactly representable in MXFP4 along the last dim (groups of 32)."""
    codes = torch.randint(0, 16, shape, generator=g)
    exps = torch.randint(-5, 0, (*shape[:-1], shape[-1] // 32), generator=g)
    return _E2M1[codes] * torch.exp2(exps.float()).repeat_interleave(32, dim=-1)


def _quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of the dequantisation for representable ``w [..., K]``: per group of 32 the
    scale ``2 ** e`` maps the largest magnitude into [4, 8); codes packed two per byte, the
    even element in the low nibble. Asserts that ``w`` was representable."""
    groups = w.unflatten(-1, (-1, 32))
    peak = groups.abs().amax(-1)
    exp = torch.where(peak > 0, torch.floor(torch.log2(peak.clamp_min(1e-30))) - 2, 0).long()
    scaled = groups / torch.exp2(exp.float())[..., None]
    match = scaled[..., None] == _E2M1  # [..., G, 32, 16]
    match[..., 8] &= torch.signbit(scaled)  # -0.0 only for negative zeros
    match[..., 0] &= ~torch.signbit(scaled)
    assert bool(match.any(-1).all()), "not representable"
    codes = match.int().argmax(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def test_mxfp4_round_trip_and_transformers_agree():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(5)
    w = _representable((3, 6, 64), g)
    blocks, scales = _quantize_mxfp4(w)
    assert blocks.shape == (3, 6, 2, 16) and scales.shape == (3, 6, 2)
    assert torch.equal(dequantize_mxfp4(blocks, scales), w)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), w)
    # transformers' own converter returns the transposed ([E, K, rows]) layout
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(theirs.transpose(1, 2), w)


def _mxfp4_checkpoint(hf, seed: int = 6) -> dict[str, torch.Tensor]:
    """Sets the HF model's expert weights to MXFP4-representable values and returns its state
    dict in the hub's format (``*_blocks`` / ``*_scales`` for the expert matrices)."""
    g = torch.Generator().manual_seed(seed)
    state = _hf_state(hf)
    params = dict(hf.named_parameters())
    for name in list(state):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            hub = _representable(tuple(state[name].transpose(1, 2).shape), g)  # [E, out, in]
            with torch.no_grad():
                params[name].copy_(hub.transpose(1, 2))
            del state[name]
            state[f"{name}_blocks"], state[f"{name}_scales"] = _quantize_mxfp4(hub)
    return state


def test_mxfp4_checkpoint_loads(tmp_path):
    hf = build(tmp_path / "dense", seed=3)
    state = _mxfp4_checkpoint(hf)
    # the pairs' halves in any order: scales first here
    model = _fresh(hf)
    items = sorted(state.items(), key=lambda kv: (not kv[0].endswith("_scales"), kv[0]))
    filled = model.load_weights(items)
    assert filled == set(dict(model.named_parameters()))
    lone = _fresh(hf)
    name = "model.layers.0.mlp.experts.down_proj"
    assert name not in lone.load_weights([(f"{name}_blocks", state[f"{name}_blocks"])])
    # through the loader, from a hub-style directory with a quantization_config
    out = tmp_path / "mxfp4"
    out.mkdir()
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    loaded = load_model(out, dtype=torch.float32)
    for prompt in _prompts(500)[:2]:
        want = _hf_logits(hf, prompt)
        assert _logprob_diff(model.reference_forward([prompt])[0], want) <= TOL
        assert _logprob_diff(loaded.reference_forward([prompt])[0], want) <= TOL
