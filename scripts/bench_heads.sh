#!/usr/bin/env bash
# Head families and training data compared on the embedded default (BENCHMARKS.md, sections
# "Head families" and "Self-distillation and Medusa-2"): same data, same steps, same tree budget.
#
#   bash scripts/bench_heads.sh            # ~1.5 h on 2 CPU cores; each stage is skipped when its output exists
#   STAGES="train eval" bash scripts/bench_heads.sh
#
# 1. one offline feature cache over medusa1_smollm2's data (the backbone runs once), then Medusa,
#    Hydra and MLP-speculator heads trained from it with medusa1_smollm2's budget (110 steps);
# 2. self-distilled data (distill_smollm2), heads on it (medusa1/hydra), Medusa-2 (LoRA, from them);
# 3. medusa-eval of every head set on the same MT-Bench first turns with a tree of the same
#    node budget grown from each set's own measured accuracy (tree=calibrated:N).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${MEDUSA_BIN:-.venv/bin}
B=${BENCH_OUT:-runs/bench_heads}
STAGES=${STAGES:-"train distill eval"}
NODES=${NODES:-4}
EVAL_ARGS=(num_prompts="${NUM_PROMPTS:-12}" max_new_tokens=96 tree="calibrated:$NODES" progress_bar=false)
TRAIN_ARGS=(trainer.progress_bar=false logger.wandb=disabled)
mkdir -p "$B"

has() { [[ " $STAGES " == *" $1 "* ]]; }
done_run() { [[ -f "$1/heads/config.json" ]]; }

if has train; then
  start=$(date +%s)
  "$BIN/medusa-train" medusa1_smollm2 features.mode=build features.cache_dir="$B/features_sharegpt" \
      output_dir="$B/build_sharegpt" "${TRAIN_ARGS[@]}"
  echo "feature cache build: $(( $(date +%s) - start )) s" | tee -a "$B/timings.txt"
  for r in medusa1_smollm2 hydra_smollm2 mlp_speculator_smollm2; do
    done_run "$B/$r" && continue
    start=$(date +%s)
    "$BIN/medusa-train" $r features.mode=train features.cache_dir="$B/features_sharegpt" output_dir="$B/$r" \
        "${TRAIN_ARGS[@]}"
    echo "$r from the cache: $(( $(date +%s) - start )) s" | tee -a "$B/timings.txt"
  done
fi

if has distill; then
  D=runs/distill_smollm2
  [[ -f $D/distill.json ]] && grep -q '"complete": true' $D/distill.json || \
      "$BIN/medusa-train" distill_smollm2 distill.max_conversations=192 distill.max_turns=1 "${TRAIN_ARGS[@]}"
  for r in medusa1_smollm2_distilled hydra_smollm2; do
    out="$B/${r%_distilled}_distilled"
    done_run "$out" && continue
    start=$(date +%s)
    "$BIN/medusa-train" $r data.source=./$D/data features.mode=train features.cache_dir="$B/features_distilled" \
        output_dir="$out" "${TRAIN_ARGS[@]}"
    echo "$r on distilled data from the cache: $(( $(date +%s) - start )) s" | tee -a "$B/timings.txt"
  done
  if ! done_run "$B/medusa2_smollm2"; then
    start=$(date +%s)
    "$BIN/medusa-train" medusa2_smollm2 lora.init_heads="$B/medusa1_smollm2_distilled/heads" \
        output_dir="$B/medusa2_smollm2" "${TRAIN_ARGS[@]}"
    echo "medusa2_smollm2 (online, LoRA): $(( $(date +%s) - start )) s" | tee -a "$B/timings.txt"
  fi
fi

if has eval; then
  for r in medusa1_smollm2 hydra_smollm2 mlp_speculator_smollm2 medusa1_smollm2_distilled hydra_smollm2_distilled \
           medusa2_smollm2; do
    [[ -f "$B/$r/heads/config.json" ]] || continue
    [[ -f "$B/$r/eval/report.json" ]] && continue
    "$BIN/medusa-eval" heads="$B/$r/heads" "${EVAL_ARGS[@]}" out="$B/$r/eval" | tail -8
  done
fi
