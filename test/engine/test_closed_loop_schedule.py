"""``tools/device/dspark_real.py``'s closed loop, which the DSPARK end-to-end figures are
measured with: at most ``conc`` requests in flight (and that many while prompts remain), each
finished one replaced by the next prompt, results in prompt order and equal to
``Engine.generate``'s; ``_run`` reports its steps by kind."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from unimem.engine.api import Engine

TOOL = Path(__file__).resolve().parents[2] / "tools" / "device" / "dspark_real.py"


def _tool():
    spec = importlib.util.spec_from_file_location("dspark_real", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_closed_loop_keeps_conc_in_flight_and_equals_generate(gemma2_ckpt):
    dr = _tool()
    eng = Engine(model_path=str(gemma2_ckpt), device="cpu", dtype="float32", page_size=4,
                 max_total_tokens=4096, disable_radix_cache=True)  # fmt: skip
    ids = [[2, 5 + i, 9, 13 + i] for i in range(7)]
    # different lengths: requests end apart, so the loop must refill one at a time
    params = [{"max_new_tokens": 3 + 2 * i, "ignore_eos": True} for i in range(7)]
    want = eng.generate(input_ids=ids, sampling_params=params)
    lanes = []
    launch = eng.core.runner.launch

    def spy(batch, in_flight=None):
        if batch.mode.name == "DECODE":
            lanes.append(len(batch.reqs))
        return launch(batch, in_flight)

    eng.core.runner.launch = spy
    got = dr._closed_loop(eng, ids, params, 3)
    eng.core.runner.launch = launch
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert max(lanes) == 3 and lanes[0] == 3  # three in flight from the start, never more
    res, outs = dr._run(eng, ids, 3, 5, 0.0, rounds=3)
    kinds = res["steps_by_kind"]
    assert res["requests"] == 9 and len(outs) == 9  # rounds x concurrency: 3 x 3 > 7 prompts
    assert set(kinds) == {"EXTEND", "DECODE"} and kinds["DECODE"]["mean_lanes"] <= 3
    eng.shutdown()


def test_greedy_comparison_runs_rounds_in_abba_order(monkeypatch):
    """``--repeats`` rounds, fresh engines of each kind in ABBA order, the ratio of the
    median tok/s, every round's figures kept; sampled runs in the first round only."""
    dr = _tool()
    built, tok_s = [], {"none": iter([100.0, 90.0, 110.0]), "dspark": iter([150.0, 200.0, 160.0])}

    class FakeEngine:
        def __init__(self, kind):
            self.kind = kind
            self.tokenizer = type("T", (), {"encode": staticmethod(lambda t: [2, len(t)])})()

    def engine(args, **kw):
        kind = "dspark" if kw.get("speculative_algorithm") == "DSPARK" else "none"
        built.append(kind)
        return FakeEngine(kind)

    def run(eng, ids, conc, output_len, temperature, **kw):
        if temperature:
            return {"tok_s": -1.0, "sampled": eng.kind}, [[0]] * len(ids)
        return {"tok_s": next(tok_s[eng.kind])}, [[7]] * len(ids)

    monkeypatch.setattr(dr, "_engine", engine)
    monkeypatch.setattr(dr, "_run", run)
    monkeypatch.setattr(dr, "_close", lambda eng: None)
    args, _ = dr._args(
        ["--model-path", "m", "--eval-prompts", "p", "--json", "o", "--repeats", "3"]
    )
    e2e: dict = {}
    runs, ids = dr._greedy_comparison(
        args, ["ab", "cde"], [4], {"speculative_algorithm": "DSPARK"}, set(), e2e
    )
    assert built == ["none", "dspark", "dspark", "none", "none", "dspark"]
    assert ids == [[2, 2], [2, 3]] and e2e["prompt_tokens"] == 4
    (row,) = e2e["greedy"]
    assert row["none_tok_s_by_round"] == [100.0, 90.0, 110.0]
    assert row["dspark_tok_s_by_round"] == [150.0, 200.0, 160.0]
    assert row["speedup"] == 160.0 / 100.0  # medians
    assert row["speedup_by_round"] == [1.5, 200.0 / 90.0, 160.0 / 110.0]
    assert row["none"]["tok_s"] == 100.0 and row["spec_equals_nonspec"] == 2
    assert e2e["none_temperature_0.7"]["sampled"] == "none"
    assert e2e["dspark_temperature_0.7_top_k_64"]["sampled"] == "dspark"
    assert runs[("dspark", 4)][0]["tok_s"] == 150.0


def test_cpu_dry_run_writes_the_report(tmp_path):
    """The whole script on the CPU (a tiny Gemma 3 with a tokenizer, an untrained drafter):
    it runs, and its JSON has what results.md reads — per concurrency every round's tok/s
    and the ratio of the medians, static == unified, adaptive against fixed."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import tiny_gemma3
    import tiny_tokenizer

    from unimem.models.loader import load_checkpoint
    from unimem.speculative.checkpoint import save_drafter
    from unimem.speculative.drafter import DsparkDrafter, draft_config_for

    ckpt = tmp_path / "ckpt"
    hf = tiny_gemma3.build(ckpt, num_hidden_layers=2,
                           layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    tiny_tokenizer.save(ckpt, hf.config.vocab_size)
    model = load_checkpoint(ckpt, dtype="float32").model
    drafter = DsparkDrafter(draft_config_for(model.config, num_layers=1), model.embed_weight,
                            model.lm_head_weight, seed=1)  # fmt: skip
    save_drafter(drafter, tmp_path / "drafter")
    prompts = tmp_path / "held.jsonl"
    prompts.write_text(
        "".join(json.dumps({"text": t, "split": "heldout"}) + "\n" for t in ("a b", "c d e", "f"))
    )
    out = tmp_path / "report.json"
    rc = _tool().main([
        "--model-path", str(ckpt), "--device", "cpu", "--drafter", str(tmp_path / "drafter"),
        "--eval-prompts", str(prompts), "--eval-split", "heldout", "--skip", "lmhead,sampled",
        "--concurrency", "1,2", "--output-len", "3", "--rounds", "2", "--json", str(out),
        "--engine-arg", "enable_prefill_delayer=true",
        "--engine-arg", "prefill_delayer_max_delay_passes=2",
    ])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["settings"]["engine_overrides"] == {
        "enable_prefill_delayer": True, "prefill_delayer_max_delay_passes": 2,
    }  # fmt: skip
    e2e = report["end_to_end"]
    assert [row["concurrency"] for row in e2e["greedy"]] == [1, 2]
    for row in e2e["greedy"]:
        assert len(row["none_tok_s_by_round"]) == len(row["dspark_tok_s_by_round"]) == 2
        n = row["none"]["requests"]  # 3 prompts; at 2 in flight 2 rounds x 2
        assert row["speedup"] > 0 and row["spec_equals_nonspec"] == n  # float32: exact
    assert e2e["unified"]["static_equals_unified"] == 4  # rounds x concurrency > 3 prompts
    assert "vs_fixed" in e2e["adaptive"] and "deterministic" not in e2e  # CUDA only


def test_engine_args_reach_every_engine_and_bad_ones_fail_first(monkeypatch):
    """``--engine-arg NAME=VALUE``: JSON values (else strings) for every engine the run
    builds; an unknown name, a missing ``=`` or one of the script's own settings is refused
    before anything runs."""
    import argparse

    import pytest

    import unimem.engine.api

    dr = _tool()
    got = dr.engine_overrides(
        ["enable_prefill_delayer=true", "prefill_delayer_max_delay_passes=4", "dtype=bfloat16"]
    )
    assert got == {
        "enable_prefill_delayer": True, "prefill_delayer_max_delay_passes": 4, "dtype": "bfloat16",
    }  # fmt: skip
    built = []
    monkeypatch.setattr(unimem.engine.api, "Engine", lambda **kw: built.append(kw))
    args = argparse.Namespace(
        model_path="m", device="cpu", mem_fraction_static=None, engine_overrides=got
    )
    dr._engine(args)
    dr._engine(args, speculative_algorithm="DSPARK")
    assert built[0] == {"model_path": "m", "device": "cpu", **got}
    assert built[1] == built[0] | {"speculative_algorithm": "DSPARK"}
    for bad, says in [
        ("no_such_arg=1", "Engine has no argument 'no_such_arg'"),
        ("enable_prefill_delayer", "NAME=VALUE"),
        ("speculative_algorithm=DSPARK", "set by the script itself"),
    ]:
        with pytest.raises(ValueError, match=says):
            dr.engine_overrides([bad])
    built.clear()
    with pytest.raises(SystemExit) as stop:  # before any training or engine
        dr.main(["--model-path", "m", "--device", "cpu", "--eval-prompts", __file__,
                 "--json", "/nowhere.json", "--engine-arg", "no_such_arg=1"])  # fmt: skip
    assert stop.value.code == 2 and built == []
