#!/usr/bin/env bash
# What the H200 has to prove, in one device call. Run from the repository root:
#   bash tools/device/gpu_suite.sh [PART ...]
#   PART: tests alloc metadata fa4 gdn engine validate bench profile (default: all)
# tests: every gpu-marked test of kernels, memory and attention (graph replay, memory under
# sync-debug, FA4 when flash-attn-4 is importable); engine: the engine's gpu tests (CUDA-graph
# steps, 200+ steps under sync-debug); validate: the small preset with DSPARK, compaction
# forced; bench: `python -m unimem bench`; profile: where a verify step's time goes;
# alloc / metadata / fa4 / gdn: the kernel benchmarks. Output goes to $OUT
# (the device tool's folder) or ./gpu-out. Exit status 1 if any part failed.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH="$PWD/python:$PWD/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests alloc metadata fa4 gdn engine validate bench profile)
status=0
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
  | tee "$out/env.txt"
for part in "${parts[@]}"; do
  case "$part" in
    tests) python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 \
             sgl-kernel/tests test/memory test/attention 2>&1 | tee "$out/gpu_tests.txt" ;;
    alloc) python3 -m unimem bench allocator --json "$out/bench_allocator.json" 2>&1 \
             | tee "$out/bench_allocator.txt" ;;
    metadata) python3 sgl-kernel/benchmark/bench_metadata.py --json "$out/bench_metadata.json" 2>&1 \
             | tee "$out/bench_metadata.txt" ;;
    fa4) python3 -m unimem.bench.fa4_arena --json "$out/bench_fa4_arena.json" 2>&1 \
             | tee "$out/bench_fa4_arena.txt" ;;
    gdn) python3 sgl-kernel/benchmark/bench_gdn.py --json "$out/bench_gdn.json" 2>&1 \
             | tee "$out/bench_gdn.txt" ;;
    engine) python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 test/engine 2>&1 \
             | tee "$out/engine_tests.txt" ;;
    validate) python3 -m unimem validate --device cuda --preset small --spec dspark \
             --output-len 128 --arena-mb 110 --json "$out/validate_small_dspark.json" 2>&1 \
             | tee "$out/validate_small_dspark.txt" ;;
    bench) python3 -m unimem bench --preset small --json "$out/bench.json" 2>&1 | tee "$out/bench.txt" ;;
    profile) python3 -m unimem bench step-profile --json "$out/profile.json" 2>&1 \
             | tee "$out/profile.txt" ;;
    *) echo "unknown part $part"; false ;;
  esac || status=1
done
exit $status
