#!/usr/bin/env bash
# The GPU proofs of DSPARK sampling / adaptive verify, the serving benchmark and the bench
# figure, in device calls. Run from the repository root after the FA4 bundle (and, for
# serving, the server / GuideLLM wheels) are installed:
#   PARTS="tests distill drafted ckpt serving" bash tools/device/gpu_dspark_serving.sh
# tests: the gpu tests of the sampling kernel, ragged write window, speculative sampling,
#   ragged verify (graph replay == eager with lengths changing every step, the adaptive loop
#   under sync-debug) and the engine (CUDA-graph steps, sampled steps);
# distill: a drafter for the `small` preset distilled on the GPU (/tmp/drafter_small);
# drafted: bench with that drafter (no acceptance control), fixed gamma vs adaptive lengths
#   under a budget of VERIFY_BUDGET rows per step (default 96); the fixed run also draws the
#   bench figure (--plot);
# ckpt: the `small` Qwen3-Next-architecture checkpoint and a drafter distilled for it;
# serving (or serving-spare, serving-binding: one of its two runs): `python -m unimem bench serving` on that checkpoint with DSPARK greedy, once with
#   memory to spare and once at a budget that binds (--max-total-tokens below what the
#   concurrency needs at the static split);
# serving-real: issue 41's serving figures on the real model: MODEL (a GGUF, or gemma-3-270m with
#   the model extra) with its shipped drafter, no speculation vs DSPARK on the unified arena,
#   the package's short real prompts, 128 tokens, concurrency 1 / 8 / 32 / 64
#   -> serving_dspark_real_<gpu>.json / .png;
# step-real: where the real model's DSPARK step goes, against its plain decode step: `bench
#   step-profile --model-path MODEL` at 1 and 48 requests (static memory), verify and
#   --no-speculation, each with its kernel breakdown -> step_real_{verify,decode}_{1,48}.json
#   (a DSPARK step cost ~2.3 plain steps at one request on the H100).
# Output: $OUT (or ./gpu-out). STEP_TIMEOUT (s, default 500) bounds each command.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
parts=${PARTS:-tests distill drafted ckpt serving}
step_timeout=${STEP_TIMEOUT:-500}
log="$out/gpu_dspark_serving.log"
status=0
. tools/device/gpu_env.sh
ck=/tmp/ckpt_qwen3_next_small
gpu_banner
for part in $parts; do
  say "$part"
  case "$part" in
    tests)
      run python3 -m pytest -q -p no:cacheprovider --durations=10 \
        sgl-kernel/tests/test_sampling_kernel.py test/engine/test_sampling.py -k "gpu or kernel" \
        && run python3 -m pytest -q -p no:cacheprovider --durations=10 -m gpu \
          sgl-kernel/tests/test_write_window.py test/speculative/test_ragged_verify_gpu.py \
          test/speculative/test_spec_sampling.py test/engine/test_gpu_engine.py ;;
    distill)
      [ -f /tmp/drafter_small/config.json ] \
        || run python3 -m unimem.training.distill --preset small --device cuda \
          --out /tmp/drafter_small --prompts 1024 --steps 400 --batch 16 --log-every 50 ;;
    drafted)
      # fixed gamma; adaptive lengths under a budget that cuts (96 rows per step for 48
      # requests: 2 on average instead of gamma + 1 = 8)
      for vl in fixed adaptive; do
        extra=()
        [ "$vl" = fixed ] && extra=(--plot "$out/bench_h200.png")
        [ "$vl" = adaptive ] && extra=(--speculative-verify-budget "${VERIFY_BUDGET:-96}")
        run python3 -m unimem bench --preset small --device cuda --spec dspark --accept-rate 0 \
          --speculative-draft-model-path /tmp/drafter_small --verify-lengths "$vl" \
          --requests 48 --input-len 512 --output-len 512 --repeats 1 \
          --json "$out/bench_drafted_${vl}_h200.json" "${extra[@]}"
      done ;;
    ckpt)
      [ -f "$ck/config.json" ] \
        || run python3 tools/make_checkpoint.py --arch qwen3_next --size small --out "$ck"
      [ -f "$ck/tokenizer.json" ] || run python3 -c "import sys; \
from unimem.models.word_tokenizer import save_word_tokenizer; \
save_word_tokenizer(sys.argv[1], 32000)" "$ck"
      [ -n "${CKPT_DRAFTER:-}" ] && { [ -f /tmp/drafter_ckpt_small/config.json ] \
        || run python3 -m unimem.training.distill --model-path "$ck" --device cuda \
          --out /tmp/drafter_ckpt_small --prompts 1024 --steps 400 --batch 16 --log-every 50; }
      true ;;
    serving|serving-spare|serving-binding)
      draft=()
      [ -f /tmp/drafter_ckpt_small/config.json ] \
        && draft=(--speculative-draft-model-path /tmp/drafter_ckpt_small)
      common=(--model-path "$ck" --device cuda --speculative-algorithm DSPARK "${draft[@]}"
        --page-size 64
        --max-running-requests 64 --prompt-tokens 256 --output-tokens 128)
      [ "$part" = serving-binding ] || run python3 -m unimem bench serving "${common[@]}" \
        --concurrency 1,8,32,64 \
        --json "$out/serving_spare_h200.json" --plot "$out/serving_spare_h200.png"
      [ "$part" = serving-spare ] && continue
      # 12 288 FULL tokens hold ~30 requests of 256 + 128 (+ lookahead) at the static split;
      # 64 concurrent requests need twice that.
      run python3 -m unimem bench serving "${common[@]}" --concurrency 16,32,64 \
        --max-total-tokens 12288 \
        --json "$out/serving_binding_h200.json" --plot "$out/serving_binding_h200.png" ;;
    serving-real)
      tag=$(gpu_tag)
      run python3 -m unimem bench serving --model-path "${MODEL:?set MODEL to the real model}" \
        --device cuda --compare speculation --prompts short --output-tokens 128 \
        --concurrency 1,8,32,64 --mem-fraction-static 0.6 \
        --json "$out/serving_dspark_real_$tag.json" --plot "$out/serving_dspark_real_$tag.png" ;;
    step-real)
      for n in 1 48; do
        run python3 -m unimem bench step-profile --model-path "${MODEL:?set MODEL to the real model}" \
          --requests $n --memory static --steps 100 --attribute 25 \
          --json "$out/step_real_verify_$n.json" \
        && run python3 -m unimem bench step-profile --model-path "$MODEL" --no-speculation \
          --requests $n --memory static --steps 100 --attribute 25 \
          --json "$out/step_real_decode_$n.json" || break
      done ;;
    *) echo "unknown part $part"; false ;;
  esac || status=1
done
exit $status
