#!/usr/bin/env bash
# EAGLE-3 on hard greedy labels vs the backbone's distribution (heads.teacher_weight), same data, same steps:
# BENCHMARKS.md "EAGLE-3 beside the other families", "Soft targets".
#
#   bash scripts/bench_eagle3_teacher.sh                    # cache (~10 min on 2 cores), 2 x 120 steps (~13 min each), 4 evals (~6 min each)
#   ARMS="0 1 0.5" STAGES="train eval" bash scripts/bench_eagle3_teacher.sh
#
# 1. cache: the first 320 ShareGPT conversations of eagle3_smollm2's stream (113 micro-batches: last layer + aux
#    layers 2, 15, 27), built once and shared by every arm;
# 2. train: eagle3_smollm2 at that data, 120 steps (~2.1 passes), once per teacher weight in ARMS
#    (0 = cross-entropy on the backbone's greedy token, 1 = cross-entropy on its distribution over the draft
#    vocabulary, as SpecForge trains EAGLE-3); held-out accuracy against the greedy tokens is in each run's log;
# 3. eval: MT-Bench first turns 1-20, greedy, two fixed trees (n1-d1-k1: depth-1 acceptance; n8-d4-k4: per-depth
#    acceptance), so tau depends on the drafter only, not on this machine's timings.
# Run it alone: the training times are part of the comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${MEDUSA_BIN:-.venv/bin}
STAGES=${STAGES:-"cache train eval"}
ARMS=${ARMS:-"0 1"}
STEPS=${STEPS:-120}
B=${BENCH_OUT:-runs/bench_eagle3_teacher}
CACHE=${CACHE:-runs/features_aux_320}
mkdir -p "$B"
. scripts/bench_stages.sh   # has <stage>, timed <label> <command...>

data=(data.max_length=1024 data.max_conversations=320 features.cache_dir="$CACHE" trainer.progress_bar=false logger.wandb=disabled)

if has cache; then
  timed "cache (320 conversations)" "$BIN/medusa-train" eagle3_smollm2 "${data[@]}" features.mode=build \
      output_dir="$B/cache_run" trainer.max_steps=200
fi

for w in $ARMS; do
  run="$B/teacher_$w"
  if has train && [[ ! -f "$run/heads/config.json" ]]; then
    timed "train teacher_weight=$w" "$BIN/medusa-train" eagle3_smollm2 "${data[@]}" features.mode=train \
        heads.teacher_weight="$w" heads.ttt_steps=3 trainer.max_steps="$STEPS" trainer.save_every=0 output_dir="$run"
  fi
  if has eval; then
    common=(heads="$run/heads" num_prompts=20 max_new_tokens=96 progress_bar=false eagle_tree=fixed)
    timed "eval teacher_weight=$w n1-d1-k1" "$BIN/medusa-eval" "${common[@]}" eagle_nodes=1 eagle_depth=1 \
        eagle_topk=1 methods=[eagle3,autoregressive] out="$B/eval_${w}_n1d1k1"
    timed "eval teacher_weight=$w n8-d4-k4" "$BIN/medusa-eval" "${common[@]}" eagle_nodes=8 eagle_depth=4 \
        eagle_topk=4 methods=[eagle3] out="$B/eval_${w}_n8d4k4"
  fi
done
