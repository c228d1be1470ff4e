#!/usr/bin/env bash
# The GPU proofs of issue 44 on ONE host with 2 GPUs (nvidia-h200-x2), in one device call.
# Needs the sglang-router wheel carried (pip install sglang_router-0.3.2-*.whl: the device
# image has no internet) and the FA4 bundle as the other gpu_*.sh scripts.
#   PARTS="ckpt dp multinode bench" bash tools/device/gpu_router.sh
# ckpt: the `small` Qwen3-Next-architecture checkpoint (bf16) and its word tokenizer;
# dp: python -m unimem.launch_server --dp-size 2 --device cuda (one GPU per replica) behind
#   the router: a completion and a stream through it, every replica serving, SIGTERM stops all;
# multinode: tensor parallel 2 as two "nodes" on this host (NCCL across the two processes):
#   validate --tp-size 2 --nnodes 2, node 1 in the background; node 0 prints the report
#   (static == unified, exact);
# bench: `python -m unimem bench router` --device cuda (worker i on GPU i): cache_aware vs
#   round_robin, 8 prefixes x 64 requests -> $OUT/bench_router_h200.json.
# Output: $OUT (or ./gpu-out). STEP_TIMEOUT (s, default 500) bounds each command.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
parts=${PARTS:-ckpt dp multinode bench}
step_timeout=${STEP_TIMEOUT:-500}
log="$out/gpu_router.log"
status=0
. tools/device/gpu_env.sh
ck=/tmp/ckpt_qwen3_next_small
gpu_banner
python3 -c "import sglang_router" || { say "FAIL: sglang_router is not installed"; exit 1; }
[ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] \
  || { say "FAIL: needs 2 GPUs"; exit 1; }
for part in $parts; do
  say "$part"
  case "$part" in
    ckpt)
      [ -f "$ck/config.json" ] \
        || run python3 tools/make_checkpoint.py --arch qwen3_next --size small --out "$ck" ;;
    dp)
      port=31000
      python3 -m unimem.launch_server --model-path "$ck" --device cuda --dp-size 2 \
        --port $port --served-model-name m --log-level warning >>"$log" 2>&1 &
      pid=$!
      ok=0
      for _ in $(seq 300); do
        curl -s 127.0.0.1:$port/readiness | grep -q '"healthy_workers":2' && { ok=1; break; }
        kill -0 $pid 2>/dev/null || break
        sleep 1
      done
      if [ $ok = 1 ]; then
        run curl -s 127.0.0.1:$port/v1/completions -H 'content-type: application/json' \
          -d '{"model":"m","prompt":"w5 w6 w7","max_tokens":8,"temperature":0}' || status=1
        run curl -sN 127.0.0.1:$port/v1/completions -H 'content-type: application/json' \
          -d '{"model":"m","prompt":"w1 w2","max_tokens":8,"stream":true}' | tail -2
        run curl -s 127.0.0.1:$port/workers
      else
        say "FAIL: --dp-size 2 did not come up"; status=1
      fi
      kill -TERM $pid; wait $pid; say "launcher exit status $?" ;;
    multinode)
      addr=127.0.0.1:$((29600 + RANDOM % 300))
      args=(validate --model-path "$ck" --device cuda --tp-size 2 --nnodes 2
        --dist-init-addr "$addr" --requests 16 --input-len 256 --output-len 64)
      UNIMEM_TP_TIMEOUT_S=300 CUDA_VISIBLE_DEVICES=1 python3 -m unimem "${args[@]}" \
        --node-rank 1 >>"$log" 2>&1 &
      node1=$!
      UNIMEM_TP_TIMEOUT_S=300 CUDA_VISIBLE_DEVICES=0 run python3 -m unimem "${args[@]}" \
        --node-rank 0 --json "$out/validate_two_nodes_h200.json" || status=1
      wait $node1 || { say "FAIL: node 1 exit status $?"; status=1; } ;;
    bench)
      run python3 -m unimem bench router --device cuda --dtype bfloat16 --model-path "$ck" \
        --json "$out/bench_router_h200.json" || status=1 ;;
  esac
done
say "done (status $status)"
exit $status
