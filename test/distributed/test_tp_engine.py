"""``unimem.Engine(tp_size=2)`` and ``validate`` with ``tp_size=2`` on the CPU (gloo, two
processes): rank 0 drives, the other rank follows the broadcast submissions and aborts; with
``UNIMEM_TP_CHECK_STATE=1`` the ranks' allocator states are compared after every step.

One engine (DSPARK chain speculation over a unified arena that compacts) serves every
engine check, so the module spawns once for it and once for ``validate``. Its ranks are
torn down in order: rank 0 stops them (they acknowledge leaving their loop), joins them, and
only then shuts the reference engine down; the rendezvous never guesses a free port (another
suite on the host could take it between the guess and the bind)."""

from __future__ import annotations

import re

import pytest
import tiny_qwen3_next
import tiny_tokenizer
import torch.distributed as dist
import tp_checks

import unimem
from unimem.engine import distributed
from unimem.engine.distributed import CHECK_ENV, run_ranks
from unimem.validate.protocol import ValidateConfig, validate

OUT = tp_checks.OUT


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """The allocator-state check on, for this process and the ranks it spawns."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CHECK_ENV, "1")
        yield


@pytest.fixture(scope="module")
def engines(checked, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next")
    hf = tiny_qwen3_next.build(path)
    tiny_tokenizer.save(path, hf.config.vocab_size)
    base = dict(model_path=str(path), device="cpu", dtype="float64", page_size=4)
    ref = unimem.Engine(**base, max_total_tokens=1024, max_running_requests=6)
    tp = unimem.Engine(
        **base,
        tp_size=2,
        enable_unified_memory=True,
        max_total_tokens=64,
        max_running_requests=3,
        speculative_algorithm="DSPARK",
        speculative_num_draft_tokens=4,
        # the prefix cache's checkpoint slots would enlarge the arena past compaction
        disable_radix_cache=True,
    )
    procs = list(tp._ranks.procs)
    try:
        yield ref, tp
    finally:
        tp.shutdown()  # the ranks acknowledge the stop, then exit; joined here
        assert [p.exitcode for p in procs] == [0]
        ref.shutdown()


def test_generate_equals_the_unsharded_engine(engines):
    ref, tp = engines
    prompts = tp_checks.prompts(500)
    params = {"max_new_tokens": OUT, "ignore_eos": True}
    want = ref.generate(input_ids=prompts, sampling_params=params)
    got = tp.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert tp.pool.stats.compactions > 0
    assert tp.get_server_info()["tp_size"] == 2


def test_text_prompt_and_stop_token(engines):
    ref, tp = engines
    text = " ".join(f"w{t}" for t in tp_checks.prompts(500)[2])
    want = ref.generate(prompt=text, sampling_params={"max_new_tokens": OUT, "ignore_eos": True})
    stop = want["output_ids"][3]
    params = {"max_new_tokens": OUT, "stop_token_ids": [stop], "ignore_eos": True}
    got = tp.generate(prompt=text, sampling_params=params)
    first = want["output_ids"].index(stop)
    assert got["output_ids"] == want["output_ids"][: first + 1]
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_logprob_options_and_adjustments_reach_every_rank(engines):
    """Prompt log-probabilities (the LM head's vocabulary gather is a collective: every rank
    must score the same rows), top log-probabilities and logit adjustments, under tensor
    parallelism and DSPARK: the unsharded engine's."""
    ref, tp = engines
    prompts = tp_checks.prompts(500)[:2]
    params = {"max_new_tokens": OUT, "ignore_eos": True, "logit_bias": {7: 2.5},
              "min_new_tokens": 3}  # fmt: skip
    kw = dict(return_logprob=True, logprob_start_len=1, top_logprobs_num=3)
    want = ref.generate(input_ids=prompts, sampling_params=params, **kw)
    got = tp.generate(input_ids=prompts, sampling_params=params, **kw)
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        gm, wm = g["meta_info"], w["meta_info"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            assert [e[1] for e in gm[key]] == [e[1] for e in wm[key]]
            assert [e[0] for e in gm[key]] == pytest.approx([e[0] for e in wm[key]], abs=1e-9)
        for key in ("input_top_logprobs", "output_top_logprobs"):
            assert [[e[1] for e in t] for t in gm[key]] == [[e[1] for e in t] for t in wm[key]]


def test_grammars_reach_every_rank(engines):
    """Structured output under tensor parallelism and DSPARK: every rank compiles the
    request's grammar and masks the same rows (verify rows after the drafts they follow);
    greedy outputs are the unsharded engine's (which does not speculate: sampled ones differ
    from its draws), sampled ones follow the grammar."""
    ref, tp = engines
    prompts = tp_checks.prompts(500)[:2]
    regex = "(w1[0-9]|w2[0-9])+w3[0-9]"
    greedy = {"max_new_tokens": OUT, "regex": regex}
    want = ref.generate(input_ids=prompts, sampling_params=greedy)
    got = tp.generate(input_ids=prompts, sampling_params=greedy)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["meta_info"]["finish_reason"] for g in got] == [
        w["meta_info"]["finish_reason"] for w in want
    ]
    sampled = dict(greedy, temperature=0.8, seed=5, max_new_tokens=24)
    for out in tp.generate(input_ids=prompts, sampling_params=sampled):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(regex, "".join(out["text"].split()))


def test_abort_reaches_every_rank(engines):
    _, tp = engines
    core = tp.core
    prompts = tp_checks.prompts(500, seed=1)
    reqs = [core.submit(p, OUT) for p in prompts[:4]]
    core.step()
    core.step()
    assert core.abort(reqs[1]) and core.abort(reqs[3])  # one running, one still waiting
    core.run()
    assert [r.finish_reason for r in reqs] == ["length", "abort", "length", "abort"]
    assert tp.pool.used_bytes() == 0


def test_warm_up_restarts_request_ids_on_every_rank(engines):
    """After the server's warm-up the ranks still agree (the state check compares request
    ids) and an abort, which names a request by id, still reaches every rank."""
    ref, tp = engines
    assert tp.warm_up()["requests"] == 3
    core = tp.core
    prompts = tp_checks.prompts(500, seed=2)
    reqs = [core.submit(p, OUT) for p in prompts[:3]]
    core.step()
    assert core.abort(reqs[2])
    core.run()
    assert [r.finish_reason for r in reqs] == ["length", "length", "abort"]
    want = ref.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": OUT})
    assert [r.output for r in reqs[:2]] == [o["output_ids"] for o in want]


def test_validate_tp2_static_equals_unified_with_compaction(checked):
    cfg = ValidateConfig(
        tp_size=2,
        requests=4,
        input_len=24,
        output_len=8,
        arena_mb=0.4,
        max_running=4,
        page_size=4,
    )
    report = validate(cfg)
    assert report["config"]["tp_size"] == 2
    assert report["exact_match"] == 4
    assert report["unified"]["compactions"] > 0


def test_tp_size_must_be_positive():
    with pytest.raises(ValueError, match=r"tp_size \(--tp-size\) must be an int >= 1"):
        ValidateConfig(tp_size=0)
    with pytest.raises(ValueError, match="tp_size must be a positive int"):
        unimem.Engine(model_path="/nowhere", tp_size=0)


def test_rendezvous_never_takes_a_port_in_use(monkeypatch):
    """Another suite's store holds the port a free-port guess would return: the ranks still
    meet (the port is bound, not guessed) and only each other."""
    other = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    monkeypatch.setattr(distributed, "free_port", lambda: other.port)
    assert run_ranks(2, tp_checks.ranks_seen) == [0, 1]
