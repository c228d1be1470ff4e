"""Gumbel-max draw over filtered logits with counter-based noise, and the noise's keys.

``gumbel_argmax(scaled, cut, keys, out)``: for every row ``n`` of ``scaled [N, V]`` (float32),
``out[n] = argmax_v(scaled[n, v] + g(keys[n], v))`` over the ``v`` with
``scaled[n, v] >= cut[n]`` (the others score ``-inf``), where ``g = -log(-log(u))`` and ``u``
is :func:`hash_uniform` — a pure function of the row's 32-bit key and the vocabulary index.
Ties go to the lowest index. ``keys [N]`` int64 in ``[0, 2**32)`` (:func:`row_keys` of a seed
and a position); ``out [N]`` int64, caller-owned. Two launches on fixed grids, no host reads:
capturable. The first splits every row into up to :data:`NSPLIT` chunks, one program each,
which write their chunk's best ``(score, first index)``; the second takes per row the best of
its partials (the smallest index among equal scores). The maximum and its first index do not
depend on how the row is cut, so the draw is the same for any split. (One program per row
walked a 262 144-token row alone: ~0.5 ms per draw at one row on an H100, most of a sampled
decode step.)

The keys: :func:`position_keys` ``(seeds [N], positions [N], stream)`` is the key of each
``(seed, position)`` in random stream ``stream`` — :func:`stream_keys` of :func:`row_keys` —
in one launch (composed of torch integer ops, one key costs ~80 tiny kernels: a sampled
DSPARK step derived ~10 sets of keys, ~800 of its ~1 250 launches). :func:`hash_uniform`
``(keys [N], vocab)`` is the uniform ``[N, vocab]`` of the draw, also one launch.

The hash is lowbias32 (a bijection of 32-bit values) applied twice to a Weyl sequence of the
vocabulary index offset by the key; the uniform takes its top 23 bits, centred in their
bucket, so ``u`` and ``1 - u`` are exact in float32 and the noise is finite. The torch
reference computes the same bits with int64 arithmetic that never overflows (32-bit products
split into 16-bit halves); the Triton kernel uses uint64 products masked to 32 bits. The
float noise may differ from the reference's in the last ulp (``log`` implementations).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op

__all__ = [
    "BLOCK",
    "NSPLIT",
    "gumbel_argmax",
    "gumbel_argmax_reference",
    "gumbel_argmax_triton",
    "gumbel_noise",
    "hash_uniform",
    "hash_uniform_reference",
    "hash_uniform_triton",
    "position_keys",
    "position_keys_reference",
    "position_keys_triton",
    "row_keys",
    "stream_keys",
]

_M32 = 0xFFFFFFFF
_C1, _C2, _WEYL, _SALT = 0x7FEB352D, 0x846CA68B, 0x9E3779B9, 0x5BD1E995


# ------------------------------------------------------------------- Triton


@triton.jit
def _mix32_u64(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _uniform_u64(key, v):
    """The uniform of :func:`hash_uniform` at vocabulary index ``v`` (uint64) of a row's key
    (uint64 below ``2**32``), float32 in ``(0, 1)``: the one definition every kernel draws
    its noise with."""
    x = (key + ((v * 0x9E3779B9) & 0xFFFFFFFF)) & 0xFFFFFFFF
    x = _mix32_u64(_mix32_u64(x) ^ key)
    return ((x >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)


BLOCK = 1024
"""Logits per loop step of a program of the draw."""

NSPLIT = 64
"""Most programs per row of the draw (fewer for a short vocabulary): at 262 144 tokens, 64
chunks of 4 096."""


@triton.jit
def _gumbel_partial_kernel(
    scaled_ptr, stride_n, cut_ptr, keys_ptr, part_val_ptr, part_idx_ptr, V, chunk,
    NSPLIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program ``(n, s)``: the best score of row ``n`` over ``[s * chunk, (s + 1) * chunk) &
    [0, V)`` and its first index into the partials; an empty chunk gives ``(-inf, s *
    chunk)``."""
    n = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, V)
    row = scaled_ptr + n * stride_n
    cut = tl.load(cut_ptr + n)
    key = tl.load(keys_ptr + n).to(tl.uint64)
    best = tl.full((), -float("inf"), tl.float32)
    best_idx = lo.to(tl.int64)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        x_s = tl.load(row + offs, mask=mask, other=-float("inf"))
        g = -tl.log(-tl.log(_uniform_u64(key, offs.to(tl.uint64))))
        score = tl.where(mask & (x_s >= cut), x_s + g, -float("inf"))
        blk_max = tl.max(score, axis=0)
        blk_idx = tl.min(tl.where(mask & (score == blk_max), offs, hi), axis=0).to(tl.int64)
        better = blk_max > best  # strictly: an earlier block keeps its tie
        best_idx = tl.where(better, blk_idx, best_idx)
        best = tl.where(better, blk_max, best)
    at = n * NSPLIT + s
    tl.store(part_val_ptr + at, best)
    tl.store(part_idx_ptr + at, best_idx)


@triton.jit
def _gumbel_pick_kernel(part_val_ptr, part_idx_ptr, out_ptr, NSPLIT: tl.constexpr):
    """Program ``n``: row ``n``'s draw from its ``NSPLIT`` partials (the first index among
    the chunks holding the best score; 0 when every score is ``-inf``)."""
    n = tl.program_id(0).to(tl.int64)
    offs = n * NSPLIT + tl.arange(0, NSPLIT)
    vals = tl.load(part_val_ptr + offs)
    idxs = tl.load(part_idx_ptr + offs)
    top = tl.max(vals, axis=0)
    tl.store(out_ptr + n, tl.min(tl.where(vals == top, idxs, 0x7FFFFFFFFFFFFFFF), axis=0))


def gumbel_argmax_triton(
    scaled: torch.Tensor, cut: torch.Tensor, keys: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """The Triton kernels (module docstring); returns ``out``."""
    n, vocab = scaled.shape
    if n == 0:
        return out
    block = min(BLOCK, max(16, 1 << (vocab - 1).bit_length()))
    nsplit = min(NSPLIT, 1 << (triton.cdiv(vocab, block) - 1).bit_length())
    chunk = triton.cdiv(triton.cdiv(vocab, nsplit), block) * block
    part_val = torch.empty(n, nsplit, dtype=torch.float32, device=scaled.device)
    part_idx = torch.empty(n, nsplit, dtype=torch.int64, device=scaled.device)
    _gumbel_partial_kernel[(n, nsplit)](
        scaled, scaled.stride(0), cut, keys, part_val, part_idx, vocab, chunk,
        NSPLIT=nsplit, BLOCK=block,
    )  # fmt: skip
    _gumbel_pick_kernel[(n,)](part_val, part_idx, out, NSPLIT=nsplit, num_warps=1)
    return out


KEYS_BLOCK = 256
"""Keys (or uniforms) per program of :func:`position_keys` / :func:`hash_uniform`."""


@triton.jit
def _position_keys_kernel(
    seeds_ptr, pos_ptr, out_ptr, n,
    HAS_STREAM: tl.constexpr, STREAM_SALT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Keys ``[n]`` of ``(seed, position)`` pairs: :func:`row_keys`, then with ``HAS_STREAM``
    the re-hash with ``STREAM_SALT`` (``_mix32_int(stream ^ _SALT)``) of :func:`stream_keys`.
    uint64 arithmetic on values below ``2**32`` (products masked back to 32 bits)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    seed = tl.load(seeds_ptr + offs, mask=mask, other=0).to(tl.uint64)  # the same 64 bits
    pos = tl.load(pos_ptr + offs, mask=mask, other=0).to(tl.uint64)
    h = _mix32_u64((seed & 0xFFFFFFFF) ^ 0x5BD1E995)
    h = _mix32_u64(h ^ (seed >> 32))
    h = _mix32_u64(h ^ (pos & 0xFFFFFFFF))
    if HAS_STREAM:
        h = _mix32_u64(h ^ STREAM_SALT)
    tl.store(out_ptr + offs, h.to(tl.int64), mask=mask)


@triton.jit
def _hash_uniform_kernel(keys_ptr, out_ptr, total, vocab, BLOCK: tl.constexpr):
    """``out`` (``[N, vocab]`` flattened, ``total`` entries): the uniform of
    :func:`hash_uniform` of each entry's row key and vocabulary index."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    key = tl.load(keys_ptr + offs // vocab, mask=mask, other=0).to(tl.uint64)
    tl.store(out_ptr + offs, _uniform_u64(key, (offs % vocab).to(tl.uint64)), mask=mask)


def position_keys_triton(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Triton launcher of :func:`position_keys` (arguments already checked): one launch."""
    n = seeds.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=seeds.device)
    if n:
        _position_keys_kernel[(triton.cdiv(n, KEYS_BLOCK),)](
            seeds.long().contiguous(), positions.long().contiguous(), out, n,
            HAS_STREAM=stream != 0, STREAM_SALT=_mix32_int(stream ^ _SALT) if stream else 0,
            BLOCK=KEYS_BLOCK,
        )  # fmt: skip
    return out


def hash_uniform_triton(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Triton launcher of :func:`hash_uniform` (arguments already checked): one launch."""
    n = keys.shape[0]
    out = torch.empty(n, vocab, dtype=torch.float32, device=keys.device)
    if n * vocab:
        _hash_uniform_kernel[(triton.cdiv(n * vocab, KEYS_BLOCK),)](
            keys.long().contiguous(), out, n * vocab, vocab, BLOCK=KEYS_BLOCK
        )
    return out


# ------------------------------------------------------------------- torch reference


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    """:func:`_mix32` of one Python int (a host constant: nothing is uploaded)."""
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A 32-bit key (int64 in ``[0, 2**32)``) per row from int64 ``seeds`` and
    ``positions`` ``[N]``."""
    seeds = seeds.long()
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    h = _mix32(lo ^ _SALT)
    h = _mix32(h ^ hi)
    return _mix32(h ^ (positions.long() & _M32))


def stream_keys(keys: torch.Tensor, stream: int) -> torch.Tensor:
    """The keys of random stream ``stream`` (an int in ``[0, 2**32)``) derived from
    :func:`row_keys` ``keys [N]``: stream 0 is ``keys`` itself (the token-sampling stream);
    every other stream re-hashes the key with the stream id, so draws of different streams at
    the same ``(seed, position)`` are unrelated."""
    if not 0 <= stream <= _M32:
        raise ValueError(f"stream must be in [0, 2**32), got {stream}")
    if stream == 0:
        return keys.long()
    return _mix32(keys.long() ^ _mix32_int(stream ^ _SALT))


def position_keys_reference(
    seeds: torch.Tensor, positions: torch.Tensor, stream: int
) -> torch.Tensor:
    """Keys ``[N]`` (int64 in ``[0, 2**32)``) of stream ``stream`` at int64 ``seeds [N]`` and
    ``positions [N]``: ``stream_keys(row_keys(seeds, positions), stream)``."""
    return stream_keys(row_keys(seeds, positions), stream)


def _check_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> None:
    if seeds.dim() != 1 or positions.shape != seeds.shape:
        raise ValueError(
            f"seeds and positions must be [N] each, got {tuple(seeds.shape)} and "
            f"{tuple(positions.shape)}"
        )
    if seeds.device != positions.device:
        raise ValueError("seeds and positions must be on one device")
    if seeds.is_floating_point() or positions.is_floating_point():
        raise ValueError("seeds and positions must be integer tensors")
    if isinstance(stream, bool) or not isinstance(stream, int) or not 0 <= stream <= _M32:
        raise ValueError(f"stream must be an int in [0, 2**32), got {stream!r}")


position_keys = kernel_op(
    "position_keys",
    triton=position_keys_triton,
    reference=position_keys_reference,
    device_of="seeds",
    check=_check_keys,
)


def hash_uniform_reference(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``u [N, vocab]`` float32 in ``(0, 1)``, a pure function of ``(keys[n], v)``."""
    key = keys.long()[:, None]
    v = torch.arange(vocab, device=keys.device, dtype=torch.int64)[None, :]
    x = _mix32(_mix32((key + _mul32(v, _WEYL)) & _M32) ^ key)
    return ((x >> 9) * 2 + 1).float() * (1.0 / (1 << 24))


def _check_uniform(keys: torch.Tensor, vocab: int) -> None:
    if keys.dim() != 1 or keys.is_floating_point():
        raise ValueError(
            f"keys must be an integer [N] tensor, got {tuple(keys.shape)} {keys.dtype}"
        )
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 0:
        raise ValueError(f"vocab must be an int >= 0, got {vocab!r}")


hash_uniform = kernel_op(
    "hash_uniform",
    triton=hash_uniform_triton,
    reference=hash_uniform_reference,
    device_of="keys",
    check=_check_uniform,
)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` of :func:`hash_uniform`, ``[N, vocab]``."""
    return -torch.log(-torch.log(hash_uniform(keys, vocab)))


def gumbel_argmax_reference(
    scaled: torch.Tensor, cut: torch.Tensor, keys: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """The draw of the module docstring into ``out``, returned."""
    noise = gumbel_noise(keys, scaled.shape[-1])
    scores = torch.where(scaled >= cut[:, None], scaled + noise, -math.inf)
    out.copy_(torch.argmax(scores, dim=-1))
    return out


def _check_draw(
    scaled: torch.Tensor, cut: torch.Tensor, keys: torch.Tensor, out: torch.Tensor
) -> None:
    if scaled.dim() != 2 or scaled.stride(-1) != 1:
        raise ValueError(f"scaled must be [N, V] with contiguous rows, got {tuple(scaled.shape)}")
    n = scaled.shape[0]
    for name, t in (("cut", cut), ("keys", keys), ("out", out)):
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(t.shape)}")
    if scaled.dtype != torch.float32 or cut.dtype != torch.float32:
        raise ValueError("scaled and cut must be float32")
    if keys.dtype != torch.int64 or out.dtype != torch.int64:
        raise ValueError("keys and out must be int64")


gumbel_argmax = kernel_op(
    "gumbel_argmax",
    triton=gumbel_argmax_triton,
    reference=gumbel_argmax_reference,
    device_of="scaled",
    check=_check_draw,
)
