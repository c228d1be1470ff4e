"""The engine's GPU path on a real device: CUDA-graph decode and verify steps with FA4, the
step loop free of host synchronisation, static and unified memory token-identical.

Skipped without CUDA (marker ``gpu``) and without FlashAttention-4 (``flash_attn.cute``)."""

from __future__ import annotations

import pytest
import torch

from unimem.engine.core import EngineCore
from unimem.memory.spec import LayerKind
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import HybridConfig, memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.speculative.chain import DsparkChain
from unimem.speculative.control import AcceptanceControl
from unimem.speculative.drafter import DsparkDrafter, draft_config_for
from unimem_kernel import id_ops, unit_ops

pytestmark = pytest.mark.gpu

MB = 1 << 20


def _fa4():
    pytest.importorskip("flash_attn.cute", reason="FA4 not installed")
    from unimem.attention.fa4_backend import FA4Backend

    return FA4Backend()


MEMORY_KERNELS = (
    id_ops._bind_units_kernel,
    id_ops._unbind_units_kernel,
    id_ops._compact_band_kernel,
    unit_ops._fill_units_kernel,
    unit_ops._copy_units_kernel,
)


def _memory_variants() -> dict[str, set[str]]:
    """Compiled variants of the pools' Triton kernels (the keys of Triton's per-device kernel
    caches: signature, specialisation and constexprs)."""
    return {
        k.__name__: {str(key) for c in k.device_caches.values() for key in c[0]}
        for k in MEMORY_KERNELS
    }


def _compiled_since(warm: dict[str, set[str]]) -> dict[str, list[str]]:
    """The variants compiled after ``warm`` was taken, by kernel (empty: none)."""
    now = _memory_variants()
    return {name: sorted(keys - warm[name]) for name, keys in now.items() if keys - warm[name]}


def _prompts(cfg: HybridConfig, n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, cfg.vocab_size, (n, length), generator=g).tolist()


def _run(
    model, pool, prompts, output_len, chain, max_running, sync_debug: bool
) -> tuple[dict[int, list[int]], EngineCore]:
    eng = EngineCore(model, pool, _fa4(), max_running, 256, chain=chain, cuda_graphs=True)
    for p in prompts:
        eng.submit(p, output_len)
    torch.cuda.synchronize()
    if sync_debug:
        torch.cuda.set_sync_debug_mode("error")
    try:
        done = eng.run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {r.rid: r.output for r in done}, eng


@pytest.mark.parametrize("speculative", [False, True])
def test_step_loop_is_sync_free_and_static_equals_unified(speculative):
    """More than 200 engine steps — admissions, chunked prefill, CUDA-graph decode or verify
    steps at several batch buckets, SWA retirement, releases, and in the unified run
    allocator-driven compaction — under torch.cuda.set_sync_debug_mode("error"): any
    synchronising CUDA call raises. Static and unified memory give identical tokens. The
    pools' kernels compile at the pools' construction, never mid-run."""
    cfg = preset("gpu_test")
    dev = torch.device("cuda")
    model = HybridModel(cfg, seed=1, device=dev)
    prompts = _prompts(cfg, 12, 150)
    gamma, max_running = 3, 6
    output_len = 240 if speculative else 120  # more than 200 steps either way
    chain, lanes = None, ()
    if speculative:
        drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=5)
        # the "reference" is arbitrary here: it only makes some drafts acceptable
        refs = {i: p + p for i, p in enumerate(prompts)}
        chain = DsparkChain(drafter, gamma, AcceptanceControl(0.5, 0, refs, dev))
        lanes = drafter.config.lanes()
    spec = memory_spec(cfg, 16, lanes)
    pages = max_running * -(-(150 + output_len + 2 * (gamma + 1)) // 16)
    static = StaticMemory(spec, pages, pages, max_running, max_running, cfg.max_context, dev)
    warm = _memory_variants()
    out_s, eng_s = _run(model, static, prompts, output_len, chain, max_running, True)
    assert not _compiled_since(warm)
    # An arena 10 % above the static run's peak: the bands must move (compaction) but
    # nothing is retracted, so both runs have the same batches and hence the same kernels.
    sinks = sum(static.layout.unit_bytes(k) for k in static.kinds if k is not LayerKind.STATE)
    arena = int(1.1 * static.stats.peak_bytes) + sinks
    unified = UnifiedMemory(spec, arena, max_running, cfg.max_context, dev)
    warm = _memory_variants()
    out_u, eng_u = _run(model, unified, prompts, output_len, chain, max_running, True)
    assert not _compiled_since(warm)
    assert eng_s.steps >= 200 and eng_u.steps >= 200
    assert unified.stats.compactions > 0 and eng_u.scheduler.retractions == 0
    assert out_s == out_u
    assert all(len(o) == output_len for o in out_u.values())
    if speculative:
        got = {r.rid: r.verify_steps for r in eng_u.scheduler.finished}
        want = {r.rid: r.verify_steps for r in eng_s.scheduler.finished}
        assert got == want


def test_graph_replay_equals_eager_steps():
    """The same requests through recorded decode steps and through eager steps: token-
    identical outputs. Four equal requests decode in lockstep, so every step has four lanes
    and the one captured bucket (4) needs no padding: kernel shapes are the same both ways."""
    cfg = preset("gpu_test")
    dev = torch.device("cuda")
    model = HybridModel(cfg, seed=2, device=dev)
    prompts = _prompts(cfg, 4, 100)
    spec = memory_spec(cfg, 16)
    outs = []
    for graphs in (False, True):
        pool = UnifiedMemory(spec, 64 * MB, 4, cfg.max_context, dev)
        eng = EngineCore(model, pool, _fa4(), 4, 512, cuda_graphs=graphs,
                     graph_buckets=(4,) if graphs else None)  # fmt: skip
        for p in prompts:
            eng.submit(p, 60)
        outs.append({r.rid: r.output for r in eng.run()})
    assert outs[0] == outs[1]


def test_engine_records_the_cuda_graph_bs_it_is_given(tmp_path):
    """``cuda_graph_bs`` (SGLang's ``--cuda-graph-bs``): the engine records step graphs for
    those batch sizes only, its largest caps the running requests, and every batch runs."""
    pytest.importorskip("flash_attn.cute", reason="FA4 not installed")
    import tiny_qwen3_next
    import tiny_tokenizer

    import unimem

    hf = tiny_qwen3_next.build(tmp_path, head_dim=128)
    tiny_tokenizer.save(tmp_path, hf.config.vocab_size)
    engine = unimem.Engine(
        model_path=str(tmp_path), device="cuda", dtype="bfloat16", page_size=4,
        max_total_tokens=1024, max_running_requests=8, cuda_graph_bs=[1, 3],
    )  # fmt: skip
    try:
        assert engine.max_running_requests == 3
        assert engine.core.runner.graphs.buckets == (1, 3)
        phases = engine.startup_seconds  # the captures are timed within the step loop's
        assert 0 < phases["cuda_graphs"] <= phases["step_loop"]
        g = torch.Generator().manual_seed(3)
        prompts = torch.randint(0, hf.config.vocab_size, (5, 20), generator=g).tolist()
        params = {"max_new_tokens": 6, "ignore_eos": True}
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert [len(o["output_ids"]) for o in outs] == [6] * 5
    finally:
        engine.shutdown()


def test_scored_prompts_on_the_graph_path_are_sync_free_and_the_oracles():
    """Requests scoring their prompts (:mod:`unimem.engine.prompt_logprobs`), asking for
    their outputs' top tokens, or adjusting their logits (``logit_bias``, ``min_tokens``; the
    prompt scoring extends ragged and eager, the others replaying their steps' forward
    halves) beside plain ones on the CUDA-graph
    engine with FA4, chunked (128-token chunks of 150-token prompts) and under
    ``set_sync_debug_mode("error")``: each output's top token is the greedy output itself,
    every scored position equals the dense oracle's
    log-softmax (a bfloat16 model: within 0.05), the top token is its argmax where the
    oracle's two best are 0.1 apart, and the outputs are those of a run that scores nothing."""
    cfg = preset("gpu_test")
    dev = torch.device("cuda")
    model = HybridModel(cfg, seed=3, device=dev)
    prompts = _prompts(cfg, 5, 150)
    spec = memory_spec(cfg, 16)
    outs = []
    for scored in (False, True):
        pool = UnifiedMemory(spec, 64 * MB, 4, cfg.max_context, dev)
        eng = EngineCore(model, pool, _fa4(), 4, 128, cuda_graphs=True, logprobs=True)
        reqs = []
        for i, p in enumerate(prompts):
            kw = {}
            if scored and i % 2 == 0:
                kw = dict(prompt_logprobs_from=i * 10, prompt_top_logprobs=2, top_logprobs=3)
            if i == 1:  # logit adjustments, in both runs
                kw = dict(logit_bias={7: 100.0})
            if i == 3:
                kw = dict(stop_token_ids=range(10, cfg.vocab_size), min_tokens=10)
            reqs.append(eng.submit(p, 20, **kw))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eng.run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        outs.append([r.output for r in reqs])
    assert outs[0] == outs[1]
    assert reqs[1].output == [7] * 20  # its bias wins every pick
    held = reqs[3].output  # no stop token for 10 outputs, then (nearly any token) one ends it
    assert len(held) > 10 and all(t < 10 for t in held[:10]) and held[-1] >= 10
    for i in (0, 2, 4):
        req = reqs[i]
        assert [t[0][0] for t in req.output_top_logprobs] == req.output
        assert all(len(t) == 3 for t in req.output_top_logprobs)
        (logits,) = model.reference_forward([torch.tensor(req.prompt, device=dev)])
        ref = torch.log_softmax(logits.double(), dim=-1).cpu()
        first = max(i * 10, 1)
        assert req.prompt_logprobs[:first] == [None] * first
        got = torch.tensor(req.prompt_logprobs[first:], dtype=torch.float64)
        want = ref[first - 1 : -1].gather(1, torch.tensor(req.prompt[first:])[:, None])[:, 0]
        err = (got - want).abs().max().item()
        assert err <= 0.05, f"request {i}: largest |delta log-prob| {err:.4f}"
        rows = ref[first - 1 : -1]
        best = rows.topk(2, dim=-1).values
        clear = (best[:, 0] - best[:, 1] > 0.1).tolist()
        tops = [t[0][0] for t in req.prompt_top_logprobs[first:]]
        assert any(clear)
        for top, argmax, ok in zip(tops, rows.argmax(-1).tolist(), clear, strict=True):
            assert top == argmax or not ok


@pytest.mark.parametrize("speculative", [False, True])
def test_penalised_requests_on_the_graph_engine(speculative):
    """Penalties on the CUDA-graph engine with FA4 (their steps replay the forward half, the
    step in flight's committed tokens added to the history on the device), plain decoding
    and DSPARK: rewarding repeats (negative presence and frequency penalties, a repetition
    penalty below 1) collapses a request's output onto few tokens, while the request beside
    it does not (its steps may run in other batch sizes than without the penalties, so its
    bf16 output need not be the same bits)."""
    cfg = preset("gpu_test")
    dev = torch.device("cuda")
    model = HybridModel(cfg, seed=4, device=dev)
    prompts = _prompts(cfg, 2, 60)
    chain, lanes = None, ()
    if speculative:
        drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=5)
        chain, lanes = DsparkChain(drafter, 3), drafter.config.lanes()
    spec = memory_spec(cfg, 16, lanes)
    outs = []
    for penalised in (False, True):
        pool = UnifiedMemory(spec, 64 * MB, 4, cfg.max_context, dev)
        eng = EngineCore(model, pool, _fa4(), 4, 128, chain=chain, cuda_graphs=True, logprobs=True)
        kw = {}
        if penalised:
            kw = dict(presence_penalty=-2.0, frequency_penalty=-2.0, repetition_penalty=0.5)
        reqs = [eng.submit(prompts[0], 40, **kw), eng.submit(prompts[1], 40)]
        eng.run()
        outs.append([r.output for r in reqs])
    plain, penal = outs
    assert len(set(penal[0])) <= 4 < len(set(plain[0]))
    assert len(penal[1]) == 40 and len(set(penal[1])) > 4


@pytest.mark.parametrize("speculative", [False, True])
def test_constrained_requests_on_the_graph_engine(speculative):
    """Structured output on the CUDA-graph engine with FA4, plain decoding and DSPARK (its
    verify steps replay their forward half, then read their drafts back to mask each row):
    greedy and sampled constrained requests follow their regex and end on EOS, beside an
    unconstrained request that runs its full length."""
    import re

    xgr = pytest.importorskip("xgrammar")
    del xgr
    from unimem.engine.grammar import GrammarBackend, GrammarSpec
    from unimem.engine.sampling import SamplingOptions

    cfg = preset("gpu_test")
    dev = torch.device("cuda")
    model = HybridModel(cfg, seed=4, device=dev)
    alphabet = "0123456789abc-"
    vocab = ["", "", "", ""] + [alphabet[i % len(alphabet)] for i in range(cfg.vocab_size - 4)]
    backend = GrammarBackend(cfg.vocab_size, [1], vocab=vocab)
    prompts = _prompts(cfg, 3, 40)
    chain, lanes = None, ()
    if speculative:
        drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=5)
        chain, lanes = DsparkChain(drafter, 3), drafter.config.lanes()
    pool = UnifiedMemory(memory_spec(cfg, 16, lanes), 64 * MB, 4, cfg.max_context, dev)
    eng = EngineCore(
        model, pool, _fa4(), 4, 128, chain=chain, cuda_graphs=True, logprobs=True,
        grammar_backend=backend,
    )  # fmt: skip
    regex = "[0-9]{3,8}-[a-c]{2,6}"
    spec = GrammarSpec("regex", regex)
    sampled = SamplingOptions(temperature=0.8, seed=3)
    reqs = [
        eng.submit(prompts[0], 24, stop_token_ids=[1], grammar=spec),
        eng.submit(prompts[1], 24, stop_token_ids=[1], grammar=spec, sampling=sampled),
        eng.submit(prompts[2], 40),
    ]
    eng.run()
    for req in reqs[:2]:
        assert req.error is None and req.finish_reason == "stop" and req.output[-1] == 1
        assert re.fullmatch(regex, "".join(vocab[t] for t in req.output[:-1]))
    assert len(reqs[2].output) == 40


@pytest.mark.parametrize("layers", ["hybrid", "attention"])
@pytest.mark.parametrize("chain_kind", [None, "fixed", "adaptive"])
def test_steps_with_extras_replay_their_forward_half(chain_kind, layers):
    """A batch with extras (a ``logit_bias`` that changes picks, top log-probabilities, a
    sampled request) on the CUDA-graph engine with FA4 replays the recorded forward half of
    its step and runs the LM head, the adjustments, the pick (or the chain's acceptance) and
    the commits eagerly after it, with no host sync: its tokens, log-probabilities and top
    log-probabilities equal, bit for bit, those of the same engine running those steps
    eagerly from end to end (its forward halves dropped). On a model without recurrent
    state (``attention``) the requests' short extend replays the padded extend's forward half
    likewise."""
    import dataclasses

    from unimem.engine.runner import ModelRunner
    from unimem.engine.sampling import SamplingOptions

    cfg = preset("gpu_test")
    padded = layers == "attention"  # no recurrent state: short extends run padded
    if padded:
        cfg = dataclasses.replace(cfg, layer_pattern=("swa", "full", "swa", "full"))
    dev = torch.device("cuda")
    model = HybridModel(cfg, seed=4, device=dev)
    prompts = _prompts(cfg, 4, 24)  # one padded extend of 4 lanes, 96 tokens
    chain, lanes = None, ()
    if chain_kind is not None:
        drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=5)
        kw = dict(verify_lengths="adaptive", verify_budget=8) if chain_kind == "adaptive" else {}
        chain, lanes = DsparkChain(drafter, 3, **kw), drafter.config.lanes()
    spec = memory_spec(cfg, 16, lanes)
    replays = []
    finish = ModelRunner.finish_half
    extend_finish = ModelRunner._extend_padded_finish

    def counted(self, *args, **kwargs):
        replays.append("step")
        return finish(self, *args, **kwargs)

    def counted_extend(self, *args, **kwargs):
        replays.append("extend")
        return extend_finish(self, *args, **kwargs)

    runs = []
    for halves in (True, False):
        pool = UnifiedMemory(spec, 64 * MB, 8, cfg.max_context, dev)
        eng = EngineCore(model, pool, _fa4(), 8, 128, chain=chain, cuda_graphs=True, logprobs=True)
        kinds = 4 if chain is not None else 1
        assert len(eng.runner.forward_graphs) == kinds
        assert (4 in eng.runner.extend_halves) is padded
        if not halves:
            eng.runner.forward_graphs = {}
            eng.runner.extend_halves = {}
        reqs = [
            eng.submit(prompts[0], 24, logit_bias={9: 4.0, 11: 3.5}),
            eng.submit(prompts[1], 24, top_logprobs=3),
            eng.submit(prompts[2], 24, sampling=SamplingOptions(temperature=0.8, seed=7)),
            eng.submit(prompts[3], 24),
        ]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        ModelRunner.finish_half = counted
        ModelRunner._extend_padded_finish = counted_extend
        try:
            eng.run()
        finally:
            ModelRunner.finish_half = finish
            ModelRunner._extend_padded_finish = extend_finish
            torch.cuda.set_sync_debug_mode("default")
        runs.append([(r.output, r.output_logprobs, r.output_top_logprobs, r.error) for r in reqs])
        if halves:
            assert replays.count("step") > 5, "the steps with extras replayed no forward half"
            assert (replays.count("extend") > 0) is padded
        else:
            assert not replays
        replays.clear()
    assert runs[0] == runs[1]
    assert all(err is None for *_, err in runs[0])
    assert any(t in (9, 11) for t in runs[0][0][0])  # the bias changed picks
    assert all(len(t) == 3 for t in runs[0][1][2])
