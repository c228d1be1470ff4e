"""A decode or verify step's per-lane bookkeeping in one launch.

After a step has chosen its tokens, each lane ``b`` (request-table row ``rows[b]``) commits
``count[b]`` of them: 1 for a decode step, ``accepted[b] + 1`` for a verify step (the anchor's
successors up to the accepted prefix plus the bonus token). Three sets of small writes
follow, which in torch are about a dozen kernels (adds, casts, comparisons, ``where``, two
``index_put_`` and two copies) of a few hundred elements each:

- the request table's device state: ``state_seq_lens[rows[b]] = seq_lens[b] + count[b]`` and
  ``state_next_tokens[rows[b]] = next_tokens[b]`` (the token the next step feeds); a lane on
  row 0 (padding) writes zeros there instead, so any number of padding lanes agree and row 0
  stays zero;
- the step's outputs: ``out_tokens[b, :W] = tokens[b]`` and ``out_counts[b] = count[b]``;
- each given ``[bs * W]`` write-slot vector (a verify step's FULL and SWA token slots, lane-
  major) masked to the committed rows: ``slots[b * W + j]`` where ``j <= accepted[b]``, slot 0
  (the sink) elsewhere — what the drafter's context K/V store needs so that rejected rows
  write nowhere.

:func:`commit_lanes` does all of it in one launch of ``bs`` programs. Integer work only: the
results equal the torch reference :func:`commit_lanes_reference` exactly.

Contract (checked on the host from metadata only; no device reads, fixed grid: capturable in
a CUDA graph): ``rows [bs]`` int32/int64, values in ``[0, len(state))``, the live (nonzero)
ones distinct; ``seq_lens [bs]`` int32; ``next_tokens [bs]`` int64; ``tokens [bs, W]`` int64
(any strides), ``W >= 1``; ``accepted [bs]`` int32 in ``0 .. W - 1`` or None (a decode step:
every lane commits one token); ``state_seq_lens [R]`` int32 and ``state_next_tokens [R]``
int64 (contiguous, caller-owned: the only state written); ``out_tokens [>= bs, >= W]`` int64
with unit last stride and ``out_counts [>= bs]`` int32 (contiguous); ``write_slots``: up to two
``[bs * W]`` contiguous int32/int64 vectors. Returns the masked copies of ``write_slots`` (new
tensors, same dtypes), in order. All tensors on one device. ``bs == 0`` launches nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2

__all__ = ["commit_lanes", "commit_lanes_reference", "commit_lanes_triton"]

_MAX_SLOT_VECTORS = 2  # a verify step's FULL and SWA write slots


@triton.jit
def _commit_lanes_kernel(
    rows_ptr,
    seq_lens_ptr,
    next_ptr,
    tokens_ptr,
    accepted_ptr,
    state_len_ptr,
    state_next_ptr,
    out_tokens_ptr,
    out_counts_ptr,
    slots0_ptr,
    kept0_ptr,
    slots1_ptr,
    kept1_ptr,
    tokens_sb,
    tokens_sj,
    out_tokens_sb,
    W: tl.constexpr,
    WP: tl.constexpr,  # next_pow2(W)
    HAS_ACCEPTED: tl.constexpr,
    N_SLOTS: tl.constexpr,  # write-slot vectors to mask: 0, 1 or 2
):
    """Program ``b``: lane ``b``'s state, outputs and masked write slots."""
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    live = row > 0
    if HAS_ACCEPTED:  # noqa: SIM108 (a constexpr branch: the pointer is not read without it)
        acc = tl.load(accepted_ptr + b)
    else:
        acc = tl.full((), 0, tl.int32)
    count = acc + 1
    seq_len = tl.load(seq_lens_ptr + b)
    nxt = tl.load(next_ptr + b)
    tl.store(state_len_ptr + row, tl.where(live, seq_len + count, 0))
    tl.store(state_next_ptr + row, tl.where(live, nxt, 0))
    tl.store(out_counts_ptr + b, count)
    j = tl.arange(0, WP)
    jmask = j < W
    tok = tl.load(tokens_ptr + b * tokens_sb + j * tokens_sj, mask=jmask)
    tl.store(out_tokens_ptr + b * out_tokens_sb + j, tok, mask=jmask)
    keep = j <= acc
    if N_SLOTS >= 1:
        s = tl.load(slots0_ptr + b * W + j, mask=jmask)
        tl.store(kept0_ptr + b * W + j, tl.where(keep, s, 0), mask=jmask)
    if N_SLOTS >= 2:
        s = tl.load(slots1_ptr + b * W + j, mask=jmask)
        tl.store(kept1_ptr + b * W + j, tl.where(keep, s, 0), mask=jmask)


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _check_vector(
    name: str,
    t: torch.Tensor,
    dtypes: tuple[torch.dtype, ...],
    n: int | None,
    contiguous: bool = False,
) -> None:
    if t.dim() != 1 or t.dtype not in dtypes or (n is not None and t.shape[0] != n):
        want = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        size = "" if n is None else f" of {n}"
        _fail(f"{name} must be a 1-D {want} vector{size}, got {t.dtype} {tuple(t.shape)}")
    if contiguous and t.numel() > 1 and t.stride(0) != 1:
        _fail(f"{name} must be contiguous")


def _check(
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    next_tokens: torch.Tensor,
    tokens: torch.Tensor,
    state_seq_lens: torch.Tensor,
    state_next_tokens: torch.Tensor,
    out_tokens: torch.Tensor,
    out_counts: torch.Tensor,
    accepted: torch.Tensor | None,
    write_slots: Sequence[torch.Tensor],
) -> None:
    _check_vector("rows", rows, (torch.int32, torch.int64), None)
    bs = rows.shape[0]
    _check_vector("seq_lens", seq_lens, (torch.int32,), bs)
    _check_vector("next_tokens", next_tokens, (torch.int64,), bs)
    if tokens.dim() != 2 or tokens.dtype != torch.int64 or tokens.shape[0] != bs:
        _fail(f"tokens must be int64 [bs = {bs}, W], got {tokens.dtype} {tuple(tokens.shape)}")
    w = tokens.shape[1]
    if w < 1:
        _fail("tokens must hold at least one column (W >= 1)")
    _check_vector("state_seq_lens", state_seq_lens, (torch.int32,), None, contiguous=True)
    _check_vector("state_next_tokens", state_next_tokens, (torch.int64,),
                  state_seq_lens.shape[0], contiguous=True)  # fmt: skip
    if out_tokens.dim() != 2 or out_tokens.dtype != torch.int64:
        _fail(f"out_tokens must be a 2-D int64 tensor, got {out_tokens.dtype} "
              f"{tuple(out_tokens.shape)}")  # fmt: skip
    if out_tokens.shape[0] < bs or out_tokens.shape[1] < w:
        _fail(f"out_tokens {tuple(out_tokens.shape)} cannot hold [{bs}, {w}]")
    if w > 1 and out_tokens.stride(1) != 1:
        _fail("out_tokens must have unit stride along its columns")
    _check_vector("out_counts", out_counts, (torch.int32,), None, contiguous=True)
    if out_counts.shape[0] < bs:
        _fail(f"out_counts holds {out_counts.shape[0]} lanes, the step has {bs}")
    if accepted is not None:
        _check_vector("accepted", accepted, (torch.int32,), bs)
    if len(write_slots) > _MAX_SLOT_VECTORS:
        _fail(f"at most {_MAX_SLOT_VECTORS} write-slot vectors, got {len(write_slots)}")
    for i, s in enumerate(write_slots):
        _check_vector(f"write_slots[{i}]", s, (torch.int32, torch.int64), bs * w, contiguous=True)
    named = [("seq_lens", seq_lens), ("next_tokens", next_tokens), ("tokens", tokens),
             ("state_seq_lens", state_seq_lens), ("state_next_tokens", state_next_tokens),
             ("out_tokens", out_tokens), ("out_counts", out_counts),
             *((("accepted", accepted),) if accepted is not None else ()),
             *((f"write_slots[{i}]", s) for i, s in enumerate(write_slots))]  # fmt: skip
    for name, t in named:
        if t.device != rows.device:
            _fail(f"{name} is on {t.device}, rows on {rows.device}")


def commit_lanes_reference(
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    next_tokens: torch.Tensor,
    tokens: torch.Tensor,
    state_seq_lens: torch.Tensor,
    state_next_tokens: torch.Tensor,
    out_tokens: torch.Tensor,
    out_counts: torch.Tensor,
    accepted: torch.Tensor | None = None,
    write_slots: Sequence[torch.Tensor] = (),
) -> list[torch.Tensor]:
    """Commit a step's lanes (module docstring): writes ``state_seq_lens``,
    ``state_next_tokens``, ``out_tokens`` and ``out_counts`` in place and returns the
    ``write_slots`` masked to each lane's committed rows."""
    bs, w = tokens.shape
    count = torch.ones_like(seq_lens) if accepted is None else accepted + 1
    idx = rows.long()
    live = rows > 0
    state_seq_lens[idx] = torch.where(live, seq_lens + count, 0)
    state_next_tokens[idx] = torch.where(live, next_tokens, 0)
    out_tokens[:bs, :w] = tokens
    out_counts[:bs] = count
    acc = torch.zeros_like(seq_lens) if accepted is None else accepted
    keep = (torch.arange(w, device=rows.device)[None, :] <= acc[:, None]).reshape(-1)
    return [torch.where(keep, s, 0) for s in write_slots]


def commit_lanes_triton(
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    next_tokens: torch.Tensor,
    tokens: torch.Tensor,
    state_seq_lens: torch.Tensor,
    state_next_tokens: torch.Tensor,
    out_tokens: torch.Tensor,
    out_counts: torch.Tensor,
    accepted: torch.Tensor | None = None,
    write_slots: Sequence[torch.Tensor] = (),
) -> list[torch.Tensor]:
    """Triton launcher of :func:`commit_lanes` (arguments already checked): one launch of
    ``bs`` programs."""
    write_slots = tuple(write_slots)
    bs, w = tokens.shape
    kept = [torch.empty_like(s) for s in write_slots]
    if bs == 0:
        return kept
    pad = list(zip(write_slots, kept, strict=True)) + [(rows, rows)] * (
        _MAX_SLOT_VECTORS - len(write_slots)
    )  # unused pointer pairs: never dereferenced (N_SLOTS)
    _commit_lanes_kernel[(bs,)](
        rows, seq_lens, next_tokens, tokens, accepted if accepted is not None else seq_lens,
        state_seq_lens, state_next_tokens, out_tokens, out_counts,
        pad[0][0], pad[0][1], pad[1][0], pad[1][1],
        tokens.stride(0), tokens.stride(1), out_tokens.stride(0),
        W=w, WP=next_pow2(w), HAS_ACCEPTED=accepted is not None, N_SLOTS=len(write_slots),
        num_warps=1,
    )  # fmt: skip
    return kept


def _check_commit(
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    next_tokens: torch.Tensor,
    tokens: torch.Tensor,
    state_seq_lens: torch.Tensor,
    state_next_tokens: torch.Tensor,
    out_tokens: torch.Tensor,
    out_counts: torch.Tensor,
    accepted: torch.Tensor | None = None,
    write_slots: Sequence[torch.Tensor] = (),
) -> None:
    _check(rows, seq_lens, next_tokens, tokens, state_seq_lens, state_next_tokens, out_tokens,
           out_counts, accepted, tuple(write_slots))  # fmt: skip


commit_lanes = kernel_op(
    "commit_lanes",
    triton=commit_lanes_triton,
    reference=commit_lanes_reference,
    device_of="rows",
    check=_check_commit,
)
