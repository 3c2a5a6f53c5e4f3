"""The GPU check's measurements (run by scripts/gpu_check.sh, which documents the device command).

    python -m benchmarks.gpu_check --out DIR [--dry-run [--full-shape]] [--tier-xml DIR/gpu_tier.xml]

First the CUDA graphs (4. below: issue 45's verdicts), then 1-3c, then 5, each as the time left allows.
On a SmolLM2-135M-shaped random Llama (exact configuration, random weights, no download), bf16:
  1. one verification step (``MedusaModel.hidden`` + ``logits`` under a tree mask) for 1..64 nodes,
     batch 1, trees grown from the head accuracies below, median of interleaved rounds;
  2. the runtime's plain loop vs transformers' greedy ``generate``, interleaved, random-token
     prompts, EOS disabled;
  3. what ``choice=auto`` would choose for Medusa trees there: expected tau of the grown tree over the measured step
     time, against plain decoding's rate;
  3b. batched verification: the step time of the runtime's batched decoder (``BatchTreeDecoder``) for
     1..16 nodes per row at batch 1..32, and the node count the per-batch rule would pick there
     (expected tau from the accuracies below over the measured step, or plain decoding);
  3c. EAGLE-3: a random drafter of ``eagle3_smollm2``'s shape (one decoder layer, draft vocabulary 8,192)
     on that backbone, one decoding step for the (nodes, depth, top-k) settings whose tau the recipe's
     drafter measured on MT-Bench on CPU (below), against plain decoding, interleaved rounds; what those
     taus would buy over the measured steps (the CPU reaches 1.24x at n1-d1-k1, each verified row
     costing ~7% of a step there);
  4. CUDA graphs (``graphs=``, benchmarks/gpu_graphs.py): at SmolLM2-135M's and Llama-3.1-8B's shapes, the
     1-token step's wall vs kernel time, the plain loop graphs off / on vs ``generate`` eager and
     ``hf_generate_static``, 1 / 16 / 64-row verification, the weight-read floor, Medusa and EAGLE-3 steps, a stub
     drafter of set acceptance end to end; ``--budget-s``: its parts that could not end in time are skipped;
     ``--skip graphs.<part>``: that part left out at both shapes (a second call's: the summary names it);
  5. the real trainer (DeepSpeed, ZeRO 1 — bf16 needs ZeRO >= 1 —, bf16), Medusa heads and then an EAGLE-3
     drafter: training step tokens/s against the backbone's forward (benchmarks/gpu_training.py), on the
     SmolLM2-shaped backbone, then at Llama-3.1-8B's shape when the time left allows it (its parts not run are
     listed: ``--skip ... graphs`` leaves it the time).
Then the verdicts against the targets, a Markdown summary (summary.md, also printed) and every
figure as JSON (gpu_check.json). ``--dry-run``: CPU, a tiny Llama, 1-2 node counts, a few tokens:
the same code paths in well under a minute; with ``--full-shape`` the SmolLM2-135M shape at those sizes.

Each section is guarded: a failure is recorded in the JSON (``errors``) and the summary, and the
sections after it still run. Both files are rewritten after every section, and the time limit's SIGTERM
(gpu_check.sh's ``timeout``) stops the run where it is and writes them once more: a run cut short keeps
every figure it had measured.

Time (``--budget-s``; not on the dry run, whose times mean nothing): every section is given an estimate of its
seconds (``SECTION_S``, ``gpu_graphs.PART_S``, ``gpu_training.PART_S``). It starts only if that estimate ends before
the budget's end (less ``RESERVE_S`` for the last write), and it is stopped at ``CAP`` times it, or at the budget's
end if sooner (``PartDeadline``, raised by a SIGALRM timer): one slow compile cannot eat the parts after it. A part
stopped there keeps what earlier parts wrote and is listed as "stopped at its deadline"; every part not run for time
is listed in the summary's "Time budget" lines with the second device call that runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository root's packages
from benchmarks import gpu_graphs, gpu_training  # noqa: E402
from benchmarks.gpu_models import EAGLE3_TAU, SMOLLM2_135M, TINY, backbone, eagle3_model  # noqa: E402
from benchmarks.timing import median, plain_loop_vs_generate, sync, verification_step  # noqa: E402

from inference.runtime.batch_decode import BatchTreeDecoder  # noqa: E402
from inference.runtime.model import MedusaModel  # noqa: E402
from inference.runtime.tree import chain_tree, expected_tau, grow_tree  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# Per-depth, per-rank probability that the head's rank-r guess is the backbone's greedy token: the
# Hydra heads on greedy targets of benchmarks/history.md ("Hydra heads on greedy targets", hydra_smollm2_greedy,
# SmolLM2-135M-Instruct). Rank 0 = top-1 on the 8 MT-Bench calibration prompts that tree=auto (now choice=auto) measured
# (0.271 / 0.198 / 0.203); ranks 1-2 share that section's held-out top-3 minus top-1 (0.163 / 0.148 /
# 0.138) in a 0.6 geometric decay, as inference.runtime.tree.reference_accuracies splits ranks.
HEAD_ACCURACY = json.loads("""{
  "source": "benchmarks/history.md, Hydra heads on greedy targets (hydra_smollm2_greedy): top-1 from tree=auto's MT-Bench \
calibration, ranks 2-3 from held-out top-3",
  "per_rank": [[0.271, 0.102, 0.061],
               [0.198, 0.093, 0.055],
               [0.203, 0.086, 0.052]]
}""")

TARGET_TREE_STEP = 1.3    # a 16-node verification step costs < 1.3x a 1-token step (bf16)
TARGET_PLAIN_LOOP = 0.90  # the runtime's plain loop within 10% of generate, or faster

# Seconds the first sections are expected to take on the GPU at the SmolLM2 shape (never measured yet: generous).
SECTION_S = {"steps": 30, "batch": 40, "plain": 60, "eagle3": 30}
CAP = 1.5          # a part is stopped at CAP x its estimate
RESERVE_S = 10     # seconds of the budget kept after the last part's deadline: the summary's last write
REFIRE_S = 5.0     # a deadline fires again every REFIRE_S s until its part ends (an interrupt swallowed on the way)
TRAINING = ("train", "train_eagle3", "train_8b", "train_eagle3_8b")
FIRST = ("steps", "batch", "plain", "eagle3")


class PartDeadline(BaseException):
    """Raised in a part still running at its deadline (``Deadline``). Not an ``Exception``: no ``except Exception``
    on the way (a failed capture's fallback, a warm-up's guard) takes it for a failure of its own and goes on."""


class Deadline:
    """Raise ``PartDeadline`` in the main thread once ``seconds`` have passed inside the block, and again every
    ``REFIRE_S`` s until it ends (a capture whose end fails because of the interrupt raises its own error, which a
    fallback may catch: the next one stops the part). SIGALRM via setitimer: a part blocked inside one long C call
    stops when that call returns."""

    def __init__(self, seconds: float, name: str):
        self.seconds, self.name, self.armed, self.old = seconds, name, False, None

    def _fire(self, signum, frame):
        if self.armed:
            raise PartDeadline(f"{self.name} stopped at its deadline ({self.seconds:.0f} s)")

    def __enter__(self):
        if math.isfinite(self.seconds):
            self.old = signal.signal(signal.SIGALRM, self._fire)
            self.armed = True
            signal.setitimer(signal.ITIMER_REAL, max(self.seconds, 1e-3), REFIRE_S)
        return self

    def __exit__(self, *exc):
        while self.old is not None:
            try:                        # a signal before ``armed`` is cleared raises here: disarm again
                self.armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, self.old)
                self.old = None
            except PartDeadline:
                continue
        return False


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "host": platform.node(), "cores": os.cpu_count()}
    import transformers

    info["transformers"] = transformers.__version__
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gb=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
    return info


# -- 1. verification step vs node count ---------------------------------------------------------------------
def tree_steps(m: MedusaModel, nodes: list[int], rounds: int, per_round: int) -> dict:
    """Median seconds of one verification step per node count (tree grown from HEAD_ACCURACY with n-1
    nodes below the root, filled to exactly n where depth x ranks allow, else a chain)."""
    acc = HEAD_ACCURACY["per_rank"]
    trees = {}
    for n in nodes:
        t, _ = grow_tree(acc, n - 1, name=f"grown{n}", fill=True)
        trees[n] = t if t.num_nodes == n else chain_tree(n)
    step = verification_step(m, list(range(7, 7 + 64)), max_nodes=max(nodes))
    for n in nodes:  # warm-up: kernels chosen, masks built
        step(n, trees[n]), step(n, trees[n])
    times: dict[int, list[float]] = {n: [] for n in nodes}
    for _ in range(rounds):  # interleaved: every count sees the same machine state
        for n in nodes:
            for _ in range(per_round):
                times[n].append(step(n, trees[n]))
    base = median(times[nodes[0]])
    out = {}
    for n in nodes:
        med = median(times[n])
        out[n] = {"ms": round(med * 1e3, 3), "vs_1": round(med / base, 3), "depth": trees[n].max_depth,
                  "tree": trees[n].choices, "samples": len(times[n]),
                  "expected_tau": round(expected_tau(trees[n], acc), 4) if trees[n].max_depth <= len(acc) else None}
    return out


# -- 2b. greedy identity with generate on the same attention kernels -------------------------------------------
def same_kernel_identity(m: MedusaModel, prompts: list, runtime_tokens: list, tokens: int) -> int:
    """How many prompts' greedy outputs of the plain loop (``runtime_tokens``, from ``plain_loop_vs_generate``)
    equal ``generate``'s when ``generate`` too runs without
    cuDNN SDPA (as decoding does: inference/attention_backends.py). With stock backends the two run different
    bf16 attention kernels, and a random-weight model's near-tied logits make rounding flip the argmax; this
    count separates that from a real difference."""
    from inference.attention_backends import decoding_sdpa
    from inference.methods import generate

    same = 0
    for ids, ours in zip(prompts, runtime_tokens):
        with decoding_sdpa(m.device):
            theirs = generate(m, list(ids), "hf_generate", max_new_tokens=tokens).tokens
        same += ours == theirs
    return same


# -- 3. what choice=auto would choose -----------------------------------------------------------------------------
def auto_choice(steps: dict) -> dict:
    """methods/medusa_choice.py's rule on the measured step times: the tree maximising expected tau / step time,
    or none when no tree beats plain decoding (1 token per 1-node step)."""
    plain = steps[min(steps)]["ms"]
    rows = []
    for n, s in sorted(steps.items()):
        if n == 1 or s["expected_tau"] is None:
            continue
        rows.append({"nodes": n, "expected_tau": s["expected_tau"], "step_ms": s["ms"],
                     "expected_tokens_per_s": round(1e3 * s["expected_tau"] / s["ms"], 2)})
    plain_rate = round(1e3 / plain, 2)
    best = max(rows, key=lambda r: r["expected_tokens_per_s"], default=None)
    chosen = best if best and best["expected_tokens_per_s"] > plain_rate else None
    return {"plain_tokens_per_s": plain_rate, "candidates": rows, "chosen": chosen,
            "expected_speedup": round(chosen["expected_tokens_per_s"] / plain_rate, 3) if chosen else 1.0,
            "accuracies": HEAD_ACCURACY}


# -- 3b. batched verification -------------------------------------------------------------------------------------
class _RandomDrafter:
    """Proposes random tokens in a fixed tree: what a batched verification step costs, whatever the heads."""

    def __init__(self, tree, vocab: int, device):
        self.buf, self.vocab, self.device = tree.buffers(device), vocab, device
        self.max_nodes, self.max_depth = tree.num_nodes, tree.max_depth

    def draft(self, dec):
        cand = torch.randint(0, self.vocab, (dec.batch, self.buf.num_nodes - 1), device=self.device)
        return self.buf, cand, None

    def rows_kept(self, index):
        pass


def batch_steps(m: MedusaModel, batches: list[int], nodes: list[int], steps: int, prompt_len: int) -> dict:
    """Median ms of one batched decoding step per (batch size, nodes per row), one prefill per pair, and
    the per-batch rule's pick (expected tau / step time, plain decoding included)."""
    acc = HEAD_ACCURACY["per_rank"]
    g = torch.Generator().manual_seed(2)
    out = {}
    for b in batches:
        prompts = [torch.randint(0, m.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(b)]
        row = {}
        for n in nodes:
            t, _ = grow_tree(acc, n - 1, name=f"grown{n}", fill=True)
            tree = t if t.num_nodes == n else chain_tree(n)
            dec = BatchTreeDecoder(m, _RandomDrafter(tree, m.vocab_size, m.device))
            with torch.inference_mode():
                dec.prefill(prompts, (steps + 3) * (tree.max_depth + 1))
                times = []
                for i in range(steps + 2):
                    t0 = time.perf_counter()
                    with m.stepping():   # as run_batch steps (a LongRoPE backbone's per-position rule)
                        dec.step()
                    sync(m.device)
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
            tau = expected_tau(tree, acc) if tree.max_depth <= len(acc) else None
            row[n] = {"ms": round(median(times) * 1e3, 3), "expected_tau": round(tau, 4) if tau else None}
        base = row[nodes[0]]["ms"]
        for n in nodes:
            row[n]["vs_1"] = round(row[n]["ms"] / base, 3)
        rates = {n: (r["expected_tau"] or 0) / r["ms"] for n, r in row.items() if n == 1 or r["expected_tau"]}
        rates[1] = 1.0 / base
        out[b] = {"steps": row, "pick": max(rates, key=rates.get)}
    return out


# -- 3c. EAGLE-3 ---------------------------------------------------------------------------------------------------
def eagle3_steps(m: MedusaModel, shapes: list[tuple[int, int, int]], rounds: int, per_round: int,
                 prompt_len: int) -> dict:
    """Median ms of one eagle3 decoding step per (nodes, depth, topk) and of a plain step, timed in
    interleaved rounds on one random prompt; expected tokens/s from ``EAGLE3_TAU`` over those steps."""
    from inference.methods.eagle3_choice import eagle3_name, eagle3_step_times

    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, m.model.config.vocab_size, (prompt_len,), generator=g).tolist()
    names = [None, *shapes]
    times: dict = {s: [] for s in names}
    for _ in range(rounds):
        for s in names:
            times[s] += eagle3_step_times(m, prompt, s, steps=per_round, warmup=2)
    plain = median(times[None])
    rows = []
    for s in shapes:
        med = median(times[s])
        rows.append({"setting": eagle3_name(s), "ms": round(med * 1e3, 3), "vs_plain": round(med / plain, 3),
                     "cpu_tau": EAGLE3_TAU[s], "expected_speedup": round(EAGLE3_TAU[s] * plain / med, 3),
                     "samples": len(times[s])})
    return {"plain_ms": round(plain * 1e3, 3), "settings": rows, "draft_vocab": m.heads.spec.truncated_vocab_size}


# -- the gpu tier (pytest's JUnit XML, written by gpu_check.sh) -----------------------------------------------
def tier_result(xml: Path | None) -> dict:
    if xml is None or not xml.is_file():
        return {"ran": False}
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {"ran": True, **n, "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": failed}


def verdicts(result: dict) -> list[dict]:
    out = []
    tier = result.get("gpu_tier", {})
    if not tier.get("ran"):
        v = ("not run", "")
    elif tier["failures"] or tier["errors"]:
        v = ("FAIL", f"{tier['failures'] + tier['errors']} of {tier['tests']} failed: {', '.join(tier['failed'][:5])}")
    elif tier["passed"] == 0:
        v = ("skipped", f"all {tier['tests']} skipped (no CUDA)")
    elif result.get("dry_run"):  # the tier ran on the CPU (GPU_TIER_DEVICE=cpu): its code works, the GPU is unproven
        v = ("passed on CPU", f"{tier['passed']} passed, {tier['skipped']} skipped (dry run: GPU_TIER_DEVICE=cpu)")
    else:
        v = ("PASS", f"{tier['passed']} passed, {tier['skipped']} skipped")
    out.append({"target": "gpu test tier passes", "verdict": v[0], "detail": v[1]})
    steps = result.get("tree_steps")
    if steps:
        n = 16 if 16 in steps else max(steps)
        r = steps[n]["vs_1"]
        out.append({"target": f"16-node verification step < {TARGET_TREE_STEP}x a 1-token step (bf16)",
                    "verdict": ("PASS" if r < TARGET_TREE_STEP else "FAIL") + ("" if n == 16 else f" ({n} nodes only)"),
                    "detail": f"{n} nodes {steps[n]['ms']} ms vs 1 node {steps[min(steps)]['ms']} ms = {r:.2f}x"})
    else:
        out.append({"target": f"16-node verification step < {TARGET_TREE_STEP}x a 1-token step (bf16)",
                    "verdict": "not run", "detail": ""})
    pl = result.get("plain_loop_vs_generate")
    target = "runtime plain loop within 10% of generate, or faster"
    if pl:
        out.append({"target": target, "verdict": "PASS" if pl["ratio"] >= TARGET_PLAIN_LOOP else "FAIL",
                    "detail": f"{pl['ratio']:.2f}x ({pl['runtime_tokens_per_s']} vs {pl['hf_generate_tokens_per_s']} "
                              f"tokens/s, {pl['identical']}/{pl['prompts']} identical)"})
    else:
        out.append({"target": target, "verdict": "not run", "detail": ""})
    return out


def summary(result: dict) -> str:
    mc = result["machine"]
    dev = mc.get("gpu", "CPU (dry run)" if result["dry_run"] else "CPU")
    dry = f" (DRY RUN: {result['backbone']} on CPU at tiny sizes, numbers mean nothing)" if result["dry_run"] else ""
    lines = [f"## GPU check: {dev}{dry}",
             "", f"torch {mc['torch']} (CUDA {mc['cuda']}), transformers {mc['transformers']}, Python {mc['python']}; "
             f"backbone {result['backbone']}, {result['dtype']}", "", "| target | verdict | detail |", "|---|---|---|"]
    lines += [f"| {v['target']} | **{v['verdict']}** | {v['detail']} |" for v in result["verdicts"]]
    steps = result.get("tree_steps")
    if steps:
        lines += ["", "Verification step (batch 1, `hidden` + `logits` under a tree mask, median):", "",
                  "| nodes | " + " | ".join(str(n) for n in steps) + " |", "|---|" + "---|" * len(steps),
                  "| step (ms) | " + " | ".join(f"{s['ms']:.2f}" for s in steps.values()) + " |",
                  "| vs 1 node | " + " | ".join(f"{s['vs_1']:.2f}x" for s in steps.values()) + " |",
                  "| expected tau | " + " | ".join(f"{s['expected_tau']:.3f}" if s["expected_tau"] else "-"
                                                    for s in steps.values()) + " |"]
    auto = result.get("tree_auto")
    if auto:
        c = auto["chosen"]
        lines += ["", f"`choice=auto` with the quickstart-class heads' accuracies (head-1/2/3 top-1 "
                      f"{' / '.join(str(r[0]) for r in HEAD_ACCURACY['per_rank'])}; {HEAD_ACCURACY['source']}): "
                  + (f"**{c['nodes']} nodes**, expected tau {c['expected_tau']}, {c['expected_tokens_per_s']} vs "
                     f"{auto['plain_tokens_per_s']} tokens/s plain = **{auto['expected_speedup']:.2f}x**" if c else
                     f"**no tree** (none beats plain decoding at {auto['plain_tokens_per_s']} tokens/s)")]
    bs = result.get("batch_steps")
    if bs:
        nodes = list(next(iter(bs.values()))["steps"])
        lines += ["", "Batched decoding step (ms; x a 1-node step at that batch size; the per-batch rule's pick):", "",
                  "| batch | " + " | ".join(f"{n} nodes" for n in nodes) + " | pick |",
                  "|---|" + "---|" * (len(nodes) + 1)]
        for b, r in bs.items():
            lines.append(f"| {b} | " + " | ".join(f"{r['steps'][n]['ms']:.2f} ({r['steps'][n]['vs_1']:.2f}x)"
                                                  for n in nodes) + f" | {r['pick']} |")
    e3 = result.get("eagle3_steps")
    if e3:
        lines += ["", f"EAGLE-3 decoding step (random drafter of `eagle3_smollm2`'s shape, draft vocabulary "
                      f"{e3['draft_vocab']}; plain step {e3['plain_ms']:.2f} ms; expected = the recipe drafter's "
                      "MT-Bench tau measured on CPU over this step):", "",
                  "| setting | step (ms) | vs plain step | tau (CPU, MT-Bench) | expected vs plain loop |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['setting']} | {r['ms']:.2f} | {r['vs_plain']:.2f}x | {r['cpu_tau']} | "
                  f"{r['expected_speedup']:.2f}x |" for r in e3["settings"]]
    pl = result.get("plain_loop_vs_generate")
    if pl:
        lines += ["", f"Plain loop vs `generate` ({pl['prompts']} random-token prompts x {result['new_tokens']} new "
                      f"tokens, greedy, EOS disabled, interleaved): runtime {pl['runtime_tokens_per_s']} tokens/s, "
                      f"`generate` {pl['hf_generate_tokens_per_s']} tokens/s = **{pl['ratio']:.2f}x**, "
                      f"{pl['identical']}/{pl['prompts']} identical "
                      f"({pl.get('identical_same_kernels', '-')}/{pl['prompts']} with `generate` on the same "
                      "attention kernels)"]
    lines += gpu_training.summary_lines(result)
    lines += gpu_graphs.summary_lines(result.get("graphs"))
    lines += budget_lines(result)
    if result["errors"]:
        lines += ["", "Errors:"] + [f"- {k}: {v.splitlines()[-1] if v else ''}" for k, v in result["errors"].items()]
    lines += ["", f"({result['seconds']:.0f} s; full figures in gpu_check.json)"]
    return "\n".join(lines) + "\n"


def not_run(result: dict) -> tuple[list[str], dict]:
    """(the parts not started for time, the parts stopped at their deadline {name: why}), from every list."""
    budget = result.get("budget", {})
    skipped = list(budget.get("skipped", [])) + [f"graphs.{p}" for p in (result.get("graphs") or {}).get("skipped", [])]
    skipped += [p for p in result.get("training_skipped", []) if p not in skipped]
    return skipped, dict(budget.get("stopped", {}))


def budget_lines(result: dict) -> list[str]:
    """summary.md's "Time budget" lines: what this call did not run or stopped, and the device call that runs it."""
    skipped, stopped = not_run(result)
    if not skipped and not stopped:
        return []
    lines = ["", f"Time budget ({result.get('budget', {}).get('budget_s')} s for this script):"]
    if skipped:
        lines.append(f"- not run for time: {', '.join(skipped)}")
    lines += [f"- stopped at its deadline: {name} ({why})" for name, why in stopped.items()]
    parts = skipped + list(stopped)
    call = "bash scripts/gpu_check.sh --out $OUT --no-tier -- --skip "
    if any(p.split(".")[0] in TRAINING for p in parts):
        lines.append(f"- the training parts run in a second device call: `{call}{' '.join(FIRST)} graphs`")
    graphs = {p.split(".")[2] for p in parts if p.startswith("graphs.") and p.count(".") >= 2}
    if graphs:   # the parts this call did not finish, at both shapes; all where a shape's model was not built
        ran = [] if "build" in graphs else [f"graphs.{p}" for p in gpu_graphs.PARTS if p not in graphs]
        lines.append(f"- the CUDA-graph parts run in a second device call: `{call}{' '.join(FIRST + TRAINING)}"
                     + "".join(f" {p}" for p in ran) + "`")
    if any(p in FIRST for p in parts):
        lines.append(f"- the first sections run in a second device call: `{call}graphs {' '.join(TRAINING)}`")
    return lines


def write_results(result: dict, out: Path, t_start: float, dry: bool) -> str:
    """summary.md and gpu_check.json from what is measured so far. Written after every section (and when the
    time limit's signal stops the run), each file replaced whole, so a run cut short keeps every figure it has."""
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    try:
        result["verdicts"] = verdicts(result) + gpu_graphs.verdicts(result.get("graphs"), dry)
        text = summary(result)
        result["errors"].pop("summary", None)   # an earlier write's failure, mended by what came since
    except Exception:   # a part stopped half-way: its figures still go to the JSON
        result["errors"]["summary"] = traceback.format_exc()
        text = f"# GPU check (incomplete)\n\nThe summary failed: see gpu_check.json\n({result['seconds']:.0f} s)\n"
    for name, body in (("gpu_check.json", json.dumps(result, indent=2, default=str) + "\n"), ("summary.md", text)):
        tmp = out / f".{name}.tmp"
        tmp.write_text(body)
        os.replace(tmp, out / name)
    return text


def _stop(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "runs" / "gpu_check"))
    ap.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_CHECK_DRY_RUN") == "1")
    ap.add_argument("--tier-xml", default=None, help="pytest's JUnit XML of the gpu tier")
    ap.add_argument("--full-shape", action="store_true",
                    help="with --dry-run: the SmolLM2-135M shape (vocabulary 49,152, 30 layers) at the dry run's "
                         "sizes, "
                         "so shape-dependent paths run on CPU before a GPU is lent (~1-2 minutes)")
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=[*FIRST, "graphs", *TRAINING, *(f"graphs.{p}" for p in gpu_graphs.PARTS)],
                    help="sections not to run; graphs.<part>: that CUDA-graph part at both shapes")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds this run may take (gpu_check.sh's timeout): parts that could not end within it are "
                         "skipped, a part past 1.5x its estimate is stopped, so the summary is always written")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (use --dry-run to check the script on CPU)")
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.bfloat16
    shape = TINY if dry and not args.full_shape else SMOLLM2_135M
    if dry:
        torch.set_num_threads(1)
    sizes = dict(nodes=[1, 2] if dry else [1, 2, 4, 8, 16, 32, 64], rounds=2 if dry else 5, per_round=2 if dry else 10,
                 prompts=2 if dry else 5, prompt_len=8 if dry else 64, new_tokens=6 if dry else 128,
                 micro=2 if dry else 8, max_length=64 if dry else 1024, train_steps=2 if dry else 8,
                 batches=[1, 2] if dry else [1, 2, 4, 8, 16, 32], batch_nodes=[1, 2] if dry else [1, 2, 4, 8, 16],
                 batch_steps=2 if dry else 6)
    name = "tiny Llama" if shape is TINY else "SmolLM2-135M-shaped Llama (random)"
    result = {"dry_run": dry, "machine": machine(), "backbone": name,
              "shape": shape, "dtype": str(dtype).replace("torch.", ""), "sizes": sizes,
              "new_tokens": sizes["new_tokens"],
              "gpu_tier": tier_result(Path(args.tier_xml) if args.tier_xml else None), "errors": {},
              "budget": {"budget_s": args.budget_s, "skipped": [], "stopped": {}}}
    end = t_start + args.budget_s - RESERVE_S if args.budget_s else math.inf
    section = Sections(result, args.skip, end, dry, lambda: write_results(result, out, t_start, dry))

    # gpu_check.sh's timeout sends SIGTERM: the run stops where it is and writes what it has (write_results)
    signal.signal(signal.SIGTERM, _stop)
    try:
        run_sections(result, section, args, device, dtype, shape, sizes)
    except KeyboardInterrupt as stop:
        result["errors"]["stopped"] = f"stopped by {stop} after {time.perf_counter() - t_start:.0f} s"
        print(f"[gpu_check] {result['errors']['stopped']}", flush=True)
    text = write_results(result, out, t_start, dry)
    print("\n" + text)
    print(f"wrote {out / 'summary.md'} and {out / 'gpu_check.json'}")


class Sections:
    """gpu_check's section runner: ``section(name, fn, estimate_s)`` runs ``fn`` unless ``--skip`` names it or (not on
    the dry run) ``estimate_s`` would end past ``end``; stops it at ``CAP`` x ``estimate_s`` or at ``end``
    (``Deadline``); records a failure in ``errors`` or a stop in ``budget``; then writes the results (``write``)."""

    def __init__(self, result: dict, skip, end: float, dry: bool, write):
        self.result, self.skip, self.end, self.dry, self.write = result, skip, end, dry, write

    def __call__(self, name: str, fn, estimate_s: float | None = None) -> None:
        if name in self.skip:
            return
        budget, now = self.result["budget"], time.perf_counter()
        guess = 0.0 if self.dry or estimate_s is None else estimate_s
        if now + guess > self.end:
            budget["skipped"].append(name)
            print(f"[gpu_check] {name} skipped: {guess:.0f} s would end past the budget", flush=True)
            return self.write()
        limit = min(CAP * guess if guess else math.inf, self.end - now)
        print(f"[gpu_check] {name} ..." + (f" (deadline {limit:.0f} s)" if math.isfinite(limit) else ""), flush=True)
        try:
            with Deadline(limit, name):
                fn()
        except PartDeadline:      # what earlier parts wrote stays; this part's figures are the ones it finished
            budget["stopped"][name] = f"after {time.perf_counter() - now:.0f} s, its deadline"
            print(f"[gpu_check] {name} stopped at its deadline ({limit:.0f} s)", flush=True)
        except Exception:  # recorded, the next section still runs
            self.result["errors"][name] = traceback.format_exc()
            print(self.result["errors"][name], file=sys.stderr, flush=True)
        print(f"[gpu_check] {name} done in {time.perf_counter() - now:.1f} s", flush=True)
        self.write()


def run_sections(result: dict, section, args, device, dtype, shape: dict, sizes: dict) -> None:
    """Every part of the check, each through ``section`` (which records its failure and writes the results), in
    the order of what is wanted most: the CUDA-graph parts (issue 45's verdicts first, ``gpu_graphs.ORDER``), then
    the first sections (measured on an H200 before), then the training; what the budget leaves out is listed with
    the second call that runs it (``budget_lines``)."""
    if "graphs" not in args.skip:
        gpu_graphs.run(result, section, device, args.dry_run, args.full_shape, section.end, args.skip)
    first_sections(result, section, device, dtype, shape, sizes)
    gpu_training.run(result, section, device, args.dry_run,
                     ("SmolLM2-135M" if shape is SMOLLM2_135M else "tiny Llama", shape), sizes, section.end, args.skip)


def first_sections(result: dict, section, device, dtype, shape: dict, sizes: dict) -> None:
    """Sections 1-3c on one backbone, built by the first of them that runs (none: none built)."""
    held: dict = {}

    def model() -> MedusaModel:
        if "m" not in held:
            held["m"] = MedusaModel(model=backbone(shape, device, dtype), tokenizer=None, heads=None)
        return held["m"]

    def steps():
        result["tree_steps"] = tree_steps(model(), sizes["nodes"], sizes["rounds"], sizes["per_round"])
        result["tree_auto"] = auto_choice(result["tree_steps"])

    def batch():
        result["batch_steps"] = batch_steps(model(), sizes["batches"], sizes["batch_nodes"], sizes["batch_steps"],
                                            sizes["prompt_len"])

    def plain():
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, shape["vocab_size"], (sizes["prompt_len"],), generator=g).tolist()
                   for _ in range(sizes["prompts"])]
        result["plain_loop_vs_generate"] = pl = plain_loop_vs_generate(model(), prompts, sizes["new_tokens"],
                                                                          with_tokens=True)
        pl["identical_same_kernels"] = same_kernel_identity(model(), prompts, pl.pop("runtime_tokens"),
                                                            sizes["new_tokens"])

    def eagle3():
        result["eagle3_steps"] = eagle3_steps(eagle3_model(model()), list(EAGLE3_TAU), sizes["rounds"],
                                              sizes["per_round"], sizes["prompt_len"])

    for name, fn in (("steps", steps), ("batch", batch), ("plain", plain), ("eagle3", eagle3)):
        section(name, fn, SECTION_S[name])
    held.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
