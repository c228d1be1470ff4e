# Sourced by the tools/device/gpu_*.sh scripts (from the repository root): the environment of a
# device call and the two helpers each part uses. Needs $log (the script's log file) and
# $step_timeout (seconds per command) set before `run` is called.
#   say MSG...  : a timestamped marker line, printed and appended to $log
#   run CMD...  : CMD under `timeout $step_timeout`, output printed and appended to $log; its
#                 status is the command's (124: timed out)
#   gpu_tag     : h200, h100 or gpu (the suffix of a results file: docs/results/NAME_TAG.json)
#   gpu_outputs NAME : out=$OUT (default ./gpu-out), created; log=$out/NAME.log
export PYTHONPATH="$PWD/python:$PWD/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# FA4 (CuTe DSL) kernels compiled once per machine, not once per process
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache
say() { echo "=== $(date -u +%H:%M:%S) $*" | tee -a "$log"; }
run() { timeout "$step_timeout" "$@" 2>&1 | tee -a "$log"; return "${PIPESTATUS[0]}"; }
gpu_banner() {
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__, \
torch.cuda.get_device_name())" 2>&1 | tee -a "$log"
}
gpu_tag() {
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
    *H200*) echo h200 ;;
    *H100*) echo h100 ;;
    *) echo gpu ;;
  esac
}
gpu_outputs() {
  out=${OUT:-gpu-out}
  mkdir -p "$out"
  log="$out/$1.log"
}
