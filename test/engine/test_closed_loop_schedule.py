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
