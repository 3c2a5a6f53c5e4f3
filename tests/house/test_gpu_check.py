"""The prepared GPU check's dry run (scripts/gpu_check.sh --dry-run): CPU, tiny sizes, same code paths.

Guards against the one-command device check breaking while no GPU is around to run it: the gpu tier
runs on the CPU and passes (a broken gpu test would otherwise first fail on scarce device time),
every measurement section runs without error, also at the SmolLM2-135M shape the GPU run uses
(vocabulary 49,152, draft vocabulary 8,192), and summary.md / gpu_check.json carry the three
verdicts and the fields BENCHMARKS.md's GPU section takes."""

import json
import subprocess
import sys
from pathlib import Path

from conftest import clean_env

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_writes_summary_and_json(tmp_path):
    out = tmp_path / "gpu_check"
    env = clean_env(PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    env.pop("OUT", None)  # the device tool's results folder, if ever set: --out decides here
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    summary = (out / "summary.md").read_text()
    assert result["dry_run"] is True and result["errors"] == {}, result["errors"]
    assert result["gpu_tier"]["ran"] and result["gpu_tier"]["tests"] >= 10
    assert result["gpu_tier"]["failures"] == result["gpu_tier"]["errors"] == 0
    steps = result["tree_steps"]
    assert set(steps) == {"1", "2"} and all(s["ms"] > 0 for s in steps.values())
    assert {"plain_tokens_per_s", "candidates", "chosen", "accuracies"} <= set(result["tree_auto"])
    pl = result["plain_loop_vs_generate"]
    assert pl["identical"] == pl["prompts"] == 2 and pl["ratio"] > 0
    assert pl["identical_same_kernels"] == 2
    e3 = result["eagle3_steps"]
    assert e3["plain_ms"] > 0 and [r["setting"] for r in e3["settings"]] == ["n1-d1-k1", "n4-d1-k4"]
    assert all(r["ms"] > 0 and r["expected_speedup"] > 0 for r in e3["settings"])
    tr = result["training"]
    assert tr["finite"] and tr["train_tokens_per_s"] > 0 and tr["forward_tokens_per_s"] > 0
    assert [v["target"] for v in result["verdicts"]] == [
        "gpu test tier passes", "16-node verification step < 1.3x a 1-token step (bf16)",
        "runtime plain loop within 10% of generate, or faster"]
    # the gpu tier ran on the CPU (GPU_TIER_DEVICE=cpu) and passed: its own code works before a GPU is lent
    assert result["gpu_tier"]["passed"] == result["gpu_tier"]["tests"] >= 17
    assert result["verdicts"][0]["verdict"] == "passed on CPU"
    for text in ("| target | verdict | detail |", "Verification step", "tree=auto", "EAGLE-3 decoding step",
                 "Plain loop vs `generate`", "training (real trainer, DeepSpeed)", "DRY RUN"):
        assert text in summary, text
    assert "## GPU check" in proc.stdout  # the summary is printed last


def test_gpu_check_dry_run_at_the_full_smollm2_shape(tmp_path):
    """Guards against a shape-dependent break (the 49,152-token vocabulary, the drafter's 8,192-token draft
    vocabulary, the trainer's truncated projection at that size) that the tiny dry run cannot show."""
    out = tmp_path / "gpu_check"
    env = clean_env(PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    env.pop("OUT", None)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--full-shape", "--no-tier", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["errors"] == {}, result["errors"]
    assert result["shape"]["vocab_size"] == 49152 and result["shape"]["num_hidden_layers"] == 30
    assert result["eagle3_steps"]["draft_vocab"] == 8192
    assert result["training"]["finite"] and result["training"]["trainable_params_m"] > 10
    assert "SmolLM2-135M-shaped" in (out / "summary.md").read_text()


def test_profile_gpu_step_dry_run(tmp_path):
    """Guards against the GPU step profiler (``bench.py profile-gpu``, what found the cuDNN planning cost)
    breaking while no GPU is around: on CPU it times every step kind, records the attention calls' arguments
    and writes profile.json / profile.txt."""
    out = tmp_path / "profile"
    proc = subprocess.run([sys.executable, "scripts/bench.py", "profile-gpu", "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "profile.json").read_text())
    for k in ("plain_step", "verify_16", "batch1_step", "batch8_step"):
        assert res[k]["wall_ms"] > 0 and "kernel_ms" in res[k], res[k]
    for k in ("plain_attention", "batch1_attention", "batch8_attention"):
        assert res[k]["calls"] > 0 and res[k]["args"]["q"].startswith("("), res[k]
    assert res["launch"]["host_us_per_launch"] > 0
    assert "BatchTreeDecoder.step, batch 8" in (out / "profile.txt").read_text()
