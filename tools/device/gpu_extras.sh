#!/usr/bin/env bash
# Steps with extras on the GPU (the forward-half split), in one device call, from the
# repository root, after the FA4 bundle and the server's wheels are installed (xgrammar
# among them for the grammar test and round):
#   bash tools/device/gpu_extras.sh [PART ...]      PART: tests cost (default: both)
# tests: the engine's GPU tests of extras on the CUDA-graph engine with FA4 — the forward
#        half replayed and the rest eager equal to the whole step run eagerly, bit for bit,
#        under set_sync_debug_mode("error") (plain, fixed and adaptive DSPARK); penalties;
#        grammars; prompt scoring beside adjustments, sync-free
# cost:  tools/device/extras_cost.py, plain and DSPARK (small preset, 32 requests, one with
#        the extra; 128 output tokens so both modes fit one call): tok/s per extra against
#        the baseline rounds, capture seconds, forward-half kinds, stable-output bytes
#        -> extras_cost_TAG.json (TAG: h100 or h200, the card it ran on)
# Output goes to $OUT (the device tool's folder) or ./gpu-out, the log to gpu_extras.log; each
# command under `timeout $STEP_TIMEOUT` (default 420 s). Exit 1 if any part failed.
set -uo pipefail
source tools/device/gpu_env.sh
gpu_outputs gpu_extras
step_timeout=${STEP_TIMEOUT:-420}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests cost)
gpu_banner
failed=()
for part in "${parts[@]}"; do
  say "part $part"
  case "$part" in
    tests) run python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 \
             test/engine/test_gpu_engine.py \
             -k "forward_half or penalised or constrained or sync_free_and_the_oracles" \
             || failed+=(tests) ;;
    cost) run python3 tools/device/extras_cost.py --modes plain,dspark --tokens 128 \
            --json "$out/extras_cost_$(gpu_tag).json" || failed+=(cost) ;;
    *) echo "gpu_extras.sh: unknown part $part" >&2; failed+=("$part") ;;
  esac
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all parts passed"
