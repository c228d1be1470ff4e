"""Ahead-of-time compile check of the Triton kernels for an H200 (sm_90), without a GPU.

The kernels of ``unimem_kernel.fused``, ``unimem_kernel.batch_invariant`` and
``unimem_kernel.gdn`` have run in the Triton interpreter only on machines without CUDA, and
the interpreter accepts code the compiler rejects. This script compiles every launch variant
the engine uses, at the ``small`` preset's sizes (bf16 activations, fp32 GDN states), with
``triton.compile`` on an ``ASTSource`` for ``GPUTarget("cuda", 90, 32)``: through TTIR, TTGIR,
LLVM IR and PTX, and to a cubin when ``ptxas`` is available (Triton bundles it; else the
check stops at PTX and says so).

How a variant's signature is obtained: the public launcher runs on CPU tensors of the real
shapes and strides (``UNIMEM_KERNEL_BACKEND=triton``) with the kernel replaced by a recorder,
so the arguments, constexprs and launch options are exactly those the launcher passes. They
are turned into a signature with the JIT's specialisation rules (:func:`specialize`): a tensor
is ``*<dtype>`` (``tt.divisibility 16`` when its address is 16-byte aligned), an int is
``i32`` / ``i64`` (``tt.divisibility 16`` when a multiple of 16, and the constant 1 when it
equals 1, unless the parameter is ``do_not_specialize``), a float ``fp32``, a bool ``u1``.

Must run with ``TRITON_INTERPRET`` unset (under the interpreter ``@triton.jit`` yields
functions that cannot be compiled); ``sgl-kernel/tests/test_compile_sm90.py`` runs it in a
subprocess. ``--only SUBSTR`` filters the variants, ``-j N`` compiles in N processes (default:
the CPU count), ``--json PATH`` writes the rows, ``--list`` prints the signatures. Each run
compiles from scratch (a fresh Triton cache). Each launch's signature is also compared with
the one Triton's own JIT computes for it (internal API; skipped where it differs). The table
gives per variant the compile time and, from the cubin, registers, stack bytes per thread
(register spills: nonzero means ptxas spilled), shared memory and warps. Exit status: 0 all
compiled (and the signatures agree), 1 some failed, 77 this Triton cannot compile for CUDA here
(one line on stderr says why).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

_ROOT = Path(__file__).resolve().parents[1]
for _p in (_ROOT / "python", _ROOT / "sgl-kernel" / "python"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

CANNOT_COMPILE = 77  # exit status: this Triton cannot compile for CUDA without a driver
ARCH, WARP_SIZE = 90, 32

# the ``small`` preset (unimem.models.presets)
D_MODEL, FFN, VOCAB = 2048, 5632, 32000
Q_HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128
GDN_H, GDN_DK, GDN_DV, CONV_K = 16, 128, 128, 4
EPS = 1e-6

_TORCH_TYPES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "float64": "fp64",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "u8",
    "float8_e4m3fn": "fp8e4nv",
    "bool": "u1",  # as Triton's JIT types a torch.bool pointer
}


@dataclass
class Variant:
    """One compile unit: a kernel with the signature, constexprs, attributes and options of
    one recorded launch."""

    name: str
    module: str
    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, object]
    attrs: dict[tuple[int, ...], list]
    options: dict[str, object] = field(default_factory=dict)
    jit_mismatch: str | None = None  # variants(crosscheck=True): vs Triton's own JIT
    launches: list[str] = field(default_factory=list)  # every launch label compiled to it


# ------------------------------------------------------------------- specialisation


def _int_type(v: int) -> str:
    return "i32" if -(2**31) <= v < 2**31 else ("i64" if -(2**63) <= v < 2**63 else "u64")


def specialize(fn, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, dict]:
    """``(signature, constexprs, attrs, options)`` of a launch ``fn[grid](*args, **kwargs)``,
    as Triton's JIT specialises it (module docstring)."""
    import torch

    names = list(fn.arg_names)
    bound = dict(zip(names, args, strict=False))
    options = {}
    for k, v in kwargs.items():
        if k in names:
            bound[k] = v
        else:
            options[k] = v
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.name not in bound:
            raise TypeError(f"{fn.__name__}: no value for {p.name}")
        v = bound[p.name]
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
            continue
        specialize_it = not p.do_not_specialize
        aligned = specialize_it and not p.do_not_specialize_on_alignment
        if v is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = None
        elif isinstance(v, torch.Tensor):
            signature[p.name] = "*" + _TORCH_TYPES[str(v.dtype).removeprefix("torch.")]
            if aligned and v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            signature[p.name] = "u1"
        elif isinstance(v, int):
            if specialize_it and v == 1:
                signature[p.name] = "constexpr"
                constexprs[p.name] = 1
                continue
            signature[p.name] = _int_type(v)
            if aligned and v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}.{p.name}: cannot specialise {type(v).__name__}")
    return signature, constexprs, attrs, options


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` records the launch."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((args, kwargs))

        return launch


@contextlib.contextmanager
def _recording(kernels: tuple[tuple[str, str], ...]) -> Iterator[dict[str, _Recorder]]:
    """Every ``(module, kernel)`` replaced by a recorder in the module that defines it (where
    its launchers look it up), by kernel name."""
    import importlib

    homes = {k: importlib.import_module(m) for m, k in kernels}
    recs = {k: _Recorder(getattr(home, k)) for k, home in homes.items()}
    with contextlib.ExitStack() as stack:
        for k, r in recs.items():
            stack.enter_context(mock.patch.object(homes[k], k, r))
        yield recs


# ------------------------------------------------------------------- the launches


def _slot_view(num_slots: int, shape: tuple[int, ...], dtype, pad: int = 64):
    """``[num_slots, *shape]`` as an ``as_strided`` view with a slot stride past the slot's
    elements (the pool's arena views)."""
    import torch

    per = 1
    for s in shape:
        per *= s
    stride_slot = per + pad
    buf = torch.zeros(num_slots * stride_slot, dtype=dtype)
    inner, acc = [], 1
    for s in reversed(shape):
        inner.append(acc)
        acc *= s
    return buf.as_strided((num_slots, *shape), (stride_slot, *reversed(inner)))


def _fused_launches() -> list[tuple[str, Callable[[], None]]]:
    import torch

    from unimem_kernel import fused as fu

    bf, f32 = torch.bfloat16, torch.float32
    t = 8

    def add_rms_norm(zero_centered: bool):
        x = torch.randn(t, D_MODEL, dtype=bf)
        fu.add_rms_norm(x, torch.randn_like(x), torch.randn(D_MODEL, dtype=bf), EPS,
                        zero_centered=zero_centered)  # fmt: skip

    def add_rms_norm_chunked():  # D > 4096: the two-pass path (SINGLE False)
        x = torch.randn(t, 5120, dtype=bf)
        fu.add_rms_norm(x, torch.randn_like(x), torch.randn(5120, dtype=bf), EPS)

    def gated(op, split: bool):
        if split:  # qwen_common / gemma3: gate and up from two projections
            op(torch.randn(t, FFN, dtype=bf), torch.randn(t, FFN, dtype=bf))
        else:  # synthetic.Mlp: the fused [gate | up] projection
            op(torch.randn(t, 2 * FFN, dtype=bf))

    in_proj = 2 * GDN_H * GDN_DK + GDN_H * GDN_DV + GDN_H * GDN_DV + 2 * GDN_H

    def gdn_gates():  # synthetic.GdnMixer: column slices of in_proj, bf16 params, fp32 state
        proj = torch.randn(t, in_proj, dtype=bf)
        b = proj[:, in_proj - 2 * GDN_H : in_proj - GDN_H]
        a = proj[:, in_proj - GDN_H :]
        fu.gdn_gates(a, b, torch.randn(GDN_H, dtype=bf), torch.randn(GDN_H, dtype=bf), f32)

    def gated_rms_norm(round_before_weight: bool):
        proj = torch.randn(t, in_proj, dtype=bf)
        z0 = 3 * GDN_H * GDN_DK
        z = proj[:, z0 : z0 + GDN_H * GDN_DV].reshape(t, GDN_H, GDN_DV)
        o = torch.randn(t, GDN_H, GDN_DV, dtype=bf)
        fu.gated_rms_norm(o, torch.randn(GDN_DV, dtype=bf), z, EPS,
                          round_before_weight=round_before_weight)  # fmt: skip

    def rope(rot_dtype, rotary: int, head_dim: int = HEAD_DIM):
        qd, kd = Q_HEADS * head_dim, KV_HEADS * head_dim
        qkv = torch.randn(t, qd + 2 * kd, dtype=bf)
        q = qkv[:, :qd].reshape(t, Q_HEADS, head_dim)
        k = qkv[:, qd : qd + kd].reshape(t, KV_HEADS, head_dim)
        cos = torch.randn(t, rotary // 2, dtype=rot_dtype)
        fu.rope_qk(q, k, cos, torch.randn_like(cos))

    def norm_add(next_norm: bool, d: int = 640):  # Gemma 3 270M's width; 5376: chunked
        x = torch.randn(t, d, dtype=bf)
        w = torch.randn(d, dtype=bf)
        fu.norm_add_rms_norm(x, torch.randn_like(x), w, w if next_norm else None, EPS,
                             zero_centered=True)  # fmt: skip

    def clamped_swiglu_biased():  # with each row's expert's gate/up biases added inside
        h = torch.randn(t, 2 * FFN, dtype=bf)
        bias = torch.randn(32, 2 * FFN, dtype=bf)
        expert = torch.randint(0, 32, (t,))
        fu.clamped_swiglu(h[:, :FFN], h[:, FFN:], 1.702, 7.0, bias=bias, expert=expert)

    def clamped_swiglu():  # gpt-oss experts: the halves of the grouped gate/up product
        h = torch.randn(t, 2 * FFN, dtype=bf)
        fu.clamped_swiglu(h[:, :FFN], h[:, FFN:], 1.702, 7.0)

    def sigmoid_gate():
        # Qwen3-Next's gated attention: 16 heads of 256, the gate a slice of the q/gate product
        qg = torch.randn(t, 16, 512, dtype=bf)
        fu.sigmoid_gate(torch.randn(t, 16, 256, dtype=bf), qg[..., 256:])

    return [
        ("add_rms_norm", lambda: add_rms_norm(False)),
        ("add_rms_norm zero_centered", lambda: add_rms_norm(True)),
        ("add_rms_norm D=5120 (chunked)", add_rms_norm_chunked),
        ("silu_mul [gate|up]", lambda: gated(fu.silu_mul, False)),
        ("silu_mul gate, up", lambda: gated(fu.silu_mul, True)),
        ("gelu_tanh_mul gate, up", lambda: gated(fu.gelu_tanh_mul, True)),
        ("gdn_gates fp32 state", gdn_gates),
        ("gated_rms_norm", lambda: gated_rms_norm(False)),
        ("gated_rms_norm round_before_weight", lambda: gated_rms_norm(True)),
        ("rope_qk fp32 full", lambda: rope(f32, HEAD_DIM)),
        ("rope_qk bf16 full", lambda: rope(bf, HEAD_DIM)),
        ("rope_qk fp32 partial 64/256", lambda: rope(f32, 64, 256)),
        ("sigmoid_gate (gated attention output)", sigmoid_gate),
        ("norm_add_rms_norm (Gemma)", lambda: norm_add(True)),
        ("norm_add_rms_norm last layer", lambda: norm_add(False)),
        ("norm_add_rms_norm D=5376 (chunked)", lambda: norm_add(True, 5376)),
        ("clamped_swiglu (gpt-oss)", clamped_swiglu),
        ("clamped_swiglu with the experts' biases (gpt-oss)", clamped_swiglu_biased),
    ]


def _with_pdl(call: Callable[[], None], early: bool = False) -> Callable[[], None]:
    """``call`` with programmatic dependent launch forced on (``unimem_kernel.pdl``; on the
    CPU it is never on by itself), the successor let in after the last store or (``early``)
    after the wait: the kernels' ``griddepcontrol`` variants."""

    def run() -> None:
        from unimem_kernel import pdl

        mode = pdl.mode
        pdl.mode = lambda t: pdl.EARLY if early else pdl.AFTER_STORES
        try:
            call()
        finally:
            pdl.mode = mode

    return run


def _norm_gemv_launches() -> list[tuple[str, Callable[[], None]]]:
    """Gemma 3 270M's small-batch layer body: q/k/v with post-norm + add + norm in front,
    gate/up with GeGLU behind, the plain o / down projections; the synthetic model's MLP with
    add + norm in front and SwiGLU behind (bf16, 1 and 16 rows)."""
    import torch

    from unimem_kernel import norm_gemv

    bf = torch.bfloat16

    def call(rows: int, n: int, k: int, mode: int, act=None):
        x = torch.randn(rows, k, dtype=bf)
        w = torch.randn(n, k, dtype=bf)
        nw = torch.randn(k, dtype=bf) if mode else None
        kw = {"delta": torch.randn(rows, k, dtype=bf)} if mode >= 2 else {}
        if mode == 2:
            kw["post_weight"] = nw
        norm_gemv.norm_linear(x, w, nw, EPS, zero_centered=mode != 3, act=act, **kw)

    return [
        (f"norm_linear {name} rows {rows}", lambda a=args, r=rows: call(r, *a))
        for name, args in (
            ("qkv", (1536, 640, 2)),
            ("first qkv", (1536, 640, 1)),
            ("gate_up", (4096, 640, 2, "gelu_tanh")),
            ("down", (640, 2048, 0)),
            ("synthetic gate_up (add + norm)", (11264, 2048, 3, "silu")),
        )
        for rows in (1, 16)
    ] + [
        ("norm_linear qkv rows 1 pdl", _with_pdl(lambda: call(1, 1536, 640, 2))),
        ("norm_linear down rows 1 pdl", _with_pdl(lambda: call(1, 640, 2048, 0))),
        ("norm_linear gate_up rows 1 pdl early",
         _with_pdl(lambda: call(1, 4096, 640, 2, "gelu_tanh"), early=True)),
    ]  # fmt: skip


def _paged_attention_launches() -> list[tuple[str, Callable[[], None]]]:
    """The split-KV decode/verify attention and its combine: Gemma 3 270M's decode (4/1
    heads of 256, window 512 or none, splits of 64 keys), the ``small`` preset's verify (16/4
    heads of 128, 8 rows), gpt-oss's verify with sinks (64/8 heads of 64)."""
    import torch

    from unimem_kernel import paged_attention

    bf = torch.bfloat16

    def call(bs, q_len, hq, hkv, d, window, sinks):
        pages = bs * 4 + 1
        kc = torch.randn(pages, 64, hkv, d, dtype=bf)
        vc = torch.randn(pages, 64, hkv, d, dtype=bf)
        q = torch.randn(bs * q_len, hq, d, dtype=bf)
        cu = torch.arange(bs + 1, dtype=torch.int32) * q_len
        seq = torch.full((bs,), 200, dtype=torch.int32)
        table = torch.arange(1, bs * 4 + 1, dtype=torch.int32).reshape(bs, 4)
        paged_attention.paged_verify_attention(
            q, kc, vc, cu, seq, table, q_len=q_len, max_seqlen_k=32768, scale=d**-0.5,
            window=window, sinks=torch.randn(hq) if sinks else None,
            split_size=64 if d > 128 else 128, kv_programs=16 if bs == 1 else 8,
        )  # fmt: skip

    shapes = (
        ("gemma3 decode", (1, 1, 4, 1, 256, None, False)),
        ("gemma3 decode window", (1, 1, 4, 1, 256, 512, False)),
        ("small verify", (8, 8, 16, 4, 128, None, False)),
        ("gpt-oss verify sinks", (8, 8, 64, 8, 64, 128, True)),
    )
    return [
        (f"paged_verify_attention {name}", lambda a=args: call(*a)) for name, args in shapes
    ] + [
        ("paged_verify_attention gemma3 decode pdl", _with_pdl(lambda: call(*shapes[1][1]))),
        (
            "paged_verify_attention gemma3 decode pdl early",
            _with_pdl(lambda: call(*shapes[1][1]), early=True),
        ),
    ]


def _draw_probs_launches() -> list[tuple[str, Callable[[], None]]]:
    """A sampled draft column's draw with its distribution: the Gemma 3 drafter's 32 768-token
    vocabulary at 48 rows, in bf16 (the drafter's logits) and float32."""
    import torch

    from unimem_kernel.draw_probs import draw_with_probs

    def call(rows: int, vocab: int, dtype):
        logits = torch.randn(rows, vocab).to(dtype)
        t = torch.full((rows,), 0.7)
        draw_with_probs(logits, t, torch.full((rows,), float("-inf")), torch.arange(rows))

    return [
        (f"draw_with_probs rows 48 vocab 32768 {name}",
         lambda n=name: call(48, 32768, getattr(torch, n)))
        for name in ("bfloat16", "float32")
    ]  # fmt: skip


def _sampling_launches() -> list[tuple[str, Callable[[], None]]]:
    """The Gumbel-max draw of a sampled token: Gemma 3's 262 144-token vocabulary at 1 and 48
    rows, the small preset's 32 000 at 384 (a verify's rows); the noise keys of each stream
    and the accept uniforms at a verify's 48 x 7 rows."""
    import torch

    from unimem_kernel import sampling

    def call(rows: int, vocab: int):
        scaled = torch.randn(rows, vocab)
        keys = sampling.row_keys(torch.arange(rows), torch.arange(rows))
        out = torch.empty(rows, dtype=torch.int64)
        sampling.gumbel_argmax(scaled, scaled.max(dim=-1).values - 1.0, keys, out)

    def keys(n: int, stream: int):
        sampling.position_keys(torch.arange(n) - 7, torch.arange(n), stream)

    return [
        *(
            (f"gumbel_argmax rows {rows} vocab {vocab}", lambda r=rows, v=vocab: call(r, v))
            for rows, vocab in ((1, 262144), (48, 262144), (384, 32000))
        ),
        *(
            (f"position_keys stream {stream}", lambda s=stream: keys(336, s))
            for stream in (0, 1, 2, 3)  # the token, draft, accept and residual streams
        ),
        ("hash_uniform 336 x 1", lambda: sampling.hash_uniform(torch.arange(336), 1)),
    ]


def _kv_store_launches() -> list[tuple[str, Callable[[], None]]]:
    """The KV store of every attention layer (target and draft)."""
    import torch

    from unimem_kernel import kv_store

    bf, t, page = torch.bfloat16, 8, 64

    def store(slot_dtype):  # column slices of a fused qkv projection into arena views
        qd, kd = Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        qkv = torch.randn(t, qd + 2 * kd, dtype=bf)
        k = qkv[:, qd : qd + kd].reshape(t, KV_HEADS, HEAD_DIM)
        v = qkv[:, qd + kd :].reshape(t, KV_HEADS, HEAD_DIM)
        kc = _slot_view(6, (page, KV_HEADS, HEAD_DIM), bf)
        vc = _slot_view(6, (page, KV_HEADS, HEAD_DIM), bf)
        kv_store.store_kv_paged(k, v, kc, vc, torch.arange(t, dtype=slot_dtype) + page)

    def rope_store(half: int, norm: bool = False, rot=None, head_dim: int = HEAD_DIM, gate=False):
        # the attention layers' RoPE + store (full / partial rotary; with the q/k norms;
        # Gemma: bf16 tables; Qwen3-Next: q beside its gate)
        if norm:
            qd, kd = Q_HEADS * head_dim * (2 if gate else 1), KV_HEADS * head_dim
            qkv = torch.randn(t, qd + 2 * kd, dtype=bf)
            q = qkv[:, :qd].reshape(t, Q_HEADS, -1)[..., :head_dim]
            k = qkv[:, qd : qd + kd].reshape(t, KV_HEADS, head_dim)
            v = qkv[:, qd + kd :].reshape(t, KV_HEADS, head_dim)
            kc = _slot_view(6, (page, KV_HEADS, head_dim), bf)
            vc = _slot_view(6, (page, KV_HEADS, head_dim), bf)
            cos = torch.randn(t, half, dtype=rot or torch.float32)
            w = torch.randn(head_dim, dtype=bf)
            kv_store.rope_store_kv(q, k, v, cos, torch.randn_like(cos), kc, vc,
                                   torch.arange(t, dtype=torch.int32) + page,
                                   qk_norm=(w, w, EPS))  # fmt: skip
            return
        qd, kd = Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        qkv = torch.randn(t, qd + 2 * kd, dtype=bf)
        q = qkv[:, :qd].reshape(t, Q_HEADS, HEAD_DIM)
        k = qkv[:, qd : qd + kd].reshape(t, KV_HEADS, HEAD_DIM)
        v = qkv[:, qd + kd :].reshape(t, KV_HEADS, HEAD_DIM)
        kc = _slot_view(6, (page, KV_HEADS, HEAD_DIM), bf)
        vc = _slot_view(6, (page, KV_HEADS, HEAD_DIM), bf)
        cos, sin = torch.randn(t, half), torch.randn(t, half)
        kv_store.rope_store_kv(q, k, v, cos, sin, kc, vc, torch.arange(t, dtype=torch.int32) + page)

    return [
        ("store_kv_paged int32 slots", lambda: store(torch.int32)),
        ("store_kv_paged int64 slots", lambda: store(torch.int64)),
        ("rope_store_kv", lambda: rope_store(HEAD_DIM // 2)),
        ("rope_store_kv partial rotary", lambda: rope_store(HEAD_DIM // 8)),
        (
            "rope_store_kv q/k norms, bf16 tables (Gemma 3 270M)",
            lambda: rope_store(128, True, torch.bfloat16, 256),
        ),
        (
            "rope_store_kv q/k norms, partial, gated q (Qwen3-Next)",
            lambda: rope_store(32, True, None, 256, True),
        ),
        (
            "rope_store_kv q/k norms, bf16 tables (Gemma 3 270M) pdl",
            _with_pdl(lambda: rope_store(128, True, torch.bfloat16, 256)),
        ),
        (
            "rope_store_kv q/k norms, bf16 tables (Gemma 3 270M) pdl early",
            _with_pdl(lambda: rope_store(128, True, torch.bfloat16, 256), early=True),
        ),
    ]


def _greedy_pick_launches() -> list[tuple[str, Callable[[], None]]]:
    """A greedy decode step's pick and log-probability (Gemma 3's 262 144-token vocabulary)."""
    import torch

    from unimem_kernel import greedy_pick

    def tempered(stats: bool, cut: bool, raw: bool = False):
        rows = 48 * 8
        args = (torch.randn(rows, 262144), torch.full((rows,), 0.7), torch.zeros(rows).long(),
                torch.zeros(rows) if cut else None)  # fmt: skip
        if raw:
            greedy_pick.tempered_token_stats(*args, raw=True)
        elif stats:
            greedy_pick.tempered_token_stats(*args)
        else:
            greedy_pick.tempered_token_probs(*args)

    return [("greedy_logprob V=262144", lambda: greedy_pick.greedy_logprob(
        torch.randn(4, 262144), torch.zeros(4, 8)[:, 0]))] + [
        (f"tempered_token_{'stats' if s else 'probs'} 48 x 8 rows V=262144"
         f"{' cut' if c else ''}", lambda s=s, c=c: tempered(s, c))
        for s in (False, True) for c in (False, True)
    ] + [
        (f"tempered_token_stats raw 48 x 8 rows V=262144{' cut' if c else ''}",
         lambda c=c: tempered(True, c, raw=True))
        for c in (False, True)
    ]  # fmt: skip


def _sorted_cut_launches() -> list[tuple[str, Callable[[], None]]]:
    """The sampler's cut-off over a row's leading values: the bounded rule's 256 of 48 x 8
    verify rows, and a whole sorted row of Gemma 3's vocabulary."""
    import torch

    from unimem_kernel.sorted_cut import sorted_cut

    def call(rows: int, width: int):
        sorted_cut(torch.randn(rows, width), torch.full((rows,), 64, dtype=torch.int32),
                   torch.full((rows,), 0.95), torch.zeros(rows))  # fmt: skip

    return [
        ("sorted_cut 384 rows x 256", lambda: call(384, 256)),
        ("sorted_cut 8 rows x 262144", lambda: call(8, 262144)),
    ]


def _chunk_maxima_launches() -> list[tuple[str, Callable[[], None]]]:
    """The select's chunk maxima at its default chunks over a verify step's rows of Gemma 3's
    logits (48 x 8 rows: 32, float32 and bf16; 16 x 8: 64; 48: 128), and at the shortest
    default chunk (8)."""
    import torch

    from unimem_kernel.chunk_maxima import chunk_maxima

    def call(rows: int, vocab: int, chunk: int, dtype):
        chunk_maxima(torch.randn(rows, vocab).to(dtype), chunk)

    return [
        ("chunk_maxima 384 x 262144 chunk 32 float32",
         lambda: call(384, 262144, 32, torch.float32)),
        ("chunk_maxima 384 x 262144 chunk 32 bfloat16",
         lambda: call(384, 262144, 32, torch.bfloat16)),
        ("chunk_maxima 128 x 262144 chunk 64 float32",
         lambda: call(128, 262144, 64, torch.float32)),
        ("chunk_maxima 48 x 262144 chunk 128 float32",
         lambda: call(48, 262144, 128, torch.float32)),
        ("chunk_maxima 48 x 16384 chunk 8 float32", lambda: call(48, 16384, 8, torch.float32)),
    ]  # fmt: skip


def _residual_draw_launches() -> list[tuple[str, Callable[[], None]]]:
    """A sampled verify step's last draw: 48 lanes of 8 rows over Gemma 3's 262 144-token
    vocabulary, the proposal over a 32 768-token draft vocabulary (and over the full one)."""
    import torch

    from unimem_kernel.residual_draw import residual_draw

    def call(reduced: bool, dtype, weighted: bool = False):
        n, vw, vocab = 48, 8, 262144
        k = 32768 if reduced else vocab
        t2d = torch.full((vocab,), k).long() if reduced else None
        residual_draw(
            torch.randn(n * vw, vocab).to(dtype), vw, torch.zeros(n).long(),
            torch.full((n,), vw - 1).long(), torch.full((n,), 0.7), torch.zeros(n * vw),
            torch.zeros(n * vw), torch.zeros(n, vw - 1, k), t2d,
            torch.zeros(n, vw - 1, dtype=torch.bool), torch.zeros(n, vw - 1).long(),
            torch.arange(n), torch.ones(n) if weighted else None,
        )  # fmt: skip

    return [
        (f"residual_draw 48 x 8 V=262144 {'K=32768' if r else 'full'} {name}",
         lambda r=r, n=name: call(r, getattr(torch, n)))
        for r in (True, False) for name in ("float32", "bfloat16")
    ] + [  # block verification's draw: the proposal divided by the lane's weight
        ("residual_draw 48 x 8 V=262144 K=32768 float32 weighted",
         lambda: call(True, torch.float32, weighted=True)),
    ]  # fmt: skip


def _block_overlap_launches() -> list[tuple[str, Callable[[], None]]]:
    """Block verification's overlaps: 48 lanes of 7 columns over Gemma 3's 262 144-token
    vocabulary, the proposals over a 32 768-token draft vocabulary (and over the full one)."""
    import torch

    from unimem_kernel.block_overlap import block_overlap

    def call(reduced: bool, dtype):
        n, vw, vocab = 48, 8, 262144
        k = 32768 if reduced else vocab
        t2d = torch.full((vocab,), k).long() if reduced else None
        d2t = torch.arange(k).long() if reduced else None
        block_overlap(
            torch.randn(n * vw, vocab).to(dtype), vw, torch.full((n,), 0.7),
            torch.zeros(n * vw), torch.zeros(n * vw), torch.zeros(n, vw - 1, k), t2d, d2t,
            torch.ones(n, vw - 1),
        )  # fmt: skip

    return [
        (f"block_overlap 48 x 7 V=262144 {'K=32768' if r else 'full'} {name}",
         lambda r=r, n=name: call(r, getattr(torch, n)))
        for r in (True, False) for name in ("float32", "bfloat16")
    ]  # fmt: skip


def _greedy_accept_launches() -> list[tuple[str, Callable[[], None]]]:
    """The fixed verify's greedy accept (``small`` preset: 48 x 8 rows of 32 000)."""
    import torch

    from unimem_kernel import greedy_accept

    def accept():
        bs, w, vocab = 48, 8, 32000
        logits = torch.randn(bs * w, vocab)
        greedy_accept.greedy_verify_accept(logits, torch.randint(0, vocab, (bs, w - 1)))

    return [("greedy_verify_accept", accept)]


def _lane_commit_launches() -> list[tuple[str, Callable[[], None]]]:
    """A step's lane commit: verify (48 lanes x 8 rows, FULL + SWA write slots) and decode."""
    import torch

    from unimem_kernel import lane_commit

    bs, w, rows, i32 = 48, 8, 64, torch.int32

    def commit(verify: bool):
        lane_commit.commit_lanes(
            torch.arange(bs, dtype=i32), torch.randint(1, 99, (bs,), dtype=i32),
            torch.randint(0, 99, (bs,)), torch.randint(0, 99, (bs, w if verify else 1)),
            torch.zeros(rows, dtype=i32), torch.zeros(rows, dtype=torch.int64),
            torch.zeros(bs, w, dtype=torch.int64), torch.zeros(bs, dtype=i32),
            torch.randint(0, w, (bs,), dtype=i32) if verify else None,
            (torch.arange(bs * w, dtype=i32),) * 2 if verify else (),
        )  # fmt: skip

    return [
        ("commit_lanes verify", lambda: commit(True)),
        ("commit_lanes decode", lambda: commit(False)),
    ]


def _fp8_gemv_launches() -> list[tuple[str, Callable[[], None]]]:
    """Qwen3-Next-80B's few-row FP8 products (``unimem_kernel.fp8_gemv``), tiles sized by
    the product: one row of ``in_proj_qkvz``, ``out_proj`` and the shared expert's down, one
    token's routed experts (gate-up through the gather, down)."""
    import importlib

    import torch

    from unimem_kernel.fp8_gemm import FP8_DTYPE, num_groups

    gemv = importlib.import_module("unimem_kernel.fp8_gemv")

    def call(rows: int, n: int, k: int, experts: int = 0, gather: bool = False) -> None:
        lead = (experts,) if experts else ()
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        wq = torch.zeros(*lead, n, k).to(FP8_DTYPE)
        ws = torch.ones(*lead, n, num_groups(k))
        offs = torch.full((experts,), rows, dtype=torch.int32) if experts else None
        gemv.fp8_gemv(x, wq, ws, offs, torch.arange(rows) if gather else None)

    return [
        (f"fp8_gemv {name}", lambda a=args: call(*a))
        for name, args in (
            ("in_proj_qkvz rows 1", (1, 12288, 2048)),
            ("out_proj rows 1", (1, 2048, 4096)),
            ("shared expert down rows 1", (1, 2048, 512)),
            ("experts gate_up tokens 1", (10, 1024, 2048, 512, True)),
            ("experts down tokens 1", (10, 2048, 512, 512)),
        )
    ]


def _rope_angles_launches() -> list[tuple[str, Callable[[], None]]]:
    """RoPE's cos/sin of a verify step (384 positions, the small preset's 64 frequencies),
    plain and with gpt-oss's factor and bf16 cast."""
    import torch

    from unimem_kernel import rope_angles

    pos = torch.arange(384)
    inv = torch.rand(HEAD_DIM // 2)
    return [
        ("rope_cos_sin", lambda: rope_angles.rope_cos_sin(pos, inv)),
        (
            "rope_cos_sin factor bf16",
            lambda: rope_angles.rope_cos_sin(pos, inv, 1.2, torch.bfloat16),
        ),
    ]


def _window_lookup_launches() -> list[tuple[str, Callable[[], None]]]:
    """The acceptance control's decisions of a verify step (48 lanes, gamma 7)."""
    import torch

    from unimem_kernel.window_lookup import window_lookup

    def lookup():
        bs = 48
        tables = (torch.zeros(bs, 2600, dtype=torch.int64), torch.zeros(bs, 2600, dtype=torch.bool))
        lanes = torch.arange(bs, dtype=torch.int32)
        window_lookup(tables, lanes, lanes, 7, 1)

    return [("window_lookup control", lookup)]


def _expert_combine_launches() -> list[tuple[str, Callable[[], None]]]:
    """The MoE layer's weight + unsort + slot sum (Qwen3-Next bench sizes: 48 x 8 tokens, top
    8 of d 2048)."""
    import torch

    from unimem_kernel import expert_combine

    def combine(dtype):
        t, k, d = 384, 8, 2048
        y = torch.randn(t * k, d, dtype=dtype)
        order = torch.argsort(torch.randint(0, 64, (t * k,)), stable=True)
        expert_combine.moe_combine(y, order, torch.rand(t, k))

    def combine_shared():
        t, k, d = 384, 8, 2048
        bf = torch.bfloat16
        y = torch.randn(t * k, d, dtype=bf)
        order = torch.argsort(torch.randint(0, 64, (t * k,)), stable=True)
        expert_combine.moe_combine(y, order, torch.rand(t, k), shared=torch.randn(t, d, dtype=bf),
                                   gate_input=torch.randn(t, d, dtype=bf),
                                   gate_weight=torch.randn(d, dtype=bf))  # fmt: skip

    def combine_bias():  # gpt-oss: 32 experts, top 4, d 2880, the down biases inside
        t, k, d, e = 384, 4, 2880, 32
        bf = torch.bfloat16
        ids = torch.randint(0, e, (t * k,))
        order = torch.argsort(ids, stable=True)
        expert_combine.moe_combine(torch.randn(t * k, d, dtype=bf), order, torch.rand(t, k),
                                   bias=torch.randn(e, d, dtype=bf), expert=ids[order])  # fmt: skip

    return [
        ("moe_combine bf16", lambda: combine(torch.bfloat16)),
        ("moe_combine fp32", lambda: combine(torch.float32)),
        ("moe_combine bf16 with the shared expert", combine_shared),
        ("moe_combine bf16 with output biases", combine_bias),
    ]


def _expert_route_launches() -> list[tuple[str, Callable[[], None]]]:
    """The MoE layer's counting sort by expert: a verify step of the Qwen3-Next bench
    checkpoint (48 x 8 tokens, top 8 of 64: the place kernel scans), one decoding token of the
    real model's routing (top 10 of 512: one 16-pair program) and a prefill chunk of it
    (4 096 tokens: the scan kernel runs)."""
    import torch

    from unimem_kernel import expert_route

    def route(t, k, e):
        expert_route.moe_route(torch.randn(t, e).topk(k, -1).indices, e)

    return [
        ("moe_route verify 384 x 8 of 64", lambda: route(384, 8, 64)),
        ("moe_route decode 1 x 10 of 512", lambda: route(1, 10, 512)),
        ("moe_route prefill 4096 x 10 of 512", lambda: route(4096, 10, 512)),
    ]


def _markov_pick_launches() -> list[tuple[str, Callable[[], None]]]:
    """The drafter's fused left-to-right pick (``small`` preset sizes)."""
    import torch

    from unimem_kernel import draft_pick

    bf = torch.bfloat16

    def pick(control: bool):
        bs, g, vocab, rank = 4, 7, 32000, 16
        base = torch.randn(bs, g, vocab)
        u, w = torch.randn(vocab, rank, dtype=bf), torch.randn(vocab, rank, dtype=bf)
        anchors = torch.randint(0, vocab, (bs,))
        ref = torch.randint(0, vocab, (bs, g)) if control else None
        take = torch.rand(bs, g) < 0.5 if control else None
        draft_pick.markov_pick(base, anchors, u, w, ref, take)

    return [
        ("markov_pick", lambda: pick(False)),
        ("markov_pick with control", lambda: pick(True)),
    ]


def _bi_launches() -> list[tuple[str, Callable[[], None]]]:
    import torch

    from unimem_kernel import batch_invariant as bi

    bf, f32 = torch.bfloat16, torch.float32
    t = 8

    def linear(k: int, n: int, dtype=bf, bias: bool = False):  # F.linear -> mm(x, W.t())
        w = torch.randn(n, k, dtype=dtype)
        b = torch.randn(n, dtype=dtype) if bias else None
        bi.bi_matmul(torch.randn(t, k, dtype=dtype), w.t(), b)

    def grouped(dtype=bf, bias: bool = False):
        e, n, k = 8, 2 * 768, D_MODEL
        offs = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8], dtype=torch.int32)
        b = torch.randn(e, n, dtype=dtype) if bias else None
        bi.bi_grouped_linear(torch.randn(t, k, dtype=dtype), torch.randn(e, n, k, dtype=dtype),
                             offs, b)  # fmt: skip

    gdn_in = 2 * GDN_H * GDN_DK + 2 * GDN_H * GDN_DV + 2 * GDN_H
    return [
        ("bi_matmul qkv 2048->3072", lambda: linear(D_MODEL, 3072)),
        ("bi_matmul gdn in_proj 2048->8224", lambda: linear(D_MODEL, gdn_in)),
        ("bi_matmul gate_up 2048->11264", lambda: linear(D_MODEL, 2 * FFN)),
        ("bi_matmul down 5632->2048", lambda: linear(FFN, D_MODEL)),
        ("bi_matmul lm_head 2048->32000", lambda: linear(D_MODEL, VOCAB)),
        ("bi_matmul bias (gpt-oss)", lambda: linear(D_MODEL, 2880, bias=True)),
        ("bi_matmul fp32", lambda: linear(D_MODEL, D_MODEL, dtype=f32)),
        ("bi_grouped_linear", grouped),
        ("bi_grouped_linear bias", lambda: grouped(bias=True)),
        ("bi_grouped_linear fp32", lambda: grouped(dtype=f32)),
        ("bi_rms_norm fp32", lambda: bi.bi_rms_norm(torch.randn(t, D_MODEL, dtype=f32),
                                                    torch.ones(D_MODEL, dtype=f32), EPS)),
        ("bi_rms_norm bf16 head", lambda: bi.bi_rms_norm(
            torch.randn(t, Q_HEADS, HEAD_DIM, dtype=bf), torch.ones(HEAD_DIM, dtype=bf), EPS)),
        ("bi_log_softmax bf16", lambda: bi.bi_log_softmax(torch.randn(t, VOCAB, dtype=bf))),
        ("bi_log_softmax fp32", lambda: bi.bi_log_softmax(torch.randn(t, VOCAB, dtype=f32))),
    ]  # fmt: skip


def _gdn_launches() -> list[tuple[str, Callable[[], None]]]:
    import torch

    from unimem_kernel import gdn, gdn_reference

    bf, f32 = torch.bfloat16, torch.float32
    bs, width, slots_n = 4, 8, 8  # lanes, verify width (gamma 7 + 1), state slots

    def mixer(mode: str, *, batch_invariant: bool = False, record: bool = False,
              hk: int = GDN_H, h: int = GDN_H, long: bool = False):  # fmt: skip
        conv_dim = gdn_reference.mixed_qkv_dim(h, GDN_DK, GDN_DV, hk)
        conv = _slot_view(slots_n, (conv_dim, CONV_K - 1), bf)
        ssm = _slot_view(slots_n, (h, GDN_DK, GDN_DV), f32)
        slots = torch.arange(bs, dtype=torch.int32)
        n = {"extend": 3 * width, "decode": bs, "verify": bs * width}[mode]
        if long:  # a prefill: several conv token blocks of 64
            n = 512
        mixed = torch.randn(n, conv_dim, dtype=bf)
        g, beta = torch.randn(n, h, dtype=f32), torch.rand(n, h, dtype=f32)
        kw = dict(
            num_k_heads=hk,
            batch_invariant=batch_invariant,
            out=torch.empty(n, h, GDN_DV, dtype=bf),
            conv_out=torch.empty_like(mixed),
        )
        cu = None
        if mode == "extend":
            cu = torch.tensor([0, 5, 5, 17, n], dtype=torch.int32)
            kw["max_seqlen"] = n - 17
        if mode == "verify" and record:
            del kw["conv_out"]  # the record's y
            kw["record"] = gdn_reference.VerifyRecord.empty(bs + 2, width, conv_dim, h, bf,
                                                            f32).lanes(bs)  # fmt: skip
        elif mode == "verify":
            kw["conv_scratch"] = torch.zeros(bs, width, conv_dim, CONV_K - 1, dtype=bf)
            kw["ssm_scratch"] = torch.zeros(bs, width, h, GDN_DK, GDN_DV, dtype=f32)
        w = torch.randn(conv_dim, CONV_K, dtype=bf)
        gdn.gdn_forward_triton(mode, mixed, w, g, beta, conv, ssm, slots, cu, **kw)

    def replay(*, hk: int = GDN_H, h: int = GDN_H, batch_invariant: bool = False):
        conv_dim = gdn_reference.mixed_qkv_dim(h, GDN_DK, GDN_DV, hk)
        conv = _slot_view(slots_n, (conv_dim, CONV_K - 1), bf)
        ssm = _slot_view(slots_n, (h, GDN_DK, GDN_DV), f32)
        # the runner passes the first lanes of a record for max_bs lanes
        record = gdn_reference.VerifyRecord.empty(bs + 2, width, conv_dim, h, bf, f32).lanes(bs)
        accepted = torch.tensor([0, 3, 7, -1], dtype=torch.int64)
        slots = torch.tensor([0, 1, 2, -1], dtype=torch.int32)
        tiles = {}
        if batch_invariant:  # the tiles gdn.gdn_replay_commit picks after such a verify
            _, bv, nw = gdn._rule_config(h, GDN_DK, GDN_DV, None, None, "batch_invariant")
            tiles = {"block_v": bv, "num_warps": nw}
        gdn.gdn_replay_commit_triton(record, accepted, conv, ssm, slots, hk, **tiles)

    def replay_layers(n_layers: int = 3):  # the engine's commit: every layer in one launch
        conv_dim = gdn_reference.mixed_qkv_dim(GDN_H, GDN_DK, GDN_DV, GDN_H)
        convs = [_slot_view(slots_n, (conv_dim, CONV_K - 1), bf) for _ in range(n_layers)]
        ssms = [_slot_view(slots_n, (GDN_H, GDN_DK, GDN_DV), f32) for _ in range(n_layers)]
        records = [gdn_reference.VerifyRecord.empty(bs + 2, width, conv_dim, GDN_H, bf, f32)
                   for _ in range(n_layers)]  # fmt: skip
        plan = gdn.ReplayCommitPlan(records, convs, ssms)
        assert plan.stacked, "the compile check's layers must line up"
        accepted = torch.tensor([0, 3, 7, -1], dtype=torch.int64)
        slots = torch.tensor([0, 1, 2, -1], dtype=torch.int32)
        gdn.gdn_replay_commit_layers(plan, accepted, slots, GDN_H)

    def rule(mode: str):  # the standalone delta-rule launchers (no SiLU / L2 prologue)
        ssm = _slot_view(slots_n, (GDN_H, GDN_DK, GDN_DV), f32)
        slots = torch.arange(bs, dtype=torch.int32)
        lead = {"decode": (bs,), "verify": (bs, width), "extend": (3 * width,)}[mode]
        q = torch.randn(*lead, GDN_H, GDN_DK, dtype=bf)
        k, v = torch.randn_like(q), torch.randn(*lead, GDN_H, GDN_DV, dtype=bf)
        g, beta = torch.randn(*lead, GDN_H, dtype=f32), torch.rand(*lead, GDN_H, dtype=f32)
        if mode == "decode":
            gdn.gated_delta_rule_decode_triton(q, k, v, g, beta, ssm, slots)
        elif mode == "verify":
            scratch = torch.zeros(bs, width, GDN_H, GDN_DK, GDN_DV, dtype=f32)
            gdn.gated_delta_rule_verify_triton(q, k, v, g, beta, ssm, slots, scratch)
        else:
            init = torch.tensor([True, False, True, True])
            cu = torch.tensor([0, 5, 5, 17, 3 * width], dtype=torch.int32)
            gdn.gated_delta_rule_extend_triton(q, k, v, g, beta, ssm, slots, cu, init)

    def conv_extend_init():  # causal_conv1d_extend with has_initial_state
        conv_dim = gdn_reference.mixed_qkv_dim(GDN_H, GDN_DK, GDN_DV, GDN_H)
        conv = _slot_view(slots_n, (conv_dim, CONV_K - 1), bf)
        x = torch.randn(3 * width, conv_dim, dtype=bf)
        cu = torch.tensor([0, 5, 5, 17, 3 * width], dtype=torch.int32)
        init = torch.tensor([True, False, True, True])
        gdn.causal_conv1d_extend_triton(x, torch.randn(conv_dim, CONV_K, dtype=bf), conv,
                                        torch.arange(bs, dtype=torch.int32), cu, init)  # fmt: skip

    return [
        ("gdn_forward extend", lambda: mixer("extend")),
        ("gdn_forward extend 495-token prompt", lambda: mixer("extend", long=True)),
        ("gdn_forward extend batch_invariant", lambda: mixer("extend", batch_invariant=True)),
        ("gdn_forward decode", lambda: mixer("decode")),
        ("gdn_forward decode batch_invariant", lambda: mixer("decode", batch_invariant=True)),
        ("gdn_forward verify STORE_STATES", lambda: mixer("verify")),
        ("gdn_forward verify record", lambda: mixer("verify", record=True)),
        ("gdn_forward verify record Hk=8 H=16",
         lambda: mixer("verify", record=True, hk=8)),
        ("gdn_forward verify record batch_invariant",
         lambda: mixer("verify", record=True, batch_invariant=True)),
        ("gdn replay commit", replay),
        ("gdn replay commit Hk=8 H=16", lambda: replay(hk=8)),
        ("gdn replay commit batch_invariant", lambda: replay(batch_invariant=True)),
        ("gdn replay commit all layers", replay_layers),
        ("gated_delta_rule decode", lambda: rule("decode")),
        ("gated_delta_rule verify", lambda: rule("verify")),
        ("gated_delta_rule extend HAS_INIT", lambda: rule("extend")),
        ("causal_conv1d_extend HAS_INIT", conv_extend_init),
    ]  # fmt: skip


def _gdn_chunked_launches() -> list[tuple[str, Callable[[], None]]]:
    import torch

    from unimem_kernel import gdn_chunked

    bf, f32 = torch.bfloat16, torch.float32
    slots_n = 8

    def chunked(*, hk: int = GDN_H, h: int = GDN_H, chunk: int = 16, precision: str = "ieee"):
        # the mixer's call after its conv (prep on), a ragged batch with a padded lane
        n = 100
        ssm = _slot_view(slots_n, (h, GDN_DK, GDN_DV), f32)
        q, k = (torch.randn(n, hk, GDN_DK, dtype=bf) for _ in range(2))
        v = torch.randn(n, h, GDN_DV, dtype=bf)
        g, beta = torch.randn(n, h, dtype=f32), torch.rand(n, h, dtype=f32)
        slots = torch.tensor([0, 1, -1, 3], dtype=torch.int32)
        cu = torch.tensor([0, 5, 5, 37, n], dtype=torch.int32)
        init = torch.tensor([True, False, True, True])
        gdn_chunked.gated_delta_rule_extend_chunked_triton(
            q, k, v, g, beta, ssm, slots, cu, init, num_k_heads=hk, chunk_size=chunk,
            prep=True, dot_precision=precision,
        )  # fmt: skip

    return [
        ("gdn chunked extend C=16", chunked),
        ("gdn chunked extend C=32", lambda: chunked(chunk=32)),
        ("gdn chunked extend Hk=8 H=16", lambda: chunked(hk=8)),
        ("gdn chunked extend tf32", lambda: chunked(precision="tf32")),
    ]


def _in(module: str, *kernels: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"unimem_kernel.{module}", k) for k in kernels)


# the kernels each group of launches records: (the module that defines it, its name)
_KERNELS = {
    "unimem_kernel.fused": (
        *_in(
            "fused_norms",
            "_add_rms_norm_kernel",
            "_norm_add_rms_norm_kernel",
            "_gated_rms_norm_kernel",
        ),
        *_in("fused_activations", "_gated_act_kernel", "_gdn_gates_kernel", "_sigmoid_gate_kernel"),
        *_in("fused_rope", "_rope_qk_kernel"),
    ),
    "unimem_kernel.batch_invariant": _in(
        "batch_invariant",
        "_bi_matmul_kernel",
        "_bi_grouped_kernel",
        "_bi_rms_norm_kernel",
        "_bi_log_softmax_kernel",
    ),
    "unimem_kernel.gdn": (
        *_in("gdn_conv", "_conv_kernel"),
        *_in("gdn_replay", "_conv_commit_kernel"),
        *_in("gdn_rule", "_rule_kernel"),
    ),
    "unimem_kernel.kv_store": _in("kv_store", "_store_kv_kernel", "_rope_store_kernel"),
    "unimem_kernel.norm_gemv": _in("norm_gemv", "_norm_linear_kernel"),
    "unimem_kernel.paged_attention": _in("paged_attention", "_split_kv_kernel", "_combine_kernel"),
    "unimem_kernel.sampling": _in(
        "sampling",
        "_gumbel_partial_kernel",
        "_gumbel_pick_kernel",
        "_position_keys_kernel",
        "_hash_uniform_kernel",
    ),
    "unimem_kernel.draw_probs": _in("draw_probs", "_draw_partial_kernel", "_draw_write_kernel"),
    "unimem_kernel.greedy_accept": _in("greedy_accept", "_row_argmax_kernel", "_accept_kernel"),
    "unimem_kernel.greedy_pick": _in(
        "greedy_pick", "_partial_kernel", "_combine_kernel", "_token_prob_kernel"
    ),
    "unimem_kernel.residual_draw": _in(
        "residual_draw", "_residual_partial_kernel", "_residual_pick_kernel"
    ),
    "unimem_kernel.block_overlap": _in("block_overlap", "_overlap_partial_kernel"),
    "unimem_kernel.sorted_cut": _in("sorted_cut", "_sorted_cut_kernel"),
    "unimem_kernel.chunk_maxima": _in("chunk_maxima", "_chunk_max_kernel"),
    "unimem_kernel.draft_pick": _in("draft_pick", "_markov_pick_kernel"),
    "unimem_kernel.expert_combine": _in("expert_combine", "_moe_combine_kernel"),
    "unimem_kernel.expert_route": _in(
        "expert_route", "_count_kernel", "_scan_kernel", "_place_kernel"
    ),
    "unimem_kernel.gdn_chunked": _in("gdn_chunked", "_chunked_rule_kernel"),
    "unimem_kernel.lane_commit": _in("lane_commit", "_commit_lanes_kernel"),
    "unimem_kernel.window_lookup": _in("window_lookup", "_window_lookup_kernel"),
    "unimem_kernel.rope_angles": _in("rope_angles", "_rope_cos_sin_kernel"),
    "unimem_kernel.fp8_gemv": _in("fp8_gemv", "_fp8_gemv_kernel"),
}

_LAUNCHES = {
    "unimem_kernel.fused": _fused_launches,
    "unimem_kernel.batch_invariant": _bi_launches,
    "unimem_kernel.gdn": _gdn_launches,
    "unimem_kernel.kv_store": _kv_store_launches,
    "unimem_kernel.norm_gemv": _norm_gemv_launches,
    "unimem_kernel.paged_attention": _paged_attention_launches,
    "unimem_kernel.sampling": _sampling_launches,
    "unimem_kernel.draw_probs": _draw_probs_launches,
    "unimem_kernel.greedy_accept": _greedy_accept_launches,
    "unimem_kernel.greedy_pick": _greedy_pick_launches,
    "unimem_kernel.residual_draw": _residual_draw_launches,
    "unimem_kernel.block_overlap": _block_overlap_launches,
    "unimem_kernel.sorted_cut": _sorted_cut_launches,
    "unimem_kernel.chunk_maxima": _chunk_maxima_launches,
    "unimem_kernel.draft_pick": _markov_pick_launches,
    "unimem_kernel.expert_combine": _expert_combine_launches,
    "unimem_kernel.expert_route": _expert_route_launches,
    "unimem_kernel.gdn_chunked": _gdn_chunked_launches,
    "unimem_kernel.lane_commit": _lane_commit_launches,
    "unimem_kernel.window_lookup": _window_lookup_launches,
    "unimem_kernel.rope_angles": _rope_angles_launches,
    "unimem_kernel.fp8_gemv": _fp8_gemv_launches,
}


def _jit_specialization(fn, args: tuple, kwargs: dict):
    """``(signature, constexprs by name, attrs)`` as Triton's own JIT computes them for this
    launch (internal API: None where this Triton version lays it out differently)."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.runtime.jit import create_function_from_signature

        backend = CUDABackend(GPUTarget("cuda", ARCH, WARP_SIZE))
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, options = binder(*args, **kwargs)
        _, sig, consts, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    except Exception:
        return None
    consts = {fn.arg_names[k[0]]: v for k, v in consts.items()}
    return sig, consts, {k: v for k, v in attrs.items() if v}


def variants(crosscheck: bool = False) -> list[Variant]:
    """Every recorded launch as a compile unit; identical specialisations (the same kernel,
    signature, constexprs, attributes and options) once, under the first launch's name.
    ``crosscheck``: also compare each launch's specialisation with Triton's own JIT's
    (``jit_mismatch`` says how they differ; ``"n/a"`` when this Triton's internals differ)."""
    import torch

    os.environ["UNIMEM_KERNEL_BACKEND"] = "triton"
    os.environ.setdefault("UNIMEM_FUSED_OPS", "on")
    torch.manual_seed(0)
    out: list[Variant] = []
    seen: dict[tuple, Variant] = {}
    for group, kernels in _KERNELS.items():
        homes = {k: m for m, k in kernels}
        for label, run in _LAUNCHES[group]():
            with _recording(kernels) as recs:
                run()
            for kname, rec in recs.items():
                modname = homes[kname]
                for args, kwargs in rec.calls:
                    sig, consts, attrs, options = specialize(rec.fn, args, kwargs)
                    mismatch = None
                    if crosscheck:
                        jit = _jit_specialization(rec.fn, args, kwargs)
                        if jit is None:
                            mismatch = "n/a"
                        elif jit != (sig, consts, attrs):
                            mismatch = f"JIT {jit} != ours {(sig, consts, attrs)}"
                    key = (modname, kname, repr(sorted(sig.items())),
                           repr(sorted((k, repr(v)) for k, v in consts.items())),
                           repr(sorted(attrs)), repr(sorted(options.items())))  # fmt: skip
                    if key in seen:
                        found = seen[key]
                        if mismatch and mismatch != "n/a":  # keep a mismatch visible
                            found.jit_mismatch = found.jit_mismatch or mismatch
                        if label not in found.launches:
                            found.launches.append(label)
                        continue
                    short = kname.strip("_").removesuffix("_kernel")
                    name = label if label.startswith(short) else f"{label}: {short}"
                    seen[key] = Variant(name, modname, kname, sig, consts, attrs, options,
                                        mismatch, [label])  # fmt: skip
                    out.append(seen[key])
    return out


# ------------------------------------------------------------------- compiling


def cannot_compile_reason() -> str | None:
    """Why this process cannot compile Triton kernels for CUDA ahead of time, or None."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set: @triton.jit functions are interpreted, not compiled"
    try:
        import triton
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        return f"triton has no AOT compile API here ({e})"
    if "nvidia" not in backends:
        return f"triton {triton.__version__} has no NVIDIA backend"
    return None


def probe(stage: str) -> str | None:
    """Compile a trivial kernel for sm_90: None when it works, else why not (the
    environment, not our kernels, is then the problem)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _probe_kernel(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)

    v = Variant("probe", __name__, "", {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                {"BLOCK": 128}, {})  # fmt: skip
    row = _compile(v, _probe_kernel, stage)
    return None if row["ok"] else f"a trivial kernel does not compile: {row['error']}"


def ptxas_path() -> str | None:
    """The ``ptxas`` Triton would use for sm_90 (``TRITON_PTXAS_PATH`` or the bundled one)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(ARCH).path
    except Exception:
        return None
    return path if path and os.path.exists(path) else None


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, stack (register spills land there) and local-array bytes per thread, from
    ``cuobjdump -res-usage``."""
    tool = shutil.which("cuobjdump")
    if tool is None:
        ptxas = ptxas_path()
        cand = Path(ptxas).with_name("cuobjdump") if ptxas else None
        tool = str(cand) if cand and cand.exists() else None
    if tool is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
    usage = {}
    for key, tag in (("regs", "REG:"), ("stack", "STACK:"), ("local", "LOCAL:")):
        for line in res.stdout.splitlines():
            if tag in line:
                usage[key] = int(line.split(tag)[1].split()[0])
                break
    return usage


def compile_variant(v: Variant, stage: str) -> dict:
    """Compile ``v`` for sm_90 up to ``stage`` (``ptx`` or ``cubin``); a result row."""
    import importlib

    return _compile(v, getattr(importlib.import_module(v.module), v.kernel), stage)


def _compile(v: Variant, fn, stage: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row = {"name": v.name, "kernel": v.kernel, "ok": False, "stage": stage, "seconds": 0.0,
           "jit_mismatch": v.jit_mismatch, "launches": v.launches}  # fmt: skip
    t0 = time.perf_counter()
    try:
        src = ASTSource(fn=fn, signature=v.signature, constexprs=v.constexprs, attrs=v.attrs)
        target = GPUTarget("cuda", ARCH, WARP_SIZE)
        if stage == "cubin":
            k = triton.compile(src, target=target, options=v.options)
            row["shared"] = k.metadata.shared
            row.update(_resource_usage(k.asm["cubin"]))
        else:
            with mock.patch(
                "triton.backends.nvidia.compiler.CUDABackend.make_cubin",
                lambda self, src, metadata, opt, cap: b"",
            ):
                k = triton.compile(src, target=target, options=v.options)
            row["shared"] = k.metadata.shared
        row["num_warps"] = k.metadata.num_warps
        row["num_stages"] = k.metadata.num_stages
        row["ok"] = True
    except Exception as e:  # a compile error: the row carries it
        msg = "".join(traceback.format_exception_only(type(e), e)).strip()
        row["error"] = msg[-4000:]
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def _worker(args):
    v, stage = args
    return compile_variant(v, stage)


def run(vs: list[Variant], only: str | None, jobs: int, stage: str) -> list[dict]:
    if only:
        vs = [v for v in vs if only.lower() in f"{v.name} {v.kernel}".lower()]
    if jobs > 1 and len(vs) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            rows = list(pool.map(_worker, [(v, stage) for v in vs]))
    else:
        rows = [compile_variant(v, stage) for v in vs]
    return rows


def _table(rows: list[dict]) -> str:
    lines = [f"{'variant':<52} {'kernel':<24} {'ok':<4} {'s':>6} {'regs':>5} {'stack':>6} "
             f"{'smem':>7} {'warps':>5}"]  # fmt: skip
    for r in rows:
        lines.append(
            f"{r['name'][:52]:<52} {r['kernel'][:24]:<24} {'yes' if r['ok'] else 'NO':<4} "
            f"{r['seconds']:>6.2f} {r.get('regs', ''):>5} {r.get('stack', ''):>6} "
            f"{r.get('shared', ''):>7} {r.get('num_warps', ''):>5}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="compile only variants whose name or kernel contains this")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--stage",
        choices=("ptx", "cubin"),
        default=None,
        help="last stage (default: cubin when ptxas is available, else ptx)",
    )
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--list", action="store_true", help="print the variants' signatures only")
    ap.add_argument(
        "--no-crosscheck",
        action="store_true",
        help="skip comparing the signatures with Triton's own JIT specialisation",
    )
    ap.add_argument(
        "--keep-cache",
        action="store_true",
        help="use Triton's cache (default: a fresh one, so that every run compiles)",
    )
    a = ap.parse_args(argv)
    if not a.keep_cache:
        cache = tempfile.mkdtemp(prefix="compile_check_")
        os.environ["TRITON_CACHE_DIR"] = cache  # read by Triton on use; workers inherit it
    reason = cannot_compile_reason()
    stage = a.stage or ("cubin" if reason is None and ptxas_path() else "ptx")
    reason = reason or probe(stage)
    if reason:
        print(f"compile_check: {reason}", file=sys.stderr)
        return CANNOT_COMPILE
    vs = variants(crosscheck=not a.no_crosscheck)
    if a.list:
        for v in vs:
            print(f"{v.name} [{v.kernel}] {v.signature} constexprs={v.constexprs} "
                  f"attrs={sorted(k[0] for k in v.attrs)} options={v.options}")  # fmt: skip
        return 0
    import triton

    t0 = time.perf_counter()
    rows = run(vs, a.only, a.jobs, stage)
    wall = time.perf_counter() - t0
    print(f"triton {triton.__version__}, target cuda sm_{ARCH}, up to {stage}"
          f"{'' if stage == 'cubin' else ' (ptxas not run)'}, {len(rows)} variants, "
          f"{wall:.1f} s wall, {a.jobs} jobs")  # fmt: skip
    print(_table(rows))
    failed = [r for r in rows if not r["ok"]]
    for r in failed:
        print(f"\n--- {r['name']} ({r['kernel']}) FAILED:\n{r['error']}")
    mismatched = [r for r in rows if r["jit_mismatch"] not in (None, "n/a")]
    for r in mismatched:
        print(f"\n--- {r['name']}: signature differs from Triton's JIT: {r['jit_mismatch']}")
    if any(r["jit_mismatch"] == "n/a" for r in rows):
        print("(signatures not cross-checked: this Triton's JIT internals differ)")
    if not a.keep_cache:
        shutil.rmtree(cache, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"triton": triton.__version__, "stage": stage,
                                            "wall_s": wall, "rows": rows}, indent=1))  # fmt: skip
    return 1 if failed or mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
