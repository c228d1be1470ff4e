"""The prefill delayer (``--enable-prefill-delayer``): while a saturated batch decodes,
admissions wait for a batch's worth of free lanes (at most ``max_delay_passes`` passes in
a row), so that a workload whose requests finish a few at a time runs far fewer extend steps
with the same tokens; the policy's triggers, caps and counters; its arguments and flags."""

from __future__ import annotations

import random
from collections import Counter

import pytest

import unimem
from unimem.engine.args import EngineArgs
from unimem.engine.prefill_delay import ADMISSION_DECAY, PrefillDelayer
from unimem.serve.args import CliError, parse_args

# --- the policy alone ------------------------------------------------------------------------


def _saturated(d: PrefillDelayer, **kw) -> bool:
    state = dict(waiting=10, running=60, max_running=64, usage=0.9) | kw
    return d.hold(**state)


def test_slot_trigger_holds_until_a_batch_of_lanes_is_free():
    d = PrefillDelayer(max_delay_passes=100)
    assert not _saturated(d)  # nothing admitted yet: no bar
    d.admitted(8)
    assert _saturated(d, running=60)  # 4 free < 8
    assert _saturated(d, running=57)  # 7 free
    assert not _saturated(d, running=56)  # 8 free
    assert d.outcomes == Counter(ready=1)
    assert d.held_passes == 2


def test_never_holds_without_waiting_or_running_requests():
    d = PrefillDelayer()
    d.admitted(64)
    assert not _saturated(d, waiting=0)
    assert not _saturated(d, running=0)
    assert d.held_passes == 0 and not d.outcomes  # no episode began


def test_max_delay_passes_caps_an_episode():
    d = PrefillDelayer(max_delay_passes=3)
    d.admitted(64)
    held = [_saturated(d) for _ in range(5)]
    assert held == [True, True, True, False, True]  # released on the 4th, a new episode then
    assert d.outcomes == Counter(max_passes=1)


def test_watermark_admits_while_the_pool_is_empty_enough():
    d = PrefillDelayer(token_usage_low_watermark=0.5)
    d.admitted(64)
    assert not _saturated(d, usage=0.2)
    assert _saturated(d, usage=0.6)
    assert not _saturated(d, usage=0.4)
    assert d.outcomes == Counter(watermark=1)


def test_the_bar_decays_every_pass():
    d = PrefillDelayer(max_delay_passes=10**6)
    d.admitted(10)
    passes = 0
    while _saturated(d, running=55):  # 9 free lanes: held until the bar drops below 9
        passes += 1
    # 10 * decay**k < 9 first at k = ceil(log(0.9) / log(decay))
    import math

    assert passes == math.ceil(math.log(0.9) / math.log(ADMISSION_DECAY)) - 1


def test_queue_trigger_and_its_wall_clock_cap():
    now = [0.0]
    d = PrefillDelayer(
        max_delay_passes=100, queue_min_ratio=0.5, max_delay_ms=10, clock=lambda: now[0]
    )
    d.admitted(16)
    # lanes are free (slot trigger off) but only 2 wait, fewer than min(40 * 0.5, 16)
    assert _saturated(d, running=40, waiting=2)
    now[0] = 0.005
    assert _saturated(d, running=40, waiting=2)
    now[0] = 0.011
    assert not _saturated(d, running=40, waiting=2)
    assert d.outcomes == Counter(max_delay_ms=1)
    assert not _saturated(d, running=40, waiting=16)  # enough wait: no episode
    assert d.outcomes == Counter(max_delay_ms=1)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_delay_passes=0), "max_delay_passes"),
        (dict(max_delay_passes=True), "max_delay_passes"),
        (dict(token_usage_low_watermark=1.5), "token_usage_low_watermark"),
        (dict(token_usage_low_watermark=float("nan")), "token_usage_low_watermark"),
        (dict(queue_min_ratio=0), "queue_min_ratio"),
        (dict(max_delay_ms=-1.0), "max_delay_ms"),
    ],
)
def test_bad_values_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PrefillDelayer(**kwargs)


# --- arguments and flags ---------------------------------------------------------------------


def test_engine_args_name_what_is_wrong():
    assert EngineArgs().prefill_delayer() is None
    d = EngineArgs(enable_prefill_delayer=True, prefill_delayer_max_delay_passes=7)
    assert d.prefill_delayer().max_delay_passes == 7
    with pytest.raises(ValueError, match="prefill_delayer_max_delay_passes needs enable_"):
        EngineArgs(prefill_delayer_max_delay_passes=7)
    with pytest.raises(ValueError, match="prefill_delayer_max_delay_passes must be >= 1"):
        EngineArgs(enable_prefill_delayer=True, prefill_delayer_max_delay_passes=0)
    with pytest.raises(ValueError, match="prefill_delayer_token_usage_low_watermark must be"):
        EngineArgs(enable_prefill_delayer=True, prefill_delayer_token_usage_low_watermark=2.0)
    with pytest.raises(ValueError, match="needs prefill_delayer_queue_min_ratio"):
        EngineArgs(enable_prefill_delayer=True, prefill_delayer_max_delay_ms=100.0)
    with pytest.raises(ValueError, match="tp_size > 1"):
        EngineArgs(enable_prefill_delayer=True, prefill_delayer_queue_min_ratio=0.2, tp_size=2)


def test_launcher_flags():
    args, _ = parse_args(["--device", "cpu", "--enable-prefill-delayer",
                          "--prefill-delayer-max-delay-passes", "12",
                          "--prefill-delayer-token-usage-low-watermark", "0.3",
                          "--prefill-delayer-queue-min-ratio", "0.25",
                          "--prefill-delayer-max-delay-ms", "200"])  # fmt: skip
    d = args.prefill_delayer()
    assert (d.max_delay_passes, d.token_usage_low_watermark, d.queue_min_ratio) == (12, 0.3, 0.25)
    assert d.max_delay_s == pytest.approx(0.2)
    with pytest.raises(CliError, match="--prefill-delayer-max-delay-passes needs --enable-"):
        parse_args(["--device", "cpu", "--prefill-delayer-max-delay-passes", "12"])


# --- in the engine ---------------------------------------------------------------------------


def _run(gemma2_ckpt, monkeypatch, **delay):
    """96 requests of staggered output lengths over 16 lanes: outputs, and the steps
    launched per mode."""
    rng = random.Random(0)
    prompts = [
        [2] + [rng.randrange(3, 400) for _ in range(rng.randrange(3, 12))] for _ in range(96)
    ]
    params = [{"max_new_tokens": rng.randrange(4, 40), "ignore_eos": True} for _ in prompts]
    eng = unimem.Engine(model_path=str(gemma2_ckpt), device="cpu", dtype="float32", page_size=4,
                        attention_backend="torch", max_running_requests=16,
                        disable_radix_cache=True, **delay)  # fmt: skip
    modes = Counter()
    launch = eng.core.runner.launch
    monkeypatch.setattr(
        eng.core.runner, "launch", lambda b, f=None: modes.update([b.mode.name]) or launch(b, f)
    )
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    delayer = eng.core.scheduler.delayer
    eng.shutdown()
    return [o["output_ids"] for o in outs], modes, delayer


def test_fewer_extend_steps_same_tokens(gemma2_ckpt, monkeypatch):
    plain, plain_modes, none = _run(gemma2_ckpt, monkeypatch)
    held, held_modes, delayer = _run(gemma2_ckpt, monkeypatch, enable_prefill_delayer=True,
                                     prefill_delayer_max_delay_passes=8)  # fmt: skip
    assert none is None
    assert held == plain
    assert held_modes["EXTEND"] * 2 <= plain_modes["EXTEND"], (held_modes, plain_modes)
    assert delayer.held_passes > 0
    assert sum(delayer.outcomes.values()) > 0


def test_server_metrics_count_held_passes(gemma2_ckpt):
    """The engine thread's snapshot and ``/metrics`` report the delayer's counters."""
    import threading

    from prometheus_client.parser import text_string_to_metric_families

    from unimem.serve.engine_loop import EngineLoop, Submission
    from unimem.serve.metrics import ServerMetrics

    eng = unimem.Engine(model_path=str(gemma2_ckpt), device="cpu", dtype="float32", page_size=4,
                        attention_backend="torch", max_running_requests=4,
                        disable_radix_cache=True, enable_prefill_delayer=True)  # fmt: skip
    loop = EngineLoop(eng.core)
    done = threading.Semaphore(0)

    def sink(delta):
        if delta.finish_reason is not None:
            done.release()

    loop.start()
    try:
        for i in range(24):  # staggered lengths over 4 lanes: finishes one at a time
            loop.submit(Submission([2, 5 + i, 7], 3 + i % 5, frozenset(), None, sink))
        for _ in range(24):
            assert done.acquire(timeout=60)
        snap = loop.snapshot()  # as of the last step
    finally:
        loop.stop()
    eng.shutdown()
    assert snap["prefill_delayer"]["held_passes"] > 0
    text = ServerMetrics(lambda: snap, {"model_name": "m"}).render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    held = families["unimem:prefill_delayer_held_passes"].samples[0].value
    assert held == snap["prefill_delayer"]["held_passes"]
    outcomes = {s.labels["outcome"] for s in families["unimem:prefill_delayer_episodes"].samples}
    assert outcomes == {"ready", "max_passes", "max_delay_ms", "watermark", "idle"}
