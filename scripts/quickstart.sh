#!/usr/bin/env bash
# The main job on the embedded default, from a fresh clone:
#   install -> train Medusa-1 heads on SmolLM2-135M-Instruct + ShareGPT (~20 min on 2 CPU cores)
#   -> per-head accuracy printed, heads exported to runs/medusa1_smollm2/heads/.
# Extra arguments are Hydra overrides, e.g.  bash scripts/quickstart.sh trainer.max_steps=20
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
[ "${MEDUSA_VENV:-.venv}" = "none" ] || . "${MEDUSA_VENV:-.venv}/bin/activate"
medusa-train medusa1_smollm2 "$@"
