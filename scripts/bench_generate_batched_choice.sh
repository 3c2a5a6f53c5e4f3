#!/usr/bin/env bash
# medusa-generate's batches with a batched evaluation's choice file (its setting per batch size) against the
# same command without it (every batch speculating as one prompt would), alternating A B A B.
#   bash scripts/bench_generate_batched_choice.sh <heads> <choice file> <prompts.jsonl> [batch size] [rounds]
# The per-batch lines medusa-generate prints on stderr give tokens and seconds; the figure is their sums.
set -euo pipefail
cd "$(dirname "$0")/.."
heads=${1:?heads directory}; choice=${2:?eagle3_lookup_tree.json or tree_schedule.json}; prompts=${3:?prompts.jsonl}
batch=${4:-4}; rounds=${5:-2}
[ "${MEDUSA_VENV:-.venv}" = "none" ] || . "${MEDUSA_VENV:-.venv}/bin/activate"
key=eagle_tree; case "$choice" in *tree_schedule.json) key=tree;; esac
out=$(mktemp -d)
for round in $(seq "$rounds"); do
  for arm in file none; do
    extra=(); [ "$arm" = file ] && extra=("$key=$choice")
    medusa-generate "heads=$heads" "prompts_file=$prompts" "batch_size=$batch" max_new_tokens=96 "${extra[@]}" \
      > "$out/$arm-$round.out" 2> "$out/$arm-$round.err"
    python - "$out/$arm-$round.err" "$arm" "$round" <<'PY'
import re, sys
path, arm, rnd = sys.argv[1:]
rows = re.findall(r"batch of (\d+): (\d+) tokens in ([\d.]+) s, [\d.]+ tokens/s, tau ([\d.]+)", open(path).read())
tokens, secs = sum(int(r[1]) for r in rows), sum(float(r[2]) for r in rows)
print(f"round {rnd} {'with the file' if arm == 'file' else 'without'}: {tokens} tokens in {secs:.2f} s = "
      f"{tokens / secs:.2f} tokens/s; tau per batch {[r[3] for r in rows]}")
PY
  done
done
