#!/usr/bin/env bash
# What the H200 has to prove, in one device call. Run from the repository root:
#   bash benchmark/gpu_suite.sh [PART ...]     PART: tests alloc metadata fa4 gdn (default: all)
# tests: every gpu-marked test (kernels, graph replay, memory under sync-debug, FA4 when
# flash-attn-4 is importable); alloc / metadata / fa4: the benchmarks. Output goes to $OUT
# (the device tool's folder) or ./gpu-out. Exit status 1 if any part failed.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH="$PWD/python:$PWD/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests alloc metadata fa4 gdn)
status=0
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
  | tee "$out/env.txt"
for part in "${parts[@]}"; do
  case "$part" in
    tests) python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 \
             sgl-kernel/tests test/memory test/attention 2>&1 | tee "$out/gpu_tests.txt" ;;
    alloc) python3 benchmark/bench_allocator.py --json "$out/bench_allocator.json" 2>&1 \
             | tee "$out/bench_allocator.txt" ;;
    metadata) python3 benchmark/bench_metadata.py --json "$out/bench_metadata.json" 2>&1 \
             | tee "$out/bench_metadata.txt" ;;
    fa4) python3 benchmark/bench_fa4_arena.py --json "$out/bench_fa4_arena.json" 2>&1 \
             | tee "$out/bench_fa4_arena.txt" ;;
    gdn) python3 benchmark/bench_gdn.py --json "$out/bench_gdn.json" 2>&1 \
             | tee "$out/bench_gdn.txt" ;;
    *) echo "unknown part $part"; false ;;
  esac || status=1
done
exit $status
