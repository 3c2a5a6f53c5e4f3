#!/usr/bin/env bash
# Installs everything, then runs the tests: the unit tier (tiny random backbones, no
# network), then the integration tier (the real embedded SmolLM2 + ShareGPT). The GPU tier
# runs only where CUDA is available. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
[ "${MEDUSA_VENV:-.venv}" = "none" ] || . "${MEDUSA_VENV:-.venv}/bin/activate"
export WANDB_MODE=disabled
# tier NAME [pytest args]: runs one tier and prints its wall time at its end, so every CI log records it.
# pytest exits 5 when a tier selects no tests; that is not a failure.
tier() {
  local name=$1 start=$SECONDS rc=0
  shift
  python -m pytest -q "$@" || rc=$?
  echo "[test] $name tier took $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || exit "$rc"
}
echo "[test] unit tier"
tier unit "$@"
if [ "${MEDUSA_SKIP_INTEGRATION:-0}" != "1" ]; then
  echo "[test] integration tier (embedded SmolLM2 + ShareGPT)"
  tier integration -m integration "$@"
fi
if python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "[test] gpu tier"
  tier gpu -m gpu "$@"
fi
