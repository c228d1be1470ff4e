#!/usr/bin/env bash
# The GPU proofs of deterministic inference (batch-invariant kernels), in one device call
# after the FA4 bundle (and, for the checkpoint part, transformers) is installed. Run from the
# repository root:
#   PARTS="tests kernels pressure ckpt bench" bash tools/device/gpu_deterministic.sh
# tests: the gpu tests of the batch-invariant kernels (GEMM, grouped GEMM, RMS norm,
#   log-softmax), the GDN step kinds, the mode's switch, the engine (alone == batched ==
#   retracted, DSPARK == decode) and the existing engine GPU tests (regressions);
# kernels: sgl-kernel/benchmark/bench_batch_invariant.py (ours vs cuBLAS / torch._grouped_mm);
# pressure: `validate --device cuda` (deterministic by default) on the small preset with an
#   arena that forces compaction and retraction, page 16 and page 64;
# ckpt: the same on the small Qwen3-Next-architecture checkpoint (ARENA_CKPT MiB, default 24:
#   40 % of its static peak of 59 MB; 60 gave no pressure);
# bench: `python -m unimem bench` without and with --enable-deterministic-inference.
# Output: $OUT (or ./gpu-out). STEP_TIMEOUT (s, default 400) bounds each command.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
parts=${PARTS:-tests kernels pressure ckpt bench}
step_timeout=${STEP_TIMEOUT:-400}
log="$out/gpu_deterministic.log"
status=0
. tools/device/gpu_env.sh
ck=/tmp/ckpt_qwen3_next_small
pressure=(--device cuda --spec dspark --requests 24 --input-len 300 --output-len 200 --seed 5)
gpu_banner
for part in $parts; do
  say "$part"
  case "$part" in
    tests)
      run python3 -m pytest -q -p no:cacheprovider --durations=10 -m gpu \
        sgl-kernel/tests/test_batch_invariant.py sgl-kernel/tests/test_gdn_batch_invariant.py \
        test/models/test_batch_invariant_mode.py test/engine/test_deterministic_gpu.py \
        test/engine/test_gpu_engine.py ;;
    kernels)
      run python3 sgl-kernel/benchmark/bench_batch_invariant.py --json "$out/bench_batch_invariant_h200.json" ;;
    pressure)
      run python3 -m unimem validate "${pressure[@]}" --preset small --page-size 16 \
        --arena-mb 60 --json "$out/validate_pressure_h200.json"
      run python3 -m unimem validate "${pressure[@]}" --preset small --page-size 64 \
        --arena-mb 60 --json "$out/validate_pressure_page64_h200.json" ;;
    ckpt)
      [ -f "$ck/config.json" ] \
        || run python3 tools/make_checkpoint.py --arch qwen3_next --size small --out "$ck"
      run python3 -m unimem validate "${pressure[@]}" --model-path "$ck" --page-size 64 \
        --arena-mb "${ARENA_CKPT:-24}" --json "$out/validate_pressure_qwen3_next_h200.json" ;;
    bench)
      # the same acceptance control both ways (a speculative reference run), so that only
      # the kernels differ
      run python3 -m unimem bench --preset small --repeats 1 --control-reference speculative \
        --json "$out/bench_det_off_h200.json"
      run python3 -m unimem bench --preset small --repeats 1 --control-reference speculative \
        --enable-deterministic-inference \
        --json "$out/bench_det_on_h200.json" ;;
    *) echo "unknown part $part"; false ;;
  esac || status=1
done
exit $status
