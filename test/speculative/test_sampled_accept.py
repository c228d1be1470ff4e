"""The offline estimate of speculative sampling's accept length
(:mod:`unimem.training.sampled_accept`) against chain speculative sampling simulated step by
step, and the soft terms that train for it (``soft_temperature``, ``soft_loss="tv"``).

A tiny Gemma 3 (vocabulary 500, CPU, float32) and an untrained drafter of one layer: from one
fixed context, the estimate over continuations the target samples at temperature 0.7 equals
the mean committed tokens of many simulated verify steps — each draft drawn from the drafter's
column distribution at the draft temperature, accepted with probability ``min(1, p / q)``
against the target's distribution on the prefix drafted so far — within their sampling
error, at draft-temperature scales 1, 0.5 and 0 (the drafter's argmax), for a drafter trained
briefly on the target's text with the temperature's soft term.
"""

from __future__ import annotations

import json

import pytest
import torch

from unimem.speculative.checkpoint import save_drafter
from unimem.speculative.drafter import DsparkDrafter, draft_config_for
from unimem.training.sampled_accept import main, sampled_accept_lengths
from unimem.training.teacher_forcing import BatchedSequencesContext, teacher_forced_states
from unimem.training.train_forward import block_logits_dense, distill_losses
from unimem.training.trainer import TrainConfig, train_drafter

GAMMA = 3
T = 0.7
VOCAB = 500


@torch.no_grad()
def _last_logits(model, seqs: torch.Tensor) -> torch.Tensor:
    """The target's logits after each row of ``seqs [N, S]`` (float64 ``[N, V]``)."""
    n, s = seqs.shape
    ctx = BatchedSequencesContext(model.config, n, s, (), model.device)
    return model.forward_with_hidden(seqs.reshape(-1), ctx).logits.double()


@torch.no_grad()
def _sample(model, prefix: list[int], n: int, steps: int, g: torch.Generator) -> torch.Tensor:
    """``n`` continuations of ``prefix`` by ``steps`` tokens sampled at ``T``: ``[n, S]``."""
    seqs = torch.tensor([prefix] * n)
    for _ in range(steps):
        p = torch.softmax(_last_logits(model, seqs) / T, -1)
        seqs = torch.cat([seqs, torch.multinomial(p, 1, generator=g)], dim=1)
    return seqs


@torch.no_grad()
def _simulate(model, drafter, prefix, base, scale, trials, g) -> float:
    """Mean tokens committed per verify step of chain speculative sampling from ``prefix``
    (its last token the anchor), ``base [GAMMA, V]`` the drafter's block logits there."""
    rows = torch.tensor([prefix] * trials)
    alive = torch.ones(trials, dtype=torch.bool)
    committed = torch.ones(trials, dtype=torch.float64)  # the residual / bonus token
    prev = rows[:, -1]
    for i in range(GAMMA):
        logits = base[i][None].double() + drafter.markov_bias(prev).double()
        if scale == 0:
            x = logits.argmax(-1)
            q_x = torch.ones(trials, dtype=torch.float64)
        else:
            q = torch.softmax(logits / (T * scale), -1)
            x = torch.multinomial(q, 1, generator=g)[:, 0]
            q_x = q.gather(1, x[:, None])[:, 0]
        p = torch.softmax(_last_logits(model, rows) / T, -1)
        p_x = p.gather(1, x[:, None])[:, 0]
        u = torch.rand(trials, generator=g, dtype=torch.float64)
        alive &= u < (p_x / q_x).clamp(max=1.0)
        committed += alive.double()
        rows = torch.cat([rows, x[:, None]], dim=1)
        prev = x
    return float(committed.mean())


def _trained_drafter(model, dc, g) -> DsparkDrafter:
    """A drafter trained briefly on the target's sampled text (so that it drafts tokens the
    target accepts: the comparison then covers long chains, not just first rejections)."""
    seqs = _sample(model, [2], 64, 20, g)
    data = teacher_forced_states(model, seqs.tolist(), [4] * 64, dc.target_layers, soft_top_k=32)
    start = DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=5)
    cfg = TrainConfig(
        steps=60, batch=16, anchors_per_step=16, gamma=GAMMA, lr=1e-2, warmup=5,
        eval_every=100, save_every=100, head_steps=0, progress=False, soft_weight=1.0,
        soft_temperature=T,
    )  # fmt: skip
    return train_drafter(start, data, None, cfg).drafter


def test_estimate_equals_simulated_speculative_sampling(gemma):
    _, model = gemma
    g = torch.Generator().manual_seed(11)
    dc = draft_config_for(model.config, num_layers=1)
    drafter = _trained_drafter(model, dc, g)
    prefix = _sample(model, [2], 1, 9, g)[0].tolist()  # a context and its anchor token
    n = 2000
    seqs = _sample(model, prefix, n, GAMMA, g)
    plen = len(prefix) - 1  # the anchor (the context's last token) is the first anchor
    # one anchor per sequence: anchor plen drafts positions plen+1 .. plen+GAMMA
    data = teacher_forced_states(
        model, seqs.tolist(), [plen] * n, dc.target_layers, soft_top_k=VOCAB
    )
    est = sampled_accept_lengths(drafter, data, GAMMA, T, (1.0, 0.5, 0.0))
    assert est[1.0]["anchors"] == n
    one = teacher_forced_states(model, [prefix], [plen], dc.target_layers)
    base = block_logits_dense(drafter, one.tokens, one.hidden, torch.tensor([plen]), GAMMA)
    for scale in (1.0, 0.5, 0.0):
        sim = _simulate(model, drafter, prefix, base[0, 0], scale, 4000, g)
        got = est[scale]["accept"]
        assert 1.0 <= got <= GAMMA + 1
        assert abs(got - sim) < 0.08, (scale, got, sim)
        # the first column's alpha is exact (no sampled prefix): sum min(p, q)
        assert 0.0 < est[scale]["alpha"][0] <= est[scale]["coverage"][0] + 1e-6
    assert est[1.0]["coverage"][0] == pytest.approx(1.0, abs=1e-3)  # full vocabulary


def test_estimate_refuses_data_without_soft_targets(gemma):
    _, model = gemma
    dc = draft_config_for(model.config, num_layers=1)
    drafter = DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=5)
    data = teacher_forced_states(model, [[2, 5, 7, 9, 11, 13]], [1], dc.target_layers)
    with pytest.raises(ValueError, match="soft targets"):
        sampled_accept_lengths(drafter, data, GAMMA, T, (1.0,))
    soft = teacher_forced_states(model, [[2, 5, 7, 9, 11, 13]], [1], dc.target_layers, soft_top_k=8)
    with pytest.raises(ValueError, match="temperature"):
        sampled_accept_lengths(drafter, soft, GAMMA, 0.0, (1.0,))
    with pytest.raises(ValueError, match="scales"):
        sampled_accept_lengths(drafter, soft, GAMMA, T, (-1.0,))


def _loss_case(model):
    g = torch.Generator().manual_seed(3)
    seqs = _sample(model, [2, 7, 9], 4, 12, g)
    dc = draft_config_for(model.config, num_layers=1)
    tf = teacher_forced_states(model, seqs.tolist(), [3] * 4, dc.target_layers, soft_top_k=16)
    drafter = DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=4)
    anchors = torch.arange(3, int(tf.lengths.max()) - 1)
    args = (drafter, tf.tokens, tf.hidden, anchors, GAMMA, tf.prompt_lens, tf.lengths)
    return tf, drafter, anchors, args


def test_total_variation_soft_term(gemma):
    """``soft_loss="tv"`` with weight 1 is the mean over entries of ``1 - sum min(p_T, q_T)``
    over the target's soft tokens (``p`` renormalised over them at ``T``, ``q`` the drafter's
    column softmax at ``T``), recomputed here from the block logits."""
    _, model = gemma
    tf, drafter, anchors, args = _loss_case(model)
    got = distill_losses(*args, soft=(tf.soft_ids, tf.soft_probs), soft_weight=1.0,
                         soft_temperature=T, soft_loss="tv")  # fmt: skip
    base = block_logits_dense(drafter, tf.tokens, tf.hidden, anchors, GAMMA).double()
    total, count = 0.0, 0
    for b in range(tf.tokens.shape[0]):
        for ai, a in enumerate(anchors.tolist()):
            for i in range(GAMMA):
                pos = a + i
                if pos + 1 >= int(tf.lengths[b]):
                    continue
                prev = tf.tokens[b, pos]
                logits = base[b, ai, i] + drafter.markov_bias(prev[None])[0].double()
                q = torch.softmax(logits / T, -1)
                ids = tf.soft_ids[b, pos].long()
                p = tf.soft_probs[b, pos].double() ** (1 / T)
                p = p / p.sum()
                total += 1.0 - float(torch.minimum(p, q[ids]).sum())
                count += 1
    assert got.n == count
    assert float(got.ce) == pytest.approx(total / count, rel=1e-4)
    # a drafter equal to the soft targets would score 0; an untrained one does not
    assert 0.0 < float(got.ce) < 1.0


def test_soft_temperature_one_is_the_plain_soft_cross_entropy(gemma):
    _, model = gemma
    tf, _, _, args = _loss_case(model)
    soft = (tf.soft_ids, tf.soft_probs)
    plain = distill_losses(*args, soft=soft, soft_weight=0.6)
    same = distill_losses(*args, soft=soft, soft_weight=0.6, soft_temperature=1.0, soft_loss="ce")
    assert torch.equal(plain.ce, same.ce)
    hot = distill_losses(*args, soft=soft, soft_weight=0.6, soft_temperature=T)
    assert not torch.equal(plain.ce, hot.ce)
    with pytest.raises(ValueError, match="soft_loss"):
        distill_losses(*args, soft=soft, soft_weight=0.6, soft_loss="kl")
    with pytest.raises(ValueError, match="soft_temperature"):
        distill_losses(*args, soft=soft, soft_weight=0.6, soft_temperature=0.0)
    with pytest.raises(ValueError, match="soft_loss"):
        TrainConfig(soft_loss="kl")
    with pytest.raises(ValueError, match="soft_temperature"):
        TrainConfig(soft_temperature=-1.0)


def test_command(gemma, tmp_path, capsys):
    path, model = gemma
    dc = draft_config_for(model.config, num_layers=1)
    out = tmp_path / "drafter"
    save_drafter(DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=5), out)
    report = tmp_path / "r.json"
    argv = ["--model-path", str(path), "--drafter", str(out), "--requests", "3", "--tokens",
            "12", "--gamma", "3", "--scales", "0,1", "--top-k-probs", "32", "--device", "cpu",
            "--json", str(report)]  # fmt: skip
    assert main(argv) == 0
    got = json.loads(report.read_text())
    assert set(got["scales"]) == {"0", "1"}
    assert all(1.0 <= r["accept"] <= 4.0 for r in got["scales"].values())
    assert "argmax" in capsys.readouterr().out
