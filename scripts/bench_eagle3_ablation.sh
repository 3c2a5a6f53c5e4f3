#!/usr/bin/env bash
# EAGLE-3 training settings, one at a time, against eagle3_smollm2's own at the same data and CPU time:
# BENCHMARKS.md "EAGLE-3 settings at equal CPU time".
#
#   bash scripts/bench_eagle3_ablation.sh                   # the ttt_steps=1 arm: ~10 min training + ~10 min evals
#   ARMS="lr2e-3:optim.lr=2e-3 ttt2:heads.ttt_steps=2,trainer.max_steps=180" bash scripts/bench_eagle3_ablation.sh
#
# Data: the 320-conversation feature cache of scripts/bench_eagle3_teacher.sh (built there, or by its cache stage);
# CONVS=1000 CACHE=runs/features_smollm2_1k_aux runs an arm at eagle3_smollm2's earlier data (1,000 x 1,024 tokens), whose
# baseline is the recipe itself, trained and evaluated by scripts/bench_eagle3.sh.
# Each arm is "name:override,override,..." on top of eagle3_smollm2 at that data; the baseline is that recipe at
# 120 steps (~12 min here), trained and evaluated the same way by scripts/bench_families.sh (its eagle3 run).
# An arm that changes the cost of a step sets trainer.max_steps so that its training takes about the same time.
# Evaluation: MT-Bench first turns 1-20, greedy, 96 tokens, the two-row tree (n1-d1-k1: what this CPU pays for)
# and a three-token chain (n3-d3-k1: acceptance at depths 1-3), as scripts/bench_families.sh evaluates.
# Run it alone: training times and tokens/s are part of the comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${MEDUSA_BIN:-.venv/bin}
STAGES=${STAGES:-"train eval"}
ARMS=${ARMS:-"ttt1:heads.ttt_steps=1,trainer.max_steps=270"}  # 270: ~2.7 s/step in a 10-step probe vs 6.1 for ttt 3
B=${BENCH_OUT:-runs/bench_eagle3_ablation}
CACHE=${CACHE:-runs/features_aux_320}
CONVS=${CONVS:-320}
mkdir -p "$B"
. scripts/bench_stages.sh   # has <stage>, timed <label> <command...>

data=(data.max_length=1024 data.max_conversations="$CONVS" features.cache_dir="$CACHE" trainer.progress_bar=false logger.wandb=disabled)
[[ -f "$CACHE/features.json" ]] || { echo "no feature cache at $CACHE: run scripts/bench_eagle3_teacher.sh's cache stage (or, for CONVS=1000, medusa-train eagle3_smollm2 data.max_conversations=1000 data.max_length=1024 features.cache_dir=$CACHE)" >&2; exit 2; }

for arm in $ARMS; do
  name=${arm%%:*}
  IFS=, read -r -a overrides <<< "${arm#*:}"
  [[ "${arm#*:}" == *trainer.max_steps=* ]] || overrides+=(trainer.max_steps=120)
  [[ "${arm#*:}" == *heads.ttt_steps=* ]] || overrides+=(heads.ttt_steps=3)  # the baseline's (the recipe's former) depth
  run="$B/$name"
  if has train && [[ ! -f "$run/heads/config.json" ]]; then
    timed "train $name (${arm#*:})" "$BIN/medusa-train" eagle3_smollm2 "${data[@]}" features.mode=train \
        trainer.save_every=0 "${overrides[@]}" output_dir="$run"
  fi
  if has eval; then
    common=(heads="$run/heads" num_prompts=20 max_new_tokens=96 progress_bar=false eagle_tree=fixed eagle_topk=1)
    timed "eval $name n1-d1-k1" "$BIN/medusa-eval" "${common[@]}" eagle_nodes=1 eagle_depth=1 \
        methods=[eagle3,autoregressive] out="$B/eval_${name}_two"
    timed "eval $name n3-d3-k1" "$BIN/medusa-eval" "${common[@]}" eagle_nodes=3 eagle_depth=3 \
        methods=[eagle3] out="$B/eval_${name}_chain"
  fi
done
