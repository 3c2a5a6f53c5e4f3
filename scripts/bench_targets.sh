#!/usr/bin/env bash
# Greedy targets (heads.targets=backbone) on the embedded default: BENCHMARKS.md "Greedy targets".
#
#   bash scripts/bench_targets.sh          # ~1.2 h on 2 CPU cores; each stage skips what exists
#   STAGES="eval" bash scripts/bench_targets.sh
#
# 1. one feature cache over 1,000 ShareGPT conversations, with the backbone's greedy token at
#    every position (runs/features_smollm2_1k, shared with the *_greedy recipes);
# 2. ablation: Medusa heads (medusa1_smollm2_greedy), same cache, same 110 steps, targets=data
#    vs targets=backbone, evaluated at one node budget (tree=calibrated:4) on the same prompts;
# 3. the recipe hydra_smollm2_greedy (3 epochs), evaluated with the latency-aware tree
#    (tree=auto) on 20 MT-Bench first turns.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${MEDUSA_BIN:-.venv/bin}
B=${BENCH_OUT:-runs/bench_targets}
STAGES=${STAGES:-"build ablation recipes eval"}
TRAIN_ARGS=(trainer.progress_bar=false logger.wandb=disabled)
mkdir -p "$B"

. scripts/bench_stages.sh   # has <stage>, timed <label> <command...>
done_run() { [[ -f "$1/heads/config.json" ]]; }

if has build; then
  timed "feature cache (1,000 conversations)" "$BIN/medusa-train" hydra_smollm2_greedy features.mode=build \
      output_dir="$B/build" "${TRAIN_ARGS[@]}"
fi

if has ablation; then
  for t in data backbone; do
    out="$B/medusa_110_$t"
    done_run "$out" && continue
    timed "medusa 110 steps, targets=$t" "$BIN/medusa-train" medusa1_smollm2_greedy heads.targets=$t \
        output_dir="$out" "${TRAIN_ARGS[@]}"
  done
fi

if has recipes; then
  for r in hydra_smollm2_greedy; do
    done_run "$B/$r" && continue
    timed "$r" "$BIN/medusa-train" $r output_dir="$B/$r" "${TRAIN_ARGS[@]}"
  done
fi

if has eval; then
  for t in data backbone; do
    d="$B/medusa_110_$t"
    [[ -f $d/heads/config.json && ! -f $d/eval4/report.json ]] || continue
    "$BIN/medusa-eval" heads="$d/heads" num_prompts=8 max_new_tokens=96 tree=calibrated:4 \
        methods=[medusa,autoregressive] progress_bar=false out="$d/eval4" | tail -6
  done
  for r in hydra_smollm2_greedy; do
    d="$B/$r"
    [[ -f $d/heads/config.json && ! -f $d/eval/report.json ]] || continue
    "$BIN/medusa-eval" heads="$d/heads" num_prompts=20 max_new_tokens=96 progress_bar=false out="$d/eval" | tail -8
  done
fi
