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

    def spy(batch):
        if batch.mode.name == "DECODE":
            lanes.append(len(batch.reqs))
        return launch(batch)

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
