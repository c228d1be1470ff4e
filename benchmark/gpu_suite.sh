#!/usr/bin/env bash
# Everything the H200 has to prove, in one device call: the gpu-marked tests (kernels,
# graph replay, memory under sync-debug, FA4 on arena views), then the benchmarks.
# Usage on the device, from the repository root: bash benchmark/gpu_suite.sh [tests|bench|all]
# Results land in $OUT (the device tool's output folder) or ./gpu-out.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH="$PWD/python:$PWD/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
what=${1:-all}
status=0
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
  | tee "$out/env.txt"
if [ "$what" != bench ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 \
    sgl-kernel/tests test/memory test/attention 2>&1 | tee "$out/gpu_tests.txt" || status=1
fi
if [ "$what" != tests ]; then
  python3 benchmark/bench_allocator.py --json "$out/bench_allocator.json" 2>&1 \
    | tee "$out/bench_allocator.txt" || status=1
  python3 benchmark/bench_fa4_arena.py --json "$out/bench_fa4_arena.json" 2>&1 \
    | tee "$out/bench_fa4_arena.txt" || status=1
fi
exit $status
