"""Tokens per step of ``eagle3`` and ``eagle3_lookup`` settings on the same prompts, and what each verifies
per step (BENCHMARKS.md "EAGLE-3 plus prompt lookup").

    .venv/bin/python scripts/scan_eagle3_lookup.py runs/eagle3_smollm2/heads PROMPTS MAX_NEW_TOKENS SETTING...

PROMPTS: N (MT-Bench first turns 1..N) or A-B (turns A..B: e.g. 21-40 to choose a setting on prompts
that an evaluation of the first 20 does not use).

A SETTING is an eagle3 tree ``nN-dD-kK``, optionally with a probability floor ``-pP`` (eagle_min_prob) and
a lookup branch ``+tT-mM`` (at most T looked-up tokens, suffixes of at most 3 and at least M tokens):
``n1-d1-k1``, ``n1-d1-k1+t3-m2``, ``n4-d1-k4-p0.1+t6-m2``.
Greedy decoding is deterministic, so tau and the rows per step need one run each; speed is not measured
here (``medusa-eval`` does that, methods interleaved). Every output is checked against plain greedy
decoding. Printed per setting: tau, the fraction of steps that grafted a looked-up chain, the mean
rows verified per step (root + drafted nodes + grafted nodes), and the tokens per step of the steps
that grafted against those that did not.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.evaluation.prompts import load_prompts  # noqa: E402
from inference.loading import load_medusa  # noqa: E402
from inference.methods import generate  # noqa: E402
from inference.methods.eagle3 import Eagle3Decoder, Eagle3Options  # noqa: E402
from inference.methods.eagle3_lookup import Eagle3LookupDecoder, Eagle3LookupOptions  # noqa: E402
from inference.runtime.decode import TokenStream, run_decoder  # noqa: E402

SETTING = re.compile(r"^n(\d+)-d(\d+)-k(\d+)(?:-p(0?\.\d+))?(?:\+t(\d+)-m(\d+))?$")


def parse(setting: str) -> dict:
    match = SETTING.match(setting)
    if not match:
        raise SystemExit(f"bad setting {setting!r}: expected nN-dD-kK[-pP][+tT-mM]")
    n, d, k, p, t, mn = match.groups()
    out = dict(nodes=int(n), depth=int(d), topk=int(k), min_prob=float(p or 0))
    if t is not None:
        out.update(num_tokens=int(t), min_ngram=int(mn), max_ngram=max(3, int(mn)))
    return out


def setting_run(m, ids: list[int], opts: dict, max_new_tokens: int):
    """(generation output, rows verified in each step, whether each step grafted a looked-up chain) of one
    prompt decoded by ``eagle3_lookup`` (``eagle3`` for a setting without a branch): each step verifies the
    root, the drafted nodes kept (all N, or those above the floor) and the looked-up chain it grafted."""
    if "num_tokens" in opts:
        dec = Eagle3LookupDecoder(m, Eagle3LookupOptions(**opts))
    else:
        dec = Eagle3Decoder(m, Eagle3Options(**opts))
    rows: list[int] = []
    grafts: list[bool] = []
    tree = dec.tree

    def recorded():                              # each step's tree, as verified
        before = getattr(dec, "grafted_nodes", 0)
        out = tree()
        rows.append(out[0].numel())
        grafts.append(getattr(dec, "grafted_nodes", 0) > before)
        return out

    dec.tree = recorded
    stream = TokenStream(run_decoder(dec, m, ids, max_new_tokens, None, None))
    for _ in stream:
        pass
    return stream.result, rows, grafts


def decode(m, ids: list[int], opts: dict, max_new_tokens: int):
    """(tokens, per-step accepted lengths, per-step grafted flag, rows verified in all) of one prompt."""
    out, rows, grafts = setting_run(m, ids, opts, max_new_tokens)
    return out.tokens, out.accept_lengths, grafts, sum(rows)


def prompt_range(text: str) -> tuple[int, int]:
    """``N`` -> (1, N); ``A-B`` -> (A, B): MT-Bench first turns, 1-based, inclusive."""
    first, _, last = text.partition("-")
    return (int(first), int(last)) if last else (1, int(first))


def main(heads_dir: str, prompts_arg: str, max_new_tokens: int, settings: list[str]) -> None:
    first, last = prompt_range(prompts_arg)
    torch.manual_seed(0)
    m = load_medusa(heads_dir)
    prompts = [m.encode_chat(p.turns[0]) for p in load_prompts("embedded:mtbench", last)[first - 1:]]
    plain = [generate(m, ids, "autoregressive", max_new_tokens=max_new_tokens).tokens for ids in prompts]
    print(f"{heads_dir}: MT-Bench first turns {first}-{last}, {max_new_tokens} tokens, greedy")
    print("| setting | tau | = greedy | steps grafting | rows per step | tau, grafting steps / others |")
    print("|---|---|---|---|---|---|")
    for setting in settings:
        opts = parse(setting)
        lengths, flags, rows, same = [], [], 0, 0
        for ids, ref in zip(prompts, plain):
            tokens, acc, grafted, r = decode(m, ids, opts, max_new_tokens)
            same += tokens == ref
            lengths += acc
            flags += grafted
            rows += r
        on = [a for a, g in zip(lengths, flags) if g]
        off = [a for a, g in zip(lengths, flags) if not g]
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")   # noqa: E731
        print(f"| {setting} | {mean(lengths):.3f} | {same}/{len(prompts)} | {len(on) / len(lengths):.2f} | "
              f"{rows / len(lengths):.2f} | {mean(on):.2f} / {mean(off):.2f} |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 5:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
