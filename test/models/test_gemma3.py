"""Gemma 3 text (``unimem.models.gemma3``) against transformers' eager ``Gemma3ForCausalLM`` on
tiny random checkpoints (``tiny_gemma3``), CPU float32.

Two checkpoints: the defaults (5 sliding : 1 full, distinct local/global RoPE bases) and one
with linear RoPE scaling on the global layers plus final-logit softcapping. Every check is
on log-softmax differences, bound ``TOL``: dense oracle, a batched extend / decode / verify
run through ``DenseContext``, greedy generation, wrong weight mappings, loader errors, and
the multimodal (``Gemma3ForConditionalGeneration``) checkpoint layouts.
"""

from __future__ import annotations

import pytest
import tiny_gemma3
import torch

from unimem.models.forward_context import DenseCache, DenseContext
from unimem.models.gemma3 import Gemma3ForCausalLM
from unimem.models.loader import checkpoint_files, iter_checkpoint, load_model, load_weights_into

TOL = 1e-4
LENGTHS = (9, 13, 17, 24, 31, 40)  # all longer than the window (8)
VARIANTS = {
    "base": {},
    "scaled_capped": {
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "final_logit_softcapping": 2.0,
    },
}


def _prompts(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in LENGTHS]


def _lp_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double().log_softmax(-1) - b.double().log_softmax(-1)).abs().max().item()


class Case:
    """One checkpoint: the HF model, ours (through ``load_model``), prompts, HF logits."""

    def __init__(self, path, overrides: dict) -> None:
        self.path = path
        self.hf = tiny_gemma3.build(path, **overrides)
        self.model = load_model(path, dtype=torch.float32)
        self.prompts = _prompts(self.hf.config.vocab_size)
        with torch.no_grad():
            self.hf_logits = [self.hf(p[None]).logits[0].float() for p in self.prompts]

    def fresh(self, state: dict[str, torch.Tensor]) -> Gemma3ForCausalLM:
        """Our model loaded from ``state`` (names -> tensors), tied like the loader does."""
        m = Gemma3ForCausalLM.from_hf_config(self.hf.config, dtype=torch.float32, device="cpu")
        load_weights_into(m, state.items(), tie_embeddings=True, where="test")
        return m


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory) -> Case:
    return Case(tmp_path_factory.mktemp(request.param), VARIANTS[request.param])


# ---------------------------------------------------------------------- forward


def test_config_mapping(case):
    c = case.model.config
    assert c.layer_pattern == ("swa",) * 5 + ("full",)
    assert c.window == 8
    assert (c.n_q_heads, c.n_kv_heads, c.head_dim_k, c.head_dim_v) == (4, 2, 16, 16)
    assert c.ffn_dim == 128 and c.max_context == 256
    assert c.attention_scale == pytest.approx(24**-0.5)
    # the loader tied the LM head to the embedding
    assert torch.equal(case.model.lm_head_weight, case.model.embed_weight)


def test_reference_forward_matches_hf(case):
    ours = case.model.reference_forward(case.prompts)
    diffs = [_lp_diff(o, r) for o, r in zip(ours, case.hf_logits, strict=True)]
    assert max(diffs) <= TOL, diffs


def test_dense_context_extend_decode_verify(case):
    """All prompts batched: extend a prefix, decode 3, verify 3 (keeping 1..3), decode the
    rest; every logits row equals HF's at its position."""
    model, prompts, ref = case.model, case.prompts, case.hf_logits
    cache = DenseCache(model.config, max_requests=len(prompts))
    slots = [cache.alloc() for _ in prompts]
    done = [0] * len(prompts)  # tokens in the cache, per request
    worst = 0.0

    def step(reqs: list[int], counts: list[int], mode: str) -> DenseContext:
        nonlocal worst
        feeds = zip(reqs, counts, strict=True)
        ids = torch.cat([prompts[r][done[r] : done[r] + n] for r, n in feeds])
        ctx = DenseContext(cache, [slots[r] for r in reqs], counts, mode)
        logits = model(ids, ctx)
        row = 0
        for r, n in zip(reqs, counts, strict=True):
            positions = [done[r] + n - 1] if mode == "extend" else range(done[r], done[r] + n)
            for p in positions:
                worst = max(worst, _lp_diff(logits[row], ref[r][p]))
                row += 1
            if mode != "verify":
                done[r] += n
        assert row == logits.shape[0]
        return ctx

    everyone = list(range(len(prompts)))
    step(everyone, [n - 7 for n in LENGTHS], "extend")
    for _ in range(3):
        step(everyone, [1] * len(everyone), "decode")
    ctx = step(everyone, [3] * len(everyone), "verify")
    kept = [1 + r % 3 for r in everyone]
    ctx.commit(kept)
    done = [d + k for d, k in zip(done, kept, strict=True)]
    while active := [r for r in everyone if done[r] < LENGTHS[r]]:
        step(active, [1] * len(active), "decode")
    assert done == list(LENGTHS)
    assert worst <= TOL, worst


def test_greedy_generation_matches_hf(case):
    model, eos = case.model, case.hf.config.eos_token_id
    cache = DenseCache(model.config, max_requests=1)
    for prompt in case.prompts[:3]:
        with torch.no_grad():
            hf_out = case.hf.generate(prompt[None], max_new_tokens=12, do_sample=False)[0]
        hf_new = hf_out[prompt.shape[0] :].tolist()
        slot = cache.alloc()
        ids, ours = prompt, []
        mode = "extend"
        while len(ours) < 12:
            ctx = DenseContext(cache, [slot], [ids.shape[0]], mode)
            token = int(model(ids, ctx)[-1].argmax())
            ours.append(token)
            if token == eos:
                break
            ids, mode = torch.tensor([token]), "decode"
        cache.free(slot)
        assert ours == hf_new


# ---------------------------------------------------------------------- wrong mappings


def _heads_rolled(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    return w.unflatten(0, (-1, head_dim)).roll(1, dims=0).flatten(0, 1)


@pytest.mark.parametrize("wrong", ["q_heads_permuted", "gate_up_swapped", "q_k_norm_swapped"])
def test_wrong_mapping_changes_logits(case, wrong):
    state = {k: v.clone() for k, v in case.hf.state_dict().items()}
    for i in range(case.hf.config.num_hidden_layers):
        pre = f"model.layers.{i}."
        if wrong == "q_heads_permuted":
            name = pre + "self_attn.q_proj.weight"
            state[name] = _heads_rolled(state[name], 16)
        else:
            a, b = {
                "gate_up_swapped": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                "q_k_norm_swapped": ("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
            }[wrong]
            state[pre + a], state[pre + b] = state[pre + b], state[pre + a]
    ours = case.fresh(state).reference_forward(case.prompts[:2])
    diff = max(_lp_diff(o, r) for o, r in zip(ours, case.hf_logits[:2], strict=True))
    assert diff > 1e3 * TOL, diff


def test_bad_tensors_raise(case):
    m = Gemma3ForCausalLM.from_hf_config(case.hf.config, dtype=torch.float32, device="cpu")
    name = "model.layers.2.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match=rf"tensor {name}: shape"):
        m.load_weights([(name, torch.zeros(64, 32))])
    bogus = "model.layers.2.self_attn.rotary.weight"
    with pytest.raises(ValueError, match=rf"unexpected tensor {bogus}"):
        m.load_weights([(bogus, torch.zeros(16))])


# ---------------------------------------------------------------------- configs


def test_unsupported_configs_raise():
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        Gemma3ForCausalLM.from_hf_config(
            tiny_gemma3.config(attn_logit_softcapping=50.0), dtype=torch.float32, device="cpu"
        )
    cfg = tiny_gemma3.config(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type"):
        Gemma3ForCausalLM.from_hf_config(cfg, dtype=torch.float32, device="cpu")


def test_explicit_layer_types_and_rope_per_kind(tmp_path):
    """layer_types given explicitly (full layers first and in the middle); a model whose
    local and global RoPE were exchanged must differ."""
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    hf = tiny_gemma3.build(tmp_path, num_hidden_layers=4, layer_types=types)
    model = load_model(tmp_path, dtype=torch.float32)
    assert model.config.layer_pattern == ("full", "swa", "swa", "full")
    prompts = _prompts(500)[3:]
    with torch.no_grad():
        ref = [hf(p[None]).logits[0] for p in prompts]
    ours = model.reference_forward(prompts)
    assert max(_lp_diff(o, r) for o, r in zip(ours, ref, strict=True)) <= TOL
    model.inv_freq_full, model.inv_freq_swa = model.inv_freq_swa, model.inv_freq_full
    ours = model.reference_forward(prompts)
    assert max(_lp_diff(o, r) for o, r in zip(ours, ref, strict=True)) > 1e3 * TOL


# ---------------------------------------------------------------------- multimodal layouts


def test_multimodal_checkpoint_text_weights(tmp_path):
    """A tiny ``Gemma3ForConditionalGeneration``: the text model loads from the saved file
    (hub layout ``language_model.model.*``, vision tensors skipped) and from the in-memory
    state dict (``model.language_model.*``), and matches HF's text-only logits."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    text = tiny_gemma3.config(rope_scaling={"rope_type": "linear", "factor": 8.0})
    cfg = Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4
    )
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(str(tmp_path))
    hf.config.text_config._attn_implementation = "eager"
    hf.config._attn_implementation = "eager"
    prompts = _prompts(500)[:3]
    with torch.no_grad():
        ref = [hf(input_ids=p[None]).logits[0] for p in prompts]

    saved = iter_checkpoint(
        checkpoint_files(tmp_path),
        torch.device("cpu"),
        Gemma3ForCausalLM.ignored_checkpoint_prefixes,
    )
    for weights in (saved, hf.state_dict().items()):
        m = Gemma3ForCausalLM.from_hf_config(hf.config, dtype=torch.float32, device="cpu")
        load_weights_into(m, weights, tie_embeddings=True, where=str(tmp_path))
        assert m.config.layer_pattern == ("swa",) * 5 + ("full",)
        ours = m.reference_forward(prompts)
        assert max(_lp_diff(o, r) for o, r in zip(ours, ref, strict=True)) <= TOL
