#!/usr/bin/env bash
# Real-architecture checkpoints on one GPU, in one device call (after the FA4 bundle and the
# transformers wheels are installed). Run from the repository root:
#   SIZE=small|bench PARTS="ckpt validate compact bench profile oracle" bash tools/device/gpu_models.sh ARCH...
#   ARCH: qwen3_next gpt_oss (default: both)
# ckpt: tools/make_checkpoint.py builds /tmp/ckpt_<arch>_<size> (kept while the machine
#   is; rebuilt only if missing);
# validate: static vs unified (same bytes), DSPARK, 16 requests of 256 + 128 tokens;
# compact: the same with a small arena, so that bands collide and compaction runs (sizes
#   below, from the validate run's JSON);
# oracle: 4 requests of 128 + 32 tokens without speculation, also through transformers'
#   generate on the same checkpoint (tokens and log-probabilities compared); oracle32: the
#   same in float32 with DSPARK (torch attention, Triton GDN, no CUDA graphs);
# bench: `python -m unimem bench` (48 requests of 512 + 512 tokens);
# smallbatch: `python -m unimem bench` with 8 running of 16 requests of 2048 + 128 tokens
#   (decode/verify attention through the split-KV kernel: static == unified);
# profile: `python -m unimem bench step-profile`'s steady-state verify step on this checkpoint (static
#   pools), every kernel's GPU time kept, grouped GEMMs (the routed experts) summed apart;
#   ATTRIBUTE=N also lists the N largest (torch op, launch site) pairs of an eager step.
# Output: $OUT (or ./gpu-out): <part>_<arch>_<size>.json and gpu_models_<size>.log.
# DEVICE / DTYPE (cpu / float32: a dry run of ckpt, validate, compact on the CPU).
# STEP_TIMEOUT (s, default 400) bounds each python command. Exit 1 if any part failed.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH="$PWD/python:$PWD/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# FA4 (CuTe DSL) kernels compiled once per machine, not once per process
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache
size=${SIZE:-bench}
parts=${PARTS:-ckpt validate compact bench profile}
step_timeout=${STEP_TIMEOUT:-400}
archs=("$@")
[ ${#archs[@]} -eq 0 ] && archs=(qwen3_next gpt_oss)
log="$out/gpu_models_${size}.log"
status=0
say() { echo "=== $(date -u +%H:%M:%S) $*" | tee -a "$log"; }
run() { timeout "$step_timeout" "$@" 2>&1 | tee -a "$log"; }

python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, \
transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$log"

for arch in "${archs[@]}"; do
  ck=/tmp/ckpt_${arch}_${size}
  tag=${arch}_${size}
  common=(--model-path "$ck" --device "${DEVICE:-cuda}" ${DTYPE:+--dtype "$DTYPE"})
  for part in $parts; do
    say "$part $tag"
    case "$part" in
      ckpt)
        [ -f "$ck/config.json" ] && [ -f "$ck/make_checkpoint.json" ] \
          || run python3 tools/make_checkpoint.py --arch "$arch" --size "$size" --out "$ck" ;;
      smallbatch)
        run python3 -m unimem bench "${common[@]}" --requests 16 --max-running 8 \
          --input-len 2048 --output-len 128 --page-size 64 \
          --json "$out/smallbatch_${tag}.json" ;;
      validate)
        run python3 -m unimem validate "${common[@]}" --spec dspark --requests 16 \
          --input-len 256 --output-len 128 --page-size 64 --max-running 16 \
          --json "$out/validate_${tag}.json" ;;
      compact)
        # gpt-oss: SWA pages retire behind the window and leave holes, so an arena just
        # above the unified peak of the validate run compacts with all 16 running.
        # qwen3_next: state slots dominate and every request runs at once, so there is no
        # churn; 8 running of 16 (requests finish at different steps under speculation)
        # and an arena 3.3% under the static pools of 8 (half those of 16): on H200 the
        # bench checkpoint then compacted 5 times and retracted 6 times (1% under: neither).
        read=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); a=sys.argv[2]; \
mb = r['unified']['peak_bytes'] * 1.02 if a == 'gpt_oss' else r['static']['capacity_bytes'] * 0.5 * 0.967; \
print(16 if a == 'gpt_oss' else 8, f'{mb / 2**20:.1f}')" "$out/validate_${tag}.json" "$arch") \
          && set -- $read && say "compact $tag: --max-running $1 --arena-mb $2" \
          && run python3 -m unimem validate "${common[@]}" --spec dspark --requests 16 \
            --input-len 256 --output-len 128 --page-size 64 --max-running "$1" --arena-mb "$2" \
            --json "$out/compact_${tag}.json" ;;
      oracle)
        run python3 -m unimem validate "${common[@]}" --oracle transformers --spec none \
          --requests 4 --input-len 128 --output-len 32 --page-size 64 --max-running 4 \
          --json "$out/oracle_${tag}.json" ;;
      oracle32)
        # float32 on the GPU (torch attention, Triton GDN, eager steps): kernels vs transformers
        # and speculative vs non-speculative without bf16 rounding in the way
        run python3 -m unimem validate --model-path "$ck" --device "${DEVICE:-cuda}" \
          --dtype float32 --backend torch --cuda-graphs off --spec dspark --oracle transformers \
          --requests 4 --input-len 128 --output-len 32 --page-size 64 --max-running 4 \
          --json "$out/oracle32_${tag}.json" ;;
      bench)
        run python3 -m unimem bench "${common[@]}" --requests 48 --input-len 512 \
          --output-len 512 --json "$out/bench_${tag}.json" ;;
      profile)
        run python3 - "$ck" "$out/profile_${tag}.json" <<'PY'
import json
import os
import re
import sys
import types
from collections import defaultdict

import torch
import torch.profiler as tp

from unimem.bench import step_profile as profile_step
from unimem.speculative.drafter import draft_config_for
from unimem.models.loader import load_model
from unimem.speculative.drafter import DsparkDrafter

ck, path = sys.argv[1:3]
held = {}
_Profile = tp.profile


class KeepProfile(_Profile):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        held["prof"] = self


tp.profile = KeepProfile
GROUPED = re.compile(r"group|grouped", re.I)
SORT = re.compile(r"radix|sort", re.I)
plain = profile_step.category


def category(name: str) -> str:
    if GROUPED.search(name):
        return "MoE grouped GEMMs (routed experts)"
    if SORT.search(name):
        return "MoE routing sort"
    return plain(name)


profile_step.category = category
dev = torch.device("cuda")
model = load_model(ck, dtype="bfloat16", device=dev)
cfg = model.config
drafter = DsparkDrafter(draft_config_for(cfg), model.embed_weight, model.lm_head_weight, seed=17)
g = torch.Generator().manual_seed(1)
args = types.SimpleNamespace(requests=48, input_len=512, gamma=7, page_size=64, steps=30,
                             replays=20, host_top=0, attribute=int(os.environ.get("ATTRIBUTE", 0)),
                             top_kernels=15)
prompts = torch.randint(0, cfg.vocab_size, (args.requests, args.input_len), generator=g).tolist()
r = profile_step.measure("static", profile_step.SPLIT_KV_MAX_BS, args, model, drafter, prompts)
kernels = defaultdict(float)
for evt in held["prof"].key_averages():
    us = getattr(evt, "self_device_time_total", None)
    if us is None:
        us = evt.self_cuda_time_total
    if us > 0:
        kernels[evt.key[:300]] += us / 1000 / 5  # measure() profiles 5 replays
per_cat = r["kernel_ms_per_step"]
total = sum(per_cat.values())
moe = per_cat.get("MoE grouped GEMMs (routed experts)", 0.0)
r["moe_grouped_gemm_share"] = moe / total if total else 0.0
r["all_kernels_ms"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1]))
r["gpu"] = torch.cuda.get_device_name(dev)
r["checkpoint"] = ck
print(f"{ck}: verify step {r['gpu_ms_per_verify_step']:.2f} ms on the GPU (replays), "
      f"{r['tokens_per_step']:.1f} tokens/step, {r['output_tok_s']:.0f} tok/s engine loop")
for label, ms in sorted(per_cat.items(), key=lambda kv: -kv[1]):
    print(f"  {label:<52}{ms:>9.3f} ms{100 * ms / total:>7.1f}%")
print(f"  MoE grouped-GEMM share of kernel time: {100 * r['moe_grouped_gemm_share']:.1f}%")
for name, ms in list(r["all_kernels_ms"].items())[:12]:
    print(f"    {ms:7.3f}  {name[:150]}")
for o in r["torch_ops_by_launch_site"]:
    print(f"    {o['ms']:7.3f} {o['calls']:5d}  {o['op'][:60]:<60} {o['site']}")
with open(path, "w") as f:
    json.dump(r, f, indent=1)
PY
        ;;
      *) echo "unknown part $part" | tee -a "$log"; false ;;
    esac || { status=1; say "FAILED: $part $tag"; }
  done
done
say "done (status $status)"
exit $status
