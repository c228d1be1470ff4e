"""``Engine.warm_up`` (the server's start-up warm-up): it runs greedy and sampled requests
through every step kind, and leaves the engine as it found it — the prefix cache empty with
its counters at zero, request ids from 0 again — so what users get afterwards, seedless
sampled requests included, is what a fresh engine gives; with DSPARK too. It refuses to run
beside queued requests."""

from __future__ import annotations

import pytest

from unimem.engine.api import Engine, startup_line

PROMPTS = [[2, 5, 9, 13, 17, 4, 8, 21, 3], [2, 6, 10], [2, 5, 9, 13, 17, 4, 30]]
PARAMS = [
    {"max_new_tokens": 7, "temperature": 0.9},  # seedless: its seed comes from its request id
    {"max_new_tokens": 7},
    {"max_new_tokens": 7, "temperature": 0.7, "top_k": 5, "seed": 4},
]


def _engine(ckpt, **extra) -> Engine:
    return Engine(
        model_path=str(ckpt), device="cpu", dtype="float32", page_size=4,
        max_total_tokens=1024, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "DSPARK"}], ids=["plain", "dspark"])
def test_warm_up_leaves_what_users_get_unchanged(gemma2_ckpt, spec):
    fresh = _engine(gemma2_ckpt, **spec)
    want = fresh.generate(input_ids=PROMPTS, sampling_params=PARAMS, return_logprob=True)
    fresh.shutdown()

    eng = _engine(gemma2_ckpt, **spec)
    steps = eng.core.steps
    done = eng.warm_up()
    assert done["requests"] == 3 and done["tokens"] > 0 and done["seconds"] >= 0
    assert eng.core.steps > steps + 2  # it ran steps (an extend and more)
    stats = eng.cache_stats()
    assert stats["cached_tokens"] == 0 and stats["lookups"] == 0 and stats["inserts"] == 0
    got = eng.generate(input_ids=PROMPTS, sampling_params=PARAMS, return_logprob=True)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert [o["meta_info"]["id"] for o in got] == [o["meta_info"]["id"] for o in want]
    assert [o["meta_info"]["cached_tokens"] for o in got] == [
        o["meta_info"]["cached_tokens"] for o in want
    ]
    eng.shutdown()


def test_warm_up_refuses_to_run_beside_queued_requests(gemma2_ckpt):
    eng = _engine(gemma2_ckpt, disable_radix_cache=True)
    req = eng.core.submit([2, 3, 4], 3)
    with pytest.raises(ValueError, match="queued or running"):
        eng.warm_up()
    eng.core.run()
    assert len(req.output) == 3
    assert eng.warm_up()["requests"] == 3  # no cache: nothing to flush
    eng.shutdown()


def test_warm_up_fits_a_tiny_context(gemma2_ckpt):
    """A context of a few tokens (with DSPARK's write window) still warms up."""
    eng = _engine(gemma2_ckpt, context_length=24, speculative_algorithm="DSPARK")
    done = eng.warm_up()
    assert done["requests"] == 3 and done["tokens"] >= 3
    eng.shutdown()


def test_engine_records_its_start_up_phases(gemma2_ckpt):
    """``startup_seconds``: each start-up phase in the order it ran (DSPARK's drafter
    included; on the CPU no CUDA graphs), also in ``get_server_info``, and the log line."""
    eng = _engine(gemma2_ckpt, speculative_algorithm="DSPARK")
    phases = eng.startup_seconds
    # no tokenizer: no grammar phase
    assert list(phases) == ["checkpoint", "drafter", "pools", "step_loop"]
    assert all(sec >= 0 for sec in phases.values()) and phases["checkpoint"] > 0
    assert eng.get_server_info()["startup_seconds"] == phases
    eng.shutdown()
    line = startup_line({"checkpoint": 40.1, "pools": 0.2, "step_loop": 12.0,
                         "cuda_graphs": 11.2, "warm_up": 3.0})  # fmt: skip
    assert line == (
        "start-up 55.3 s: checkpoint 40.1 s, pools 0.2 s, step loop 12.0 s "
        "(CUDA graphs 11.2 s), warm up 3.0 s"
    )
