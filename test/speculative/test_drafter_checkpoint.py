"""DSPARK drafter checkpoints: ``save_drafter`` -> ``load_drafter`` round trip and the load
errors of a drafter that does not fit its target (each names the field or tensor)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from unimem.models.forward_context import masked_attention
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.speculative.checkpoint import (
    FP8_MATRICES,
    ROW_SCALE,
    fp8_rows,
    load_drafter,
    save_drafter,
)
from unimem.speculative.drafter import DsparkDrafter, draft_config_for


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    model = HybridModel(cfg, seed=0)
    return cfg, model


def _drafter(model, seed=3, **changes):
    import dataclasses

    dc = dataclasses.replace(draft_config_for(model.config), **changes)
    return DsparkDrafter(dc, model.embed_weight, model.lm_head_weight, seed=seed)


def _proposals(drafter, n=24, gamma=5, bs=3, seed=0):
    """Proposals of ``bs`` requests at committed length ``n`` over a random context (the
    inference path: ``context_kv``, then ``propose`` with a dense ``attend``)."""
    c = drafter.config
    g = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(bs, n, c.d_model, generator=g, dtype=c.dtype) for _ in c.target_layers]
    anchors = torch.randint(0, c.vocab_size, (bs,), generator=g)
    ctx = [drafter.context_kv([h[b] for h in hidden], torch.arange(n)) for b in range(bs)]
    positions = torch.arange(n, n + gamma).repeat(bs)

    def attend(j, q, k, v):
        out = []
        for b in range(bs):
            rows = slice(b * gamma, (b + 1) * gamma)
            keys = torch.cat([ctx[b][j][0], k[rows]])
            values = torch.cat([ctx[b][j][1], v[rows]])
            out.append(
                masked_attention(
                    q[rows],
                    keys,
                    values,
                    torch.arange(n, n + gamma),
                    torch.arange(n + gamma),
                    c.layer_window(j),
                    q.shape[-1] ** -0.5,
                )
            )
        return torch.cat(out)

    base = drafter.block_logits(anchors, positions, attend)
    return drafter.pick(base, anchors), base


def test_round_trip_gives_bit_identical_proposals(tiny, tmp_path):
    _, model = tiny
    drafter = _drafter(model, gamma=5)
    save_drafter(drafter, tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    loaded = load_drafter(tmp_path / "d", model)
    assert loaded.config == drafter.config
    assert loaded.config.gamma == 5
    # its own weights only, bit for bit; the target's embedding and LM head are shared
    saved = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert set(saved) == {n for n, _ in drafter.named_parameters()}
    assert not any("embed." in n or "lm_head" in n for n in saved)
    for (name, a), (_, b) in zip(
        drafter.named_parameters(), loaded.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
        assert not b.requires_grad
    assert loaded.embed is model.embed_weight and loaded.lm_head is model.lm_head_weight
    tokens_a, base_a = _proposals(drafter)
    tokens_b, base_b = _proposals(loaded)
    assert torch.equal(base_a, base_b)
    assert torch.equal(tokens_a, tokens_b)
    # a drafter seeded differently proposes differently: the weights did come from the file
    assert not torch.equal(_proposals(_drafter(model, seed=4))[1], base_b)


def test_config_json_names_the_fields(tiny, tmp_path):
    _, model = tiny
    drafter = _drafter(model)
    save_drafter(drafter, tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["format"] == "unimem-dspark-drafter"
    assert d["target_layers"] == [1, 3, 5]
    assert d["layer_hosts"] == ["full", "swa"]
    assert d["window"] == 8 and d["markov_rank"] == 16
    assert d["vocab_size"] == 512 and d["d_model"] == 256
    assert d["dtype"] == "float64" and d["gamma"] is None


def test_load_casts_to_the_requested_dtype(tiny, tmp_path):
    _, model = tiny
    drafter = _drafter(model)
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path, model, dtype=torch.float32)
    assert loaded.config.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    assert loaded.config.lanes()[0].layer.dtype == torch.float32
    torch.testing.assert_close(loaded.fc.double(), drafter.fc, rtol=1e-6, atol=0)


def test_fp8_weights_store_the_projections_in_float8_with_row_scales(tiny, tmp_path):
    _, model = tiny
    drafter = _drafter(model, gamma=5)
    save_drafter(drafter, tmp_path / "bf", fp8_weights=False)
    save_drafter(drafter, tmp_path / "f8", fp8_weights=True)
    saved = load_file(str(tmp_path / "f8" / "model.safetensors"))
    params = dict(drafter.named_parameters())
    quantised = {n for n in params if n.rsplit(".", 1)[-1] in FP8_MATRICES}
    assert {"fc", "layers.0.qkv_proj", "layers.1.down"} <= quantised
    assert set(saved) == set(params) | {n + ROW_SCALE for n in quantised}
    for n in quantised:
        assert saved[n].dtype == torch.float8_e4m3fn and saved[n + ROW_SCALE].dtype == torch.float32
        assert saved[n].float().abs().amax(dim=1).eq(448).all(), n  # each row's largest at 448
    assert saved["markov_u"].dtype == drafter.markov_u.dtype  # the rest as it was
    loaded = load_drafter(tmp_path / "f8", model)
    for name, p in loaded.named_parameters():
        ref = params[name]
        if name in quantised:  # e4m3: 3 mantissa bits, rounding error <= 2^-4 of the row's max
            q, scale = fp8_rows(ref)
            assert torch.equal(p, (q.float() * scale[:, None]).double()), name
            err = (p - ref).abs() / ref.abs().amax(dim=1, keepdim=True)
            assert 0 < err.max() <= 2**-4, name
        else:
            assert torch.equal(p, ref), name
    f8 = (tmp_path / "f8" / "model.safetensors").stat().st_size
    bf = (tmp_path / "bf" / "model.safetensors").stat().st_size
    assert f8 < bf  # float64 tiny drafter: the matrices 8 -> 1 byte (+ 4 a row)
    # the drafter still drafts: its proposals from the dequantised weights are those of a
    # drafter holding exactly those values
    tokens, base = _proposals(loaded)
    assert torch.isfinite(base).all() and tokens.shape == (3, 5)


def test_fp8_rows_maps_each_rows_largest_magnitude_to_448_and_zero_rows_stay_zero():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [3e-3, 1e-3, -6e-3]])
    q, scale = fp8_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.tolist() == pytest.approx(
        [2 / 448, 1.0, 6e-3 / 448]
    )
    assert q.float()[[0, 2]].abs().amax(dim=1).tolist() == [448.0, 448.0]
    assert q.float()[1].eq(0).all()
    torch.testing.assert_close(q.float() * scale[:, None], w, rtol=2**-4, atol=0)


@pytest.mark.parametrize(
    "edit, match",
    [
        ("drop_scale", "needs a 2-D shape and its per-row scale 'fc.row_scale'"),
        ("bad_scale", "'fc.row_scale' must be float32 \\[256\\]"),
        ("scale_of_plain", "scales 'mask_embed', which is .*not float8"),
    ],
)
def test_fp8_weights_with_a_wrong_scale_are_refused_by_name(tiny, tmp_path, edit, match):
    _, model = tiny
    save_drafter(_drafter(model), tmp_path, fp8_weights=True)
    path = tmp_path / "model.safetensors"
    t = load_file(str(path))
    if edit == "drop_scale":
        del t["fc" + ROW_SCALE]
    elif edit == "bad_scale":
        t["fc" + ROW_SCALE] = t["fc" + ROW_SCALE][:-1].contiguous()
    else:
        t["mask_embed" + ROW_SCALE] = torch.ones(1)
    save_file(t, str(path))
    with pytest.raises(ValueError, match=match):
        load_drafter(tmp_path, model)


def _edit_config(path, **changes):
    d = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is _DROP:
            del d[k]
        else:
            d[k] = v
    (path / "config.json").write_text(json.dumps(d))


_DROP = object()


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"vocab_size": 500}, "vocab_size 500 does not fit the target's vocab_size 512"),
        ({"d_model": 128}, "d_model 128 does not fit the target's d_model 256"),
        ({"target_layers": [1, 6]}, "target_layers: layer index 6 out of range .* 6 layers"),
        ({"window": 32}, "window 32 is larger than the target's SWA window \\(16\\)"),
        ({"n_kv_heads": 3}, "DraftConfig.n_kv_heads"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"layers": 3}, "unknown field 'layers'"),
        ({"ffn_dim": _DROP}, "missing field\\(s\\) \\['ffn_dim'\\]"),
        ({"format": "hf"}, "format must be 'unimem-dspark-drafter'"),
    ],
)
def test_config_that_does_not_fit_fails_naming_the_field(tiny, tmp_path, changes, match):
    _, model = tiny
    save_drafter(_drafter(model), tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=match):
        load_drafter(tmp_path, model)


def test_shapes_that_do_not_fit_fail_naming_the_tensor(tiny, tmp_path):
    _, model = tiny
    save_drafter(_drafter(model), tmp_path)
    weights = tmp_path / "model.safetensors"
    good = load_file(str(weights))

    def write(tensors):
        save_file(tensors, str(weights))

    write({k: v for k, v in good.items() if k != "layers.1.down"})
    with pytest.raises(ValueError, match="missing tensor 'layers.1.down'"):
        load_drafter(tmp_path, model)
    write({**good, "layers.1.down": good["layers.1.down"][:, :-1].contiguous()})
    with pytest.raises(ValueError, match="tensor 'layers.1.down' has shape \\(256, 511\\)"):
        load_drafter(tmp_path, model)
    write({**good, "embed": model.embed_weight.clone()})
    with pytest.raises(ValueError, match="unexpected tensor 'embed'"):
        load_drafter(tmp_path, model)
    weights.unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_drafter(tmp_path, model)
    with pytest.raises(ValueError, match="no config.json"):
        load_drafter(tmp_path / "nowhere", model)


def test_drafter_of_another_target_fails(tiny, tmp_path):
    """A drafter saved for a target with a wider model does not load onto ``tiny``."""
    import dataclasses

    cfg, model = tiny
    wide_cfg = dataclasses.replace(cfg, d_model=128, ffn_dim=256, vocab_size=300)
    wide = HybridModel(wide_cfg, seed=1)
    save_drafter(_drafter(wide), tmp_path)
    with pytest.raises(ValueError, match="vocab_size 300 does not fit"):
        load_drafter(tmp_path, model)
