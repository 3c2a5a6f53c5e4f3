#!/usr/bin/env bash
# The four drafter families side by side at equal data and equal CPU-minutes: BENCHMARKS.md
# "Four families, equal data, equal CPU-minutes".
#
#   bash scripts/bench_families.sh                          # ~90 min on 2 cores: 4 trainings (~12 min each), 12 evals
#   FAMILIES="medusa eagle3" STAGES=eval bash scripts/bench_families.sh
#
# Data: the first 320 ShareGPT conversations of eagle3_smollm2's stream, from one feature cache (last layer + aux
# layers 2, 15, 27: it serves every family; built by scripts/bench_eagle3_teacher.sh's cache stage, or here).
# Training: each family's recipe with the backbone's greedy tokens as targets, the same optimizer settings, and as
# many steps as fit in the CPU time EAGLE-3's 120 steps take on this machine (~12 min; steps per family in STEPS_*,
# sized from an 8-step probe of each: Medusa ~2.6 s/step, Hydra ~3.0, MLP speculator ~4.2, EAGLE-3 ~6.1).
# Evaluation (MT-Bench first turns 1-20 and the 12 code prompts, greedy, 96 tokens, methods interleaved):
#   two   the best single draft token per step (Medusa: chain2, EAGLE-3: n1-d1-k1): the tree this CPU pays for,
#         against the runtime's loop and transformers' generate;
#   chain a three-token chain (chain4 / n3-d3-k1): per-depth acceptance (n-alpha) at depths 1-3;
#   code  the two-row tree on the code prompts, against the runtime's loop.
# Run it alone: training times and tokens/s are part of the comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${MEDUSA_BIN:-.venv/bin}
STAGES=${STAGES:-"cache train eval"}
FAMILIES=${FAMILIES:-"medusa hydra mlp_speculator eagle3"}
B=${BENCH_OUT:-runs/bench_families}
CACHE=${CACHE:-runs/features_aux_320}
STEPS_medusa=${STEPS_medusa:-280}
STEPS_hydra=${STEPS_hydra:-240}
STEPS_mlp_speculator=${STEPS_mlp_speculator:-175}
STEPS_eagle3=${STEPS_eagle3:-120}
mkdir -p "$B"
. scripts/bench_stages.sh   # has <stage>, timed <label> <command...>

data=(data.max_length=1024 data.max_conversations=320 features.cache_dir="$CACHE" trainer.progress_bar=false logger.wandb=disabled)
recipe() {
  case $1 in
    medusa) echo medusa1_smollm2_greedy ;;
    hydra) echo hydra_smollm2_greedy ;;
    mlp_speculator) echo mlp_speculator_smollm2 ;;
    eagle3) echo eagle3_smollm2 ;;
  esac
}

if has cache && [[ ! -f "$CACHE/features.json" ]]; then
  timed "cache (320 conversations)" "$BIN/medusa-train" eagle3_smollm2 "${data[@]}" features.mode=build \
      output_dir="$B/cache_run" trainer.max_steps=200
fi

for f in $FAMILIES; do
  run="$B/$f"
  steps_var="STEPS_$f"
  if has train && [[ ! -f "$run/heads/config.json" ]]; then
    timed "train $f (${!steps_var} steps)" "$BIN/medusa-train" "$(recipe "$f")" "${data[@]}" features.mode=train \
        heads.targets=backbone optim.lr=1e-3 optim.warmup_steps=20 trainer.max_steps="${!steps_var}" \
        trainer.save_every=0 output_dir="$run" $([[ $f == eagle3 ]] && echo heads.ttt_steps=3)
  fi
  if has eval; then
    common=(heads="$run/heads" max_new_tokens=96 progress_bar=false)
    if [[ $f == eagle3 ]]; then
      m=eagle3
      two=(eagle_tree=fixed eagle_nodes=1 eagle_depth=1 eagle_topk=1)
      chain=(eagle_tree=fixed eagle_nodes=3 eagle_depth=3 eagle_topk=1)
    else
      m=medusa
      two=(tree=chain2)
      chain=(tree=chain4)
    fi
    timed "eval $f two-row tree, MT-Bench" "$BIN/medusa-eval" "${common[@]}" "${two[@]}" num_prompts=20 \
        methods="[$m,autoregressive,hf_generate]" out="$B/eval_${f}_two"
    timed "eval $f chain of 3, MT-Bench" "$BIN/medusa-eval" "${common[@]}" "${chain[@]}" num_prompts=20 \
        methods="[$m]" out="$B/eval_${f}_chain"
    timed "eval $f two-row tree, code" "$BIN/medusa-eval" "${common[@]}" "${two[@]}" prompts=code num_prompts=12 \
        methods="[$m,autoregressive]" out="$B/eval_${f}_code"
  fi
done
