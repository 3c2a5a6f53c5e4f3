"""The prepared GPU check's dry run (scripts/gpu_check.sh --dry-run): CPU, tiny sizes, same code paths.

Guards against the one-command device check breaking while no GPU is around to run it: the gpu tier
runs on the CPU and passes (a broken gpu test would otherwise first fail on scarce device time),
every measurement section runs without error, also at the SmolLM2-135M shape the GPU run uses
(vocabulary 49,152, draft vocabulary 8,192), and summary.md / gpu_check.json carry the
verdicts and the fields BENCHMARKS.md's GPU section takes, the CUDA-graph part's (benchmarks/gpu_graphs.py)
included: on the CPU it runs graphs=uncaptured where the GPU runs graphs=on, and says so in the JSON."""

GRAPH_TARGETS = [
    "graphs=on: every step and drafter call captured, none failed, no replay disagreed (SmolLM2-135M shape)",
    "graphs=on: every step and drafter call captured, none failed, no replay disagreed (Llama-3.1-8B shape)",
    "graphs=on: 1-token step wall <= 1.3x its kernel time (SmolLM2-135M shape)",
    "graphs=on: 1-token step wall <= 1.3x its kernel time (Llama-3.1-8B shape)",
    "graphs=on: plain loop >= 2.0x hf_generate_static (SmolLM2-135M shape)",
    "graphs=on: plain loop >= 1.3x hf_generate_static (Llama-3.1-8B shape)",
    "graphs=on: 8B plain loop >= 60% of the weight-read floor",
    "graphs=on: 16-row verification <= 1.25x a 1-token step (8B)",
    "graphs=on: Medusa drafting + verification <= 1.3x a plain step (SmolLM2-135M shape)",
    "graphs=on: Medusa drafting + verification <= 1.3x a plain step (Llama-3.1-8B shape)",
    "graphs=on: EAGLE-3 drafting + verification <= 1.3x a plain step (SmolLM2-135M shape)",
    "graphs=on: EAGLE-3 drafting + verification <= 1.3x a plain step (Llama-3.1-8B shape)",
    "graphs=on: stub drafter at tau 2.0 >= 1.6x the captured plain loop (8B)"]


def check_graphs_part(result: dict, summary: str) -> None:
    """The CUDA-graph part ran every piece on the CPU: graphs off and "on" (uncaptured there, recorded), the
    weight-read floor's bandwidth (assumed there, measured on a GPU), the plain loop beside both transformers
    baselines, drafting steps, the stub drafter at each tau, and the capture comparison (CUDAGraph vs torch.compile
    reduce-overhead) with its GPU-only third way skipped for a reason."""
    g = result["graphs"]
    assert g["graphs_on_mode"] == "uncaptured" and "refused off CUDA" in g["graphs_on_note"]
    assert g["skipped"] == [] and set(g["shapes"]) == {"smollm2_135m", "llama31_8b"}
    # the floor's bandwidth is measured on a GPU (an H100's is ~30% below the H200's); the dry run says it assumed one
    assert g["read_bytes_per_s"] == 4.2e12 and g["read_bandwidth"].startswith("assumed")
    for key, s in g["shapes"].items():
        for mode in ("off", "on"):
            assert s["step"][mode]["wall_ms"] > 0 and s["step"][mode]["kernel_ms"] > 0, (key, mode)
            assert s["step"][mode]["clock"] == "cpu"   # the dry run's profiler records CPU op time
        # the step's graph and logits back to back (the step body on the host's clock on the CPU) beside the profiler's
        # sum, checked only on CUDA
        on = s["step"]["on"]
        assert on["events_ms"] > 0 and on["wall_vs_events"] > 0 and on["profiler_short"] is False
        assert on["kernel_unreliable"] is False and on["dropped_events"] == 0
        assert set(s["step"]["verify"]) == {"1", "16", "64"} and s["step"]["verify"]["1"]["vs_1"] == 1.0
        tps = s["loop"]["tokens_per_s"]
        assert set(tps) == {"plain_off", "plain_on", "hf_generate", "hf_generate_static"}
        assert all(v["median"] > 0 and v["n"] == result["graphs"]["sizes"]["rounds"] for v in tps.values())
        assert s["loop"]["plain_on_vs"]["hf_generate_static"] > 0 and s["floor"]["plain_on_fraction"] > 0
        # the floor's fraction by the plain loop's decode-only rate; the tiny model's embedding is tied: all read
        assert set(s["loop"]["decode_tokens_per_s"]) == {"plain_off", "plain_on"}
        assert s["floor"]["rate"] == "decode-only"
        assert s["floor"]["plain_on_tokens_per_s"] == s["loop"]["decode_tokens_per_s"]["plain_on"]["median"]
        assert s["floor"]["input_embedding_left_out"] == 0 and s["floor"]["read_bytes"] == s["param_bytes"]
        assert set(s["drafting"]["kinds"]) == {"medusa tree16", "sampled medusa tree16", "eagle3 n1-d1-k1",
                                               "eagle3 n4-d1-k4"}
        assert all(v["vs_plain_captured"]["on"] > 0 for v in s["drafting"]["kinds"].values())
        runs = s["stub"]["runs"]
        assert [(r["target_tau"], r["graphs"]) for r in runs] == [(1.5, "on"), (2.0, "on"), (3.0, "on"), (2.0, "off")]
        assert all(r["measured_tau"] >= 1 and r["vs_plain_on"] > 0 for r in runs)
        # static steps verify k + 1 rows in one fixed bucket: the stub's p = 1 pass is the path every run follows
        assert all(r["off_truth"] == 0 for r in runs if r["graphs"] == "on")
        assert s["static"]["captured"] is False and s["static"]["kv_capacity"] >= 256
        w, sz = s["capture_ways"], g["sizes"]
        assert set(w["ms"]) == {"uncaptured", "cuda_graph", "reduce_overhead"} and w["ms"]["reduce_overhead"] is None
        assert all(w["ms"][k]["median"] > 0 and w["ms"][k]["n"] == sz["ways_rounds"] * sz["ways_per_round"]
                   for k in ("uncaptured", "cuda_graph"))
        # nothing is captured on the CPU: the "cuda_graph" stand-in is the same uncaptured step, equal to it
        assert w["cuda_graph_captured"] is False and w["capture_s"] is None and "graph_memory_bytes" in w
        assert w["matches_uncaptured"] == {"cuda_graph": True, "reduce_overhead": None}
        assert w["max_abs_diff"] == {"cuda_graph": 0.0, "reduce_overhead": None}
        assert w["reduce_overhead"] is None
        assert w["skipped"] == "torch.compile reduce-overhead needs CUDA graphs: GPU only"
        assert w["which"].startswith("dry run") and w["torch"]
        assert w["issues"] and all(u.startswith("https://github.com/pytorch/pytorch/issues/") for u in w["issues"])
    for text in ("CUDA graphs: graphs 'on' = graphs=uncaptured", "1-token step wall / kernel ms, graphs on",
                 "1-token step graphs on: kernel ms (profiler) / graph + logits back to back ms (CUDA events",
                 "Stub drafter of set acceptance", "hf_generate_static",
                 "static 1-token step ms: uncaptured / CUDAGraph / reduce-overhead",
                 'Capturing: torch.cuda.CUDAGraph directly or torch.compile(mode="reduce-overhead")',
                 "reduce-overhead skipped: torch.compile reduce-overhead needs CUDA graphs: GPU only"):
        assert text in summary, text

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
    # both families train at both shapes: the 8B one (its tiny stand-in here) through a backbone made on the device
    # and handed to the trainer (benchmarks/gpu_training.handed_backbone), which the dry run must have run
    for key, heads, shape in (("training", "medusa", "tiny Llama"), ("training_eagle3", "eagle3", "tiny Llama"),
                              ("training_8b", "medusa", "Llama-3.1-8B (tiny stand-in)"),
                              ("training_eagle3_8b", "eagle3", "Llama-3.1-8B (tiny stand-in)")):
        tr = result[key]
        assert tr["heads"] == heads and tr["shape"] == shape, (key, tr)
        assert tr["finite"] and tr["train_tokens_per_s"] > 0 and tr["forward_tokens_per_s"] > 0, (key, tr)
    assert result["training_skipped"] == [] and result["training_8b_build_s"] >= 0
    assert "| Llama-3.1-8B (tiny stand-in) eagle3, ZeRO 1, bf16" in summary
    assert [v["target"] for v in result["verdicts"]] == [
        "gpu test tier passes", "16-node verification step < 1.3x a 1-token step (bf16)",
        "runtime plain loop within 10% of generate, or faster", *GRAPH_TARGETS]
    assert all(v["verdict"] == "dry run" for v in result["verdicts"][3:]), result["verdicts"][3:]
    assert all(s["tiny_stand_in"] for s in result["graphs"]["shapes"].values())
    check_graphs_part(result, summary)
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
    # a hang guard, not a timing: it ran past 300 s beside another test run on 2 cores
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--full-shape", "--no-tier", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["errors"] == {}, result["errors"]
    assert result["shape"]["vocab_size"] == 49152 and result["shape"]["num_hidden_layers"] == 30
    assert result["eagle3_steps"]["draft_vocab"] == 8192
    assert result["training"]["finite"] and result["training"]["trainable_params_m"] > 10
    assert result["training_eagle3"]["finite"] and result["training_eagle3"]["heads"] == "eagle3"
    assert result["training"]["shape"] == "SmolLM2-135M" and result["training_eagle3_8b"]["finite"]
    assert "SmolLM2-135M-shaped" in (out / "summary.md").read_text()
    shapes = result["graphs"]["shapes"]   # the graph part's SmolLM2 entry at its own shape, the 8B one tiny
    assert shapes["smollm2_135m"]["shape"]["vocab_size"] == 49152 and not shapes["smollm2_135m"]["tiny_stand_in"]
    assert shapes["llama31_8b"]["tiny_stand_in"]
    assert all(r["measured_tau"] >= 1 for r in shapes["smollm2_135m"]["stub"]["runs"])
    assert shapes["smollm2_135m"]["capture_ways"]["matches_uncaptured"]["cuda_graph"] is True


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


def test_gpu_check_training_at_8b_runs_only_when_it_fits():
    """Guards against the 8B training part overrunning the device call (it would cost the summary) or being dropped
    silently: with too little time left it is skipped and listed, with enough its backbone is built first and both
    families then train on it."""
    import time

    import torch

    from benchmarks import gpu_training

    for end, expect in ((time.perf_counter(), ["train", "train_eagle3"]),
                        (float("inf"), ["train", "train_eagle3", "train_8b.build"])):
        names, result = [], {}
        gpu_training.run(result, lambda name, fn, *est: names.append(name), torch.device("cpu"), False,
                         ("tiny Llama", {}), {}, end)
        assert names == expect   # the stub section runs nothing: no backbone built, so no 8B trainer follows
        assert result["training_skipped"] == ([] if end == float("inf") else ["train_8b", "train_eagle3_8b"])
    names = []   # --skip of both 8B trainers: their 16 GB backbone is not built either
    gpu_training.run({}, lambda name, fn, *est: names.append(name), torch.device("cpu"), False, ("tiny Llama", {}), {},
                     float("inf"), ("train_8b", "train_eagle3_8b"))
    assert names == ["train", "train_eagle3"]
    assert "skipped (time): train_8b, train_eagle3_8b" in "\n".join(gpu_training.summary_lines(
        {"training_skipped": ["train_8b", "train_eagle3_8b"]}))


def test_gpu_check_stopped_by_its_time_limit_keeps_what_it_measured(tmp_path, monkeypatch):
    """Guards against a device run that overruns losing every figure: the results are written after each section
    (each file replaced whole), and the time limit's SIGTERM stops the run where it is and writes what it has,
    with the stop recorded, instead of dying with no summary."""
    import os
    import signal

    from benchmarks import gpu_check

    out = tmp_path / "gpu_check"
    seen = {}

    def two_sections(result, section, *args):
        section("steps", lambda: result.update(probe={"ms": 1.0}))   # a figure no verdict reads
        seen["after_first"] = json.loads((out / "gpu_check.json").read_text())
        section("batch", lambda: os.kill(os.getpid(), signal.SIGTERM))   # the limit, inside the second part

    monkeypatch.setattr(gpu_check, "run_sections", two_sections)
    monkeypatch.setattr(sys, "argv", ["gpu_check", "--dry-run", "--out", str(out)])
    saved = signal.getsignal(signal.SIGTERM)
    try:
        gpu_check.main()
    finally:
        signal.signal(signal.SIGTERM, saved)
    assert seen["after_first"]["probe"] == {"ms": 1.0}
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["probe"] == {"ms": 1.0} and "batch" not in result["errors"] and "summary" not in result["errors"]
    assert result["errors"]["stopped"].startswith("stopped by signal")
    summary = (out / "summary.md").read_text()
    assert "| target | verdict | detail |" in summary and "- stopped: stopped by signal 15" in summary
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "summary.md"]   # no temporary file left


def test_a_profiler_that_misses_graph_kernels_is_caught():
    """Guards against the 1-token step's wall / kernel verdict failing (or passing) on a profiler that under-counts
    the kernels of graph replays (CUPTI with CUDA 13.0): under half graphs off's kernel count, or under half the
    device time of its graph and logits replayed back to back (CUDA events), marks it short, and the verdict then
    divides by that time and says so."""
    from benchmarks.gpu_graphs import profiler_short, verdicts

    off = {"wall_ms": 30.0, "kernel_ms": 2.4, "device_ops": 1300, "clock": "cuda", "wall_vs_kernel": 12.5}
    good = {"wall_ms": 3.0, "kernel_ms": 2.5, "device_ops": 1290, "events_ms": 2.7, "wall_vs_events": 1.11,
            "clock": "cuda"}
    assert not profiler_short(good, off)
    assert profiler_short({**good, "device_ops": 40}, off)                        # kernels of the graph missed
    assert profiler_short({**good, "kernel_ms": 0.9}, off)                        # their time missed
    assert not profiler_short({**good, "events_ms": None, "device_ops": None}, {})   # no figures
    assert not profiler_short({**good, "kernel_ms": 0.9, "clock": "cpu"}, off)   # the dry run: CPU op time
    short = {**good, "kernel_ms": 0.5, "device_ops": 40, "wall_vs_kernel": 6.0, "profiler_short": True}
    g = {"shapes": {"smollm2_135m": {"step": {"on": short, "off": off}}}}
    v = next(x for x in verdicts(g, dry=False) if x["target"].startswith("graphs=on: 1-token step"))
    want = "3.0 ms wall / 2.7 ms of its graph and logits back to back (CUDA events) = 1.11x"
    assert v["verdict"] == "PASS" and want in v["detail"]
    assert "40 of graphs off's 1300" in v["detail"]
    g["shapes"]["smollm2_135m"]["step"]["on"] = {**good, "wall_vs_kernel": 1.2, "profiler_short": False}
    v = next(x for x in verdicts(g, dry=False) if x["target"].startswith("graphs=on: 1-token step"))
    assert v["verdict"] == "PASS" and v["detail"].startswith("3.0 ms wall / 2.5 ms cuda = 1.2x")
    # always there
    assert "its graph and logits replayed back to back (CUDA events): 2.7 ms, wall 1.11x that" in v["detail"]


def test_a_run_stopped_by_its_own_budget_exits_0_with_its_summary(tmp_path):
    """Guards against gpu_check.sh passing on ``timeout``'s own exit code (124 when its deadline fired, 137 after
    -k) although the run stopped itself there and wrote its summary: the device tool reads 124 / 137 as "ran past
    its limit". With summary.md written the script says so in one line and exits 0 (137: the summary is marked
    as cut after the last finished part and printed); without one it still fails."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_timeout = bin_dir / "timeout"   # runs the command, then returns the code a fired deadline gives
    fake_timeout.write_text('#!/usr/bin/env bash\nwhile [[ "$1" == -* ]]; do [ "$1" = -k ] && shift; shift; done\n'
                            'shift\n"$@"\nexit "${FAKE_TIMEOUT_RC:-0}"\n')
    fake_python = bin_dir / "python"     # writes summary.md for gpu_check.py when asked to (WRITE_SUMMARY=1)
    fake_python.write_text('#!/usr/bin/env bash\nif [ "$2" = benchmarks.gpu_check ]; then\n'
                           '  while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done\n'
                           '  [ "$WRITE_SUMMARY" = 1 ] && echo "## GPU check (stub)" > "$out/summary.md"\nfi\n'
                           'exit 0\n')
    for f in (fake_timeout, fake_python):
        f.chmod(0o755)
    for rc, summary, expect in (("124", "1", 0), ("137", "1", 0), ("124", "0", 1), ("3", "1", 3)):
        out = tmp_path / f"out{rc}{summary}"
        env = clean_env(PYTHON=str(fake_python), PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_TIMEOUT_RC=rc,
                        WRITE_SUMMARY=summary)
        env.pop("OUT", None)
        proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--no-tier", "--out", str(out)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == expect, (rc, summary, proc.stdout[-2000:], proc.stderr[-2000:])
        if expect == 0:
            assert "stopped by its own budget; summary written" in proc.stdout
            assert ("killed at its own budget" in (out / "summary.md").read_text()) == (rc == "137")


def sections(monkeypatch, end: float = float("inf")):
    """gpu_check's section runner on a fresh result (not a dry run: estimates count), writes counted."""
    from benchmarks import gpu_check

    monkeypatch.setattr(gpu_check, "REFIRE_S", 0.05)
    result = {"errors": {}, "budget": {"budget_s": 100, "skipped": [], "stopped": {}}}
    writes = []
    return gpu_check.Sections(result, [], end, False, lambda: writes.append(json.dumps(result))), result, writes


def test_a_part_past_its_deadline_is_stopped_and_the_next_one_runs(monkeypatch):
    """Guards against one slow part (an inductor compile, a capture that hangs) eating the parts after it, with the
    outer timeout the only stop: a part still running at 1.5x its estimate is stopped there (also one that swallows
    the first interrupt, as a capture whose end fails and is caught as a failed capture does), listed as stopped at
    its deadline, not as an error; the results written before it survive and the next part runs."""
    import time

    section, result, writes = sections(monkeypatch)
    section("steps", lambda: result.update(probe=1), 10)

    def slow():
        try:
            while True:
                time.sleep(0.01)
        except BaseException:   # the first interrupt swallowed: the deadline fires again
            pass
        while True:
            time.sleep(0.01)

    t = time.perf_counter()
    section("graphs.llama31_8b.loop", slow, 0.2)
    assert time.perf_counter() - t < 5
    section("eagle3", lambda: result.update(after=1), 10)
    assert result["probe"] == result["after"] == 1 and result["errors"] == {}
    assert list(result["budget"]["stopped"]) == ["graphs.llama31_8b.loop"]
    assert json.loads(writes[1])["probe"] == 1 and len(writes) == 3
    time.sleep(0.2)   # the timer is disarmed: nothing fires after the part


def test_parts_not_run_for_time_are_listed_with_the_call_that_runs_them(monkeypatch):
    """Guards against the first sections and the small trainings starting with no time left (only the CUDA-graph
    parts had a start guard) and against a summary that does not say what was not run: a section whose estimate
    ends past the budget is skipped and listed, and the summary's "Time budget" lines name every part not run or
    stopped (CUDA-graph parts, the 8B training) and the second device call for each."""
    import time

    from benchmarks import gpu_check

    section, result, _ = sections(monkeypatch, end=time.perf_counter() + 5)
    ran = []
    section("plain", lambda: ran.append("plain"), 60)
    section("train", lambda: ran.append("train"), 1)
    assert ran == ["train"] and result["budget"]["skipped"] == ["plain"]
    result["budget"]["stopped"]["graphs.smollm2_135m.loop"] = "after 165 s, its deadline"
    result["graphs"] = {"skipped": ["llama31_8b.capture_ways.reduce_overhead"]}
    result["training_skipped"] = ["train_8b", "train_eagle3_8b"]
    text = "\n".join(gpu_check.budget_lines(result))
    assert ("not run for time: plain, graphs.llama31_8b.capture_ways.reduce_overhead, train_8b, train_eagle3_8b"
            in text)
    assert "stopped at its deadline: graphs.smollm2_135m.loop (after 165 s, its deadline)" in text
    assert "--no-tier -- --skip steps batch plain eagle3 graphs`" in text          # the training's second call
    # the graphs': the parts this call finished are left out of it (at both shapes), the loop and capture_ways run
    assert ("--skip steps batch plain eagle3 train train_eagle3 train_8b train_eagle3_8b graphs.steps graphs.gqa "
            "graphs.drafting graphs.stub graphs.batches`") in text
    result["budget"]["skipped"].append("graphs.llama31_8b.build")   # a shape not built: every part runs again
    assert "--skip steps batch plain eagle3 train train_eagle3 train_8b train_eagle3_8b`" in "\n".join(
        gpu_check.budget_lines(result))
    assert "--skip graphs train train_eagle3 train_8b train_eagle3_8b`" in text    # the first sections'
    assert gpu_check.budget_lines({"budget": {"skipped": [], "stopped": {}}}) == []


def test_graphs_on_that_fell_back_to_uncaptured_is_said_so():
    """Guards against "graphs on" figures that were measured uncaptured (a failed capture sets the static steps
    uncaptured) passing as captured ones, shown only by JSON fields: per shape a verdict requires every step and
    drafter call captured, no failed capture and no disagreeing replay; where graphs on fell back, every other
    verdict of that shape and its summary column say "on (fell back to uncaptured)"."""
    from benchmarks.gpu_graphs import summary_lines, verdicts

    calls = {"captures": {"eagle3.tree": 1}, "failed_captures": 0, "checked_replays": 1, "disagreeing_replays": 0}

    def static(captured=True, failed=0, disagreed=0):
        return {"captured": captured, "captures": {"1": 1}, "failed_captures": failed, "checked_replays": 3,
                "disagreeing_replays": disagreed, "drafter_calls": dict(calls), "capture_s": 0.1,
                "graph_memory_bytes": 0}

    off = {"wall_ms": 30.0, "kernel_ms": 2.4, "device_ops": 1300, "clock": "cuda", "wall_vs_kernel": 12.5}
    on = {"wall_ms": 3.0, "kernel_ms": 2.5, "device_ops": 1290, "events_ms": 2.7, "wall_vs_events": 1.11,
          "clock": "cuda", "wall_vs_kernel": 1.2, "profiler_short": False}

    def shape(label, st, drafting_st):
        return {"label": label, "tiny_stand_in": False, "static": st, "step": {"on": on, "off": off},
                "drafting": {"static": {"eagle3": drafting_st}, "kinds": {}}}

    g = {"graphs_on_mode": "on", "graphs_on_note": "graphs 'on' = captured CUDA graphs",
         "shapes": {"smollm2_135m": shape("SmolLM2-135M", static(), static()),
                    "llama31_8b": shape("Llama-3.1-8B", static(captured=False, failed=1), static())}}
    v = {x["target"]: x for x in verdicts(g, dry=False)}
    good = v["graphs=on: every step and drafter call captured, none failed, no replay disagreed (SmolLM2-135M shape)"]
    bad = v["graphs=on: every step and drafter call captured, none failed, no replay disagreed (Llama-3.1-8B shape)"]
    assert good["verdict"] == "PASS" and bad["verdict"] == "FAIL" and "fell back to uncaptured" in bad["detail"]
    small = v["graphs=on: 1-token step wall <= 1.3x its kernel time (SmolLM2-135M shape)"]
    big = v["graphs=on: 1-token step wall <= 1.3x its kernel time (Llama-3.1-8B shape)"]
    assert small["verdict"] == "PASS" and big["verdict"] == "PASS (on fell back to uncaptured)"
    assert big["detail"].startswith("on (fell back to uncaptured): ")
    g["shapes"]["smollm2_135m"]["drafting"]["static"]["eagle3"] = static(disagreed=1)   # a drafter replay disagreed
    assert verdicts(g, dry=False)[0]["verdict"] == "FAIL"
    header = next(line for line in summary_lines(g) if line.startswith("| figure |"))
    assert "Llama-3.1-8B [graphs on: on (fell back to uncaptured)]" in header and "SmolLM2-135M |" in header


def test_reduce_overhead_runs_only_where_its_compile_fits(monkeypatch):
    """Guards against capture_ways starting torch.compile(mode="reduce-overhead") (60-120 s at the 8B shape) with
    too little time left, where it would run into the next deadline: with the time left covering the part but not
    the compile, the part runs without it (listed skipped, the section's estimate its own); with enough, with it."""
    import time

    import torch

    from benchmarks import gpu_graphs
    from benchmarks.gpu_models import TINY

    seen = {}
    monkeypatch.setattr(gpu_graphs, "capture_ways", lambda *a, **k: seen.update(compile=a[-1]) or {})
    for spare, compile_too in ((50, False), (1000, True)):
        g = {"graphs_on_mode": "uncaptured", "skipped": [], "shapes": {}}
        estimates = {}

        def section(name, fn, estimate=None):   # runs the build and capture_ways only
            estimates[name] = estimate
            if name.endswith((".build", ".capture_ways")):
                fn()
        sz = {**gpu_graphs.sizes(True), "dry": False}
        gpu_graphs.run_shape(g, {}, "llama31_8b", "Llama-3.1-8B", TINY, section, torch.device("cpu"), sz,
                             time.perf_counter() + spare)
        assert seen["compile"] is compile_too
        assert ("llama31_8b.capture_ways.reduce_overhead" in g["skipped"]) is not compile_too
        ways = gpu_graphs.PART_S["capture_ways"] + gpu_graphs.PART_S["reduce_overhead"] * compile_too
        assert estimates["graphs.llama31_8b.capture_ways"] == ways


def tiny_model(**overrides):
    """A tiny random Llama on the CPU (bf16, as the GPU check's), with graphs=uncaptured static steps."""
    import torch

    from benchmarks.gpu_models import TINY, device_llama
    from inference.runtime.model import MedusaModel
    from inference.runtime.static_steps import apply_graphs

    m = MedusaModel(model=device_llama({**TINY, **overrides}, torch.device("cpu"), torch.bfloat16), tokenizer=None,
                    heads=None)
    return apply_graphs(m, "uncaptured")


def test_the_weight_read_floor_counts_what_a_step_reads_and_the_loop_its_decoding_rate():
    """Guards against the 8B weight-read floor verdict being ~7% too easy: an untied input embedding (Llama-3.1-8B:
    1.05 GB of 16 GB) is read one row a token, not whole, so its other rows are left out of the bytes a step reads
    (tied, the lm_head reads the table whole: counted once); and the loop's fraction is its decode-only rate, not
    one that counts the uncaptured prefill as decoding time."""
    from benchmarks.gpu_graphs import weight_floor

    loop = {"tokens_per_s": {"plain_on": {"median": 10.0}, "plain_off": {"median": 5.0}},
            "decode_tokens_per_s": {"plain_on": {"median": 12.0}, "plain_off": {"median": 6.0}}}
    untied = tiny_model(tie_word_embeddings=False)
    table = untied.model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in untied.model.parameters())
    left = (table.shape[0] - 1) * table.shape[1] * table.element_size()
    f = weight_floor(untied, loop, 1e9)
    assert f["tokens_per_s"] == round(1e9 / (total - left), 1)                 # not 1e9 / total
    assert f["plain_on_fraction"] == round(12.0 / (1e9 / (total - left)), 6)   # the decode-only rate, not 10
    assert f["param_bytes"] == total and f["input_embedding_left_out"] == left and f["read_bytes"] == total - left
    assert f["rate"] == "decode-only" and f["plain_on_tokens_per_s"] == 12.0
    tied = tiny_model()
    f = weight_floor(tied, {"tokens_per_s": loop["tokens_per_s"]}, 1e9)   # no decode-only figure: said so
    assert f["input_embedding_left_out"] == 0 and f["read_bytes"] == f["param_bytes"]
    assert f["param_bytes"] == sum(p.numel() * p.element_size() for p in tied.model.parameters())
    assert f["rate"] == "prefill included" and f["plain_on_tokens_per_s"] == 10.0


def test_the_wall_time_and_the_events_time_cover_the_same_step(monkeypatch):
    """Guards against the wall / kernel verdict's fallback (a profiler that misses graph kernels) dividing the
    step's wall time, which covers ``hidden`` + ``logits`` and their launches, by the backbone graph's replays
    alone (biased towards FAIL): the device time beside it is the very step body, back to back between CUDA
    events (the host's clock on the CPU)."""
    from benchmarks.gpu_graphs import sizes, step_costs
    from benchmarks.timing import verification_step

    m = tiny_model()
    step = verification_step(m, list(range(3, 11)), max_nodes=4)
    step(1)
    calls = {"hidden": 0, "logits": 0}
    for name in calls:
        real = getattr(m, name)
        monkeypatch.setattr(m, name, lambda *a, real=real, name=name, **k: calls.__setitem__(name, calls[name] + 1)
                            or real(*a, **k))
    assert step.device_ms(1, 5) > 0 and calls == {"hidden": 5, "logits": 5}
    assert step.device_ms(1, 5) > 0 and calls == {"hidden": 10, "logits": 10}   # the cache truncated each time
    monkeypatch.undo()
    on = step_costs(m, list(range(3, 11)), sizes(True))["on"]
    assert on["events_ms"] > 0 and on["wall_vs_events"] == round(on["wall_ms"] / on["events_ms"], 3)


def test_absurd_profiler_kernel_times_are_dropped_or_marked_unreliable():
    """Guards against CUPTI's known bad figures (kineto#1165 under CUDA graphs, pytorch#192021 corrupted timestamps
    at a session's start) turning the wall / kernel verdict into a silent PASS: events of negative duration or
    longer than the profiled window are dropped, a kernel sum past the window or past the step's wall time marks
    the figure unreliable and the verdict "unreliable", and the same steps' CUDA-event time stands beside the
    profiler's figure in the verdict and the summary."""
    from benchmarks import gpu_graphs
    from benchmarks.gpu_graphs import summary_lines, verdicts

    off = {"wall_ms": 30.0, "kernel_ms": 2.4, "device_ops": 1300, "clock": "cuda", "wall_vs_kernel": 12.5,
           "kernel_unreliable": False, "dropped_events": 0}
    on = {"wall_ms": 1.0, "kernel_ms": 2.5, "device_ops": 1290, "clock": "cuda", "wall_vs_kernel": 0.4,
          "events_ms": 0.8, "wall_vs_events": 1.25, "profiler_short": False, "kernel_unreliable": True,
          "dropped_events": 3}
    g = {"graphs_on_mode": "on", "graphs_on_note": "graphs 'on' = captured CUDA graphs",
         "shapes": {"smollm2_135m": {"label": "SmolLM2-135M", "tiny_stand_in": False, "step": {"on": on, "off": off}}}}
    v = next(x for x in verdicts(g, dry=False) if x["target"].startswith("graphs=on: 1-token step"))
    assert v["verdict"] == "unreliable", v
    assert "kernel sum 2.5 ms exceeds the step's wall time 1.0 ms (3 absurd events dropped)" in v["detail"]
    assert "its graph and logits replayed back to back (CUDA events): 0.8 ms, wall 1.25x that" in v["detail"]
    text = "\n".join(summary_lines(g))
    assert "| 1.0 / 2.5 (0.4x, cuda, UNRELIABLE: over the wall time) |" in text and "| 2.5 / 0.8 (1.25x; " in text
    kernel_sum = gpu_graphs.kernel_sum   # what device_time sums the profiler's CUDA events with
    assert kernel_sum([100.0, -5.0, 50.0, 1e9], 1000.0, 1) == {"kernel_ms": 0.15, "device_ops": 2.0,
                                                              "dropped_events": 2, "kernel_unreliable": False}
    assert kernel_sum([600.0, 600.0], 1000.0, 2)["kernel_unreliable"]   # busier than the window: not kernel time


def test_a_kernel_sum_over_the_steps_wall_time_is_marked_unreliable(monkeypatch):
    """Guards against a profiler sum larger than the step's own wall time (one stream, synchronized at both ends:
    impossible) being taken for kernel time: step_costs marks it unreliable (beyond 5% of run-to-run noise on a
    device-bound step), on CUDA's clock only."""
    from benchmarks import gpu_graphs

    m = tiny_model()
    for kernel_ms, unreliable in ((1e6, True), (1e-6, False)):
        monkeypatch.setattr(gpu_graphs, "device_time", lambda fn, device, steps, k=kernel_ms: {
            "kernel_ms": k, "device_ops": 1.0, "dropped_events": 0, "kernel_unreliable": False, "clock": "cuda"})
        out = gpu_graphs.step_costs(m, list(range(3, 11)), gpu_graphs.sizes(True))
        assert out["on"]["kernel_unreliable"] is out["off"]["kernel_unreliable"] is unreliable


class FakeClock:
    """``time`` for gpu_graphs: perf_counter reads a clock the test's section advances."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self):
        return self.now


def test_issue_45_verdict_parts_run_first_and_fit_the_default_budget(monkeypatch):
    """Guards against the default device call spending its budget on sections measured before (steps, batch, plain,
    eagle3) and on the 8B's parts no verdict reads (gqa, batches, capture_ways and its reduce-overhead compile)
    before SmolLM2's verdict parts, which then went "not run for time" with no second call left in the 15 minutes:
    the CUDA-graph parts come first, both shapes' verdict parts before any other part; with every part taking its
    whole estimate, every verdict part still runs inside what the default budget leaves after a 76 s start + tier
    (440 s after gpu_check.sh's margins); ``--skip graphs.<part>`` leaves a part out at both shapes."""
    import argparse

    import torch

    from benchmarks import gpu_check, gpu_graphs
    from benchmarks.gpu_models import TINY

    names = []

    def builds_only(name, fn, estimate=None):
        names.append(name)
        if name.endswith(".build"):
            fn()

    gpu_graphs.run({"errors": {}}, builds_only, torch.device("cpu"), True)
    verdict = ["graphs.smollm2_135m.build", "graphs.smollm2_135m.steps", "graphs.smollm2_135m.loop",
               "graphs.smollm2_135m.drafting", "graphs.llama31_8b.build", "graphs.llama31_8b.steps",
               "graphs.llama31_8b.loop", "graphs.llama31_8b.drafting", "graphs.llama31_8b.stub"]
    rest = ["graphs.llama31_8b.gqa", "graphs.llama31_8b.batches", "graphs.llama31_8b.capture_ways",
            "graphs.smollm2_135m.gqa", "graphs.smollm2_135m.stub", "graphs.smollm2_135m.batches",
            "graphs.smollm2_135m.capture_ways"]
    assert names == verdict + rest
    names.clear()
    gpu_graphs.run({"errors": {}}, builds_only, torch.device("cpu"), True, skip=("graphs.steps", "graphs.loop",
                                                                                 "graphs.drafting", "graphs.stub"))
    assert names == ["graphs.smollm2_135m.build", "graphs.llama31_8b.build", *(n for n in rest if "stub" not in n)]
    # the whole check: the CUDA-graph parts first, then the sections measured before, then the training
    names.clear()
    args = argparse.Namespace(dry_run=True, skip=[], full_shape=False)
    section = lambda name, fn, estimate=None: names.append(name)   # noqa: E731 (runs nothing, builds nothing)
    section.end = float("inf")
    gpu_check.run_sections({"errors": {}}, section, args, torch.device("cpu"), torch.bfloat16, TINY, {})
    first = [names.index(n) for n in ("steps", "batch", "plain", "eagle3")]
    last_graph = max(i for i, n in enumerate(names) if n.startswith("graphs."))
    assert names[0].startswith("graphs.") and last_graph < min(first)
    assert names.index("train") > max(first)
    # the budget: each part "takes" its whole estimate on a clock the section advances; real shapes' estimates
    clock = FakeClock()
    monkeypatch.setattr(gpu_graphs, "time", clock)
    monkeypatch.setattr(gpu_graphs, "SHAPES", {k: (label, TINY) for k, (label, _) in gpu_graphs.SHAPES.items()})
    ran = []

    def takes_its_estimate(name, fn, estimate=None):
        ran.append(name)
        if name.endswith(".build"):
            fn()
        clock.now += estimate

    result = {"errors": {}}
    gpu_graphs.run(result, takes_its_estimate, torch.device("cpu"), False, deadline=clock.now + 470 - 30 - 76)
    assert ran[:len(verdict)] == verdict, (ran, result["graphs"]["skipped"])
    assert all(f"graphs.{s}" in rest for s in result["graphs"]["skipped"] if "reduce_overhead" not in s)
