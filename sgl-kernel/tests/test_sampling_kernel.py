"""gumbel_argmax: the Triton kernel (through the interpreter on CPU) equals its torch
reference; the noise is a pure function of (key, vocab index); filtered entries never win.
position_keys and hash_uniform: their one-launch kernels give the references' bits."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel.sampling import (
    gumbel_argmax,
    gumbel_argmax_reference,
    gumbel_argmax_triton,
    hash_uniform,
    hash_uniform_reference,
    hash_uniform_triton,
    position_keys,
    position_keys_reference,
    position_keys_triton,
    row_keys,
    stream_keys,
)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    scaled = (torch.randn(n, vocab, generator=g) * 2).to(DEV)
    # cut: keep roughly the top third of each row; one row keeps everything
    cut = scaled.quantile(0.66, dim=-1).contiguous()
    cut[0] = -math.inf
    keys = row_keys(torch.arange(n, device=DEV) * 977 - 5, torch.arange(n, device=DEV) + 3)
    return scaled, cut, keys


@pytest.mark.parametrize(
    "n, vocab", [(1, 7), (5, 100), (4, 1500), (3, 2048), (2, 5000), (1, 70_000)]
)
def test_triton_kernel_equals_the_reference(n, vocab):
    scaled, cut, keys = _case(n, vocab, seed=vocab)
    want = gumbel_argmax_reference(scaled, cut, keys, torch.empty(n, dtype=torch.int64, device=DEV))
    got = gumbel_argmax_triton(
        scaled, cut, keys, torch.full((n,), -1, dtype=torch.int64, device=DEV)
    )
    assert torch.equal(got, want)
    assert (scaled.gather(1, got[:, None])[:, 0] >= cut).all()


def test_split_rows_pick_the_first_best_whatever_the_chunk():
    """Rows cut into chunks (vocab 9 000: 16 chunks of 1 024, the last ones short or empty):
    a row whose only kept tokens sit in one late chunk, one that keeps a single token in the
    last (short) chunk, one that keeps nothing (token 0, as the reference), and rows where
    equal scores in two chunks must give the earlier index."""
    n, vocab = 5, 9000
    scaled, _, keys = _case(n, vocab, seed=3)
    cut = torch.full((n,), math.inf, device=DEV)
    scaled[0, 6000:6100] += 50.0  # only these pass row 0's cut
    cut[0] = float(scaled[0, 6000:6100].min())
    cut[1] = float(scaled[1, 8999])  # the last token only (ties aside: check below)
    scaled[1, :8999] = torch.minimum(scaled[1, :8999], scaled[1, 8999] - 1)
    # row 2 keeps nothing: cut +inf
    # rows 3, 4: one token each in two chunks with the same scaled value and the same noise
    # cannot be built (the noise depends on the index), so give them -inf noise-free ties:
    # every kept token scores +inf (scaled +inf), the first kept index must win
    cut[3] = -math.inf
    cut[4] = -math.inf
    scaled[3, [1500, 7000]] = math.inf
    scaled[4, [3, 8191]] = math.inf
    want = gumbel_argmax_reference(scaled, cut, keys, torch.empty(n, dtype=torch.int64, device=DEV))
    got = gumbel_argmax_triton(
        scaled, cut, keys, torch.full((n,), -1, dtype=torch.int64, device=DEV)
    )
    assert torch.equal(got, want)
    assert 6000 <= int(got[0]) < 6100
    assert got[1:].tolist() == [8999, 0, 1500, 3]


def test_strided_rows_and_padding_lanes():
    scaled, cut, keys = _case(4, 300)
    wide = torch.zeros(4, 320, device=DEV)
    wide[:, :300] = scaled
    view = wide[:, :300]  # row stride 320
    want = gumbel_argmax_reference(scaled, cut, keys, torch.empty(4, dtype=torch.int64, device=DEV))
    got = gumbel_argmax_triton(view, cut, keys, torch.empty(4, dtype=torch.int64, device=DEV))
    assert torch.equal(got, want)


def test_keys_are_deterministic_and_the_noise_uniform():
    keys = row_keys(torch.tensor([1, 1, -1]), torch.tensor([2, 3, 2]))
    assert keys.dtype == torch.int64 and ((keys >= 0) & (keys < 2**32)).all()
    assert keys[0] != keys[1] != keys[2]
    u = hash_uniform(keys, 50_000)
    assert torch.equal(u, hash_uniform(keys, 50_000))
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.std()) - math.sqrt(1 / 12)) < 0.01


def test_bad_shapes_and_dtypes_are_refused():
    scaled, cut, keys = _case(2, 10)
    out = torch.empty(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="cut must have shape"):
        gumbel_argmax(scaled, cut[:1], keys, out)
    with pytest.raises(ValueError, match="float32"):
        gumbel_argmax(scaled.double(), cut, keys, out)
    with pytest.raises(ValueError, match="int64"):
        gumbel_argmax(scaled, cut, keys.int(), out)


def test_stream_keys_are_deterministic_distinct_and_uniform():
    keys = row_keys(torch.arange(2000) * 7919 - 3, torch.arange(2000) % 37)
    assert torch.equal(stream_keys(keys, 0), keys)  # stream 0: the token-sampling keys
    a, b = stream_keys(keys, 1), stream_keys(keys, 2)
    assert torch.equal(a, stream_keys(keys, 1))
    assert ((a >= 0) & (a < 2**32)).all() and ((b >= 0) & (b < 2**32)).all()
    assert (a != keys).all() and (a != b).all()
    # the first uniform of each stream: uniform, and unrelated to the other streams'
    u0, u1, u2 = (hash_uniform(k, 1)[:, 0].double() for k in (keys, a, b))
    for u in (u1, u2):
        assert abs(float(u.mean()) - 0.5) < 0.03
        assert abs(float(torch.corrcoef(torch.stack([u, u0]))[0, 1])) < 0.08
    assert abs(float(torch.corrcoef(torch.stack([u1, u2]))[0, 1])) < 0.08
    with pytest.raises(ValueError, match="stream"):
        stream_keys(keys, -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stream", [0, 1, 3, 2**32 - 1])
def test_position_keys_kernel_gives_the_references_bits(device, stream):
    """Seeds over the whole int64 range (negative ones, ones above 2**32), positions past
    2**32 (only their low 32 bits count), a length that is not a multiple of the block."""
    g = torch.Generator().manual_seed(stream % 1000)
    n = 300
    seeds = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g, dtype=torch.int64)
    seeds[:4] = torch.tensor([0, -1, 2**32, -(2**63)])
    positions = torch.randint(0, 2**40, (n,), generator=g, dtype=torch.int64)
    seeds, positions = seeds.to(device), positions.to(device)
    want = position_keys_reference(seeds, positions, stream)
    got = position_keys_triton(seeds, positions, stream)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(want, stream_keys(row_keys(seeds, positions), stream))
    assert position_keys_triton(seeds[:0], positions[:0], stream).shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n, vocab", [(1, 1), (7, 1), (3, 1000), (2, 70_001)])
def test_hash_uniform_kernel_gives_the_references_bits(device, n, vocab):
    keys = row_keys(torch.arange(n) * 977 - 5, torch.arange(n) + 3).to(device)
    want = hash_uniform_reference(keys, vocab)
    got = hash_uniform_triton(keys, vocab)
    assert got.shape == (n, vocab) and torch.equal(got, want)


def test_key_ops_refuse_bad_arguments():
    s = torch.arange(4)
    with pytest.raises(ValueError, match="seeds and positions must be"):
        position_keys(s, s[:3], 1)
    with pytest.raises(ValueError, match="integer"):
        position_keys(s.float(), s, 1)
    with pytest.raises(ValueError, match="stream"):
        position_keys(s, s, 2**32)
    with pytest.raises(ValueError, match="keys must be"):
        hash_uniform(s[:, None], 3)
    with pytest.raises(ValueError, match="vocab"):
        hash_uniform(s, -1)
