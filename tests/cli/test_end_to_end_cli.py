"""The debugging pipeline from the command line, as a user runs it: train -> eval -> export -> generate on
``debug_tiny`` (each step a subprocess, seconds in all), then training on the backbone a run kept."""

from __future__ import annotations

import json
import shlex
import subprocess

from conftest import TINY_DATA, clean_env, console_script


def _run(prog, *args, cwd):
    proc = subprocess.run([console_script(prog), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=clean_env(), timeout=300)
    assert proc.returncode == 0, f"{prog} {' '.join(map(str, args))}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr
    return proc


def report_ids(folder) -> dict:
    return json.loads((folder / "report.json").read_text())


def test_debug_tiny_runs_train_eval_export_generate(tmp_path):
    """Guards against: the debugging recipe's heads recording 'random:llama' as their backbone, so
    `medusa-eval heads=runs/debug_tiny/heads` refuses ("a random test model that cannot be rebuilt"):
    the random backbone must be saved with the run (<output_dir>/backbone, safetensors, model + tokenizer)
    and named as the heads' base model, so eval, export and generate work with no backbone= at all.
    Also guards against `backbone.name_or_path=<dir>` on debug_tiny silently training the recipe's random
    backbone (random_init winning over the named one)."""
    run = tmp_path / "runs" / "debug_tiny"
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in
                                                      ["Say hello.", "Count to three.", "Name a colour."]) + "\n")
    _run("medusa-train", "debug_tiny", "trainer.max_steps=2", f"data.source={TINY_DATA}", "trainer.threads=1",
         "logger.plot=false", "output_dir=runs/debug_tiny", cwd=tmp_path)
    kept = run / "backbone"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in kept.iterdir()}
    assert sum(p.stat().st_size for p in kept.iterdir()) < 2_000_000  # a few hundred kB
    spec = json.loads((run / "heads" / "config.json").read_text())
    assert spec["base_model"] == str(kept.resolve())

    _run("medusa-eval", "heads=runs/debug_tiny/heads", "prompts=prompts.jsonl", "num_prompts=2", "max_new_tokens=8",
         "kernels=stock", "tree=chain3", "progress_bar=false", "threads=1", cwd=tmp_path)
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["per_method"]["medusa"]["greedy_identical_fraction"] == 1.0  # lossless on the kept backbone

    # batched: the tree per batch size saved (medusa_choice.json), and medusa-generate's batches decoded with it
    proc = _run("medusa-eval", "heads=runs/debug_tiny/heads", "prompts=prompts.jsonl", "num_prompts=2",
                "max_new_tokens=8", "kernels=stock", "progress_bar=false", "threads=1", "calibration_prompts=1",
                "calibration_tokens=8", "batch_size=[1,2]", "out=runs/debug_tiny/eval_batched", cwd=tmp_path)
    path = run / "eval_batched" / "medusa_choice.json"
    saved = json.loads(path.read_text())
    sized = json.loads((run / "eval_batched" / "report.json").read_text())["batched"]["speculation"]["medusa"]
    assert saved["method"] == "medusa" and set(saved["schedule"]["choices"]) == {"1", "2"}
    assert {b: c["tree"]["name"] if c else "plain" for b, c in saved["schedule"]["choices"].items()} == sized["schedule"]
    assert saved["base_model_fingerprint"] == spec["base_model_fingerprint"] and set(saved["static_shapes"]) == {"1", "2"}
    assert f"prompts_file=prompts.jsonl batch_size=2 choice={path.relative_to(tmp_path)}" in proc.stdout
    proc = _run("medusa-generate", "heads=runs/debug_tiny/heads", f"choice={path.relative_to(tmp_path)}",
                "prompts_file=prompts.jsonl", "batch_size=2", "max_new_tokens=8", "kernels=stock", "threads=1",
                cwd=tmp_path)
    assert "batch of 2:" in proc.stderr and "batch of 1:" in proc.stderr
    # the same schedule measured again, on every prompt but the one that chose it (evaluated on its own choice,
    # that prompt once flattered it: the file records the digests of the prompts it was chosen on)
    proc = _run("medusa-eval", "heads=runs/debug_tiny/heads", "prompts=prompts.jsonl", "max_new_tokens=8",
                "kernels=stock", "progress_bar=false", "threads=1", "batch_size=[1,2]",
                f"choice={path.relative_to(tmp_path)}", "out=runs/debug_tiny/eval_again", cwd=tmp_path)
    report = json.loads((run / "eval_again" / "report.json").read_text())
    again = report["batched"]["speculation"]["medusa"]
    assert again["tree"] == "given" and again["schedule"] == sized["schedule"]
    assert len(saved["chosen_on_prompts"]) == 1 and "1 of the prompts chose" in proc.stderr
    assert report["choice_calibration_prompt_ids"] == report_ids(run / "eval_batched")["calibration_prompt_ids"]
    assert not set(report["evaluated_prompt_ids"]) & set(report["choice_calibration_prompt_ids"])

    _run("medusa-export", "heads=runs/debug_tiny/heads", "format=medusa_v1", "out=runs/debug_tiny/medusa_v1",
         "materialize=true", cwd=tmp_path)
    proc = _run("medusa-generate", "heads=runs/debug_tiny/medusa_v1", "prompt=Say hello.", "max_new_tokens=8",
                "kernels=stock", "tree=chain3", "threads=1", cwd=tmp_path)
    assert "tokens, tau" in proc.stderr

    # the named backbone wins over the recipe's random_init (and is not copied into the run)
    other = tmp_path / "runs" / "named"
    proc = _run("medusa-train", "debug_tiny", f"backbone.name_or_path={kept}", "trainer.max_steps=1",
                f"data.source={TINY_DATA}", "trainer.threads=1", "logger.plot=false", f"output_dir={other}",
                cwd=tmp_path)
    assert f"backbone {kept.resolve()}" in proc.stdout
    assert json.loads((other / "heads" / "config.json").read_text())["base_model"] == str(kept.resolve())
    assert not (other / "backbone").exists()


def test_eagle3_drafter_from_the_command_line(tmp_path):
    """Guards against: an eagle3 drafter that trains but cannot be evaluated, exported or generated with from
    the CLI — eval picking the static-tree medusa method for it, an export the runtime cannot import back
    (the vLLM/SGLang directory must load as the same drafter), generate refusing its own heads, or an
    choice=auto choice that medusa-generate cannot decode with (eagle3_lookup_choice.json)."""
    run = tmp_path / "runs" / "e3"
    # three: with calibration_prompts=1 held out (never evaluated), the batched run below still evaluates two
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in
                                                      ["Say hello.", "Count to three.", "Name a colour."]) + "\n")
    _run("medusa-train", "debug_tiny", "heads.kind=eagle3", "backbone.random_init.num_hidden_layers=4",
         "heads.ttt_steps=2", "trainer.max_steps=2",
         f"data.source={TINY_DATA}", "trainer.threads=1", "logger.plot=false", "output_dir=runs/e3", cwd=tmp_path)
    spec = json.loads((run / "heads" / "config.json").read_text())
    assert spec["kind"] == "eagle3" and spec["num_heads"] == 2

    _run("medusa-eval", "heads=runs/e3/heads", "methods=[eagle3]", "prompts=prompts.jsonl", "num_prompts=2",
         "max_new_tokens=8", "kernels=stock", "progress_bar=false", "threads=1", "choice=fixed", "eagle_nodes=4",
         "eagle_depth=3",
         "eagle_topk=2", "eagle_min_prob=0.01",
         cwd=tmp_path)
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["per_method"]["eagle3"]["greedy_identical_fraction"] == 1.0
    assert report["method_options"]["eagle3"]["eagle_min_prob"] == 0.01
    assert len(report["per_method"]["eagle3"]["n_alpha"]) == 3
    assert not list((run / "eval").glob("*_choice.json"))  # a fixed tree: nothing chosen, nothing to reuse

    # the default method (eagle3_lookup) at choice=auto: its choice saved by the evaluation and decoded
    # by medusa-generate as measured
    proc = _run("medusa-eval", "heads=runs/e3/heads", "prompts=prompts.jsonl", "num_prompts=1", "max_new_tokens=8",
                "kernels=stock", "progress_bar=false", "threads=1", "calibration_prompts=1", "calibration_tokens=8",
                "out=runs/e3/eval_auto", cwd=tmp_path)
    path = run / "eval_auto" / "eagle3_lookup_choice.json"
    choice = json.loads(path.read_text())
    chosen = json.loads((run / "eval_auto" / "report.json").read_text())["method_options"]["eagle3_lookup"]
    at_one = choice["schedule"]["choices"]["1"] or {"eagle_nodes": 0, "eagle_lookup_tokens": 0}   # null: plain
    assert choice["method"] == "eagle3_lookup" and at_one["eagle_nodes"] == chosen["eagle_nodes"]
    assert at_one["eagle_lookup_tokens"] == chosen["eagle_lookup_tokens"]
    assert choice["base_model_fingerprint"] == spec["base_model_fingerprint"]
    printed = next(x for x in proc.stdout.splitlines() if x.startswith("decode with eagle3_lookup's choice: "))
    argv = shlex.split(printed.split(": ", 1)[1])   # the line that decodes with it, run as printed
    assert argv[0] == "medusa-generate" and f"choice={path.relative_to(tmp_path)}" in argv, printed
    assert "max_new_tokens=8" in argv, printed   # the evaluation's answers' length
    proc = _run(*argv, "kernels=stock", "threads=1", cwd=tmp_path)
    assert "tokens, tau" in proc.stderr
    # batched: the choice per batch size saved, and medusa-generate's batches decoded with that schedule
    proc = _run("medusa-eval", "heads=runs/e3/heads", "prompts=prompts.jsonl", "num_prompts=2", "max_new_tokens=8",
                "kernels=stock", "progress_bar=false", "threads=1", "calibration_prompts=1", "calibration_tokens=8",
                "batch_size=[1,2]", "out=runs/e3/eval_batched", cwd=tmp_path)
    path = run / "eval_batched" / "eagle3_lookup_choice.json"
    choice = json.loads(path.read_text())
    sized = json.loads((run / "eval_batched" / "report.json").read_text())["batched"]["speculation"]["eagle3_lookup"]
    assert set(choice["schedule"]["choices"]) == {"1", "2"}
    assert {b: c is None for b, c in choice["schedule"]["choices"].items()} == \
        {b: v == "plain" for b, v in sized["schedule"].items()}
    assert f"prompts_file=prompts.jsonl batch_size=2 choice={path.relative_to(tmp_path)}" in proc.stdout
    (tmp_path / "three.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in ["Hi.", "Yes?", "No."]) + "\n")
    proc = _run("medusa-generate", "heads=runs/e3/heads", f"choice={path.relative_to(tmp_path)}",
                "prompts_file=three.jsonl", "batch_size=2", "max_new_tokens=8", "kernels=stock", "threads=1",
                cwd=tmp_path)
    assert [f"=== [{i}/3]" in proc.stdout for i in (1, 2, 3)] == [True] * 3
    assert "batch of 2:" in proc.stderr and "batch of 1:" in proc.stderr

    _run("medusa-export", "heads=runs/e3/heads", "format=eagle3", "out=runs/e3/eagle3", cwd=tmp_path)
    cfg = json.loads((run / "eagle3" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    proc = _run("medusa-generate", "heads=runs/e3/eagle3", f"backbone={run / 'backbone'}", "prompt=Say hello.",
                "max_new_tokens=8", "kernels=stock", "threads=1", cwd=tmp_path)
    assert "tokens, tau" in proc.stderr
