#!/usr/bin/env bash
# Issue 41's next experiment: weigh the training loss toward the block's first columns, where
# the shipped drafter's sampled acceptance is furthest from a perfect block drafter's
# (docs/results.md, "Nor is drafting a block blind to its own drafts": column 0 0.585 against
# 1, column 1 0.510 against 0.782; columns 3+ already at the independent-column ceiling).
# From the repository root, after the FA4 bundle:
#   MODEL=/path/to/gemma-3-270m.gguf [DECAYS="1 0.7"] [BUDGET=120] [GEN_BUDGET=60] \
#     bash tools/device/gpu_drafter_columns.sh
# Each variant continues the shipped drafter (--init) with the shipped run's objective (total
# variation against the target's top-64 distribution at 0.7, on text two thirds sampled at
# 0.7) and block column i's loss weighed DECAY ** i, for BUDGET training seconds on the same
# text (generated once, GEN_BUDGET seconds, kept in TEXT_CACHE, default
# /tmp/drafter_columns_text.pt). DECAY 1 is the control: the same extra training with every
# column alike, so that a gain is the weighting's, not the extra steps'. Every drafter — the
# shipped one first — is then scored by unimem.training.sampled_accept on the package's short
# prompts (16 x 128 tokens sampled at 0.7 by the target): the accept length and each
# column's sum min(p, q).
# Time: GEN_BUDGET + ~60 s, then per variant BUDGET + ~40 s, then ~30 s per score: the
# defaults take ~8 minutes on an H100. A later call with the same TEXT_CACHE skips the
# generation; SKIP_SHIPPED=1 skips scoring the shipped drafter again.
# Output: $OUT (or ./gpu-out): drafter_columns.json (per drafter: decay, accept, alpha per
# column, training steps) and gpu_drafter_columns.log.
set -uo pipefail
source tools/device/gpu_env.sh
gpu_outputs gpu_drafter_columns
step_timeout=${STEP_TIMEOUT:-580}
: "${MODEL:?set MODEL to the target model (a GGUF, a checkpoint directory, or gemma-3-270m)}"
budget=${BUDGET:-120}
text=${TEXT_CACHE:-/tmp/drafter_columns_text.pt}
shipped=python/unimem/data/drafters/gemma-3-270m
gpu_banner
status=0
score() {  # score NAME DRAFTER_DIR
  run python3 -m unimem.training.sampled_accept --model-path "$MODEL" --drafter "$2" \
    --prompts short --requests 16 --tokens 128 --temperature 0.7 --scales 1 --device cuda \
    --json "/tmp/columns_score_$1.json" || status=1
}
[ "${SKIP_SHIPPED:-0}" = 1 ] || { say "score: the shipped drafter"; score shipped "$shipped"; }
for decay in ${DECAYS:-1 0.7}; do
  say "decay $decay: train $budget s from the shipped drafter"
  run python3 -m unimem.training.train_drafter --model-path "$MODEL" --device cuda \
    --out "/tmp/columns_$decay" --init "$shipped" --text-cache "$text" \
    --bos-prompts 65536 --prompt-len 24 --gen-len 128 --gen-chunk 4096 \
    --gen-time-budget "${GEN_BUDGET:-60}" --temperatures 0.7,0.7,0 --max-running 512 \
    --gamma 7 --steps 1000000 --batch 64 --anchors-per-step 48 --lr 7e-4 --warmup 50 \
    --time-budget "$budget" --eval-every 100000 --head-steps 0 --states per-batch \
    --soft-top-k 64 --soft-loss tv --soft-temperature 0.7 --soft-weight 1 \
    --position-decay "$decay" --no-progress || status=1
  say "score: decay $decay"
  score "decay_$decay" "/tmp/columns_$decay"
done
python3 - "$out/drafter_columns.json" "$(gpu_tag)" "$budget" ${DECAYS:-1 0.7} <<'PY' | tee -a "$log"
import datetime, json, sys
from pathlib import Path
out, tag, budget, decays = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4:]
rows = []
for name, decay in [("shipped", None)] + [(f"decay_{d}", d) for d in decays]:
    score = Path(f"/tmp/columns_score_{name}.json")
    row = {"drafter": name, "position_decay": decay}
    if score.is_file():
        s = json.loads(score.read_text())["scales"]
        s = s["1"] if "1" in s else next(iter(s.values()))  # the scale 1 (--scales 1)
        row.update({k: s[k] for k in ("accept", "alpha") if k in s})
    train = Path(f"/tmp/columns_{decay}/training.json")
    if decay is not None and train.is_file():
        row["steps"] = json.loads(train.read_text())["steps"]
    rows.append(row)
json.dump({"gpu": tag, "date": datetime.date.today().isoformat(), "budget_s": budget,
           "drafters": rows}, open(out, "w"), indent=1)
for r in rows:
    print(r["drafter"], r.get("accept"), r.get("alpha"))
PY
say "done, status $status"
exit $status
