"""Could a datastore of the backbone's own outputs draft better than its context (retrieval drafting)?

    .venv/bin/python scripts/corpus_ngram_precision.py runs/eagle3_smollm2/heads runs/distill_greedy_short \
        [num_prompts] [max_new_tokens]

The datastore: every n-gram (n = 2, 3, 4) of a self-distillation run's responses (the backbone's greedy
continuations of ShareGPT prompts, ``medusa-distill``'s JSONL shards) -> counts of the token after it.
The test: the backbone's greedy continuations of MT-Bench first turns 1..num_prompts. At every generated
position the datastore proposes its most frequent next token for the last n tokens when that token has at
least ``share`` of the n-gram's count and the n-gram at least ``min count`` occurrences. Printed per
(n, share, min count): the fraction of positions with a proposal, its precision (the proposal is the
greedy token), and hits per position. A drafter's depth-1 top-1 accuracy is the figure to beat
(BENCHMARKS.md). Nothing is timed.
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.evaluation.prompts import load_prompts  # noqa: E402
from inference.loading import load_medusa  # noqa: E402
from inference.methods import generate  # noqa: E402

SIZES = (2, 3, 4)


def datastore(m, distill_dir: Path) -> dict[int, dict[tuple, Counter]]:
    tables = {n: defaultdict(Counter) for n in SIZES}
    shards = sorted((distill_dir / "data").glob("*.jsonl"))
    if not shards:
        raise SystemExit(f"{distill_dir}/data has no JSONL shards (a medusa-distill output directory)")
    count = 0
    for shard in shards:
        for line in shard.open():
            messages = json.loads(line)["messages"]
            prompt = m.encode_chat(messages[0]["content"])
            response = m.tokenizer(messages[1]["content"], add_special_tokens=False)["input_ids"]
            seq = prompt[-max(SIZES):] + response       # the response's first n-grams reach into the template
            count += len(response)
            for n in SIZES:
                for i in range(n, len(seq)):
                    tables[n][tuple(seq[i - n:i])][seq[i]] += 1
    print(f"datastore: {count} response tokens from {len(shards)} shards")
    return tables


def main(heads_dir: str, distill_dir: str, num_prompts: int, max_new_tokens: int) -> None:
    m = load_medusa(heads_dir)        # any heads of the backbone: only its tokenizer and greedy outputs are used
    tables = datastore(m, Path(distill_dir))
    tests = []
    for p in load_prompts("embedded:mtbench", num_prompts):
        ids = m.encode_chat(p.turns[0])
        tests.append((len(ids), ids + generate(m, ids, "autoregressive", max_new_tokens=max_new_tokens).tokens))
    print(f"test: MT-Bench first turns 1-{num_prompts}, {max_new_tokens} greedy tokens each")
    print("| n | share >= | min count | positions proposed | precision | hits per position |")
    print("|---|---|---|---|---|---|")
    for n in SIZES:
        for share in (0.0, 0.5, 0.7, 0.9):
            for min_count in (1, 3):
                proposed = hits = total = 0
                for start, seq in tests:
                    for i in range(start, len(seq)):
                        total += 1
                        counts = tables[n].get(tuple(seq[i - n:i]))
                        if not counts:
                            continue
                        tok, k = counts.most_common(1)[0]
                        seen = sum(counts.values())
                        if k / seen < share or seen < min_count:
                            continue
                        proposed += 1
                        hits += tok == seq[i]
                print(f"| {n} | {share} | {min_count} | {proposed / total:.3f} | {hits / max(proposed, 1):.3f} | "
                      f"{hits / total:.3f} |")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 20,
         int(sys.argv[4]) if len(sys.argv) > 4 else 96)
