"""Structured output in the engine (float64 ``tiny`` preset over a synthetic character
vocabulary, CPU): greedy constrained outputs — plain decoding and DSPARK verify steps, fixed
and adaptive lengths — equal the dense oracle's greedy decoding of the grammar-masked logits
(log-probabilities too); sampled ones always follow the grammar and, once stopped, match it
whole; requests beside them are unchanged; bad grammars are refused before queuing."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from unimem.attention.torch_backend import TorchReferenceBackend  # noqa: E402
from unimem.engine.core import EngineCore  # noqa: E402
from unimem.engine.grammar import GrammarBackend, GrammarSpec  # noqa: E402
from unimem.engine.sampling import SamplingOptions  # noqa: E402
from unimem.memory.unified import UnifiedMemory  # noqa: E402
from unimem.models.config import memory_spec  # noqa: E402
from unimem.models.presets import preset  # noqa: E402
from unimem.models.synthetic import HybridModel  # noqa: E402
from unimem.speculative.chain import DsparkChain  # noqa: E402
from unimem.speculative.control import AcceptanceControl  # noqa: E402
from unimem.speculative.drafter import DsparkDrafter, draft_config_for  # noqa: E402

EOS = 1
ALPHABET = '0123456789abcdefghijklmnopqrstuvwxyz{}[]":, -.'


def _vocab(size: int) -> list[str]:
    """Ids 0-3 special (empty strings), then the alphabet's characters, then their pairs."""
    out = ["", "", "", ""]
    a = len(ALPHABET)
    for i in range(size - 4):
        out.append(ALPHABET[i % a] if i < a else ALPHABET[i % a] + ALPHABET[(i // a) % a])
    return out


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    vocab = _vocab(cfg.vocab_size)
    backend = GrammarBackend(cfg.vocab_size, [EOS], vocab=vocab)
    return cfg, HybridModel(cfg, seed=31), backend, vocab


def _engine(cfg, model, backend, chain_kind: str | None, control=None, halves: bool = False):
    chain, lanes = None, ()
    if chain_kind is not None:
        drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=2)
        kw = dict(verify_lengths="adaptive", verify_budget=8) if chain_kind == "adaptive" else {}
        chain, lanes = DsparkChain(drafter, 3, control, **kw), drafter.config.lanes()
    pool = UnifiedMemory(memory_spec(cfg, 16, lanes), 8 << 20, 4, cfg.max_context)
    eng = EngineCore(
        model,
        pool,
        TorchReferenceBackend(),
        4,
        64,
        chain=chain,
        logprobs=True,
        grammar_backend=backend,
    )
    eng.runner.eager_halves = halves  # the split step a graph engine takes
    return eng


def _prompts(cfg, n, length):
    g = torch.Generator().manual_seed(6)
    return torch.randint(4, cfg.vocab_size, (n, length), generator=g).tolist()


def _text(vocab, tokens):
    return "".join(vocab[t] for t in tokens)


def _oracle(model, backend, prompt, n, spec=None, stops=frozenset({EOS})):
    """Greedy decoding of the dense oracle's logits, masked by a fresh matcher of ``spec``
    walking the output: ``(tokens, logprobs)``, ending at a stop token (kept) or after
    ``n`` tokens."""
    state = None if spec is None else backend.state(spec, stops)
    toks, lps = list(prompt), []
    while len(toks) - len(prompt) < n:
        (logits,) = model.reference_forward([torch.tensor(toks)])
        row = logits[-1].double().clone()
        if state is not None:
            bits = torch.full((1, backend.words), -1, dtype=torch.int32)
            state.matcher.fill_next_token_bitmask(bits, 0)
            allowed = ((bits[0][:, None] >> torch.arange(32)) & 1).bool().reshape(-1)
            row[~allowed[: row.numel()]] = float("-inf")
        t = int(row.argmax())
        lps.append(float(torch.log_softmax(row, -1)[t]))
        toks.append(t)
        if state is not None:
            assert state.matcher.accept_token(t)
        if t in stops:
            break
    return toks[len(prompt) :], lps


REGEX = "[0-9]{2,4}-[a-c]{1,3}"


@pytest.mark.parametrize("chain_kind", [None, "fixed", "adaptive"])
@pytest.mark.parametrize("halves", [False, True], ids=["whole", "halves"])
def test_greedy_constrained_outputs_follow_the_masked_logits(tiny, chain_kind, halves):
    cfg, model, backend, vocab = tiny
    prompts = _prompts(cfg, 3, 16)
    spec = GrammarSpec("regex", REGEX)
    enum = GrammarSpec("json_schema", json.dumps({"enum": ["yes", "no", "maybe"]}))
    eng = _engine(cfg, model, backend, chain_kind, halves=halves)
    a = eng.submit(prompts[0], 12, stop_token_ids=[EOS], grammar=spec)
    b = eng.submit(prompts[1], 12, stop_token_ids=[EOS], grammar=enum)
    c = eng.submit(prompts[2], 12, stop_token_ids=[EOS])
    eng.run()
    want_a, lps_a = _oracle(model, backend, prompts[0], 12, spec)
    want_b, lps_b = _oracle(model, backend, prompts[1], 12, enum)
    assert a.output == want_a and b.output == want_b
    assert a.output_logprobs == pytest.approx(lps_a, abs=1e-6)  # float32 outputs
    assert b.output_logprobs == pytest.approx(lps_b, abs=1e-6)
    assert c.output == _oracle(model, backend, prompts[2], 12)[0]
    for req in (a, b):  # the grammar completes within 12 tokens: the request stops on EOS
        assert req.finish_reason == "stop" and req.output[-1] == EOS and req.error is None
    assert re.fullmatch(REGEX, _text(vocab, a.output))
    assert json.loads(_text(vocab, b.output)) in ("yes", "no", "maybe")


@pytest.mark.parametrize("chain_kind", ["fixed", "adaptive"])
def test_accepted_drafts_walk_the_grammar(tiny, chain_kind):
    """Drafts that are mostly the oracle's own tokens (the acceptance control at 0.8) are
    accepted: each verify row is masked by the grammar's state after the drafts before it,
    and the outputs still equal the oracle's."""
    cfg, model, backend, vocab = tiny
    prompts = _prompts(cfg, 2, 16)
    schema = json.dumps({"type": "array", "items": {"enum": ["ab", "c"]}, "maxItems": 4})
    specs = [GrammarSpec("regex", "[0-9]{3,6}(-[a-c]{2}){1,3}"), GrammarSpec("json_schema", schema)]
    wants = [_oracle(model, backend, p, 24, spec) for p, spec in zip(prompts, specs, strict=True)]
    refs = {rid: p + w for rid, (p, (w, _)) in enumerate(zip(prompts, wants, strict=True))}
    eng = _engine(cfg, model, backend, chain_kind, AcceptanceControl(0.8, 3, refs))
    reqs = [
        eng.submit(p, 24, stop_token_ids=[EOS], grammar=spec)
        for p, spec in zip(prompts, specs, strict=True)
    ]
    eng.run()
    for req, (want, lps) in zip(reqs, wants, strict=True):
        assert req.output == want and req.error is None
        assert req.output_logprobs == pytest.approx(lps, abs=1e-6)
    assert sum(r.verified_tokens for r in reqs) > 1.5 * sum(r.verify_steps for r in reqs)


def test_fill_masks_each_row_after_the_drafts_before_it(tiny):
    cfg, _, backend, vocab = tiny
    ids = {t: vocab.index(t) for t in "0123-ab"}
    spec = GrammarSpec("regex", "[0-9]{2}-[a-c]+")
    state = backend.state(spec, [EOS])
    drafts = [ids["1"], ids["2"], ids["-"], ids["3"], ids["a"]]  # "3" breaks the grammar
    out = np.zeros((len(drafts) + 1, backend.words), dtype=np.int32)
    state.fill(out, drafts)
    for j in range(4):  # rows 0..3: the state after drafts[:j]
        fresh = backend.state(spec, [EOS])
        assert fresh.accept(drafts[:j]) == (j, False)
        want = torch.zeros(1, backend.words, dtype=torch.int32)
        fresh.matcher.fill_next_token_bitmask(want, 0)
        assert (out[j] == want[0].numpy()).all(), j
    assert (out[4:] == -1).all()  # past the refused draft: unconstrained
    again = np.zeros((1, backend.words), dtype=np.int32)
    state.fill(again)  # the walk was rolled back
    assert (again[0] == out[0]).all()


@pytest.mark.parametrize("chain_kind", [None, "fixed"])
@pytest.mark.parametrize("halves", [False, True], ids=["whole", "halves"])
def test_sampled_constrained_outputs_follow_the_grammar(tiny, chain_kind, halves):
    cfg, model, backend, vocab = tiny
    prompts = _prompts(cfg, 4, 10)
    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"],
        "additionalProperties": False,
    }
    specs = [
        GrammarSpec("regex", REGEX),
        GrammarSpec("json_schema", json.dumps(schema)),
        GrammarSpec("ebnf", 'root ::= "[" item ("," item)* "]"\nitem ::= [a-c] | [0-9]+'),
        GrammarSpec("json_object"),
    ]
    eng = _engine(cfg, model, backend, chain_kind, halves=halves)
    reqs = []
    for seed in range(2):
        for p, spec in zip(prompts, specs, strict=True):
            opts = SamplingOptions(temperature=0.9, seed=seed)
            req = eng.submit(p, 40, stop_token_ids=[EOS], sampling=opts, grammar=spec)
            reqs.append((spec, req))
    eng.run()
    for spec, req in reqs:
        assert req.error is None and req.finish_reason in ("stop", "length")
        # everything output was accepted by a fresh matcher of the grammar
        check = backend.state(spec, [EOS])
        assert check.accept(req.output) == (len(req.output), req.finish_reason == "stop")
        if req.finish_reason != "stop":
            continue
        text = _text(vocab, req.output)
        if spec.kind == "regex":
            assert re.fullmatch(REGEX, text)
        elif spec.kind == "json_schema":
            value = json.loads(text)
            assert set(value) == {"id", "ok"} and isinstance(value["ok"], bool)
        elif spec.kind == "json_object":
            json.loads(text)
        else:
            assert text.startswith("[") and text.endswith("]")


def test_the_grammar_ends_the_request_without_stop_tokens(tiny):
    """A request without stop tokens (``ignore_eos``) still ends once its grammar is complete:
    on the model's EOS, which the grammar's end allows."""
    cfg, model, backend, vocab = tiny
    (prompt,) = _prompts(cfg, 1, 8)
    eng = _engine(cfg, model, backend, None)
    req = eng.submit(prompt, 20, grammar=GrammarSpec("regex", "[0-9]{3}"))
    eng.run()
    assert req.finish_reason == "stop" and req.output[-1] == EOS and EOS not in req.output[:-1]
    assert re.fullmatch("[0-9]{3}", _text(vocab, req.output))


def test_bad_grammars_are_refused_before_queuing(tiny):
    cfg, model, backend, _ = tiny
    (prompt,) = _prompts(cfg, 1, 8)
    eng = _engine(cfg, model, backend, None)
    with pytest.raises(ValueError, match="regex does not compile: Regex parsing error at"):
        eng.submit(prompt, 4, grammar=GrammarSpec("regex", "[0-9"))
    with pytest.raises(ValueError, match="json_schema does not compile: not JSON"):
        eng.submit(prompt, 4, grammar=GrammarSpec("json_schema", "{'type': 1"))
    with pytest.raises(ValueError, match="ebnf does not compile"):
        eng.submit(prompt, 4, grammar=GrammarSpec("ebnf", "root ::= missing"))
    with pytest.raises(ValueError, match="grammar kind must be one of"):
        GrammarSpec("yaml", "a: 1")
    with pytest.raises(ValueError, match="regex is empty"):
        GrammarSpec("regex", " ")
    bare = EngineCore(
        model,
        UnifiedMemory(memory_spec(cfg, 16), 8 << 20, 4, cfg.max_context),
        TorchReferenceBackend(),
        4,
        64,
    )
    with pytest.raises(ValueError, match="needs a grammar backend"):
        bare.submit(prompt, 4, grammar=GrammarSpec("regex", "a"))
    assert eng.scheduler.idle and bare.scheduler.idle
    ok = eng.submit(prompt, 4, stop_token_ids=[EOS])  # the engine still serves
    eng.run()
    assert len(ok.output) >= 1


def test_retracted_constrained_requests_resume_where_their_grammar_stood(tiny):
    """Under memory pressure requests are retracted and recomputed with their output kept;
    their matchers, which read only that output, stay where they were: the outputs are the
    oracle's."""
    cfg, model, backend, vocab = tiny
    prompts = _prompts(cfg, 4, 40)
    pool = UnifiedMemory(memory_spec(cfg, 16), int(0.8 * (1 << 20)), 4, cfg.max_context)
    eng = EngineCore(model, pool, TorchReferenceBackend(), 4, 64, grammar_backend=backend)
    spec = GrammarSpec("regex", "[a-z]{10,40}")
    reqs = [eng.submit(p, 36, stop_token_ids=[EOS], grammar=spec) for p in prompts]
    eng.run()
    assert eng.scheduler.retractions > 0
    for p, req in zip(prompts, reqs, strict=True):
        assert req.error is None and req.output == _oracle(model, backend, p, 36, spec)[0]
