"""``python -m unimem validate --spec dspark``: flags, report keys, reporting of mismatches,
and the requests a chain engine rejects."""

from __future__ import annotations

import json

import pytest
import torch

from unimem.__main__ import main
from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.engine.core import EngineCore
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.speculative.chain import DsparkChain
from unimem.speculative.drafter import DsparkDrafter, draft_config_for
from unimem.validate.protocol import spec_mismatches


def test_main_command_with_dspark_writes_the_report(tmp_path, capsys):
    out = tmp_path / "report.json"
    args = ["validate", "--requests", "3", "--input-len", "12", "--output-len", "7"]
    args += ["--spec", "dspark", "--gamma", "3", "--accept-rate", "0.7", "--max-running", "2"]
    assert main([*args, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "ACCEPTANCE CONTROL ON (rate 0.7)" in table and "drafter: seeded, untrained" in table
    report = json.loads(out.read_text())
    assert report["acceptance_control"] == {"on": True, "rate": 0.7}
    n = report["requests"]
    assert n == 3
    for key in ("exact_match", "verify_counts_match", "accept_lengths_match"):
        assert report[key] == n
    assert report["spec_matches_reference"] == n and report["spec_mismatches"] == []
    for mode in ("static", "unified"):
        assert report[mode]["verify_steps"] > 0
        assert 1.0 <= report[mode]["accept_length"] <= 4.0
    assert report["config"]["spec"] == "dspark" and report["config"]["gamma"] == 3
    assert "verify_steps" not in report["reference"]
    assert main([*args[:-4], "--accept-rate", "0", "--max-running", "2"]) == 0
    assert "acceptance control: off" in capsys.readouterr().out


def test_bad_spec_flags_fail_at_start_up(capsys):
    assert main(["validate", "--spec", "dspark", "--gamma", "0"]) == 2
    assert "gamma" in capsys.readouterr().err
    assert main(["validate", "--spec", "dspark", "--accept-rate", "1.5"]) == 2
    assert "accept rate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["validate", "--spec", "eagle"])


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, HybridModel(cfg, seed=1)


def test_mismatch_report_names_position_tokens_and_margin(tiny):
    cfg, model = tiny
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    # the model's own greedy continuation of prompt 0, by the dense oracle
    ids = list(prompts[0])
    for _ in range(4):
        ids.append(int(model.reference_forward([torch.tensor(ids)])[0][-1].argmax()))
    expected = {0: ids[5:], 1: [7, 7]}
    wrong = list(expected[0])
    wrong[2] = (wrong[2] + 1) % cfg.vocab_size
    runs = {"static": {0: expected[0], 1: [7, 7]}, "unified": {0: wrong, 1: [7, 7]}}
    diffs = spec_mismatches(model, prompts, expected, runs)
    assert len(diffs) == 1
    d = diffs[0]
    assert (d["mode"], d["rid"], d["first_diff"]) == ("unified", 0, 2)
    assert d["spec_token"] == wrong[2] and d["reference_token"] == expected[0][2]
    assert d["oracle_top2"][0] == expected[0][2]
    assert d["logit_margin"] > 0


def test_chain_engine_needs_room_for_the_write_window_and_the_draft_lanes(tiny):
    cfg, model = tiny
    drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head)
    chain = DsparkChain(drafter, 4)
    spec = memory_spec(cfg, 16, draft_lanes=drafter.config.lanes())
    pool = UnifiedMemory(spec, 16 << 20, 2, cfg.max_context)
    eng = EngineCore(model, pool, TorchReferenceBackend(), 2, 32, chain=chain)
    # prompt + output - 1 fits the context, but not the last write window (4) plus the
    # look-ahead step (5) that may run before the host reads that the request finished
    with pytest.raises(ValueError, match="write window and look-ahead 9 exceed the context"):
        eng.submit([1] * (cfg.max_context - 17), 10)
    eng.submit([1] * (cfg.max_context - 18), 10)
    plain = UnifiedMemory(memory_spec(cfg, 16), 4 << 20, 2, cfg.max_context)
    with pytest.raises(ValueError, match="draft_lanes"):
        EngineCore(model, plain, TorchReferenceBackend(), 2, 32, chain=chain)
    with pytest.raises(ValueError, match="gamma"):
        DsparkChain(drafter, 0)
