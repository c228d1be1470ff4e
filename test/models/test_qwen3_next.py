"""Qwen3-Next on unimem's model interface against HuggingFace transformers (independent
code) on a tiny random checkpoint (:mod:`tiny_qwen3_next`), CPU float32.

Oracle: HF's logits of every prompt position (eager attention, per-expert MoE). Checked:
the dense oracle (``reference_forward``), a batched :class:`DenseContext` run (extend a
prefix, decode, verify + partial commit, decode again), greedy generation, that wrong weight
mappings are caught, and the loader's errors. The helpers without a ``test_`` prefix are
shared with ``test_qwen3_5.py``.
"""

from __future__ import annotations

import pytest
import tiny_qwen3_next
import torch

from unimem.models.forward_context import DenseCache, DenseContext
from unimem.models.loader import load_model
from unimem.models.qwen3_next import Qwen3NextForCausalLM

TOL = 1e-4
"""Max abs difference of log-softmax values against HF."""

LENGTHS = (10, 13, 29, 47, 66, 90)
"""Prompt lengths: short ones, and ones past the 64-token chunk of the chunked delta rule."""


def prompts(vocab: int, lengths=LENGTHS, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


@torch.no_grad()
def hf_logits(hf_model, ids_list: list[torch.Tensor]) -> list[torch.Tensor]:
    """HF's logits ``[L, vocab]`` of every position of each prompt, run alone."""
    return [hf_model(ids[None]).logits[0].float() for ids in ids_list]


def logprob_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().log_softmax(-1) - b.double().log_softmax(-1)).abs().max())


def reference_diff(model, ids_list, hf) -> float:
    """Max log-prob difference of ``reference_forward`` against HF logits ``hf``."""
    ours = model.reference_forward(ids_list)
    return max(logprob_diff(o, r) for o, r in zip(ours, hf, strict=True))


@torch.no_grad()
def dense_context_diff(model, ids_list, hf, tail: int = 9, verify: int = 4, keep: int = 2):
    """Run all prompts as one batch through a :class:`DenseCache`: extend each prompt but
    its last ``tail`` tokens, decode 2 tokens, verify ``verify`` tokens and keep ``keep`` of
    them, then decode the rest one by one. Every logits row produced is compared with HF's
    row of the same position; returns the max log-prob difference and the rows compared."""
    assert tail >= 2 + verify + 1
    n = len(ids_list)
    cache = DenseCache(model.config, n, model.device)
    slots = [cache.alloc() for _ in range(n)]
    pos = [0] * n  # tokens in the cache per request
    worst, rows = 0.0, 0

    def run(mode: str, counts: list[int]):
        ctx = DenseContext(cache, slots, counts, mode)
        parts = [ids[p : p + k] for ids, p, k in zip(ids_list, pos, counts, strict=True)]
        return ctx, model.forward(torch.cat(parts), ctx)

    def check(logits_rows: torch.Tensor, positions: list[list[int]]) -> None:
        nonlocal worst, rows
        r = 0
        for i, plist in enumerate(positions):
            for p in plist:
                worst = max(worst, logprob_diff(logits_rows[r], hf[i][p]))
                r += 1
        rows += r
        assert r == logits_rows.shape[0]

    counts = [len(ids) - tail for ids in ids_list]
    _, logits = run("extend", counts)
    check(logits, [[k - 1] for k in counts])
    pos = counts
    step = 0
    while pos[0] < len(ids_list[0]):
        if step == 2:  # one verify of several tokens, keeping a prefix
            ctx, logits = run("verify", [verify] * n)
            check(logits, [list(range(p, p + verify)) for p in pos])
            ctx.commit([keep] * n)
            pos = [p + keep for p in pos]
        else:
            _, logits = run("decode", [1] * n)
            check(logits, [[p] for p in pos])
            pos = [p + 1 for p in pos]
        step += 1
    return worst, rows


@torch.no_grad()
def dense_greedy(model, ids_list: list[torch.Tensor], new_tokens: int) -> list[list[int]]:
    """Greedy continuation of every prompt, batched through a :class:`DenseCache`."""
    n = len(ids_list)
    cache = DenseCache(model.config, n, model.device)
    slots = [cache.alloc() for _ in range(n)]
    ctx = DenseContext(cache, slots, [len(ids) for ids in ids_list], "extend")
    nxt = model.forward(torch.cat(ids_list), ctx).argmax(-1)
    out = [[int(t)] for t in nxt]
    for _ in range(new_tokens - 1):
        ctx = DenseContext(cache, slots, [1] * n, "decode")
        nxt = model.forward(nxt, ctx).argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            out[i].append(t)
    return out


@torch.no_grad()
def hf_greedy(hf_model, ids_list: list[torch.Tensor], new_tokens: int) -> list[list[int]]:
    out = []
    for ids in ids_list:
        gen = hf_model.generate(
            ids[None],
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
        out.append(gen[0, len(ids) :].tolist())
    return out


def state_dict_of(hf_model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in hf_model.state_dict().items()}


def load_state(cls, hf_model, sd, dtype=torch.float32):
    model = cls.from_hf_config(hf_model.config, dtype=dtype, device="cpu")
    filled = model.load_weights(sd.items())
    missing = {n for n, _ in model.named_parameters(remove_duplicate=False)} - filled
    assert not missing, missing
    return model


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next")
    hf = tiny_qwen3_next.build(path)
    model = load_model(path, dtype=torch.float32)
    ids = prompts(hf.config.vocab_size)
    return path, hf, model, ids, hf_logits(hf, ids)


# ---------------------------------------------------------------------- tests


def test_config(tiny):
    _, hf, model, _, _ = tiny
    assert isinstance(model, Qwen3NextForCausalLM)
    c = model.config
    assert c.layer_pattern == ("gdn", "gdn", "gdn", "full")
    assert (c.n_q_heads, c.n_kv_heads, c.head_dim_k, c.head_dim_v) == (4, 2, 32, 32)
    assert (c.gdn_heads, c.gdn_key_heads, c.gdn_head_dim_k, c.gdn_head_dim_v) == (4, 2, 16, 16)
    assert (c.conv_kernel, c.ffn_dim, c.window, c.max_context) == (4, 32, None, 256)
    assert c.attention_scale == 32**-0.5 and model.rotary.rotary_dim == 8
    assert model.embed_weight.shape == model.lm_head_weight.shape == (500, 64)
    layer = model.model.layers[0]
    assert layer.linear_attn.A_log.dtype == torch.float32
    assert layer.mlp.experts.gate_up_proj.shape == (4, 64, 64)


def test_reference_forward_matches_hf(tiny):
    _, _, model, ids, hf = tiny
    assert reference_diff(model, ids, hf) <= TOL


def test_dense_context_matches_hf(tiny):
    _, _, model, ids, hf = tiny
    worst, rows = dense_context_diff(model, ids, hf)
    assert rows == len(ids) * 12
    assert worst <= TOL


def test_greedy_matches_hf_generate(tiny):
    _, hf_model, model, ids, _ = tiny
    sel = [ids[1], ids[4]]
    assert dense_greedy(model, sel, 8) == hf_greedy(hf_model, sel, 8)


def test_in_memory_state_dict_loads_the_same(tiny):
    """HF's in-memory names (stacked ``mlp.experts.gate_up_proj``) load to the same model as
    the saved per-expert checkpoint."""
    _, hf_model, model, _, _ = tiny
    sd = state_dict_of(hf_model)
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    other = load_state(Qwen3NextForCausalLM, hf_model, sd)
    ours = dict(model.named_parameters())
    for name, p in other.named_parameters():
        assert torch.equal(p, ours[name]), name


@pytest.mark.parametrize(
    "overrides",
    [
        {"mlp_only_layers": [1, 3]},  # dense MLP on some layers
        {"decoder_sparse_step": 2, "tie_word_embeddings": True},
        {"num_experts": 0},  # dense everywhere
        {"linear_num_key_heads": 4, "norm_topk_prob": False},
    ],
)
def test_variants_match_hf(tmp_path, overrides):
    hf_model = tiny_qwen3_next.build(tmp_path, **overrides)
    model = load_model(tmp_path, dtype=torch.float32)
    if overrides.get("tie_word_embeddings"):
        assert model.lm_head_weight.data_ptr() == model.embed_weight.data_ptr()
    ids = prompts(hf_model.config.vocab_size, lengths=(11, 70))
    assert reference_diff(model, ids, hf_logits(hf_model, ids)) <= TOL


def _swap(sd, a, b):
    sd[a], sd[b] = sd[b].clone(), sd[a].clone()


def _swap_key_head_groups(w: torch.Tensor, hk: int) -> torch.Tensor:
    return w.reshape(hk, -1, w.shape[-1]).flip(0).reshape(w.shape)


@pytest.mark.parametrize("wrong", ["k_v_swapped", "qkvz_key_heads_swapped", "experts_swapped"])
def test_wrong_mapping_is_caught(tiny, wrong):
    _, hf_model, _, ids, hf = tiny
    sd = state_dict_of(hf_model)
    if wrong == "k_v_swapped":
        _swap(
            sd, "model.layers.3.self_attn.k_proj.weight", "model.layers.3.self_attn.v_proj.weight"
        )
    elif wrong == "qkvz_key_heads_swapped":
        name = "model.layers.1.linear_attn.in_proj_qkvz.weight"
        sd[name] = _swap_key_head_groups(sd[name], 2)
    else:
        name = "model.layers.2.mlp.experts.gate_up_proj"
        sd[name] = sd[name].flip(0).contiguous()
    model = load_state(Qwen3NextForCausalLM, hf_model, sd)
    assert reference_diff(model, ids[:3], hf[:3]) > 100 * TOL


def test_loader_errors(tiny):
    _, hf_model, _, _, _ = tiny
    model = Qwen3NextForCausalLM.from_hf_config(hf_model.config, dtype=torch.float32, device="cpu")
    bad = "model.layers.3.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=bad.replace(".", r"\.")):
        model.load_weights([(bad, torch.zeros(7, 64))])
    with pytest.raises(ValueError, match="in_proj_qkvz"):
        model.load_weights([("model.layers.0.linear_attn.in_proj_qkvz.weight", torch.zeros(7, 64))])
    with pytest.raises(ValueError, match=r"unexpected tensor model\.layers\.0\.foo\.weight"):
        model.load_weights([("model.layers.0.foo.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"unexpected tensor .*experts\.4\.up_proj"):
        model.load_weights([("model.layers.0.mlp.experts.4.up_proj.weight", torch.zeros(32, 64))])
    assert model.load_weights([("mtp.fc.weight", torch.zeros(3))]) == set()


def test_unsupported_config_is_rejected():
    cfg = tiny_qwen3_next.config()
    cfg.rope_parameters = {**cfg.rope_parameters, "rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="rope_parameters"):
        Qwen3NextForCausalLM.from_hf_config(cfg, dtype=torch.float32, device="cpu")
    cfg = tiny_qwen3_next.config()
    cfg.layer_types = [
        "linear_attention",
        "sliding_attention",
        "linear_attention",
        "full_attention",
    ]
    with pytest.raises(ValueError, match=r"layer_types\[1\]"):
        Qwen3NextForCausalLM.from_hf_config(cfg, dtype=torch.float32, device="cpu")
