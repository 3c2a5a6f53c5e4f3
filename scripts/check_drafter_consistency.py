"""Where an EAGLE-3 drafter's acceptance goes between training and decoding: the drafter's depth-1
accuracy teacher-forced on the backbone's own greedy replies to MT-Bench prompts, against the
acceptance that decoding measures on the same replies (BENCHMARKS.md "Where depth-1 acceptance goes").

    .venv/bin/python scripts/check_drafter_consistency.py runs/eagle3_smollm2/heads [num_prompts] [max_new_tokens] [replies.json]

For each prompt: the runtime's plain greedy loop writes the reply; one backbone forward over prompt +
reply (tapping the drafter's aux layers) and one drafter pass over every position give the drafter's
guess of x_{t+2} from (fc(aux_t), x_{t+1}), as decoding computes it at a step whose root is x_{t+1}.
Printed:
  - teacher-forced top-1 / top-3 over every reply position (a guess of the 2nd reply token onwards);
  - the same split by where the guess sits: right after the prompt, after a position the guess got right;
  - a replay of decoding with the two-row tree (n1-d1-k1) over those guesses (a draft accepted when it
    equals the reply's next token, then the step advances by 2, else by 1): its tau must equal what
    ``medusa-eval eagle_nodes=1 eagle_depth=1 eagle_topk=1`` measures on the same prompts, because the
    drafter's KV cache after each step equals one pass over the true prefix (tests/test_eagle3_decoding.py),
    so a difference names a defect in decoding's bookkeeping;
  - the draft vocabulary's coverage of the reply tokens (a token outside it can never be drafted).
With a fourth argument the prompts' and replies' token ids are written there as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.backbone import HiddenStateTap  # noqa: E402
from inference.evaluation.prompts import load_prompts  # noqa: E402
from inference.loading import load_medusa  # noqa: E402
from inference.methods import generate  # noqa: E402


@torch.inference_mode()
def drafter_guesses(m, ids: torch.Tensor) -> torch.Tensor:
    """[L, 3] the drafter's top-3 target-vocabulary guesses of x_{t+2} at every position t (last two: none)."""
    d = m.heads
    n = ids.numel()
    with HiddenStateTap(m.model, d.spec.aux_layers) as tap:
        m.body(input_ids=ids[None], position_ids=torch.arange(n)[None], use_cache=False)
    aux = tap.features()[0]
    nxt = torch.cat([ids[1:], ids.new_tensor([0])])
    normed, _, _ = d.forward_step(nxt[None], d.combine(aux)[None], torch.arange(n)[None])
    return d.to_vocab_ids(d.project(normed[0]).topk(3, -1).indices)


def main(heads_dir: str, num_prompts: int = 20, max_new_tokens: int = 96, replies_out: str = "") -> dict:
    torch.manual_seed(0)
    m = load_medusa(heads_dir)
    d = m.heads
    in_vocab = None if d.token_map is None else set(d.token_map.tolist())
    hits = hits3 = total = first_hits = first_total = after_hit = after_hit_total = 0
    covered = 0
    steps = tokens = 0
    dumped = []
    for p in load_prompts("embedded:mtbench", num_prompts):
        prompt = torch.tensor([m.encode_chat(p.turns[0])])
        reply = generate(m, prompt[0].tolist(), "autoregressive", max_new_tokens=max_new_tokens).tokens
        ids = torch.cat([prompt[0], torch.tensor(reply)])
        dumped.append({"id": p.id, "prompt": prompt[0].tolist(), "reply": reply})
        n, length = prompt.shape[1], ids.numel()
        guess = drafter_guesses(m, ids)
        prev_right = False
        for t in range(n - 1, length - 2):           # guess of x_{t+2}, a reply token from the 2nd on
            target = int(ids[t + 2])
            right = int(guess[t, 0]) == target
            hits += right
            hits3 += target in guess[t].tolist()
            total += 1
            covered += in_vocab is None or target in in_vocab
            if t == n - 1:
                first_hits, first_total = first_hits + right, first_total + 1
            elif prev_right:
                after_hit, after_hit_total = after_hit + right, after_hit_total + 1
            prev_right = right
        # replay of two-row decoding: the first reply token comes from prefill; each step's root is x_j
        j = n
        while j < length - 1:                        # a step whose root x_j has a next reply token
            ok = int(guess[j - 1, 0]) == int(ids[j + 1])
            advance = 2 if ok and j + 1 < length - 1 else 1
            steps += 1
            tokens += advance
            j += advance
    result = {
        "heads": heads_dir, "prompts": num_prompts, "max_new_tokens": max_new_tokens, "guesses": total,
        "teacher_forced_top1": hits / total, "teacher_forced_top3": hits3 / total,
        "first_guess_after_prompt_top1": first_hits / max(first_total, 1),
        "top1_after_a_right_guess": after_hit / max(after_hit_total, 1),
        "draft_vocab_coverage": covered / total,
        "replayed_two_row_tau": tokens / max(steps, 1),
    }
    print(json.dumps(result, indent=1))
    if replies_out:
        Path(replies_out).write_text(json.dumps(dumped))
    return result


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        raise SystemExit(__doc__)
    main(args[0], *(int(a) for a in args[1:3]), *args[3:4])
