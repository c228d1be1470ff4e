#!/usr/bin/env bash
# FP8 on one GPU (issue 43), in one device call, from the repository root:
#   bash tools/device/gpu_fp8.sh [--out DIR] [--parts "P..."] [--model-path GEMMA] [--prompts FILE]
#        [--big-layers N|auto]
# Parts (default: all, in this order). Estimated 18-23 min in total on an H200: with calls
# limited to 10 min run three, same --out: --parts "tests sweep gemm profile" (~9 min),
# --parts "bench qwen3next" (~7 min), --parts "gemma big" (~6 min). The sweep's table only
# reaches later parts run in the same call (or once committed).
#   tests     : the gpu-marked FP8 tests (Triton FP8 GEMMs vs their references and in a CUDA
#               graph; a tiny FP8 Qwen3-Next on CUDA graphs, static == unified, deterministic
#               alone == batched)
#   sweep     : sgl-kernel/benchmark/bench_fp8_gemm.py --sweep (<= 3 min): the Triton FP8 GEMM's tiles
#               (row/column tile, warps, stages, split-K) per shape at 48, 128, 16, 384 rows (the budget may stop the last)
#               -> fp8_sweep.json and the tuned table fp8_gemm_configs.json, which is also
#               installed into this working copy (unimem_kernel/) for the parts after it;
#               commit it from --out to keep it
#   gemv      : the few-row FP8 product (unimem_kernel.fp8_gemv): its GPU tests, then
#               sgl-kernel/benchmark/bench_fp8_gemv.py (tiles swept at one row / one token of
#               Qwen3-Next-80B's shapes, then the sized and best tile against the tensor-core
#               path at 1-8 rows and 1-48 tokens) -> fp8_gemv.json, fp8_gemv_best.txt (the
#               best tile; GEMV_TILE=best makes the parts after it use it)
#   gemm      : sgl-kernel/benchmark/bench_fp8_gemm.py at 48 and 384 rows: bf16 vs FP8 rowwise/tensor
#               (_scaled_mm) vs block-scaled Triton (+ invariant tile) vs block-scaled
#               _scaled_mm, and the grouped expert GEMM bf16 vs FP8 -> fp8_gemm.json
#   profile   : `python -m unimem bench step-profile`, the small preset's steady-state verify step (48
#               requests, gamma 7, static pools) in bf16, in FP8, and in FP8 with the
#               activation quantisation fused into the GEMMs (UNIMEM_FP8_ACT_QUANT=fused), with
#               the kernel breakdown -> profile_small_{bf16,fp8,fp8_fused}.json
#   bench     : `python -m unimem bench --preset small` (48 x 512 -> 2048, DSPARK)
#               in bf16, with --quantization fp8, and fp8 fused -> bench_small_bf16_TAG.json,
#               bench_fp8_TAG.json (docs/results/bench_fp8_TAG.json), bench_fp8_fused_TAG.json
#               (TAG: h200 or h100, the card it ran on)
#   qwen3next : make_checkpoint.py's Qwen3-Next `bench` checkpoint (2048 hidden, 24 layers,
#               64 experts), `python -m unimem bench --model-path` 48 x 512 -> 512 in bf16 and
#               --quantization fp8 -> qwen3next_{bf16,fp8}.json (ms/step in each)
#   gemma     : tools/device/fp8_agreement.py on --model-path (Gemma 3 270M; the GGUF loader of
#               branch gguf) with --prompts (>= 24 lines), 128 tokens each: top-1 agreement
#               (goal >= 98 %) and mean |delta log-prob| -> gemma_fp8_agreement.json
#   big       : the Qwen3-Next-80B shape (hidden 2048, 512 experts) with --big-layers layers
#               (default 24: ~42 GB of FP8 shards, the disk holds 64 GB; `auto`: as many
#               of the 48 as the free disk and BIG_OVERFLOW_MB (default 40000) of RAM in
#               BIG_OVERFLOW_DIR (default /dev/shm/unimem-big) hold — all 48 on an H200,
#               whose 139 GB take their ~83 GB) written FP8 by make_checkpoint.py on the GPU
#               (shards past the disk in the overflow, linked), then served by launch_server
#               (tools/device/fp8_serve_big.py): load time, weight bytes, single-stream and
#               32-concurrent decode throughput -> big_fp8_serve.json; then the single
#               stream's decode step with its kernel breakdown (`bench step-profile
#               --no-speculation --requests 1`) -> big_fp8_profile_1.json; the shards are
#               deleted afterwards unless BIG_KEEP=1 (a later call with the same layers then
#               reuses them); BIG_STEPS (default "serve profile") picks the runs after the
#               write ("write": none, the checkpoint only, with BIG_KEEP=1 for a later call);
#               BIG_GEMV_ROWS (default: unset, the code's default) lists UNIMEM_FP8_GEMV_ROWS
#               values to profile one after the other (e.g. "0 4": the tensor-core path, then
#               the few-row product) -> big_fp8_profile_1_gemvR.json each
# Output: --out (default ./gpu-out): the JSON files above and gpu_fp8.log. Every command runs
# under `timeout $STEP_TIMEOUT` (default 420 s); VARIANTS (default "bf16 fp8 fp8_fused") names the
# runs of the profile and bench parts. Exit 1 if any part failed (named at the end). The kernel
# parts (sweep, gemm, gemv) need torch and Triton only; the others also the FA4 bundle and the
# server's wheels (installed by the bundle's finish call), checked before any part runs.
set -uo pipefail
out=gpu-out
parts="tests sweep gemm profile bench qwen3next gemma big"
gemma=""
prompts=""
big_layers=24
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --parts) parts=$2; shift 2 ;;
    --model-path) gemma=$2; shift 2 ;;
    --prompts) prompts=$2; shift 2 ;;
    --big-layers) big_layers=$2; shift 2 ;;
    *) echo "gpu_fp8.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
log="$out/gpu_fp8.log"
step_timeout=${STEP_TIMEOUT:-420}
# the variants the profile and bench parts run (VARIANTS="bf16 fp8" leaves the fused one out)
variants=${VARIANTS:-bf16 fp8 fp8_fused}
# shellcheck source=tools/device/gpu_env.sh
source tools/device/gpu_env.sh
failed=()
fail() { say "FAILED: $1"; failed+=("$1"); }

gpu_banner
# the kernel parts need torch and Triton only; the others run the engine (FA4) or the server
kernel_only=1
for part in $parts; do
  case "$part" in sweep|gemm|gemv) ;; *) kernel_only=0 ;; esac
done
KERNEL_ONLY=$kernel_only python3 - <<'EOF' 2>&1 | tee -a "$log" || { echo "gpu_fp8.sh: environment incomplete" >&2; exit 1; }
import os
import torch, triton  # noqa: F401
if os.environ["KERNEL_ONLY"] != "1":
    import safetensors, transformers, httpx, fastapi, flash_attn.cute  # noqa: F401
assert torch.cuda.is_available(), "no CUDA device"
cap = torch.cuda.get_device_capability()
assert cap >= (8, 9), f"FP8 tensor cores need sm_89+, got sm_{cap[0]}{cap[1]}"
engine = "" if os.environ["KERNEL_ONLY"] == "1" else f" transformers {transformers.__version__}"
print(f"torch {torch.__version__} triton {triton.__version__}{engine} sm {cap}",
      torch.cuda.get_device_name())
EOF
for part in $parts; do
  case "$part" in
    gemma) [ -n "$gemma" ] && [ -n "$prompts" ] && [ -f "$prompts" ] \
      || { echo "gpu_fp8.sh: part gemma needs --model-path and --prompts FILE" >&2; exit 2; } ;;
  esac
done

for part in $parts; do
  say "part $part"
  case "$part" in
    tests)
      run python3 -m pytest -q -m gpu sgl-kernel/tests/test_fp8_gemm.py test/models/test_fp8.py \
        || fail tests ;;
    sweep)
      # the sweep adds this GPU's entry to a copy of the committed table (other GPUs' stay)
      cp sgl-kernel/python/unimem_kernel/fp8_gemm_configs.json "$out/fp8_gemm_configs.json"
      run python3 sgl-kernel/benchmark/bench_fp8_gemm.py --sweep --sweep-out "$out/fp8_gemm_configs.json" \
        --json "$out/fp8_sweep.json" \
        && cp "$out/fp8_gemm_configs.json" sgl-kernel/python/unimem_kernel/fp8_gemm_configs.json \
        || fail sweep ;;
    gemv)
      run python3 -m pytest -q -m gpu sgl-kernel/tests/test_fp8_gemv.py || fail "gemv tests"
      run python3 sgl-kernel/benchmark/bench_fp8_gemv.py --json "$out/fp8_gemv.json" \
        --best-out "$out/fp8_gemv_best.txt" || fail gemv
      if [ "${GEMV_TILE:-}" = best ] && [ -s "$out/fp8_gemv_best.txt" ]; then
        export UNIMEM_FP8_GEMV_CONFIG=$(cat "$out/fp8_gemv_best.txt")
        say "gemv: the parts after this one use tile $UNIMEM_FP8_GEMV_CONFIG"
      fi ;;
    gemm)
      run python3 sgl-kernel/benchmark/bench_fp8_gemm.py --m 48 384 --moe --json "$out/fp8_gemm.json" \
        || fail gemm ;;
    profile)
      for q in $variants; do
        flag=(); [ "$q" != bf16 ] && flag=(--quantization fp8)
        act=separate; [ "$q" = fp8_fused ] && act=fused
        UNIMEM_FP8_ACT_QUANT=$act run python3 -m unimem bench step-profile --memory static \
          --steps 30 --replays 10 "${flag[@]}" --json "$out/profile_small_$q.json" \
          || fail "profile $q"
      done ;;
    bench)
      tag=$(gpu_tag)
      for q in $variants; do
        flag=(); [ "$q" != bf16 ] && flag=(--quantization fp8)
        act=separate; [ "$q" = fp8_fused ] && act=fused
        name=bench_${q}_$tag; [ "$q" = bf16 ] && name=bench_small_bf16_$tag
        UNIMEM_FP8_ACT_QUANT=$act run python3 -m unimem bench --preset small "${flag[@]}" \
          --json "$out/$name.json" || fail "bench $q"
      done ;;
    qwen3next)
      ck=/tmp/ckpt_qwen3_next_bench
      { [ -f "$ck/make_checkpoint.json" ] \
        || run python3 tools/make_checkpoint.py --arch qwen3_next --size bench --out "$ck"; } \
        || { fail "qwen3next checkpoint"; continue; }
      for q in bf16 fp8; do
        flag=(); [ "$q" = fp8 ] && flag=(--quantization fp8)
        run python3 -m unimem bench --model-path "$ck" --requests 48 --input-len 512 \
          --output-len 512 --page-size 64 "${flag[@]}" --json "$out/qwen3next_$q.json" \
          || fail "qwen3next $q"
      done ;;
    gemma)
      run python3 tools/device/fp8_agreement.py --model-path "$gemma" --prompts "$prompts" \
        --requests 24 --tokens 128 --json "$out/gemma_fp8_agreement.json"
      rc=$?
      [ "$rc" = 0 ] || fail "gemma (exit $rc; 3 = agreement below the goal)" ;;
    big)
      avail=$(df -Pm /tmp | awk 'NR == 2 {print $4}')
      # shards past /tmp's disk go to RAM (tmpfs), at most BIG_OVERFLOW_MB of it (the server
      # needs the rest of the machine's 128 GB): all 48 layers are ~83 GB, the disk 64 GB
      spill=${BIG_OVERFLOW_DIR:-/dev/shm/unimem-big}
      spill_cap=${BIG_OVERFLOW_MB:-40000}
      spill_mb=0
      if [ "$spill_cap" -gt 0 ] && mkdir -p "$spill" 2>/dev/null; then
        spill_mb=$(df -Pm "$spill" | awk 'NR == 2 {print $4 - 8000}')
        [ "$spill_mb" -gt "$spill_cap" ] && spill_mb=$spill_cap
        [ "$spill_mb" -lt 0 ] && spill_mb=0
      fi
      if [ "$big_layers" = auto ]; then
        # as many of the 48 layers as /tmp and the overflow hold, 4 GB of /tmp left over
        # (one layer ~1.7 GB of FP8)
        big_layers=$(( (avail + spill_mb - 1500 - 4000) / 1700 ))
        [ "$big_layers" -gt 48 ] && big_layers=48
      fi
      say "big: $avail MB free in /tmp, $spill_mb MB of overflow in $spill -> $big_layers layers"
      ck=/tmp/ckpt_qwen3_next_80b_fp8_l$big_layers
      need=$(( big_layers * 1700 + 1500 ))  # MB: ~1.7 GB of FP8 per layer + bf16 tables
      if [ ! -f "$ck/make_checkpoint.json" ] && [ $(( avail + spill_mb )) -lt "$need" ]; then
        fail "big: $avail + $spill_mb MB free, $need MB needed for $big_layers layers"
        continue
      fi
      { [ -f "$ck/make_checkpoint.json" ] \
        || run python3 tools/make_checkpoint.py --arch qwen3_next --size 80b --fp8 \
          --layers "$big_layers" --out "$ck" --overflow-dir "$spill"; } \
        || { fail "big checkpoint"; continue; }
      run cat "$ck/make_checkpoint.json"
      [[ " ${BIG_STEPS:-serve profile} " == *" serve "* ]] && { run python3 tools/device/fp8_serve_big.py --model-path "$ck" --vocab 151936 \
        --requests 64 --concurrency 32 --prompt-tokens 256 --output-tokens 128 \
        --json "$out/big_fp8_serve.json" -- --quantization fp8 --mem-fraction-static 0.88 \
        --max-running-requests 64 --page-size 64 || fail "big serve"; }
      # where one stream's decode step goes (an FP8 checkpoint runs in FP8 without the flag)
      if [[ " ${BIG_STEPS:-serve profile} " == *" profile "* ]]; then
        for rows in ${BIG_GEMV_ROWS:--}; do
          name=big_fp8_profile_1; [ "$rows" = - ] || name=big_fp8_profile_1_gemv$rows
          ( [ "$rows" = - ] || export UNIMEM_FP8_GEMV_ROWS=$rows
            run python3 -m unimem bench step-profile --model-path "$ck" --no-speculation \
              --requests 1 --input-len 256 --page-size 64 --memory static --steps 30 \
              --replays 10 --json "$out/$name.json" ) || fail "big profile $name"
        done
      fi
      [ "${BIG_KEEP:-0}" = 1 ] || rm -rf "$ck" "$spill" ;;
    *) fail "unknown part $part" ;;
  esac
done
say "done; failed parts: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
