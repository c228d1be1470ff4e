"""``python -m unimem validate --model-path`` on a tiny checkpoint: static == unified with
compaction, and transformers as a third run (``--oracle transformers``)."""

from __future__ import annotations

import json

import pytest
import tiny_gemma3
import tiny_tokenizer

from unimem.__main__ import main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    hf = tiny_gemma3.build(path)
    tiny_tokenizer.save(path, hf.config.vocab_size)
    return path


def test_validate_on_a_checkpoint_with_the_transformers_oracle(checkpoint, tmp_path):
    out = tmp_path / "report.json"
    argv = ["validate", "--model-path", str(checkpoint), "--oracle", "transformers"]
    argv += ["--requests", "6", "--input-len", "20", "--output-len", "12", "--page-size", "4"]
    argv += ["--arena-mb", "0.06", "--max-running", "4", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["exact_match"] == 6
    assert report["unified"]["compactions"] > 0
    assert report["oracle_matches"] == 6
    assert report["oracle_max_logprob_diff"] < 1e-4


def test_text_prompts_and_dspark(checkpoint, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7 w8 w9 w10 w11 w12 w13 w14\nw20 w30 w40 w50 w60 w70 w80\n")
    out = tmp_path / "report.json"
    argv = ["validate", "--model-path", str(checkpoint), "--prompts", str(prompts)]
    argv += ["--requests", "2", "--output-len", "8", "--spec", "dspark", "--gamma", "3"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["exact_match"] == 2 and report["spec_matches_reference"] == 2


def test_flags_that_need_a_checkpoint_fail_at_start(tmp_path, capsys):
    assert main(["validate", "--oracle", "transformers"]) == 2
    assert "--oracle transformers needs --model-path" in capsys.readouterr().err
    assert main(["validate", "--model-path", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
