#!/usr/bin/env bash
# Issue 47 on one GPU, one device call, from the repository root:
#   MODEL=/path/to/model [GGUF=/path/to/model.gguf] [LLAMA_BIN=/tmp/llcpp/llama.cpp/build/bin] \
#   [PROMPTS=file] [COMPILE=1] [PARTS="tests floor pdl layer-body sampler sweep wide"] bash tools/device/gpu_decode_floor.sh
# tests: the GPU tests of the fused kernels (post-norm + add + norm, q/k norms inside the
#   RoPE + K/V store, gpt-oss's clamped SwiGLU with its biases, norm_linear, the split-KV
#   attention, the split Gumbel draw, moe_combine) at real shapes (batch invariance included)
#   and of the sampler (the bounded and unfiltered graphs among them);
# floor: `python -m unimem bench decode-floor` (static and unified waves of 1 / 8 / 48 x 256 tokens,
#   profiler kernels per layer, GPU time against its floor, the synthetic model's kernels per
#   layer, llama.cpp's batched-bench and server when GGUF and LLAMA_BIN are given, and
#   torch.compile against the fused kernels with COMPILE=1).
# pdl: the same bench at 1 and 8 requests with UNIMEM_PDL=0 (plain launches) and =1 (the
#   successor let in after the last store) -> decode_floor_pdl_0.json / _1.json, to set against
#   floor's (the default, early);
# layer-body: the same bench at 1 and 8 requests with UNIMEM_NORM_LINEAR_ROWS=0 (every layer
#   in its ten launches), to set against floor's one-row norm_linear body -> decode_floor_layered.json;
# sweep: sgl-kernel/benchmark/bench_norm_gemv.py (norm_linear's tiles against the launches it
#   replaces, 1 / 8 / 16 rows) -> bench_norm_gemv.json and norm_gemv_configs.json;
# wide: tools/device/generation_rate.py -> generation_rate.json: train_drafter's generating
#   engine (512 requests, page 16, mem fraction 0.4) against a small pool at page 64 and
#   without log-probabilities: start-up, wave tok/s, and a profile of a 512-lane decode step
#   (the shipped drafter's text came at ~12k tok/s there, a 48-request wave decodes at ~45k);
# sampler: `python -m unimem bench sampler` (bounded top-k against the whole-row sort) -> sampler.json.
# Output: $OUT (or ./gpu-out): decode_floor.json and gpu_decode_floor.log; also copied to
# docs/results/decode_floor_<gpu>.json (h200, h100) when OUT is not given. Exit 1 if any part
# failed.
set -uo pipefail
source tools/device/gpu_env.sh
gpu_outputs gpu_decode_floor
step_timeout=${STEP_TIMEOUT:-540}
: "${MODEL:?set MODEL to the model (an HF directory or a .gguf)}"
parts=${PARTS:-tests floor pdl layer-body sampler}
status=0
gpu_banner
for part in $parts; do
  say "$part"
  case "$part" in
    tests)
      run python3 -m pytest -q -m gpu sgl-kernel/tests/test_fused_ops.py \
        sgl-kernel/tests/test_kv_store.py -k "norm_add or qk_norm or clamped" || status=1
      run python3 -m pytest -q -m gpu sgl-kernel/tests/test_norm_gemv.py \
        sgl-kernel/tests/test_paged_attention.py sgl-kernel/tests/test_sampling_kernel.py \
        sgl-kernel/tests/test_moe_combine.py sgl-kernel/tests/test_pdl.py \
        test/engine/test_sampling.py || status=1 ;;
    pdl)
      for mode in 0 1; do
        args=(--model-path "$MODEL" --json "$out/decode_floor_pdl_$mode.json" --concurrency 1,8
              --no-synthetic)
        [ -n "${PROMPTS:-}" ] && args+=(--prompts "$PROMPTS")
        run env UNIMEM_PDL=$mode python3 -m unimem bench decode-floor "${args[@]}" || status=1
      done ;;
    layer-body)
      args=(--model-path "$MODEL" --json "$out/decode_floor_layered.json" --concurrency 1,8
            --no-synthetic)
      [ -n "${PROMPTS:-}" ] && args+=(--prompts "$PROMPTS")
      run env UNIMEM_NORM_LINEAR_ROWS=0 python3 -m unimem bench decode-floor "${args[@]}" || status=1 ;;
    wide)
      run python3 tools/device/generation_rate.py --model-path "$MODEL" \
        --json "$out/generation_rate.json" || status=1 ;;
    sweep)
      run python3 sgl-kernel/benchmark/bench_norm_gemv.py --rows 1,8,16 \
        --json "$out/bench_norm_gemv.json" --configs-out "$out/norm_gemv_configs.json" || status=1 ;;
    sampler)
      run python3 -m unimem bench sampler --json "$out/sampler.json" || status=1 ;;
    floor)
      args=(--model-path "$MODEL" --json "$out/decode_floor.json")
      [ -n "${PROMPTS:-}" ] && args+=(--prompts "$PROMPTS")
      [ -n "${GGUF:-}" ] && args+=(--gguf "$GGUF" --llama-bin "${LLAMA_BIN:-/tmp/llcpp/llama.cpp/build/bin}")
      [ -n "${COMPILE:-}" ] && args+=(--compile)
      run python3 -m unimem bench decode-floor "${args[@]}" || status=1
      [ -z "${OUT:-}" ] && [ -f "$out/decode_floor.json" ] \
        && mkdir -p docs/results && cp "$out/decode_floor.json" "docs/results/decode_floor_$(gpu_tag).json" ;;
    *) say "unknown part $part"; status=1 ;;
  esac
done
say "done, status $status"
exit $status
