#!/usr/bin/env bash
# Issue 41's recipe choices, measured: one generation of the target's text, then drafters of
# several recipes trained from scratch on that same text for the same time, each scored by its
# held-out accept length (acceptance control off: offline greedy chain replay, as
# train_drafter reports it). From the repository root, after the FA4 bundle:
#   MODEL=/path/to/gemma-3-270m.gguf [BUDGET=60] [GEN_BUDGET=240] [VARIANTS="..."] \
#     bash tools/device/gpu_drafter_recipes.sh
# Time: the first run GEN_BUDGET + BUDGET + ~60 s (engine start-up with its graphs), each
# further recipe BUDGET + ~25 s (model load, held-out continuations without graphs, states);
# the defaults take ~15 minutes on an H100. A short budget ranks recipes by how fast they
# learn, which need not be how far they get: rerun the best two with a longer one.
# MODEL: the target; BUDGET: training seconds per recipe; GEN_BUDGET: seconds of generation
# for the shared text (greedy continuations of <bos>-sampled prompts), kept in TEXT_CACHE
# (default /tmp/drafter_text.pt) for later runs; VARIANTS: one recipe
# per line, flags added to the base recipe (2 draft layers over target layers 1, 9, 17,
# Markov rank 16, a 32 768-token draft vocabulary, gamma 7; the first variant adds soft
# targets, the target's own top-16 distribution at every position, at half the loss; the
# second weighs block column i's loss 0.8 ** i; the Markov bias has rank >= 1, so 4 and 64
# bracket the base's 16).
# Several device calls: the recipes' drafters stay in /tmp/recipe_K on the machine, so a
# later call with SKIP_BASE=1 (the base recipe already trained there) and the remaining
# VARIANTS adds /tmp/recipe_K+1.. and reports every recipe trained so far.
# Output: $OUT (or ./gpu-out): drafter_recipes.json (per recipe: flags, held-out accept
# length before/after, steps, weights bytes) and gpu_drafter_recipes.log.
set -uo pipefail
source tools/device/gpu_env.sh
gpu_outputs gpu_drafter_recipes
step_timeout=${STEP_TIMEOUT:-580}
: "${MODEL:?set MODEL to the target model (a GGUF, a checkpoint directory, or gemma-3-270m)}"
budget=${BUDGET:-60}
text=${TEXT_CACHE:-/tmp/drafter_text.pt}
held=/tmp/drafter_recipes_heldout.jsonl
python3 -c "import json, sys
from unimem.data.prompts import short_prompts
with open(sys.argv[1], 'w') as f:
    for t in short_prompts():
        f.write(json.dumps({'text': t, 'split': 'heldout'}) + '\n')" "$held"
variants=${VARIANTS:-"
--soft-top-k 16 --soft-weight 0.5
--position-decay 0.8
--draft-layers 1
--draft-layers 3
--markov-rank 4
--markov-rank 64
--target-layers 5,11,17
--draft-vocab 8192"}
base=(--model-path "$MODEL" --device cuda --text-cache "$text"
  --eval-prompts "$held" --eval-split heldout --eval-sequences 56
  --bos-prompts 131072 --prompt-len 24 --gen-len 128 --gen-chunk 4096
  --gen-time-budget "${GEN_BUDGET:-240}" --temperatures 0 --max-running 512
  --draft-layers 2 --draft-ffn-dim 1024 --draft-vocab 32768 --markov-rank 16 --gamma 7
  --steps 1000000 --batch 64 --anchors-per-step 48 --lr 2e-3 --warmup 100
  --time-budget "$budget" --eval-every 1000 --head-steps 100 --no-progress)
gpu_banner
status=0
if [ "${SKIP_BASE:-0}" = 1 ] && [ -f /tmp/recipe_0/training.json ]; then
  say "base recipe: kept from an earlier call (/tmp/recipe_0)"
else
  rm -rf /tmp/recipe_[0-9]*  # a call that trains the base recipe starts the set over
  say "base recipe (generates $text unless it exists)"
  run python3 -m unimem.training.train_drafter "${base[@]}" --out /tmp/recipe_0 || status=1
  mkdir -p /tmp/recipe_0 && echo "(base)" > /tmp/recipe_0/flags.txt
fi
i=0  # the next recipe goes after those an earlier call left
while [ -d "/tmp/recipe_$((i + 1))" ]; do i=$((i + 1)); done
while IFS= read -r flags; do
  [ -z "$flags" ] && continue
  i=$((i + 1))
  say "recipe $i: $flags"
  # shellcheck disable=SC2086  # the flags split into arguments on purpose
  run python3 -m unimem.training.train_drafter "${base[@]}" $flags --out "/tmp/recipe_$i" \
    || status=1
  mkdir -p "/tmp/recipe_$i" && echo "$flags" > "/tmp/recipe_$i/flags.txt"
done <<< "$variants"
python3 - "$out/drafter_recipes.json" "$i" "$budget" "$(gpu_tag)" <<'PY' | tee -a "$log"
import datetime, json, sys
from pathlib import Path
rows = []
for k in range(int(sys.argv[2]) + 1):
    d = Path(f"/tmp/recipe_{k}")
    if not (d / "training.json").is_file():
        rows.append({"flags": (d / "flags.txt").read_text().strip() if d.exists() else "?",
                     "error": "no training.json"})
        continue
    t = json.loads((d / "training.json").read_text())
    rows.append({"flags": (d / "flags.txt").read_text().strip(), "accept_before":
                 t["accept_before"], "accept_after": t["accept_after"], "steps": t["steps"],
                 "weights_bytes": t["weights_bytes"], "draft_config": t["draft_config"],
                 "sequences": t["sequences"], "text_cache": t.get("text_cache")})
json.dump({"gpu": sys.argv[4], "date": datetime.date.today().isoformat(),
           "budget_s": float(sys.argv[3]), "recipes": rows}, open(sys.argv[1], "w"), indent=1)
for r in rows:
    print(f"{r['flags']:<28} accept {r.get('accept_after') or float('nan'):.3f} "
          f"steps {r.get('steps', 0)}")
PY
say "done, status $status"
exit $status
