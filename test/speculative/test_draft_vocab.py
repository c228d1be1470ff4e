"""A reduced draft vocabulary (``DraftConfig.draft_vocab_size``, the map ``d2t``):

- the training forward still computes the inference function (logits over the ``K`` rows);
- ``pick`` returns target ids, equal to a pick over the full vocabulary whose logits are
  ``-inf`` off ``d2t`` (the Markov bias of a previous token outside the vocabulary from
  ``U``'s extra row), and a control's reference outside the vocabulary is taken as is;
- ``sample_pick`` hands its policy logits over the drafter's own vocabulary and takes target
  ids back; a column's proposal, kept over that vocabulary, scatters back to the target's
  (``Proposals.rows``);
- the checkpoint round trip keeps ``d2t``, and refuses a file without it;
- greedy speculative output through the engine equals non-speculative output, and
  speculative sampling runs through it;
- bad maps are refused by name.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.engine.core import EngineCore
from unimem.engine.sampling import SamplingOptions
from unimem.memory.static import StaticMemory
from unimem.models.config import HybridConfig, memory_spec
from unimem.models.forward_context import masked_attention
from unimem.models.synthetic import HybridModel
from unimem.speculative.chain import DsparkChain
from unimem.speculative.checkpoint import load_drafter, save_drafter
from unimem.speculative.drafter import DsparkDrafter, draft_config_for
from unimem.training.distill import greedy_rollouts, random_prompts
from unimem.training.train_forward import block_logits_dense, distill_losses

GAMMA = 4
K = 40


@pytest.fixture(scope="module")
def mini():
    cfg = HybridConfig(
        vocab_size=96,
        d_model=32,
        n_q_heads=2,
        n_kv_heads=1,
        head_dim_k=16,
        head_dim_v=16,
        ffn_dim=64,
        layer_pattern=("full", "swa", "full"),
        window=16,
        gdn_heads=1,
        gdn_head_dim_k=8,
        gdn_head_dim_v=8,
        dtype=torch.float64,
        max_context=256,
    )
    return HybridModel(cfg, seed=0)


def _drafter(model, seed=17):
    dc = draft_config_for(model.config, draft_vocab_size=K)
    d2t = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(3))[:K]
    return DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=seed, d2t=d2t)


def test_training_forward_is_the_inference_function(mini):
    drafter = _drafter(mini)
    dc = drafter.config
    data = greedy_rollouts(mini, random_prompts(2, 10, 96, 5), 16, dc.target_layers)
    anchors = torch.tensor([3, 11, 20])
    dense = block_logits_dense(drafter, data.tokens, data.hidden, anchors, GAMMA)
    assert dense.shape == (2, 3, GAMMA, K)
    for b in range(2):
        for a, n in enumerate(anchors.tolist()):
            ctx = drafter.context_kv([h[b, :n] for h in data.hidden], torch.arange(n))
            q_pos = torch.arange(n, n + GAMMA)

            def attend(j, q, k, v, ctx=ctx, n=n, q_pos=q_pos):
                keys, values = torch.cat([ctx[j][0], k]), torch.cat([ctx[j][1], v])
                return masked_attention(
                    q, keys, values, q_pos, torch.arange(n + GAMMA), dc.layer_window(j),
                    q.shape[-1] ** -0.5,
                )  # fmt: skip

            want = drafter.block_logits(data.tokens[b, n : n + 1], q_pos, attend)[0]
            torch.testing.assert_close(dense[b, a], want, rtol=0, atol=1e-10)
    # targets outside the draft vocabulary add no cross-entropy and are never "accepted"
    out = distill_losses(
        drafter, data.tokens, data.hidden, anchors, GAMMA, data.prompt_lens, data.lengths
    )
    tgt = data.tokens[:, (anchors[:, None] + torch.arange(1, GAMMA + 1)).clamp(max=25)]
    outside = drafter.to_draft(tgt) == K
    assert outside.any()
    assert not out.accepted[outside].any()


def _full_pick(drafter, base, anchors, ref=None, take=None):
    """The pick over the whole vocabulary, -inf off d2t, by the definition."""
    v = drafter.config.vocab_size
    prev = anchors.long()
    cols = []
    for i in range(base.shape[1]):
        logits = torch.full((base.shape[0], v), float("-inf"), dtype=base.dtype)
        logits[:, drafter.d2t] = base[:, i] + drafter.markov_bias(prev)
        tok = logits.argmax(-1)
        if take is not None:
            tok = torch.where(take[:, i], ref[:, i], tok)
        cols.append(tok)
        prev = tok
    return torch.stack(cols, 1)


def test_pick_maps_to_target_ids(mini):
    drafter = _drafter(mini)
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(5, GAMMA, K, generator=gen, dtype=torch.float64) * 3
    outside = [t for t in range(96) if t not in set(drafter.d2t.tolist())]
    anchors = torch.tensor([outside[0], int(drafter.d2t[3]), outside[1], 7, 50])
    got = drafter.pick(base, anchors)
    assert torch.equal(got, _full_pick(drafter, base, anchors))
    assert set(got.flatten().tolist()) <= set(drafter.d2t.tolist())
    ref = torch.tensor([outside[2]] * 5)[:, None].expand(5, GAMMA).contiguous()
    take = torch.zeros(5, GAMMA, dtype=torch.bool)
    take[0, 1] = take[3, 0] = True
    got = drafter.pick(base, anchors, ref, take)
    assert torch.equal(got, _full_pick(drafter, base, anchors, ref, take))
    assert int(got[0, 1]) == outside[2]


def test_sample_pick_policy_sees_the_draft_vocabulary(mini):
    """The policy gets each column's logits over the drafter's ``K`` entries (base plus the
    Markov bias of the previous target id), returns target ids, which condition the next
    column, and whatever else it keeps comes back per column."""
    drafter = _drafter(mini)
    base = torch.randn(3, GAMMA, K, dtype=torch.float64)
    anchors = torch.tensor([1, 2, 3])
    seen = []

    def choose(i, logits):
        seen.append(logits)
        idx = torch.softmax(logits, -1).argmax(-1)
        return drafter.d2t[idx], idx

    tokens, kept = drafter.sample_pick(base, anchors, choose)
    assert [x.shape for x in seen] == [(3, K)] * GAMMA
    prev = anchors
    for i in range(GAMMA):
        want = base[:, i] + drafter.markov_bias(prev).to(base.dtype)
        assert torch.equal(seen[i], want)
        assert torch.equal(tokens[:, i], drafter.d2t[kept[i]])
        prev = tokens[:, i]
    assert set(tokens.flatten().tolist()) <= set(drafter.d2t.tolist())


def test_proposal_rows_are_the_target_vocabulary_distributions():
    """``Proposals.rows`` scatters a column's draft-vocabulary distribution to the target
    ids ``d2t`` (zero elsewhere) and gives the point mass where the control replaced."""
    from unimem.speculative.spec_sampling import Proposals

    g = torch.Generator().manual_seed(0)
    bs, vocab = 3, 96
    d2t = torch.randperm(vocab, generator=g)[:K]
    q = torch.softmax(torch.randn(bs, GAMMA, K, generator=g), -1)
    tokens = d2t[torch.randint(0, K, (bs, GAMMA), generator=g)]
    point = torch.zeros(bs, GAMMA, dtype=torch.bool)
    point[1, 2] = True
    tokens[1, 2] = int(torch.tensor([t for t in range(vocab) if t not in d2t.tolist()][0]))
    prop = Proposals(tokens, torch.ones(bs, GAMMA), q, point, d2t)
    col = torch.tensor([0, 2, 3])
    rows = prop.rows(col, vocab)
    assert rows.shape == (bs, vocab)
    for b in (0, 2):
        want = torch.zeros(vocab)
        want[d2t] = q[b, col[b]]
        assert torch.equal(rows[b], want)
    assert rows[1].sum() == 1 and rows[1, tokens[1, 2]] == 1


def test_checkpoint_round_trip_and_errors(mini, tmp_path):
    drafter = _drafter(mini)
    save_drafter(drafter, tmp_path / "d")
    back = load_drafter(tmp_path / "d", mini)
    assert back.config.draft_vocab_size == K
    assert torch.equal(back.d2t, drafter.d2t)
    for (n, p), (m, q) in zip(back.named_parameters(), drafter.named_parameters(), strict=True):
        assert n == m and torch.equal(p, q)
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    del tensors["d2t"]
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t"):
        load_drafter(tmp_path / "d", mini)
    dc = drafter.config
    with pytest.raises(ValueError, match="distinct"):
        DsparkDrafter(dc, mini.embed_weight, mini.lm_head_weight, d2t=torch.zeros(K))
    with pytest.raises(ValueError, match="outside"):
        DsparkDrafter(dc, mini.embed_weight, mini.lm_head_weight, d2t=torch.arange(K) + 90)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        draft_config_for(mini.config, draft_vocab_size=97)


def test_engine_greedy_output_is_exact(mini):
    drafter = _drafter(mini)
    cfg = mini.config
    prompts = random_prompts(3, 8, 96, seed=9)

    def run(chain, sampling=None):
        lanes = chain.drafter.config.lanes() if chain else ()
        pool = StaticMemory(memory_spec(cfg, 16, lanes), 64, 64, 4, 4, cfg.max_context)
        eng = EngineCore(mini, pool, TorchReferenceBackend(), 4, 64, chain=chain)
        reqs = [eng.submit(p, 12, sampling=sampling) for p in prompts]
        eng.run()
        return [r.output for r in reqs]

    assert run(DsparkChain(drafter, GAMMA)) == run(None)
    # speculative sampling through the reduced vocabulary runs and stays in the vocabulary
    outs = run(DsparkChain(drafter, GAMMA), SamplingOptions(temperature=0.8, seed=3))
    assert all(len(o) == 12 and all(0 <= t < 96 for t in o) for o in outs)
