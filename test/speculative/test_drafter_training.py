"""Training a drafter on text the target writes (a tiny Gemma 3 checkpoint, CPU, float32):

- teacher-forced states (batched, one extend over whole sequences) equal the states captured
  while generating;
- a short training run on the target's own text — prompts it samples from ``<bos>`` at
  temperature 1, greedy continuations — raises the held-out accept length well above the
  untrained drafter's (a bound that fails if training does nothing), with a reduced draft
  vocabulary; the confidence head is calibrated on held-out data;
- a run stopped and resumed from its checkpoint directory continues where it stopped;
- the most frequent tokens make the draft vocabulary; prompt files with splits;
- the shipped drafter of a model is used by default by ``Engine`` (DSPARK), an explicit
  drafter path wins, a drafter that does not fit is ignored;
- the draft layers' context window (``--context-window``, the default): every layer
  SWA-hosted where the target's SWA layers reach, else FULL-hosted with the window as a
  mask; a windowed drafter in the Engine, static and unified; the shipped drafters attend no
  further back than the sequences they trained on; the held-out
  continuations run ``--eval-len`` tokens; the offline evaluations give the same numbers in
  anchor chunks, and by output position (``python -m unimem.training.accept_by_position``);
- a trained drafter grows deeper (``with_extra_layers``, ``--init`` with more
  ``--draft-layers``) drafting exactly as before until trained, and its projections can be
  stored in float8 (``--fp8-weights``);
- slow tier: the whole command (``python -m unimem.training.train_drafter``: Engine-written
  data, training, checkpoint) and the engine's own accept length on held-out prompts
  (no acceptance control) against the untrained drafter, outputs exact.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from unimem.models.loader import load_checkpoint
from unimem.speculative import shipped
from unimem.speculative.checkpoint import save_drafter
from unimem.speculative.drafter import (
    DsparkDrafter,
    draft_config_for,
    with_context_window,
    with_extra_layers,
)
from unimem.training.distill import Rollouts, greedy_rollouts
from unimem.training.prompt_sets import read_prompts
from unimem.training.teacher_forcing import (
    BatchedSequencesContext,
    states_of,
    teacher_forced_states,
    tokens_only,
)
from unimem.training.trainer import (
    TrainConfig,
    frequent_tokens,
    offline_accept_lengths,
    train_drafter,
)

GAMMA = 4
BOS = 2


@torch.no_grad()
def _generate(model, prompts, gen_len, temperature, seed):
    """Continuations of equal-length ``prompts`` by recomputing the whole batch each step
    (small models only): greedy at temperature 0, else sampled."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.tensor(prompts)
    for _ in range(gen_len):
        b, s = seqs.shape
        ctx = BatchedSequencesContext(model.config, b, s, (), model.device)
        logits = model.forward_with_hidden(seqs.reshape(-1), ctx).logits.double()
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        seqs = torch.cat([seqs, nxt], dim=1)
    return seqs.tolist()


def _text(model, n, seed, prompt_len=8, gen_len=32):
    """``n`` sequences the target writes: a prompt sampled from <bos> at temperature 1,
    then a greedy continuation."""
    prompts = _generate(model, [[BOS]] * n, prompt_len - 1, 1.0, seed)
    return _generate(model, prompts, gen_len, 0.0, seed), [prompt_len] * n


def test_teacher_forced_states_equal_captured_ones(gemma):
    _, model = gemma
    prompts = [[BOS, 5, 9, 30, 7], [BOS, 11, 12], [BOS, 40, 41, 42, 43, 44, 45]]
    layers = (1, 3, 5)
    cap = greedy_rollouts(model, prompts, 12, layers)
    seqs = [cap.tokens[i, : int(cap.lengths[i])].tolist() for i in range(3)]
    tf = teacher_forced_states(model, seqs, [len(p) for p in prompts], layers)
    for i in range(3):
        n = int(cap.lengths[i]) - 1  # captured: every position the target ran
        for a, b in zip(cap.hidden, tf.hidden, strict=True):
            torch.testing.assert_close(a[i, :n], b[i, :n], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="prompt length"):
        teacher_forced_states(model, seqs, [0, 1, 1], layers)


def test_training_on_the_targets_text_raises_the_accept_length(gemma, tmp_path):
    _, model = gemma
    seqs, lens = _text(model, 96, seed=1)
    held_seqs, held_lens = _text(model, 8, seed=2)  # other prompts: never trained on
    dc = draft_config_for(model.config, num_layers=1, draft_vocab_size=128)
    train = teacher_forced_states(model, seqs[:88], lens[:88], dc.target_layers)
    calib = teacher_forced_states(model, seqs[88:], lens[88:], dc.target_layers)
    held = teacher_forced_states(model, held_seqs, held_lens, dc.target_layers)
    d2t = frequent_tokens(train, 128, model.config.vocab_size)
    start = DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=17, d2t=d2t)
    cfg = TrainConfig(
        steps=100, batch=16, anchors_per_step=16, gamma=GAMMA, lr=1e-2, warmup=10,
        eval_every=50, save_every=50, checkpoint_dir=str(tmp_path / "state"), head_steps=20,
        progress=False,
    )  # fmt: skip
    result = train_drafter(start, train, held, cfg, calibration=calib)
    assert result.steps_done == 100 and result.stopped_by == "steps"
    assert result.accept_before < 1.3
    assert result.accept_after > result.accept_before + 0.5, (
        result.accept_before,
        result.accept_after,
    )
    assert [h["step"] for h in result.history if "accept_length" in h] == [50, 100]
    lrs = [h["lr"] for h in result.history]
    assert lrs[4] < lrs[9] and lrs[-1] < 0.01 * max(lrs)  # warm-up, then cosine to ~0
    d = result.drafter
    assert d.config.gamma == GAMMA and torch.equal(d.d2t, d2t)
    assert offline_accept_lengths(d, held, GAMMA) == pytest.approx(result.accept_after)
    cal = result.calibration
    assert cal is not None and cal.bce < 0.5 and abs(cal.mean_survival - cal.base_rate) < 0.25
    assert (tmp_path / "state" / "train_state.pt").is_file()


def test_offline_evaluations_in_chunks_and_by_output_position(gemma, monkeypatch):
    """The offline evaluations split long sequences into anchor chunks without changing a
    number, and the accept length by output position partitions the replay's verify steps."""
    from unimem.training import distill
    from unimem.training.distill import confidence_calibration
    from unimem.training.trainer import offline_accept_by_position

    _, model = gemma
    seqs, lens = _text(model, 5, seed=9, gen_len=40)
    dc = draft_config_for(model.config, num_layers=1, draft_vocab_size=64)
    d = DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=3)
    data = teacher_forced_states(model, seqs, lens, dc.target_layers)
    whole = offline_accept_lengths(d, data, GAMMA, rows_per_pass=2)
    calib = confidence_calibration(d, data, GAMMA)
    by_pos = offline_accept_by_position(d, data, GAMMA, edges=(0, 8, 16, 32))
    monkeypatch.setattr(distill, "LOGITS_PER_PASS", GAMMA * 64 * 3)  # 1-3 anchors a pass
    assert offline_accept_lengths(d, data, GAMMA, rows_per_pass=2) == whole
    chunked = confidence_calibration(d, data, GAMMA)
    assert chunked.n == calib.n and chunked.base_rate == calib.base_rate
    assert chunked.bce == pytest.approx(calib.bce, rel=1e-5)
    assert chunked.ece == pytest.approx(calib.ece, abs=1e-9)
    assert set(by_pos) == {"all", "0-7", "8-15", "16-31", "32-"}
    assert by_pos["all"]["accept"] == pytest.approx(whole)
    assert sum(v["steps"] for k, v in by_pos.items() if k != "all") == by_pos["all"]["steps"]
    total = sum(v["accept"] * v["steps"] for k, v in by_pos.items() if k != "all")
    assert total / by_pos["all"]["steps"] == pytest.approx(whole)
    with pytest.raises(ValueError, match="edges must start at 0"):
        offline_accept_by_position(d, data, GAMMA, edges=(4, 8))


def test_accept_by_position_command(gemma, tmp_path, capsys):
    """``python -m unimem.training.accept_by_position``: the drafter as saved and re-windowed,
    by output position, in a table and a JSON; an impossible window fails before the
    generation."""
    from unimem.training.accept_by_position import main

    path, model = gemma
    d = tmp_path / "drafter"
    dc = draft_config_for(model.config, num_layers=2)
    save_drafter(DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=5), d)
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"w{i} w{i + 5} w{i + 9}\n" for i in range(3)))
    out = tmp_path / "acc.json"
    base = ["--model-path", str(path), "--drafter", str(d), "--prompts", str(prompts),
            "--requests", "3", "--tokens", "24", "--gamma", str(GAMMA), "--device", "cpu",
            "--dtype", "float32", "--edges", "0,8,16"]  # fmt: skip
    assert main([*base, "--windows", "4,8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["variants"]) == ["as saved", "window 4", "window 8"]
    assert report["variants"]["window 4"]["layer_hosts"] == ["swa", "swa"]
    assert report["variants"]["as saved"]["layer_hosts"] == ["full", "swa"]
    for v in report["variants"].values():
        acc = v["accept"]
        assert set(acc) == {"all", "0-7", "8-15", "16-"}
        assert sum(acc[k]["steps"] for k in ("0-7", "8-15", "16-")) == acc["all"]["steps"]
    assert "window 8 (swa+swa, 8)" in capsys.readouterr().out
    # past the target's SWA window (8): FULL-hosted layers with the window
    assert main([*base, "--windows", "12", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["variants"]["window 12"]
    assert row["layer_hosts"] == ["full", "full"] and row["context_window"] == 12
    with pytest.raises(ValueError, match="context window must be an int >= 1"):
        main([*base, "--windows", "0"])


def test_soft_targets_are_the_targets_own_distribution(gemma):
    """The teacher-forced soft targets at position ``p`` are the target's ``k`` most probable
    next tokens after ``tokens[:p + 1]`` (on greedy text the first is ``tokens[p + 1]``),
    with the probabilities of a whole-sequence forward; nothing past a sequence's end."""
    _, model = gemma
    seqs, lens = _text(model, 3, seed=5, gen_len=10)
    seqs[1] = seqs[1][:14]  # a shorter one: padded in its batch
    k = 4
    tf = teacher_forced_states(model, seqs, lens, (1,), soft_top_k=k)
    assert tf.soft_ids.shape == (3, len(seqs[0]), k)
    for i, seq in enumerate(seqs):
        ref = torch.softmax(model.reference_forward([torch.tensor(seq)])[0].double(), -1)
        top = ref.topk(k, dim=-1)
        n = len(seq)
        assert torch.equal(tf.soft_ids[i, :n].long(), top.indices)
        torch.testing.assert_close(tf.soft_probs[i, :n].double(), top.values, rtol=2e-3, atol=1e-3)
        greedy = tf.soft_ids[i, lens[i] - 1 : n - 1, 0].long()
        assert torch.equal(greedy, torch.tensor(seq[lens[i] : n]))
        assert not tf.soft_probs[i, n:].any()
    with pytest.raises(ValueError, match="soft_top_k"):
        teacher_forced_states(model, seqs, lens, (1,), soft_top_k=-1)


def test_one_hot_soft_targets_at_the_tokens_leave_the_loss_unchanged(gemma):
    """Soft targets that put all mass on the next token give the tokens' own cross-entropy,
    whatever their weight."""
    from unimem.training.train_forward import distill_losses

    _, model = gemma
    seqs, lens = _text(model, 4, seed=6, gen_len=12)
    dc = draft_config_for(model.config, num_layers=1, draft_vocab_size=128)
    tf = teacher_forced_states(model, seqs, lens, dc.target_layers)
    d2t = frequent_tokens(tf, 128, model.config.vocab_size)
    drafter = DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=3, d2t=d2t)
    nxt = torch.cat([tf.tokens[:, 1:], tf.tokens[:, -1:]], dim=1)
    soft = (nxt[..., None].to(torch.int32), torch.ones(*nxt.shape, 1, dtype=torch.float16))
    anchors = torch.arange(int(tf.prompt_lens.min()), int(tf.lengths.max()) - 1)
    args = (drafter, tf.tokens, tf.hidden, anchors, GAMMA, tf.prompt_lens, tf.lengths)
    plain = distill_losses(*args)
    mixed = distill_losses(*args, soft=soft, soft_weight=0.7)
    torch.testing.assert_close(mixed.ce, plain.ce, rtol=1e-5, atol=1e-6)


def test_position_decay_weighs_each_block_column(gemma):
    """``position_decay`` 1 is the plain mean; ``d < 1`` is the mean of the entries'
    cross-entropies weighted ``d ** column``: recomputed from the per-column means of a
    drafter whose first column is worse than the others (the weighted loss leans to it)."""
    from unimem.training.train_forward import distill_losses

    _, model = gemma
    seqs, lens = _text(model, 4, seed=7, gen_len=12)
    dc = draft_config_for(model.config, num_layers=1)
    tf = teacher_forced_states(model, seqs, lens, dc.target_layers)
    drafter = DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=4)
    anchors = torch.arange(int(tf.prompt_lens.min()), int(tf.lengths.max()) - 1)
    args = (drafter, tf.tokens, tf.hidden, anchors, GAMMA, tf.prompt_lens, tf.lengths)
    plain = distill_losses(*args)
    assert torch.equal(distill_losses(*args, position_decay=1.0).ce, plain.ce)
    # per column: each column's own sum and count of valid entries (one anchor at a time
    # covers every column, so the columns come from single-column runs of anchors)
    sums, counts = [], []
    for col in range(GAMMA):
        one = distill_losses(
            drafter, tf.tokens, tf.hidden, anchors, col + 1, tf.prompt_lens, tf.lengths
        )
        total = one.ce.double() * one.n
        sums.append(total - (sum(sums) if sums else 0.0))
        counts.append(one.n - (sum(counts) if counts else 0))
    d = 0.5
    want = sum(d**i * s_ for i, s_ in enumerate(sums)) / sum(d**i * n for i, n in enumerate(counts))
    got = distill_losses(*args, position_decay=d).ce
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="position_decay"):
        TrainConfig(position_decay=0.0)


def test_training_with_soft_targets_raises_the_accept_length(gemma):
    _, model = gemma
    seqs, lens = _text(model, 96, seed=1)
    held_seqs, held_lens = _text(model, 8, seed=2)
    dc = draft_config_for(model.config, num_layers=1, draft_vocab_size=128)
    train = teacher_forced_states(model, seqs, lens, dc.target_layers, soft_top_k=8)
    held = teacher_forced_states(model, held_seqs, held_lens, dc.target_layers)
    d2t = frequent_tokens(train, 128, model.config.vocab_size)
    start = DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=17, d2t=d2t)
    cfg = TrainConfig(
        steps=100, batch=16, anchors_per_step=16, gamma=GAMMA, lr=1e-2, warmup=10,
        eval_every=100, save_every=100, head_steps=0, progress=False, soft_weight=0.5,
    )  # fmt: skip
    result = train_drafter(start, train, held, cfg)
    assert result.accept_after > result.accept_before + 0.5, (
        result.accept_before,
        result.accept_after,
    )
    bare = teacher_forced_states(model, seqs[:8], lens[:8], dc.target_layers)
    with pytest.raises(ValueError, match="soft targets"):
        train_drafter(start, bare, None, cfg)


def test_per_batch_states_train_as_stored_ones(gemma, tmp_path):
    """Text kept as tokens alone, its states (and soft targets) computed per drawn batch,
    trains as the same text with every state stored: the same batches, the same losses
    (float32, the forwards' shapes differ); without a states function it is refused."""
    from unimem.training.train_drafter import _store_states, parser

    path, model = gemma
    seqs, lens = _text(model, 24, seed=4, gen_len=12)
    dc = draft_config_for(model.config, num_layers=1, draft_vocab_size=128)
    stored = teacher_forced_states(model, seqs, lens, dc.target_layers, soft_top_k=4)
    bare = tokens_only(seqs, lens, dc.target_layers, model.device)
    assert bare.hidden == [] and torch.equal(bare.tokens, stored.tokens)
    rows = torch.tensor([3, 0, 7])
    got, want = states_of(model, bare.select(rows), soft_top_k=4), stored.select(rows)
    for a, b in zip(got.hidden, want.hidden, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.soft_ids, want.soft_ids)

    def states(part):
        return states_of(model, part, soft_top_k=4)

    start = DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=17)
    cfg = TrainConfig(
        steps=6, batch=8, anchors_per_step=8, gamma=GAMMA, warmup=0, eval_every=100,
        save_every=100, head_steps=2, progress=False, soft_weight=0.5,
    )  # fmt: skip
    a = train_drafter(start, stored, None, cfg)
    b = train_drafter(start, bare, None, cfg, states=states)
    assert [h["loss"] for h in b.history] == pytest.approx([h["loss"] for h in a.history], rel=1e-4)
    with pytest.raises(ValueError, match="states function"):
        train_drafter(start, bare, None, cfg)
    base = ["--model-path", str(path), "--out", str(tmp_path), "--soft-top-k", "4"]
    assert _store_states(model, seqs, 3, parser().parse_args(base))  # auto: small text
    assert not _store_states(model, seqs, 3, parser().parse_args([*base, "--states", "per-batch"]))


def _resume_case(model):
    """The resume tests' training text (eight short continuations with their states) and a
    one-layer drafter to train on it."""
    seqs, lens = _text(model, 8, seed=3, gen_len=12)
    dc = draft_config_for(model.config, num_layers=1)
    data = teacher_forced_states(model, seqs, lens, dc.target_layers)
    return data, DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=17)


def test_resume_continues_where_it_stopped(gemma, tmp_path):
    data, start = _resume_case(gemma[1])
    kw = dict(
        batch=4, anchors_per_step=4, gamma=GAMMA, warmup=0, eval_every=100, save_every=2,
        checkpoint_dir=str(tmp_path), head_steps=0, progress=False,
    )  # fmt: skip
    whole = train_drafter(start, data, None, TrainConfig(steps=6, **kw | {"checkpoint_dir": None}))
    train_drafter(start, data, None, TrainConfig(steps=4, **kw))
    logs = []
    resumed = train_drafter(start, data, None, TrainConfig(steps=6, **kw), log=logs.append)
    assert any("resumed" in m and "step 4" in m for m in logs)
    assert [h["step"] for h in resumed.history] == [1, 2, 3, 4, 5, 6]
    # the same batches as an uninterrupted run (the generator's state was saved); the
    # learning rates differ only through the schedule's horizon (4 then 6 steps)
    assert resumed.history[-1]["loss"] == pytest.approx(whole.history[-1]["loss"], rel=0.2)


def test_resume_counts_the_time_budget_over_the_whole_run(gemma, tmp_path):
    """A resumed run goes on down the cosine of the training seconds its earlier processes
    spent (a fresh horizon warmed the learning rate back up: on the GPU that undid a run's
    annealing), and one whose time budget is spent trains no further."""
    data, start = _resume_case(gemma[1])
    cfg = TrainConfig(
        steps=100_000, batch=4, anchors_per_step=4, gamma=GAMMA, warmup=0, eval_every=10**6,
        save_every=2, checkpoint_dir=str(tmp_path), head_steps=0, progress=False,
        time_budget_s=1000.0, lr=1e-3,
    )  # fmt: skip
    first = train_drafter(start, data, None, dataclasses.replace(cfg, steps=2))
    assert first.history[0]["lr"] == pytest.approx(1e-3, rel=1e-3)
    state_file = tmp_path / "train_state.pt"
    state = torch.load(state_file, weights_only=False)
    assert 0.0 < state["trained_s"] < 1000.0

    def resume_after(seconds: float) -> tuple[list[dict], str | None]:
        state["trained_s"] = seconds  # as if the earlier processes had trained that long
        torch.save(state, state_file)
        run = train_drafter(start, data, None, dataclasses.replace(cfg, steps=3))
        return run.history, run.stopped_by

    # 90 % of the budget spent: the schedule's progress at step 3 is max(2 / 3, 0.9)
    history, _ = resume_after(900.0)
    assert [h["step"] for h in history] == [1, 2, 3]
    assert history[-1]["lr"] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(0.9 * math.pi)), rel=1e-2)
    history, stopped_by = resume_after(1000.0)  # all of it: no step more
    assert [h["step"] for h in history] == [1, 2]
    assert stopped_by == "time"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_resume_on_the_gpu(gemma, tmp_path):
    """The state file of a CUDA run resumes on CUDA (the sampler's generator state stays a
    CPU tensor: mapped onto the GPU with the weights, ``set_state`` refused it)."""
    path, cpu_model = gemma
    model = load_checkpoint(path, dtype="float32", device="cuda").model
    seqs, lens = _text(cpu_model, 8, seed=3, gen_len=12)
    dc = draft_config_for(model.config, num_layers=1)
    data = teacher_forced_states(cpu_model, seqs, lens, dc.target_layers)
    data = dataclasses.replace(
        data, tokens=data.tokens.cuda(), hidden=[h.cuda() for h in data.hidden]
    )
    start = DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=17)
    kw = dict(
        batch=4, anchors_per_step=4, gamma=GAMMA, warmup=0, eval_every=100, save_every=2,
        checkpoint_dir=str(tmp_path), head_steps=0, progress=False,
    )  # fmt: skip
    train_drafter(start, data, None, TrainConfig(steps=2, **kw))
    logs = []
    resumed = train_drafter(start, data, None, TrainConfig(steps=4, **kw), log=logs.append)
    assert any("resumed" in m and "step 2" in m for m in logs)
    assert [h["step"] for h in resumed.history] == [1, 2, 3, 4]
    assert next(resumed.drafter.parameters()).device.type == "cuda"


def test_frequent_tokens():
    tokens = torch.tensor([[2, 9, 5, 5, 7, 0], [2, 3, 7, 5, 9, 9]])
    data = Rollouts(tokens, [], torch.tensor([2, 1]), torch.tensor([5, 6]), ())
    # continuations: [5, 5, 7] and [3, 7, 5, 9, 9]: 5 x3, 7 x2, 9 x2, 3 x1; then unseen ids
    assert frequent_tokens(data, 6, 10).tolist() == [5, 7, 9, 3, 0, 1]
    with pytest.raises(ValueError, match="draft vocabulary"):
        frequent_tokens(data, 11, 10)


def test_prompt_files(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("first prompt\n\nsecond\\nline\n")
    assert read_prompts(text) == ["first prompt", "second\nline"]
    with pytest.raises(ValueError, match="no splits"):
        read_prompts(text, "heldout")
    jl = tmp_path / "p.jsonl"
    rows = [{"text": "a", "split": "train"}, {"prompt": "b", "split": "heldout"}, "c"]
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert read_prompts(jl) == ["a", "b", "c"]
    assert read_prompts(jl, "heldout") == ["b"]
    with pytest.raises(ValueError, match="no prompts of split 'dev'"):
        read_prompts(jl, "dev")
    (tmp_path / "bad.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_prompts(tmp_path / "bad.jsonl")


def test_settings_are_checked_before_any_text_is_generated():
    """``check_args`` refuses a setting that cannot train (here a Markov rank of 0, which the
    drafter refuses) before the generating engine starts; and every recipe of
    ``tools/device/gpu_drafter_recipes.sh``'s default list, on its base flags, passes it (a
    bad variant would otherwise fail only after minutes of generation on the GPU)."""
    import re
    import shlex
    from pathlib import Path

    from unimem.training.train_drafter import check_args, gen_graph_bs, parser

    def parse(flags: list[str]):
        return parser().parse_args(["--model-path", "m", "--out", "o", *flags])

    for flags, bad in (
        (["--markov-rank", "0"], "--markov-rank"),
        (["--draft-layers", "0"], "--draft-layers"),
        (["--position-decay", "1.5"], "position_decay"),
        (["--soft-top-k", "-1"], "--soft-top-k"),
        (["--gen-graph-bs", "0,8"], "--gen-graph-bs"),
        (["--gen-graph-bs", "eight"], "--gen-graph-bs"),
    ):
        with pytest.raises(ValueError, match=bad):
            check_args(parse(flags))
    # the generating engine's graph sizes: a few, and its batch limit (never a cap on it)
    assert gen_graph_bs(parse(["--max-running", "512"])) == [1, 8, 64, 256, 512]
    assert gen_graph_bs(parse(["--max-running", "48"])) == [1, 8, 48]
    assert gen_graph_bs(parse([])) == [1, 8, 64, 256]  # the engine's default limit on CUDA
    assert gen_graph_bs(parse(["--gen-graph-bs", "all"])) is None
    script = Path(__file__).resolve().parents[2] / "tools/device/gpu_drafter_recipes.sh"
    text = script.read_text()
    base = re.search(r"\nbase=\((.*?)\)\n", text, re.S).group(1)
    # the shell's variables as values: the default it names ("${X:-240}"), 60 seconds of
    # training for $budget, else a path
    base = re.sub(
        r'"\$\{?(\w+)(?::-(\w+))?\}?"',
        lambda m: m.group(2) or {"budget": "60"}.get(m.group(1), "x"),
        base,
    )
    variants = re.search(r'variants=\$\{VARIANTS:-"(.*?)"\}', text, re.S).group(1)
    lines = [v for v in variants.splitlines() if v.strip()]
    assert len(lines) >= 6
    for line in lines:
        args = parser().parse_args([*shlex.split(base), "--out", "o", *shlex.split(line)])
        check_args(args)


def test_model_key():
    for name in (
        "gemma-3-270m",
        "/models/gemma-3-270m/",
        "/x/gemma-3-270m-q4_k_m.gguf",
        "Gemma-3-270M-BF16",
    ):
        assert shipped.model_key(name) == "gemma-3-270m", name


def test_context_window_bounds_every_draft_layer(gemma):
    import argparse

    from unimem.training.train_drafter import DEFAULT_CONTEXT_WINDOW, context_window

    _, model = gemma
    c = model.config  # SWA window 8
    dc = draft_config_for(c, num_layers=3, context_window=6)
    assert dc.layer_hosts == ("swa",) * 3 and dc.window == 6 and dc.context_window is None
    assert [dc.layer_window(j) for j in range(3)] == [6, 6, 6]
    base = draft_config_for(c)
    assert base.layer_hosts == ("full", "swa") and base.context_window is None
    assert [base.layer_window(j) for j in range(2)] == [None, 4]
    w = with_context_window(base, 4, c)
    assert w.layer_hosts == ("swa", "swa") and w.window == 4
    assert dataclasses.replace(w, layer_hosts=base.layer_hosts, window=base.window) == base
    # past the target's SWA window, or on a target without SWA layers: FULL-hosted layers
    # attend the window (their lanes keep every position)
    wide = with_context_window(base, 9, c)
    assert wide.layer_hosts == ("full", "full") and wide.window is None
    assert wide.context_window == 9 and [wide.layer_window(j) for j in range(2)] == [9, 9]
    assert all(lane.layer.window is None for lane in wide.lanes())
    assert draft_config_for(c, context_window=9).layer_hosts == ("full", "full")
    no_swa = dataclasses.replace(c, layer_pattern=("full",) * c.num_layers, window=None)
    full = draft_config_for(no_swa, context_window=5)
    assert full.layer_hosts == ("full", "full") and full.context_window == 5
    swa_only = dataclasses.replace(c, layer_pattern=("swa",) * c.num_layers)
    with pytest.raises(ValueError, match="no FULL layers to host"):
        draft_config_for(swa_only, context_window=9)
    with pytest.raises(ValueError, match="context window must be an int >= 1"):
        draft_config_for(c, context_window=0)
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match="context window must be an int >= 1"):
            with_context_window(base, bad, c)
    with pytest.raises(ValueError, match="DraftConfig.context_window"):
        dataclasses.replace(base, context_window=0)

    def args(w):
        return argparse.Namespace(context_window=w)

    assert context_window(args(None)) == DEFAULT_CONTEXT_WINDOW
    assert context_window(args(0)) is None and context_window(args(5)) == 5
    with pytest.raises(ValueError, match="--context-window must be >= 0"):
        context_window(args(-1))


@pytest.mark.parametrize("kind", ["windowed", "grown_fp8"])
def test_windowed_drafter_in_the_engine_static_and_unified(gemma, tmp_path, kind):
    """A drafter whose layers are all SWA-hosted (a bounded context window) runs in the
    Engine with static pools and with the unified arena alike: outputs equal plain decoding
    and the two memories verify and accept the same. ``grown_fp8``: the same drafter grown
    to 3 layers (the new one's output projections then drawn, so that it computes) and
    stored with float8 projections."""
    from unimem.engine.api import Engine

    path, model = gemma
    dc = draft_config_for(model.config, num_layers=2, context_window=6)
    d = tmp_path / kind
    drafter = DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=5)
    if kind == "grown_fp8":
        drafter = with_extra_layers(drafter, 3, seed=6)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for w in (drafter.layers[2].o_proj, drafter.layers[2].down):
                w.copy_(torch.randn(w.shape, generator=g) * 0.02)
    save_drafter(drafter, d, fp8_weights=kind == "grown_fp8")
    prompts = [[BOS, 7 + i, 30 + 3 * i, 11] for i in range(4)]
    params = {"max_new_tokens": 40}  # past the window, and past the target's SWA window (8)
    kw = dict(model_path=str(path), dtype="float32", max_total_tokens=1024)

    def run(**extra):
        eng = Engine(**kw, **extra)
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        eng.shutdown()
        meta = [(o["meta_info"].get("spec_verify_ct"), o["meta_info"].get("spec_accept_length"))
                for o in outs]  # fmt: skip
        return [o["output_ids"] for o in outs], meta

    ref, _ = run()
    spec = dict(speculative_algorithm="DSPARK", speculative_draft_model_path=str(d))
    static, m_static = run(**spec)
    unified, m_unified = run(**spec, enable_unified_memory=True)
    assert static == ref and unified == ref
    assert m_static == m_unified and all(n and n >= 1 for n, _ in m_static)


def test_shipped_drafters_attend_no_further_back_than_they_trained():
    """A drafter meets, at any output length, only contexts as long as its training
    sequences (``with_context_window``): each of a shipped drafter's layers attends a window
    no longer than its training command's prompt + continuation."""
    import shlex

    dirs = [d for d in shipped.DRAFTERS_DIR.iterdir() if (d / "config.json").is_file()]
    assert dirs
    for d in dirs:
        config = json.loads((d / "config.json").read_text())
        argv = shlex.split(json.loads((d / "training.json").read_text())["command"])
        prompt_len = int(argv[argv.index("--prompt-len") + 1])
        gen_len = int(argv[argv.index("--gen-len") + 1])
        for host in config["layer_hosts"]:
            reach = config["window"] if host == "swa" else config.get("context_window")
            assert reach is not None and reach <= prompt_len + gen_len, (d, host, reach)


def test_shipped_drafters_fit_the_repositorys_size_limit():
    """A drafter kept in the repository is at most 20 MB (``data/drafters/README.md``): a
    deeper one ships with ``--fp8-weights``."""
    dirs = [d for d in shipped.DRAFTERS_DIR.iterdir() if (d / "config.json").is_file()]
    assert dirs
    for d in dirs:
        size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
        assert size <= 20_000_000, (d, size)


def test_engine_uses_the_shipped_drafter_by_default(gemma, tmp_path, monkeypatch):
    from unimem.engine.api import Engine

    path, model = gemma
    root = tmp_path / "drafters"
    dc = draft_config_for(model.config, num_layers=1)
    save_drafter(
        DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=5), root / path.name
    )
    monkeypatch.setattr(shipped, "DRAFTERS_DIR", root)
    kw = dict(model_path=str(path), dtype="float32", max_total_tokens=512)
    eng = Engine(speculative_algorithm="DSPARK", **kw)
    assert eng.drafter_path == str(root / path.name)
    out = eng.generate(input_ids=[BOS, 7, 8], sampling_params={"max_new_tokens": 6})
    assert out["meta_info"]["spec_verify_ct"] >= 1 and out["meta_info"]["spec_accept_length"] >= 1
    eng.shutdown()
    other = tmp_path / "other"
    save_drafter(DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=6), other)
    eng = Engine(speculative_algorithm="DSPARK", speculative_draft_model_path=str(other), **kw)
    assert eng.drafter_path == str(other)
    eng.shutdown()
    # a drafter of the same name that does not fit this model is not used
    cfg_file = root / path.name / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "target_layers": [40]}))
    eng = Engine(speculative_algorithm="DSPARK", **kw)
    assert eng.drafter_path is None
    eng.shutdown()


def test_generation_budget_keeps_the_first_round_and_stops_between_rounds(gemma, tmp_path):
    """``--gen-time-budget`` counts generation only: a budget already spent when the
    first round starts (engine start-up can take longer than the budget on a GPU) still
    yields that round's text, and no round starts after the budget is spent."""
    from unimem.training.train_drafter import generate, parser

    path, _ = gemma
    argv = [
        "--model-path", str(path), "--out", str(tmp_path / "d"), "--device", "cpu",
        "--dtype", "float32", "--bos-prompts", "12", "--gen-chunk", "4", "--prompt-len", "4",
        "--gen-len", "6", "--temperatures", "0", "--gen-time-budget", "1e-9",
    ]  # fmt: skip
    text = generate(parser().parse_args(argv), log=lambda *_: None)
    assert text.info["prompts"] == 4  # one round of --gen-chunk, then the budget stops it
    assert 0 < len(text.sequences) == len(text.prompt_lens) <= 4
    seconds = text.info["seconds"]  # the engine's start-up is reported apart
    assert 0 < seconds["engine_start"] < seconds["generation"]
    assert list(text.info["engine_startup_seconds"]) == [
        "checkpoint",
        "grammar",
        "pools",
        "step_loop",
    ]
    assert text.info["continuation_tok_s"] > 0


def test_generating_engine_admits_in_batches(gemma, tmp_path, monkeypatch):
    """The generating engine runs the prefill delayer (``--gen-delay-passes``; 0 turns it
    off), with the same text either way."""
    from unimem.engine import api
    from unimem.training.train_drafter import generate, parser

    path, _ = gemma
    made = []
    real = api.Engine.__init__

    def spy(self, *a, **kw):
        made.append(kw)
        real(self, *a, **kw)

    monkeypatch.setattr(api.Engine, "__init__", spy)
    argv = [
        "--model-path", str(path), "--out", str(tmp_path / "d"), "--device", "cpu",
        "--dtype", "float32", "--bos-prompts", "8", "--gen-chunk", "8", "--prompt-len", "4",
        "--gen-len", "6", "--temperatures", "0,1", "--max-running", "3",
    ]  # fmt: skip
    quiet = lambda *_: None  # noqa: E731
    held = generate(parser().parse_args([*argv, "--gen-delay-passes", "5"]), log=quiet)
    plain = generate(parser().parse_args([*argv, "--gen-delay-passes", "0"]), log=quiet)
    assert made[0]["enable_prefill_delayer"] and made[0]["prefill_delayer_max_delay_passes"] == 5
    assert "enable_prefill_delayer" not in made[1]
    assert held.sequences == plain.sequences
    with pytest.raises(ValueError, match="--gen-delay-passes"):
        generate(parser().parse_args([*argv, "--gen-delay-passes", "-1"]), log=quiet)


def test_text_cache_is_written_once_then_read_instead_of_generating(gemma, tmp_path):
    """``--text-cache``: the first run writes the training text it generated, the next
    reads the same text back (no generation), and a cache of another model or another kind
    of file is refused by name."""
    from unimem.training.train_drafter import generate, parser

    path, _ = gemma
    cache = tmp_path / "text.pt"
    argv = [
        "--model-path", str(path), "--out", str(tmp_path / "d"), "--device", "cpu",
        "--dtype", "float32", "--bos-prompts", "6", "--gen-chunk", "6", "--prompt-len", "4",
        "--gen-len", "5", "--temperatures", "0", "--text-cache", str(cache),
    ]  # fmt: skip
    quiet = lambda *_: None  # noqa: E731
    first = generate(parser().parse_args(argv), log=quiet)
    assert cache.is_file() and "text_cache" not in first.info
    again = generate(parser().parse_args(argv), log=quiet)
    assert (again.sequences, again.prompt_lens) == (first.sequences, first.prompt_lens)
    assert again.info["text_cache"]["path"] == str(cache)
    assert again.info["bos_prompts"] == first.info["bos_prompts"] == 6
    other = tmp_path / "other"
    other.mkdir()
    for f in path.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    argv_other = [*argv]
    argv_other[argv_other.index(str(path))] = str(other)
    with pytest.raises(ValueError, match=r"text-cache .* made for .*tiny-gemma"):
        generate(parser().parse_args(argv_other), log=quiet)
    junk = tmp_path / "junk.pt"
    torch.save({"tokens": torch.zeros(3)}, junk)
    argv[argv.index(str(cache))] = str(junk)
    with pytest.raises(ValueError, match="not a training text"):
        generate(parser().parse_args(argv), log=quiet)


def test_held_out_continuations_run_eval_len_tokens(gemma, tmp_path):
    """The held-out yardstick is ``--eval-len`` greedy tokens long (longer than the training
    text: what long outputs meet), capped by the model's context; ``--eval-len 0`` is
    refused before anything is generated."""
    from unimem.training.train_drafter import generate, parser

    path, model = gemma
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"text": f"w{i} w{i + 3}"}) + "\n" for i in range(3)))
    quiet = lambda *_: None  # noqa: E731

    def argv(eval_len):
        return [
            "--model-path", str(path), "--out", str(tmp_path / "d"), "--device", "cpu",
            "--dtype", "float32", "--bos-prompts", "2", "--prompt-len", "4", "--gen-len", "5",
            "--temperatures", "0", "--eval-prompts", str(held), "--eval-len", str(eval_len),
        ]  # fmt: skip

    text = generate(parser().parse_args(argv(40)), log=quiet)
    assert max(len(s) - p for s, p in zip(text.sequences, text.prompt_lens, strict=True)) <= 5
    new = [len(s) - p for s, p in zip(text.held_sequences, text.held_prompt_lens, strict=True)]
    assert len(new) == 3 and max(new) == 40 and min(new) >= 2
    text = generate(parser().parse_args(argv(10**6)), log=quiet)
    assert max(map(len, text.held_sequences)) <= model.config.max_context
    with pytest.raises(ValueError, match="--eval-len must be >= 1"):
        generate(parser().parse_args(argv(0)), log=quiet)


def test_a_grown_drafter_drafts_exactly_as_before(gemma):
    """``with_extra_layers``: the old layers' weights, new layers hosted as the last one
    with zero output projections — the same block logits bit for bit — and different ones
    once a new layer's projection moves."""
    from unimem.training.train_forward import block_forward_dense

    _, model = gemma
    dc = draft_config_for(model.config, num_layers=1, draft_vocab_size=128)
    g = torch.Generator().manual_seed(5)
    d2t = torch.randperm(model.config.vocab_size, generator=g)[:128]
    small = DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=3, d2t=d2t)
    grown = with_extra_layers(small, 3, seed=9)
    assert grown.config.num_layers == 3 and grown.config.layer_hosts == dc.layer_hosts * 3
    assert torch.equal(grown.d2t, small.d2t)
    for name, t in small.state_dict().items():
        assert torch.equal(grown.state_dict()[name], t), name
    for layer in grown.layers[1:]:
        assert not layer.o_proj.any() and not layer.down.any() and layer.qkv_proj.any()
    seqs, lens = _text(model, 3, seed=1)
    data = teacher_forced_states(model, seqs, lens, dc.target_layers)
    anchors = torch.arange(2, 20, 3)
    hidden = [h for h in data.hidden]
    base_small, _ = block_forward_dense(small, data.tokens, hidden, anchors, GAMMA)
    base_grown, _ = block_forward_dense(grown, data.tokens, hidden, anchors, GAMMA)
    assert torch.equal(base_small, base_grown)
    with torch.no_grad():
        grown.layers[2].down.normal_(generator=g)
    assert not torch.equal(block_forward_dense(grown, data.tokens, hidden, anchors, GAMMA)[0],
                           base_small)  # fmt: skip
    with pytest.raises(ValueError, match="num_layers 1 must exceed the drafter's 1"):
        with_extra_layers(small, 1, seed=0)


def test_train_drafter_grows_its_init_and_stores_fp8_weights(gemma, tmp_path):
    """``--init`` with more ``--draft-layers`` trains the grown drafter; ``--fp8-weights``
    writes its projections in float8 with row scales, and it loads back; fewer layers than
    the init, or other target layers, are refused before anything is generated."""
    from safetensors.torch import load_file

    from unimem.speculative.checkpoint import ROW_SCALE, load_drafter
    from unimem.training.train_drafter import generate, parser, train_on

    path, model = gemma
    init = tmp_path / "init"
    dc = draft_config_for(model.config, num_layers=1, draft_vocab_size=128)
    save_drafter(
        DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=3, d2t=torch.arange(128)),
        init,
    )
    quiet = lambda *_: None  # noqa: E731

    def argv(*extra):
        return [
            "--model-path", str(path), "--out", str(tmp_path / "d"), "--device", "cpu",
            "--dtype", "float32", "--bos-prompts", "6", "--gen-chunk", "6", "--prompt-len", "4",
            "--gen-len", "12", "--temperatures", "0", "--init", str(init), "--steps", "3",
            "--batch", "4", "--anchors-per-step", "4", "--gamma", str(GAMMA), "--head-steps",
            "0", "--draft-vocab", "128", "--no-progress", *extra,
        ]  # fmt: skip

    args = parser().parse_args(argv("--draft-layers", "2", "--fp8-weights"))
    args.argv = []
    summary = train_on(generate(args, log=quiet), args, log=quiet)
    assert summary["draft_config"]["layers"] == 2 and summary["draft_config"]["fp8_weights"]
    saved = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert saved["layers.1.down"].dtype == torch.float8_e4m3fn
    assert "layers.1.down" + ROW_SCALE in saved and saved["markov_u"].dtype == torch.float32
    loaded = load_drafter(tmp_path / "d", model)
    assert loaded.config.num_layers == 2 and loaded.layers[1].down.any()  # trained, not zero
    for bad, match in (
        (("--draft-layers", "0"), "the --init drafter has 1 layers"),
        (("--target-layers", "0,1"), r"--target-layers \[0, 1\]: the --init drafter reads"),
    ):
        with pytest.raises(ValueError, match=match):
            generate(parser().parse_args(argv(*bad)), log=quiet)


@pytest.mark.slow
def test_train_drafter_command_end_to_end(gemma, tmp_path):
    from unimem.engine.api import Engine
    from unimem.training.train_drafter import main

    path, _ = gemma
    held = tmp_path / "held.jsonl"
    rows = [
        {"text": " ".join(f"w{(i * 7 + j * 13) % 400 + 4}" for j in range(6)), "split": s}
        for i in range(12)
        for s in ("heldout",)
    ]
    held.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "drafter"
    argv = [
        "--model-path", str(path), "--out", str(out), "--device", "cpu", "--dtype", "float32",
        "--bos-prompts", "128", "--prompt-len", "8", "--gen-len", "32", "--temperatures", "0",
        "--max-running", "64", "--eval-prompts", str(held), "--eval-split", "heldout",
        "--draft-layers", "1", "--draft-vocab", "256", "--steps", "200", "--batch", "16",
        "--anchors-per-step", "16", "--gamma", str(GAMMA), "--lr", "1e-2", "--warmup", "10",
        "--eval-every", "100", "--head-steps", "20", "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "training.json").read_text())
    assert summary["command"].startswith("python -m unimem.training.train_drafter")
    assert summary["accept_after"] > summary["accept_before"] + 0.5, summary
    texts = read_prompts(held, "heldout")
    kw = dict(model_path=str(path), dtype="float32", max_total_tokens=2048)
    params = {"max_new_tokens": 32}

    def run(**extra):
        eng = Engine(**kw, **extra)
        outs = eng.generate(prompt=texts, sampling_params=params)
        eng.shutdown()
        steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
        toks = sum(o["meta_info"].get("spec_accept_length", 0) * o["meta_info"].get(
            "spec_verify_ct", 0) for o in outs)  # fmt: skip
        return [o["output_ids"] for o in outs], (toks / steps if steps else None)

    ref, _ = run()
    untrained, acc_u = run(speculative_algorithm="DSPARK", speculative_num_draft_tokens=5)
    trained, acc_t = run(
        speculative_algorithm="DSPARK",
        speculative_num_draft_tokens=5,
        speculative_draft_model_path=str(out),
    )
    assert untrained == ref and trained == ref
    assert acc_t > acc_u + 0.5, (acc_u, acc_t)
