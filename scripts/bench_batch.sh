#!/usr/bin/env bash
# Batched decoding on the embedded default: BENCHMARKS.md "Batched decoding".
#
#   bash scripts/bench_batch.sh                    # both stages; ~45 min on 2 CPU cores
#   STAGES=eval bash scripts/bench_batch.sh
#
# Needs the quickstart's heads (runs/medusa1_smollm2/heads: bash scripts/quickstart.sh) and the best
# heads (runs/hydra_smollm2_greedy/heads: medusa-train hydra_smollm2_greedy).
# 1. ragged: the two batch KV layouts (per-row compaction vs masked gaps) at B = 4 and 16, Hydra heads;
# 2. eval: medusa-eval batch_size=[1,2,4,8,16,32] on 32 MT-Bench first turns (8 more calibrate), for each
#    head set: medusa with the tree chosen per batch size (tree=auto), the plain batched loop and
#    transformers' batched generate, interleaved batch by batch; report.json + throughput_vs_batch.png;
# 3. rounds: B = 16 and 32 again for the best heads, each batch decoded 3 times per method (one or two
#    batches per size are few to average over): the ratio at the sizes where speculation is off.
# 4. chains: the draft model (self:8, k <= 3) and prompt lookup (<= 10 tokens) with their chain length
#    chosen per batch size (batch_chains=auto) on 32 MT-Bench first turns, then with the set length at
#    every B (batch_chains=fixed, B = 1, 16) for the before/after, and prompt lookup on the code prompts
#    (where it proposes more often).
# 5. eagle3: the EAGLE-3 drafter (runs/eagle3_smollm2/heads: medusa-train eagle3_smollm2) batched, its
#    (nodes, depth, top-k) chosen per batch size (eagle_tree=auto), against the same baselines.
# 6. eagle3_lookup: the same drafter with each row's looked-up branch, beside eagle3, both at the set
#    one-draft tree (eagle_tree=fixed, n1-d1-k1, the setting eagle3's sizing picks at batch 1) at B = 1, 2, 4.
# Run it alone: every figure here is a latency.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${MEDUSA_BIN:-.venv/bin}
STAGES=${STAGES:-"ragged eval rounds chains eagle3 eagle3_lookup"}
B=${BENCH_OUT:-runs/bench_batch}
QUICK=${QUICK_HEADS:-runs/medusa1_smollm2/heads}
BEST=${BEST_HEADS:-runs/hydra_smollm2_greedy/heads}
EAGLE3=${EAGLE3_HEADS:-runs/eagle3_smollm2/heads}
mkdir -p "$B"
. scripts/bench_stages.sh   # has <stage>, timed <label> <command...>

if has ragged; then
  timed "ragged layouts" "$BIN/python" scripts/bench_ragged.py "$BEST" --batch 4 16 --tree chain2 tree4 \
      --rounds 3 | tee "$B/ragged.md"
fi

if has eval; then
  for heads in "$BEST" "$QUICK"; do
    name=$(basename "$(dirname "$heads")")
    timed "eval $name" "$BIN/medusa-eval" heads="$heads" batch_size=[1,2,4,8,16,32] num_prompts=32 \
        max_new_tokens=96 progress_bar=false out="$B/$name"
  done
fi

if has rounds; then
  timed "eval rounds" "$BIN/medusa-eval" heads="$BEST" batch_size=[16,32] batch_rounds=3 num_prompts=32 \
      max_new_tokens=96 progress_bar=false out="$B/rounds_$(basename "$(dirname "$BEST")")"
fi

if has chains; then
  chains=(methods=[draft,prompt_lookup] draft=self:8 draft_k=3 max_new_tokens=96 progress_bar=false)
  timed "eval chains auto" "$BIN/medusa-eval" "${chains[@]}" batch_size=[1,2,4,8,16,32] num_prompts=32 \
      out="$B/chains_auto"
  timed "eval chains fixed" "$BIN/medusa-eval" "${chains[@]}" batch_size=[1,16] num_prompts=32 batch_chains=fixed \
      out="$B/chains_fixed"
  timed "eval lookup code" "$BIN/medusa-eval" methods=[prompt_lookup] prompts=code batch_size=[1,4,16] \
      num_prompts=12 max_new_tokens=96 progress_bar=false out="$B/chains_code"
fi

if has eagle3; then
  timed "eval eagle3" "$BIN/medusa-eval" heads="$EAGLE3" methods=[eagle3] batch_size=[1,2,4,8,16,32] num_prompts=32 \
      max_new_tokens=96 progress_bar=false out="$B/eagle3_smollm2"
fi

if has eagle3_lookup; then
  timed "eval eagle3_lookup" "$BIN/medusa-eval" heads="$EAGLE3" methods=[eagle3,eagle3_lookup] batch_size=[1,2,4] \
      num_prompts=16 max_new_tokens=96 eagle_tree=fixed eagle_nodes=1 eagle_depth=1 eagle_topk=1 progress_bar=false \
      out="$B/eagle3_lookup_smollm2"
fi
