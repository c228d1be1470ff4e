"""unimem_kernel: pure tensor ops for the unimem memory runtime.

Each op is a pure function of tensors and ints with caller-owned outputs; each has a Triton
kernel and a torch reference of identical semantics (see ``_dispatch``). Nothing here knows
about pools, requests or models.
"""

from unimem_kernel._dispatch import in_interpreter_stand_in
from unimem_kernel.batch_invariant import (
    MatmulConfig,
    bi_grouped_linear,
    bi_grouped_linear_reference,
    bi_linear,
    bi_linear_reference,
    bi_log_softmax,
    bi_log_softmax_reference,
    bi_matmul,
    bi_matmul_reference,
    bi_rms_norm,
    bi_rms_norm_reference,
    matmul_config,
)
from unimem_kernel.draft_pick import markov_pick, markov_pick_reference
from unimem_kernel.expert_choice import router_topk, router_topk_reference
from unimem_kernel.expert_combine import moe_combine, moe_combine_reference
from unimem_kernel.expert_gemm import expert_gemm_config, expert_linear
from unimem_kernel.expert_route import ExpertRoute, moe_route, moe_route_reference
from unimem_kernel.fp8_gemm import (
    fp8_gemm,
    fp8_gemm_reference,
    fp8_grouped_linear,
    fp8_linear,
    fp8_quantize_groups,
    fp8_quantize_groups_reference,
)
from unimem_kernel.fp8_gemv import fp8_gemv, fp8_gemv_reference
from unimem_kernel.fused import (
    add_rms_norm,
    add_rms_norm_reference,
    clamped_swiglu,
    clamped_swiglu_reference,
    gated_rms_norm,
    gated_rms_norm_reference,
    gdn_gates,
    gdn_gates_reference,
    gelu_tanh_mul,
    gelu_tanh_mul_reference,
    norm_add_rms_norm,
    norm_add_rms_norm_reference,
    rope_qk,
    rope_qk_reference,
    sigmoid_gate,
    sigmoid_gate_reference,
    silu_mul,
    silu_mul_reference,
)
from unimem_kernel.gdn_chunked import (
    gated_delta_rule_extend_chunked,
    gated_delta_rule_extend_chunked_reference,
    gated_delta_rule_extend_chunked_triton,
)
from unimem_kernel.greedy_accept import greedy_verify_accept, greedy_verify_accept_reference
from unimem_kernel.greedy_pick import greedy_logprob, greedy_logprob_reference
from unimem_kernel.id_ops import (
    bind_units,
    bind_units_reference,
    compact_band,
    compact_band_reference,
    translate_slots,
    translate_slots_reference,
    translate_tokens,
    translate_tokens_reference,
    unbind_units,
    unbind_units_reference,
)
from unimem_kernel.kv_store import (
    rope_store_kv,
    rope_store_kv_reference,
    store_kv_paged,
    store_kv_paged_reference,
)
from unimem_kernel.lane_commit import commit_lanes, commit_lanes_reference
from unimem_kernel.metadata import (
    build_decode_metadata,
    build_decode_metadata_reference,
    build_extend_metadata,
    build_extend_metadata_reference,
)
from unimem_kernel.norm_gemv import norm_linear, norm_linear_reference
from unimem_kernel.rope_angles import rope_cos_sin, rope_cos_sin_reference
from unimem_kernel.state_commit import (
    StateCommitPlan,
    commit_states,
    commit_states_multi,
    commit_states_multi_reference,
    commit_states_reference,
)
from unimem_kernel.unit_ops import (
    copy_units,
    copy_units_reference,
    fill_units,
    fill_units_reference,
)
from unimem_kernel.window_lookup import window_lookup, window_lookup_reference
from unimem_kernel.write_window import gather_write_window, gather_write_window_reference

__all__ = [
    "ExpertRoute",
    "fp8_gemm",
    "fp8_gemm_reference",
    "fp8_gemv",
    "fp8_gemv_reference",
    "fp8_grouped_linear",
    "fp8_linear",
    "fp8_quantize_groups",
    "fp8_quantize_groups_reference",
    "in_interpreter_stand_in",
    "MatmulConfig",
    "StateCommitPlan",
    "add_rms_norm",
    "add_rms_norm_reference",
    "bi_grouped_linear",
    "bi_grouped_linear_reference",
    "bi_linear",
    "bi_linear_reference",
    "bi_log_softmax",
    "bi_log_softmax_reference",
    "bi_matmul",
    "bi_matmul_reference",
    "bi_rms_norm",
    "bi_rms_norm_reference",
    "bind_units",
    "bind_units_reference",
    "build_decode_metadata",
    "build_decode_metadata_reference",
    "build_extend_metadata",
    "build_extend_metadata_reference",
    "clamped_swiglu",
    "clamped_swiglu_reference",
    "commit_lanes",
    "commit_lanes_reference",
    "commit_states",
    "commit_states_multi",
    "commit_states_multi_reference",
    "commit_states_reference",
    "compact_band",
    "compact_band_reference",
    "copy_units",
    "copy_units_reference",
    "expert_gemm_config",
    "expert_linear",
    "fill_units",
    "fill_units_reference",
    "gated_delta_rule_extend_chunked",
    "gated_delta_rule_extend_chunked_reference",
    "gated_delta_rule_extend_chunked_triton",
    "gated_rms_norm",
    "gated_rms_norm_reference",
    "gather_write_window",
    "gather_write_window_reference",
    "gdn_gates",
    "gdn_gates_reference",
    "gelu_tanh_mul",
    "gelu_tanh_mul_reference",
    "greedy_logprob",
    "greedy_logprob_reference",
    "greedy_verify_accept",
    "greedy_verify_accept_reference",
    "markov_pick",
    "markov_pick_reference",
    "matmul_config",
    "moe_combine",
    "moe_combine_reference",
    "moe_route",
    "moe_route_reference",
    "norm_add_rms_norm",
    "norm_add_rms_norm_reference",
    "norm_linear",
    "norm_linear_reference",
    "rope_cos_sin",
    "rope_cos_sin_reference",
    "rope_qk",
    "rope_qk_reference",
    "rope_store_kv",
    "rope_store_kv_reference",
    "router_topk",
    "router_topk_reference",
    "sigmoid_gate",
    "sigmoid_gate_reference",
    "silu_mul",
    "silu_mul_reference",
    "store_kv_paged",
    "store_kv_paged_reference",
    "translate_slots",
    "translate_slots_reference",
    "translate_tokens",
    "translate_tokens_reference",
    "unbind_units",
    "unbind_units_reference",
    "window_lookup",
    "window_lookup_reference",
]
