#!/usr/bin/env bash
# The GPU runs of "the verify step at the hardware floor", in one device call after the FA4
# bundle is installed. Run from the repository root:
#   PARTS="tests kernels profile bench" bash tools/device/gpu_floor.sh
# tests: the gpu tests of the fused model ops, the KV store (and RoPE + store), the drafter's
#   pick, the greedy accept, the GDN replay commit (equal to the per-position-state commit;
#   all layers in one launch), the chunked GDN prefill, GDN batch
#   invariance, the MoE kernels (router, route, grouped GEMM, combine), the batch-invariant
#   GEMMs and norms, and the engine (sync-debug loop, graph replay == eager);
# kernels: sgl-kernel/benchmark/bench_fused_ops.py (each fused op vs the torch chain it replaces),
#   sgl-kernel/benchmark/bench_gdn_prefill.py (recurrent vs chunked GDN prefill at 4k / 32k tokens),
#   sgl-kernel/benchmark/bench_gdn.py (conv and delta rule per step kind);
# profile: `python -m unimem bench step-profile` (where a verify step's time goes; the host's
#   share, its
#   top functions and the torch ops of an eager step by launch site);
#   with UNFUSED=1 also the same with UNIMEM_FUSED_OPS=off (the fused-vs-unfused comparison);
# attribute: step-profile on static pools only, with the torch ops of an eager step by
#   launch site and the top kernels (the data for choosing what to fuse next);
# sweep: bench_gdn.py's delta-rule tile sweep at the verify width (decode and verify);
# explore: python -m unimem.bench.verify_attention (the split-KV Triton verify attention against FA4; SPLITS and
#   PROGRAMS sweep its split size and programs per KV head), bench_fused_ops.py;
# splitkv: unimem.bench.verify_attention at few requests (SPLIT_BS, default 1 2 4 8 16 24) and
#   contexts 512 .. 32k, split sizes 64/128 and 2..16 programs per (request, KV head): the
#   data for choosing when decode/verify attention takes the split-KV kernel;
# smallbatch: step-profile at 1 and 4 requests with 28k-token prompts and at 16 with 8k,
#   FA4 against the split-KV kernel for decode/verify attention (--split-kv-max-bs 0,16);
# flaprefill: bench_gdn.py's prefill rows at 4k and 32k tokens, 1 and 4 requests: our
#   recurrent extend against fla's chunked kernel (with the slot gather/scatter it needs);
# prefill: the GPU tests of the fla prefill path, `python -m unimem bench prefill` (time to first
#   token of one 4k / 28k prompt, recurrent vs fla) and bench_gdn.py's prefill rows at 512 ..
#   2048 tokens (where fla starts to win);
# fp8: sgl-kernel/benchmark/bench_fp8_gemm.py (the verify GEMM shapes in e4m3 against bf16);
# conv: sgl-kernel/benchmark/bench_gdn_conv.py (the GDN conv's tiles in decode and verify, bitwise
#   checked)
#   and sgl-kernel/benchmark/bench_gemm_shapes.py (the verify GEMM shapes: cuBLAS, cuBLASLt, zero
#   bias);
# bench: `python -m unimem bench` (docs/results/bench_h200.json; BENCH_ARGS adds flags).
# Output: $OUT (or ./gpu-out). STEP_TIMEOUT (s, default 400) bounds each command.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
parts=${PARTS:-tests kernels profile bench}
step_timeout=${STEP_TIMEOUT:-400}
log="$out/gpu_floor.log"
status=0
. tools/device/gpu_env.sh
gpu_banner
for part in $parts; do
  say "$part"
  case "$part" in
    tests)
      run python3 -m pytest -q -p no:cacheprovider --durations=10 -m gpu \
        sgl-kernel/tests/test_fused_ops.py sgl-kernel/tests/test_gdn_replay_commit.py \
        sgl-kernel/tests/test_gdn_chunked.py sgl-kernel/tests/test_kv_store.py \
        sgl-kernel/tests/test_draft_pick.py sgl-kernel/tests/test_gdn_batch_invariant.py \
        sgl-kernel/tests/test_moe_combine.py sgl-kernel/tests/test_moe_route.py \
        sgl-kernel/tests/test_expert_gemm.py sgl-kernel/tests/test_router_topk.py \
        sgl-kernel/tests/test_gdn_kernels.py sgl-kernel/tests/test_batch_invariant.py \
        sgl-kernel/tests/test_greedy_accept.py sgl-kernel/tests/test_paged_attention.py \
        test/engine/test_gpu_engine.py \
        test/speculative/test_ragged_verify_gpu.py test/models/test_logits_matmul.py ;;
    kernels)
      run python3 sgl-kernel/benchmark/bench_fused_ops.py --json "$out/bench_fused_ops_h200.json"
      run python3 sgl-kernel/benchmark/bench_gdn_prefill.py --json "$out/bench_gdn_prefill_h200.json"
      run python3 sgl-kernel/benchmark/bench_gdn.py --json "$out/bench_gdn_h200.json" ;;
    profile)
      run python3 -m unimem bench step-profile --host-top 15 --attribute 40 --top-kernels 25 \
        --json "$out/profile_step_h200.json"
      if [ "${UNFUSED:-0}" = 1 ]; then
        UNIMEM_FUSED_OPS=off run python3 -m unimem bench step-profile \
          --json "$out/profile_step_unfused_h200.json"
      fi ;;
    attribute)
      run python3 -m unimem bench step-profile --memory static --attribute 80 --top-kernels 40 \
        --json "$out/profile_attribute_h200.json" ;;
    sweep)
      run python3 sgl-kernel/benchmark/bench_gdn.py --bs 48 --verify-tokens 8 --sweep \
        --prefill-lens 64 --prefill-requests 1 --no-fla --json "$out/bench_gdn_sweep_h200.json" ;;
    explore)
      run python3 -m unimem.bench.verify_attention --splits ${SPLITS:-64} \
        --programs ${PROGRAMS:-4} --json "$out/bench_verify_attention_h200.json"
      run python3 sgl-kernel/benchmark/bench_fused_ops.py --json "$out/bench_fused_ops_h200.json" ;;
    splitkv)
      for bs in ${SPLIT_BS:-1 2 4 8 16 24}; do
        run python3 -m unimem.bench.verify_attention --bs "$bs" --q-len 8 1 --window 0 \
          --context 512 2048 8192 32768 --splits 64 128 --programs 2 4 8 16 --repeats 3 \
          --json "$out/bench_verify_attention_bs${bs}_h200.json"
      done ;;
    smallbatch)
      for case in "1 28000" "4 28000" "16 8192"; do
        set -- $case
        run python3 -m unimem bench step-profile --memory static --requests "$1" --input-len "$2" \
          --split-kv-max-bs 0,16 --top-kernels 12 --json "$out/profile_small_batch_${1}x${2}_h200.json"
      done ;;
    flaprefill)
      for reqs in 1 4; do
        run python3 sgl-kernel/benchmark/bench_gdn.py --bs 1 --prefill-requests "$reqs" \
          --prefill-lens 4096 32768 --repeats 3 --prefill-iters 2 \
          --json "$out/bench_gdn_prefill_fla_r${reqs}_h200.json"
      done ;;
    prefill)
      run python3 -m pytest -q -p no:cacheprovider -m gpu test/models/test_gdn_prefill.py
      run python3 -m unimem bench prefill --lens 4096 28000 \
        --json "$out/bench_prefill_h200.json"
      run python3 sgl-kernel/benchmark/bench_gdn.py --bs 1 --prefill-requests 1 \
        --prefill-lens 256 512 1024 2048 --repeats 3 \
        --json "$out/bench_gdn_prefill_fla_short_h200.json" ;;
    fp8)
      run python3 sgl-kernel/benchmark/bench_fp8_gemm.py --json "$out/bench_fp8_gemm_h200.json" ;;
    conv)
      run python3 sgl-kernel/benchmark/bench_gdn_conv.py --json "$out/bench_gdn_conv_h200.json"
      run python3 sgl-kernel/benchmark/bench_gemm_shapes.py --no-tunable --split-shapes \
        --json "$out/gemm_shapes_ltbias_h200.json" ;;
    bench)
      run python3 -m unimem bench --preset small ${BENCH_ARGS:-} --json "$out/bench_h200.json" ;;
    *) echo "unknown part $part"; false ;;
  esac || status=1
done
exit $status
