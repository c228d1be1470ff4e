"""Drafter distillation (CPU, float64, a target smaller than ``tiny``):

- the training forward computes the inference function: its logits equal ``block_logits``
  through the inference path for every anchor;
- a short distillation lowers the loss and raises the greedy accept length measured through
  the engine on held-out prompts over the untrained drafter it started from, and the
  distilled drafter's speculative outputs equal non-speculative greedy outputs;
- the command line writes a checkpoint that ``validate --speculative-draft-model-path`` runs;
- a drafter re-windowed to a bounded context (every layer SWA-hosted) keeps its training
  forward equal to the inference function, and the engine applies its window: its accept
  length follows the offline replay of the same windowed drafter, not the unbounded one's.
"""

from __future__ import annotations

import pytest
import torch

from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.engine.core import EngineCore
from unimem.memory.static import StaticMemory
from unimem.models.config import HybridConfig, memory_spec
from unimem.models.forward_context import masked_attention
from unimem.models.synthetic import HybridModel
from unimem.speculative.chain import DsparkChain
from unimem.speculative.checkpoint import load_drafter, save_drafter
from unimem.speculative.drafter import DsparkDrafter, draft_config_for, with_context_window
from unimem.training.distill import (
    DistillConfig,
    distill,
    greedy_rollouts,
    main,
    offline_accept_length,
    random_prompts,
)
from unimem.training.train_forward import block_logits_dense
from unimem.validate.protocol import ValidateConfig, validate

GAMMA = 4


def _mini() -> HybridConfig:
    return HybridConfig(
        vocab_size=96,
        d_model=64,
        n_q_heads=2,
        n_kv_heads=1,
        head_dim_k=32,
        head_dim_v=32,
        ffn_dim=128,
        layer_pattern=("full", "gdn", "swa", "full"),
        window=16,
        gdn_heads=2,
        gdn_head_dim_k=16,
        gdn_head_dim_v=16,
        dtype=torch.float64,
        max_context=512,
    )


@pytest.fixture(scope="module")
def mini():
    cfg = _mini()
    return cfg, HybridModel(cfg, seed=0)


def _untrained(model, seed=17):
    dc = draft_config_for(model.config)
    return DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=seed)


@pytest.mark.parametrize("context_window", [None, 6])
def test_training_forward_is_the_inference_function(mini, context_window):
    """``block_logits_dense`` at every anchor == ``block_logits`` with the context K/V of
    the positions before the anchor and a dense causal (windowed) attention."""
    cfg, model = mini
    drafter = _untrained(model)
    if context_window is not None:
        drafter.config = with_context_window(drafter.config, context_window, cfg)
    dc = drafter.config
    data = greedy_rollouts(model, random_prompts(2, 12, cfg.vocab_size, 5), 20, dc.target_layers)
    anchors = torch.tensor([1, 5, 12, 20, 30])  # past the SWA draft window (8) too
    dense = block_logits_dense(drafter, data.tokens, data.hidden, anchors, GAMMA)
    for b in range(2):
        for a, n in enumerate(anchors.tolist()):
            ctx = drafter.context_kv([h[b, :n] for h in data.hidden], torch.arange(n))
            q_pos = torch.arange(n, n + GAMMA)

            def attend(j, q, k, v, ctx=ctx, n=n, q_pos=q_pos):
                keys, values = torch.cat([ctx[j][0], k]), torch.cat([ctx[j][1], v])
                k_pos = torch.arange(n + GAMMA)
                window, scale = dc.layer_window(j), q.shape[-1] ** -0.5
                return masked_attention(q, keys, values, q_pos, k_pos, window, scale)

            want = drafter.block_logits(data.tokens[b, n : n + 1], q_pos, attend)[0]
            torch.testing.assert_close(dense[b, a], want, rtol=0, atol=1e-10)


def _engine_run(model, prompts, output_len, drafter=None):
    """Greedy outputs, and with ``drafter`` the accept length (no acceptance control)."""
    cfg = model.config
    lanes = drafter.config.lanes() if drafter is not None else ()
    pool = StaticMemory(memory_spec(cfg, 16, lanes), 128, 128, 8, 8, cfg.max_context)
    chain = DsparkChain(drafter, GAMMA) if drafter is not None else None
    eng = EngineCore(model, pool, TorchReferenceBackend(), 8, 64, chain=chain)
    reqs = [eng.submit(p, output_len) for p in prompts]
    eng.run()
    outputs = [r.output for r in reqs]
    if drafter is None:
        return outputs, None
    return outputs, sum(r.verified_tokens for r in reqs) / sum(r.verify_steps for r in reqs)


def test_distillation_lowers_the_loss_and_raises_the_accept_length(mini, tmp_path):
    cfg, model = mini
    start = _untrained(model)
    before = {n: p.clone() for n, p in start.named_parameters()}
    dcfg = DistillConfig(
        steps=40,
        prompts=24,
        prompt_len=16,
        gen_len=32,
        gamma=GAMMA,
        lr=1e-2,
        batch=4,
        seed=0,
        eval_prompts=4,
        log_every=0,
    )
    result = distill(model, dcfg, drafter=start)
    losses = result.losses
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    drafter = result.drafter
    assert drafter.config.gamma == GAMMA and drafter.config.dtype == torch.float64
    assert not any(p.requires_grad for p in drafter.parameters())
    # the drafter it started from is untouched
    assert all(torch.equal(p, before[n]) for n, p in start.named_parameters())
    assert result.accept_after > result.accept_before

    # through the engine, on held-out prompts (another seed than the training prompts),
    # after a checkpoint round trip
    save_drafter(drafter, tmp_path / "d")
    distilled = load_drafter(tmp_path / "d", model)
    prompts = random_prompts(8, 16, cfg.vocab_size, seed=12345)
    ref, _ = _engine_run(model, prompts, 32)
    out_u, accept_u = _engine_run(model, prompts, 32, start)
    out_d, accept_d = _engine_run(model, prompts, 32, distilled)
    assert out_u == ref and out_d == ref  # speculation never changes greedy outputs
    assert accept_d > accept_u + 0.5, (accept_u, accept_d)
    # the offline replay of the engine's schedule measures the same kind of number
    held = greedy_rollouts(model, prompts, 32, distilled.config.target_layers)
    assert offline_accept_length(distilled, held, GAMMA) > accept_u + 0.5

    # re-windowed to 4 positions of context (prompts 16 + outputs 32 go far past it): the
    # engine drafts with the window — its accept length follows the offline replay of the
    # windowed drafter (the two schedules differ by ~0.02 at most here), which is away from
    # the unbounded drafter's
    unbounded = offline_accept_length(distilled, held, GAMMA)
    trained = distilled.config
    for window, hosts in ((4, ("swa", "swa")), (20, ("full", "full"))):
        # 20 > the target's SWA window (16): FULL-hosted layers with the window as a mask
        distilled.config = with_context_window(trained, window, cfg)
        assert distilled.config.layer_hosts == hosts
        assert [distilled.config.layer_window(j) for j in range(2)] == [window, window]
        out_w, accept_w = _engine_run(model, prompts, 32, distilled)
        assert out_w == ref
        windowed = offline_accept_length(distilled, held, GAMMA)
        assert abs(windowed - unbounded) > 0.03, (window, windowed, unbounded)
        assert abs(accept_w - windowed) < 0.03, (window, accept_w, windowed, unbounded)


def test_command_line_writes_a_checkpoint_validate_runs(tmp_path, capsys):
    out = tmp_path / "drafter"
    args = ["--preset", "tiny", "--out", str(out), "--steps", "3", "--prompts", "2"]
    args += ["--prompt-len", "8", "--gen-len", "6", "--gamma", "3", "--eval-prompts", "0"]
    assert main(args) == 0
    assert "wrote" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    report = validate(
        ValidateConfig(
            requests=2,
            input_len=16,
            output_len=8,
            spec="dspark",
            gamma=3,
            accept_rate=0.0,
            speculative_draft_model_path=str(out),
        )
    )
    assert report["exact_match"] == 2
    assert report["spec_matches_reference"] == 2, report["spec_mismatches"]
    assert report["static"]["verify_steps"] > 0


def test_command_line_errors(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\n")
    args = ["--preset", "tiny", "--out", str(tmp_path / "d"), "--prompts", str(prompts)]
    assert main(args) == 2
    assert "text prompts need a --model-path tokenizer" in capsys.readouterr().err
    assert main(["--preset", "tiny", "--out", str(tmp_path / "d"), "--steps", "0"]) == 2
    assert "DistillConfig.steps" in capsys.readouterr().err
