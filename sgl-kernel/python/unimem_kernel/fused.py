"""Fused elementwise model ops: residual add + RMS norm, gated activations, GDN gates, the GDN
output norm, gated attention's output gate and RoPE on q and k, each one Triton launch in
place of a chain of torch ops. This module is their one import path; they live by kind in
:mod:`~unimem_kernel.fused_norms`, :mod:`~unimem_kernel.fused_activations` and
:mod:`~unimem_kernel.fused_rope` (shared checks: :mod:`~unimem_kernel.fused_common`).

Every op has a ``*_reference`` torch function that is, literally, the torch code the models
ran before the fusion (``unimem.models.nn_ops`` / ``qwen_common`` / ``synthetic``), so a model
that calls the public op gets bit-identical results wherever the reference runs (CPU, float64).
Every public op is a ``_dispatch.kernel_op``: the Triton kernel on CUDA (or when
``UNIMEM_KERNEL_BACKEND=triton``), the reference otherwise. Float64 inputs and dtype
combinations the kernels do not cover always run the reference.

Numerics of the kernels (what "identical semantics" means here): every intermediate that torch
rounds to a storage dtype (bf16 / fp16 / the state dtype) is rounded at the same point
(:func:`unimem_kernel.rounding.round_rne`), and the math in between runs in fp32 in the same
order as torch's. What differs is the rounding of the transcendental functions (``exp``,
``rsqrt``; ``log1p`` and ``tanh`` are built from ``exp`` / ``log``) and of the row reductions
(the sum of squares in fixed chunks, not torch's tree), so the kernels agree with the
references to an ulp or so, not bitwise, except where a test in
``sgl-kernel/tests/test_fused_ops.py`` states bitwise equality.

The norms reduce each row in fixed chunks (row-local: safe in batch-invariant mode); the
others are elementwise. Outputs are freshly allocated; launch grids depend on shapes only
(CUDA-graph capturable). The kernels have no backward: where autograd would record the op
(an input requires grad, :func:`records_autograd`), the public op runs its reference.

``UNIMEM_FUSED_OPS=off`` runs every op's reference (the unfused torch code) even on CUDA: the
switch for comparing fused against unfused steps, and a way around a kernel that fails on a
new GPU or Triton version. :func:`use_triton` is that rule, for callers that choose between a
fused op and their own torch code.
"""

from unimem_kernel._dispatch import records_autograd
from unimem_kernel.fused_activations import (
    clamped_swiglu,
    clamped_swiglu_reference,
    gdn_gates,
    gdn_gates_reference,
    gelu_tanh_mul,
    gelu_tanh_mul_reference,
    sigmoid_gate,
    sigmoid_gate_reference,
    silu_mul,
    silu_mul_reference,
)
from unimem_kernel.fused_common import use_triton
from unimem_kernel.fused_norms import (
    add_rms_norm,
    add_rms_norm_reference,
    gated_rms_norm,
    gated_rms_norm_reference,
    norm_add_rms_norm,
    norm_add_rms_norm_reference,
)
from unimem_kernel.fused_rope import check_rope_args, rope_qk, rope_qk_reference
from unimem_kernel.rounding import round_rne as _round  # noqa: F401 (its former import path)

__all__ = [
    "add_rms_norm",
    "add_rms_norm_reference",
    "check_rope_args",
    "clamped_swiglu",
    "clamped_swiglu_reference",
    "gated_rms_norm",
    "gated_rms_norm_reference",
    "gdn_gates",
    "gdn_gates_reference",
    "gelu_tanh_mul",
    "gelu_tanh_mul_reference",
    "norm_add_rms_norm",
    "norm_add_rms_norm_reference",
    "records_autograd",
    "rope_qk",
    "rope_qk_reference",
    "sigmoid_gate",
    "sigmoid_gate_reference",
    "silu_mul",
    "silu_mul_reference",
    "use_triton",
]
