#!/usr/bin/env bash
# EAGLE-3 beside the other families on the embedded default: BENCHMARKS.md "EAGLE-3 beside the other families".
#
#   bash scripts/bench_eagle3.sh                 # cache + training (~1 h on 2 CPU cores), eval, export check
#   STAGES="eval export" bash scripts/bench_eagle3.sh
#   SETTINGS="" EAGLE3_RUN=runs/eagle3_cpu BENCH_OUT=runs/bench_eagle3_cpu bash scripts/bench_eagle3.sh   # the recipe now
#
# 1. train: recipe eagle3_smollm2 at the section's data, 1,000 conversations x 1,024 tokens (builds
#    runs/features_smollm2_1k_aux once: last layer + 3 aux layers; the recipe now caches 2,000 x 512);
# 2. eval: medusa-eval on MT-Bench first turns 1-20 and on the bundled code prompts, eagle3 (tree chosen on
#    this machine, eagle_tree=auto) vs the runtime's plain loop vs transformers' generate, interleaved;
#    plus one fixed setting per run for the per-depth acceptance at a known tree;
# 3. export: format=eagle3, then the restated vLLM and SGLang loaders on real features (max |logit diff|).
# Run it alone: every figure here is a latency.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${MEDUSA_BIN:-.venv/bin}
RUN=${EAGLE3_RUN:-runs/eagle3_smollm2}
STAGES=${STAGES:-"train eval export"}
B=${BENCH_OUT:-runs/bench_eagle3}
mkdir -p "$B"
. scripts/bench_stages.sh   # has <stage>, timed <label> <command...>

# The section's figures are the 3-step drafter (the recipe's defaults until it went one step deep for CPU decoding);
# SETTINGS="" trains the recipe as it is now.
read -r -a settings <<< "${SETTINGS-heads.ttt_steps=3 trainer.max_steps=300 data.max_conversations=1000 data.max_length=1024 features.cache_dir=runs/features_smollm2_1k_aux}"
if has train && [[ ! -f "$RUN/heads/config.json" ]]; then
  timed "eagle3_smollm2 (cache + training)" "$BIN/medusa-train" eagle3_smollm2 output_dir="$RUN" "${settings[@]}" \
      trainer.progress_bar=false logger.wandb=disabled
fi

if has eval; then
  common=(heads="$RUN/heads" max_new_tokens=96 progress_bar=false)
  timed "eval mtbench auto" "$BIN/medusa-eval" "${common[@]}" num_prompts=20 eagle_tree=auto \
      methods=[eagle3,autoregressive,hf_generate] out="$B/mtbench_auto"
  timed "eval code auto" "$BIN/medusa-eval" "${common[@]}" prompts=code num_prompts=20 eagle_tree=auto \
      methods=[eagle3,autoregressive] out="$B/code_auto"
  timed "eval mtbench fixed n8-d4-k4" "$BIN/medusa-eval" "${common[@]}" num_prompts=20 eagle_tree=fixed eagle_nodes=8 \
      eagle_depth=4 eagle_topk=4 methods=[eagle3,autoregressive] out="$B/mtbench_n8d4k4"
fi

if has export; then
  rm -rf "$RUN/eagle3"
  "$BIN/python" scripts/check_eagle3_export.py "$RUN/heads" "$RUN/eagle3" | tee "$B/export_check.json"
fi
