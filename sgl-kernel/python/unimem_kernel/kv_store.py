"""Store a step's K and V rows into paged caches at physical write slots, in one launch.

An attention layer's K/V for ``T`` tokens go to slots ``slots[t]`` (``page * page_size +
offset``, physical, as the metadata builder's write window gives them) of strided paged views
into the arena: ``k_cache [num_pages, page_size, Hkv, Dk]``, ``v_cache [num_pages, page_size,
Hkv, Dv]`` whose page stride is the arena's envelope, not ``page_size * H * D``. Slots in page
0 — the sink — receive zeros, so a padded lane or a rejected row that was redirected there
leaves the sink all zeros; negative slots are treated as slot 0.

The Triton kernel runs one program per token: it reads the token's slot, computes page and
offset in int64 (arena strides exceed 2^31 elements), and writes the token's whole K row and V
row (every head) through the views' strides, cast to the cache dtype (round to nearest even,
as torch's ``.to``). It allocates nothing, reads nothing on the host and has a grid of ``T``
programs, so it is recorded inside a step's CUDA graph. Several tokens may name the sink in
one call (they all write zeros there); two tokens naming the same live slot is a caller bug
(either row may win, as with torch's ``index_put_``).

``store_kv_paged_reference`` is the torch code the attention backends ran before (two
``index_put_`` through the views), with the same semantics.

``rope_store_kv`` is the attention layer's RoPE and this store in one launch: it rotates q
into a new tensor (as ``unimem_kernel.rope_qk``) and writes the rotated K rows straight into
the cache — the rotated K never exists outside the arena — with V beside them. Its reference
is ``rope_qk_reference`` followed by ``store_kv_paged_reference``; the kernel's arithmetic is
``rope_qk``'s (the same device function), so its q and cached K equal ``rope_qk`` + this
store bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_kernel import pdl
from unimem_kernel._dispatch import kernel_op, next_pow2, records_autograd
from unimem_kernel.batch_invariant import bi_rms_norm
from unimem_kernel.fused_common import FUSED_SWITCH, KERNEL_DTYPES
from unimem_kernel.fused_common import use_triton as use_fused_triton
from unimem_kernel.fused_rope import check_rope_args, rope_heads, rope_qk, rope_qk_reference
from unimem_kernel.rounding import round_rne

__all__ = [
    "qk_norm_reference",
    "rope_store_kv",
    "rope_store_kv_reference",
    "store_kv_paged",
    "rope_store_kv_triton",
    "store_kv_paged_reference",
    "store_kv_paged_triton",
]


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])  # slices of the write window
def _store_kv_kernel(
    k_ptr,  # [T, H, DK], unit stride on the last dim
    v_ptr,  # [T, H, DV]
    kc_ptr,  # [pages, page_size, H, DK] strided view (unit last stride)
    vc_ptr,  # [pages, page_size, H, DV]
    slots_ptr,  # [T] physical slots (int32 or int64)
    page_size,
    k_st,
    k_sh,
    v_st,
    v_sh,
    kc_sp,
    kc_so,
    kc_sh,
    vc_sp,
    vc_so,
    vc_sh,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BH: tl.constexpr,
    BDK: tl.constexpr,
    BDV: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.maximum(tl.load(slots_ptr + t).to(tl.int64), 0)
    page = slot // page_size  # slot >= 0: truncation is floor here
    off = slot - page * page_size
    offs_h = tl.arange(0, BH)[:, None]
    offs_k = tl.arange(0, BDK)[None, :]
    offs_v = tl.arange(0, BDV)[None, :]
    mk = (offs_h < H) & (offs_k < DK)
    mv = (offs_h < H) & (offs_v < DV)
    # the sink page loads nothing (zeros); the scalar predicate as an integer bound
    live_h = offs_h < tl.where(page > 0, H, 0)
    k = tl.load(k_ptr + t * k_st + offs_h * k_sh + offs_k, mask=mk & live_h, other=0.0)
    v = tl.load(v_ptr + t * v_st + offs_h * v_sh + offs_v, mask=mv & live_h, other=0.0)
    kc = kc_ptr + page * kc_sp + off * kc_so + offs_h * kc_sh + offs_k
    vc = vc_ptr + page * vc_sp + off * vc_so + offs_h * vc_sh + offs_v
    tl.store(kc, round_rne(k.to(tl.float32), kc_ptr.dtype.element_ty), mask=mk)
    tl.store(vc, round_rne(v.to(tl.float32), vc_ptr.dtype.element_ty), mask=mv)


def store_kv_paged_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write ``k[t] [H, Dk]`` and ``v[t] [H, Dv]`` into physical slot ``slots[t]`` of the
    (strided) paged caches; slots in the sink page (``< page_size``, or negative) receive
    zeros. ``k``/``v`` may be any strided views (e.g. column slices of a fused projection);
    their dtype is cast to the caches' (module docstring). The kernel is one launch, grid
    ``[T]``; the reference is one ``index_put_`` per cache with device index tensors (no host
    read; writes through any view strides)."""
    page_size = k_cache.shape[1]
    s = slots.long().clamp_min(0)
    page = torch.div(s, page_size, rounding_mode="floor")
    off = s - page * page_size
    live = (page > 0)[:, None, None]
    k_cache[page, off] = torch.where(live, k.to(k_cache.dtype), 0)
    v_cache[page, off] = torch.where(live, v.to(v_cache.dtype), 0)


def _check(k, v, k_cache, v_cache, slots) -> None:
    if k.dim() != 3 or v.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            f"expected k [T, H, Dk], v [T, H, Dv], caches [pages, page_size, H, D]; got "
            f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if slots.dim() != 1 or slots.shape[0] != k.shape[0] or v.shape[0] != k.shape[0]:
        raise ValueError(
            f"slots [T] must match k/v's T: slots {tuple(slots.shape)}, k {k.shape[0]}, "
            f"v {v.shape[0]}"
        )
    if k.shape[1:] != k_cache.shape[2:] or v.shape[1:] != v_cache.shape[2:]:
        raise ValueError(
            f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match caches "
            f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
        )
    if k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int32 or int64, got {slots.dtype}")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slots", slots)):
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device}, k on {k.device}")


def store_kv_paged_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Triton launcher of :func:`store_kv_paged` (arguments checked): one launch, grid
    ``[T]``."""
    t = k.shape[0]
    if t == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' last dim must have unit stride")
    h, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slots, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H=h, DK=dk, DV=dv, BH=next_pow2(h), BDK=next_pow2(dk), BDV=next_pow2(dv),
    )  # fmt: skip


def _check_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> bool:
    _check(k, v, k_cache, v_cache, slots)
    return k_cache.dtype != torch.float64


store_kv_paged = kernel_op(
    "store_kv_paged",
    triton=store_kv_paged_triton,
    reference=store_kv_paged_reference,
    device_of="k_cache",
    check=_check_store,
)


# ------------------------------------------------------------------ RoPE + store, one pass


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def _rope_store_kernel(
    q_ptr,  # [T, HQ, D] (unit last stride)
    k_ptr,  # [T, HK, D]
    v_ptr,  # [T, HK, DV]
    cos_ptr,  # [T, HALF] rows (unit last stride)
    sin_ptr,
    qo_ptr,  # [T, HQ, D] contiguous: the rotated q
    kc_ptr,  # [pages, page_size, HK, D] strided view (unit last stride)
    vc_ptr,  # [pages, page_size, HK, DV]
    slots_ptr,  # [T] physical slots (int32 or int64)
    page_size,
    HQ,
    HK,
    D,
    HALF,
    q_st,
    q_sh,
    k_st,
    k_sh,
    v_st,
    v_sh,
    c_st,
    s_st,
    kc_sp,
    kc_so,
    kc_sh,
    vc_sp,
    vc_so,
    vc_sh,
    qw_ptr,  # [D] q norm weight (zero-centred), read only with NORM
    kw_ptr,  # [D] k norm weight
    eps,
    NORM: tl.constexpr,
    DV: tl.constexpr,
    BHQ: tl.constexpr,
    BHK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BDV: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``(t, 0)``: every query head of token ``t`` rotated into ``qo``; ``(t, 1)``:
    every key head rotated into the token's cache slot and its V rows copied beside them
    (zeros in the sink)."""
    t = tl.program_id(0).to(tl.int64)
    c_row = cos_ptr + t * c_st
    s_row = sin_ptr + t * s_st
    if tl.program_id(1) == 0:
        pdl.wait(PDL)
        rope_heads(q_ptr + t * q_st, q_sh, qo_ptr + t * HQ * D, D, HQ, c_row, s_row, D, HALF,
                    BHQ, BLOCK_R, BLOCK_P, True, qw_ptr, eps, NORM)  # fmt: skip
    else:
        slot = tl.maximum(tl.load(slots_ptr + t).to(tl.int64), 0)  # no PDL kernel writes it
        pdl.wait(PDL)
        page = slot // page_size  # slot >= 0: truncation is floor here
        off = slot - page * page_size
        keep = page > 0  # the sink page receives zeros
        kc = kc_ptr + page * kc_sp + off * kc_so
        rope_heads(k_ptr + t * k_st, k_sh, kc, kc_sh, HK, c_row, s_row, D, HALF, BHK, BLOCK_R,
                    BLOCK_P, keep, kw_ptr, eps, NORM)  # fmt: skip
        heads = tl.arange(0, BHK)[:, None]
        cols = tl.arange(0, BDV)[None, :]
        mv = (heads < HK) & (cols < DV)
        live = mv & (cols < tl.where(keep, DV, 0))  # the scalar predicate as an integer bound
        v = tl.load(v_ptr + t * v_st + heads * v_sh + cols, mask=live, other=0.0)
        vc = vc_ptr + page * vc_sp + off * vc_so + heads * vc_sh + cols
        tl.store(vc, round_rne(v.to(tl.float32), vc_ptr.dtype.element_ty), mask=mv)
    pdl.launch_dependents(PDL)


def qk_norm_reference(
    q: torch.Tensor, k: torch.Tensor, qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` through their zero-centred RMS norms over the head dim (``x *
    rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32, float64 for float64, cast back once:
    Gemma's and Qwen3-Next's ``q_norm`` / ``k_norm``); unchanged when ``qk_norm`` is None."""
    if qk_norm is None:
        return q, k
    q_w, k_w, eps = qk_norm

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        xa = x.to(acc)
        y = xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)
        return (y * (1.0 + w.to(acc))).to(x.dtype)

    return norm(q, q_w), norm(k, k_w)


def rope_store_kv_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """The torch reference of :func:`rope_store_kv`: :func:`qk_norm_reference` (when given),
    ``rope_qk_reference``, then :func:`store_kv_paged_reference` of the rotated K;
    returns the rotated q."""
    q, k = qk_norm_reference(q, k, qk_norm)
    q_rot, k_rot = rope_qk_reference(q, k, cos, sin)
    store_kv_paged_reference(k_rot, v, k_cache, v_cache, slots)
    return q_rot


def rope_store_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Triton launcher of :func:`rope_store_kv` (arguments checked; q, k and the caches of
    one fp16 / bf16 / fp32 dtype): one launch, grid ``[T, 2]``."""
    t, hq, d = q.shape
    hk = k.shape[1]
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' last dim must have unit stride")
    q2, k2, v2, c2, s2 = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, cos, sin))
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return qo
    half = cos.shape[1]
    rest = d - 2 * half
    dv = v.shape[2]
    norm_args = (c2, c2, 0.0) if qk_norm is None else (qk_norm[0], qk_norm[1], float(qk_norm[2]))
    pdl_mode = pdl.mode(q)
    _rope_store_kernel[(t, 2)](
        q2, k2, v2, c2, s2, qo, k_cache, v_cache, slots, k_cache.shape[1], hq, hk, d, half,
        q2.stride(0), q2.stride(1), k2.stride(0), k2.stride(1), v2.stride(0), v2.stride(1),
        c2.stride(0), s2.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *norm_args, NORM=qk_norm is not None, DV=dv, BHQ=next_pow2(hq), BHK=next_pow2(hk),
        BLOCK_R=next_pow2(half),
        BLOCK_P=next_pow2(rest) if rest else 0, BDV=next_pow2(dv), PDL=pdl_mode,
        **pdl.launch_options(pdl_mode),
    )  # fmt: skip
    return qo


def _rope_store_kv_in_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """RoPE on ``q [T, Hq, D]`` and ``k [T, Hk, D]`` (``unimem_kernel.rope_qk``'s contract:
    ``cos, sin [T, R/2]``, rotate-half over the first ``R`` dims), then ``k`` rotated and ``v
    [T, Hk, Dv]`` stored at ``slots`` as :func:`store_kv_paged` stores them. Returns the
    rotated q (new, contiguous); the rotated K is written only into ``k_cache``.

    One Triton launch (grid ``[T, 2]``: a token's query heads; its key and value heads,
    ``rope_store_kv_triton``) where ``rope_qk`` and the store would run Triton (CUDA,
    ``UNIMEM_FUSED_OPS`` on, no autograd) and the caches hold q's dtype; else (this function)
    its steps, each an op of its own: the q/k norms (``bi_rms_norm`` where the fused ops run
    Triton, else :func:`qk_norm_reference`), ``rope_qk``, then :func:`store_kv_paged` — the
    same results; off CUDA every step is its reference, so this is
    :func:`rope_store_kv_reference`.

    ``qk_norm = (q_weight [D], k_weight [D], eps)``: each q and k head is first replaced by
    its zero-centred RMS norm over ``D`` (:func:`qk_norm_reference`: fp32 math, rounded to
    q's dtype before the rotation), in the same launch; the norm's sum of squares is
    row-local (one head of one token), so the result does not depend on the batch."""
    if qk_norm is not None:
        if use_fused_triton(q) and q.dtype != torch.float64:  # one row-local launch each
            q = bi_rms_norm(q, qk_norm[0], qk_norm[2], zero_centered=True)
            k = bi_rms_norm(k, qk_norm[1], qk_norm[2], zero_centered=True)
        else:
            q, k = qk_norm_reference(q, k, qk_norm)
    q_rot, k_rot = rope_qk(q, k, cos, sin)
    store_kv_paged(k_rot, v, k_cache, v_cache, slots)
    return q_rot


def _check_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> bool:
    _check(k, v, k_cache, v_cache, slots)
    if qk_norm is not None:
        q_w, k_w, _ = qk_norm
        d = q.shape[-1] if q.dim() else 0
        for name, w in (("q norm weight", q_w), ("k norm weight", k_w)):
            if not isinstance(w, torch.Tensor) or w.shape != (d,) or w.device != q.device:
                raise ValueError(f"{name} must be a [{d}] tensor on {q.device}, got {w!r:.80}")
    if q.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be [T, Hq, D] with k's T and D, got {tuple(q.shape)}")
    check_rope_args(q, k, cos, sin)
    return (
        q.dtype in KERNEL_DTYPES
        and q.dtype == k.dtype == k_cache.dtype
        and cos.dtype != torch.float64
        and (qk_norm is None or qk_norm[0].dtype != torch.float64)
        and not records_autograd(q, k, v, cos, sin)
    )


rope_store_kv = kernel_op(
    "rope_store_kv",
    triton=rope_store_kv_triton,
    reference=_rope_store_kv_in_steps,
    device_of="q",
    check=_check_rope_store,
    switch=FUSED_SWITCH,
)
