#!/usr/bin/env bash
# The prepared GPU check: one command, on the lent GPU machine (H100 or H200), < 8 minutes, everything in one folder.
#
#   1. the gpu test tier (pytest -m gpu: tree verification vs sequential decoding in bf16/fp16,
#      greedy identity in fp32, KV cache + compaction on CUDA, DeepSpeed heads steps: ZeRO 0 fp32, ZeRO 1 and 2 bf16;
#      static-shape steps captured as CUDA graphs: tests/runtime/test_static_steps_gpu.py); 4 minutes at most;
#   2. benchmarks/gpu_check.py, in the order of what is wanted most, each part as the time left allows: first
#      CUDA graphs (benchmarks/gpu_graphs.py; issue 45's verdicts) at SmolLM2-135M's and Llama-3.1-8B's shapes
#      (8B: 16 GB of random bf16 weights made on the GPU), both shapes' verdict parts first (~6 minutes at their
#      generous estimates, most of it transformers' compile for hf_generate_static): step wall vs kernel time graphs
#      off / on beside the same steps' CUDA-event time, the plain loop off / on vs generate eager and
#      hf_generate_static, 1/16/64-row verification, the weight-read floor, Medusa and EAGLE-3 steps, a stub drafter
#      of set acceptance (tau 1.5 / 2 / 3) end to end; then the other graph parts (grouped-query attention, batched
#      loops, CUDAGraph vs torch.compile reduce-overhead); then, on a SmolLM2-135M-shaped random Llama in bf16,
#      what an H200 measured before: verification step for 1..64 tree nodes, plain loop vs transformers' generate,
#      what choice=auto would choose, batched steps, an EAGLE-3 step of eagle3_smollm2's shape vs a plain step;
#      last the training step's tokens/s vs the backbone forward (real trainer, DeepSpeed ZeRO 1, bf16;
#      benchmarks/gpu_training.py), Medusa heads and EAGLE-3, at the SmolLM2 shape, then at the 8B shape (~100 s);
#   3. summary.md (Markdown for BENCHMARKS.md's GPU section, with every verdict) and gpu_check.json.
# Time: the tier and gpu_check.py together stay under 8 minutes: gpu_check.py gets what the tier left of
# $GPU_CHECK_BUDGET_S (default 470 s from the script's start; at least 200 s), and is told so (--budget-s):
# parts that could not end in time are skipped, a part still running at its own deadline is stopped there (both
# listed in the summary, with the second call that runs them), so the summary is written.
# Exit status: gpu_check.py's (0 once the summary is written: the verdicts are in it). Where this script's outer
# `timeout` fired all the same (124, or 137 after -k) and summary.md exists, the run stopped itself at its
# budget: it prints "stopped by its own budget; summary written" and exits 0, not timeout's code, which the device
# tool reads as "ran past its limit". 1: no summary.md.
#
# First, here (a machine with pip and a registry), once:
#     bash scripts/gpu_wheels.sh        # DeepSpeed, Hydra, datasets... into .whl/ (~6 MiB, git-ignored)
# Then the device call (the `run` tool of the device machine; .whl travels because carry names it):
#     run(command="bash scripts/gpu_check.sh --out $OUT", carry=[".whl"], timeout_s=540)
# The reply's output_tail ends with the summary; $OUT holds summary.md, gpu_check.json,
# gpu_tier.xml, gpu_tier.log and check.log (5 files, well under the 8-file limit).
#
# Here, on CPU, the same paths on a tiny model in a minute or two, the gpu tier included (on the CPU;
# what tests/house/test_gpu_check.py runs):
#     bash scripts/gpu_check.sh --dry-run [--out DIR]      # or GPU_CHECK_DRY_RUN=1
#
# Options: --out DIR (default runs/gpu_check, or $OUT when set), --dry-run, --no-tier (skip pytest),
# --full-shape (with --dry-run: the SmolLM2-135M shape at the dry run's sizes, ~30 s more); after `--`, arguments
# for benchmarks/gpu_check.py, e.g. the training at both shapes alone (~4 minutes, a second call's worth):
#     run(command="bash scripts/gpu_check.sh --out $OUT --no-tier -- --skip steps batch plain eagle3 graphs", ...)
# (`--skip graphs.<part>` leaves one CUDA-graph part out at both shapes; summary.md names each second call.)
# Python: $PYTHON, else python3. If .whl/ holds wheels and DeepSpeed is not importable, they are
# installed into /tmp/gpu_check_site (no index, no deps) and put on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-runs/gpu_check}
dry=${GPU_CHECK_DRY_RUN:-0}
tier=1
full=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2;;
    --out=*) out="${1#--out=}"; shift;;
    --dry-run) dry=1; shift;;
    --no-tier) tier=0; shift;;
    --full-shape) full=1; shift;;
    --) shift; break;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2;;
  esac
done
PY=${PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled WANDB_SILENT=true TOKENIZERS_PARALLELISM=false \
  HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 GPU_CHECK_DRY_RUN=$dry
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import deepspeed, hydra, datasets" >/dev/null 2>&1; then
  site=/tmp/gpu_check_site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || { echo "gpu_check.sh: installing .whl/ failed" >&2; exit 1; }
  # PYTHONPATH precedes site-packages, so a carried wheel shadows the image's copy of the same package; of
  # those carried, only typing-extensions is also in the image (the carried 4.16.0 keeps older APIs).
  export PYTHONPATH="$PYTHONPATH:$site"
fi
{
  echo "== gpu_check $(date -u +%FT%TZ) dry_run=$dry"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  "$PY" -c "import torch, transformers as t; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
'transformers', t.__version__)"
  "$PY" -c "import deepspeed, hydra, omegaconf, datasets as d; print('deepspeed', deepspeed.__version__,
'hydra', hydra.__version__, 'datasets', d.__version__)" 2>&1 | tail -1
} 2>&1 | tee "$out/check.log"
xml_arg=()
if [ "$tier" = 1 ]; then
  # The gpu tier: every test marked gpu. 4 minutes at most. The dry run runs it on the CPU
  # (GPU_TIER_DEVICE=cpu, ~15 s) so that the tier's own code is known to work before a GPU is lent.
  [ "$dry" = 1 ] && export GPU_TIER_DEVICE=cpu
  timeout -k 15 240 "$PY" -m pytest -q -p no:cacheprovider -m gpu --junitxml="$out/gpu_tier.xml" \
    tests/runtime/test_runtime_gpu.py tests/runtime/test_static_steps_gpu.py tests/training/test_train_gpu.py \
    2>&1 | tee "$out/gpu_tier.log" | tail -15
  xml_arg=(--tier-xml "$out/gpu_tier.xml")
fi
dry_arg=()
[ "$dry" = 1 ] && dry_arg=(--dry-run)
[ "$full" = 1 ] && dry_arg+=(--full-shape)
left=$(( ${GPU_CHECK_BUDGET_S:-470} - SECONDS ))   # what the tier left of the budget, 200 s at least
[ "$left" -lt 200 ] && left=200
timeout -k 20 "$left" "$PY" -m benchmarks.gpu_check --out "$out" --budget-s $(( left - 20 )) "${dry_arg[@]}" \
  "${xml_arg[@]}" "$@" \
  2>&1 | tee -a "$out/check.log"
rc=${PIPESTATUS[0]}
[ -f "$out/summary.md" ] || { echo "gpu_check.sh: no summary written (rc $rc)" >&2; exit 1; }
# timeout's own codes (124: its deadline fired, 137: killed after -k) read as "ran past its limit" to the device
# tool, but the run stopped itself here and its summary is written: exit 0, as a finished run with its stops listed.
case "$rc" in
  124) echo "gpu_check.sh: stopped by its own budget; summary written"; exit 0;;
  137) echo "(killed at its own budget after the last part it finished: figures up to there)" >> "$out/summary.md"
       cat "$out/summary.md"
       echo "gpu_check.sh: stopped by its own budget; summary written (by the last finished part)"; exit 0;;
esac
exit "$rc"
