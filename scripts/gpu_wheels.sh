#!/usr/bin/env bash
# Wheels the GPU machine lacks, into .whl/ (git-ignored), for scripts/gpu_check.sh to install there.
#
#   bash scripts/gpu_wheels.sh            # here, once, before the device call (needs pip + a registry)
#
# The lent GPU machine, H100 or H200 (one image; see /work/.library/device/KINDS.md), has Python 3.12, torch 2.11,
# transformers 5.17, peft, pyarrow, pandas, xxhash, fsspec, huggingface-hub, psutil, ninja,
# py-cpuinfo, msgpack, einops, nvidia-ml-py, pyyaml, tqdm, but not DeepSpeed, Hydra, OmegaConf,
# pydantic or datasets, and it reaches no registry. What the check needs:
#   deepspeed (+ hjson, pydantic, pydantic-core, annotated-types, typing-inspection,
#   typing-extensions): the training step;
#   hydra-core, omegaconf, antlr4-python3-runtime: composing the recipe;
#   datasets (+ dill, multiprocess): the trainer's conversation stream.
# Not carried: wandb (~20 MB of platform binaries; the check runs logger.wandb=disabled) and peft
# (on the machine already; only lora.enabled needs it).
# Versions are the ones this repository's venv tests with. deepspeed and antlr4 ship only
# source archives: they are built here into pure-Python wheels (py3-none-any).
# Prints the total size: the working tree plus .whl/ must stay under the device's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
dest=.whl
mkdir -p "$dest"
# Binary-or-pure wheels for the machine's CPython 3.12 on x86-64 Linux.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" \
  hydra-core==1.3.8 omegaconf==2.3.1 hjson==3.1.0 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# Source-only packages, built into pure-Python wheels (deepspeed builds no ops: DS_BUILD_OPS=0).
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" \
  deepspeed==0.19.8 antlr4-python3-runtime==4.9.3
ls -l "$dest"
whl=$(du -sb "$dest" | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "wheels: $((whl / 1024)) KiB; tracked tree: $((tree / 1024)) KiB; together $(((whl + tree) / 1048576)) MiB of 64 MiB"
[ $((whl + tree)) -lt $((60 * 1048576)) ] || { echo "too large to carry (keep under ~60 MiB)" >&2; exit 1; }
