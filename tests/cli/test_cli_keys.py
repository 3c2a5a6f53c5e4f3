"""medusa-eval / medusa-generate keys generated from the methods' own option declarations (``inference/cli_keys.py``):
every method option reachable, typed and documented from both command lines, declared once; replaced keys
refused in one line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from conftest import clean_env

import inference.cli as cli
from inference.cli_keys import REPLACED, EvalKeys, GenerateKeys, method_keys
from inference.methods.registry import get, names

# options fields that are no command-line key: runtime objects a choice sets (choice=auto / choice=<file>)
KEYLESS = {"schedule"}


def test_every_method_option_is_a_documented_command_line_key():
    """Guards against a method option the command line cannot set (no key in a schema) or that --help does not
    explain: each keyed field of each registered method is a key of both commands, with its help and default in
    medusa-eval --help; the only key-less fields are runtime objects a choice sets."""
    eval_keys = {f.name for f in dataclasses.fields(cli.EvalConfig)}
    generate_keys = {f.name for f in dataclasses.fields(cli.GenerateConfig)}
    text = cli.eval_help()
    for name in names():
        for f in dataclasses.fields(get(name).options):
            key = f.metadata.get("key")
            if key is None:
                assert f.name in KEYLESS, (name, f.name)
                continue
            assert key in eval_keys and key in generate_keys, (name, key)
            assert f.metadata.get("help"), (name, key)
            assert f"  {key} (default " in text and f.metadata["help"] in text, (name, key)


def test_method_keys_are_declared_once():
    """Guards against the commands re-declaring a method's keys and defaults (two places to change, drifting
    apart): the commands' own keys and the methods' keys meet only where a command key is also read by a
    method (trust_remote_code: the draft checkpoint's custom code), and an unset method key leaves the
    method's own default."""
    own = {f.name for f in dataclasses.fields(EvalKeys)} | {f.name for f in dataclasses.fields(GenerateKeys)}
    assert set(method_keys()) & own == {"trust_remote_code"}
    cfg = cli.EvalConfig()
    assert all(getattr(cfg, key) is None for key in method_keys() if key not in own)
    assert cli.GenerateConfig().tree == "tree4" and cli.GenerateConfig().choice == "fixed"
    assert cli.EvalConfig().choice == "auto"


@pytest.mark.parametrize("main, args, words", [
    (cli.eval_main, ["eagle_tree=auto"], REPLACED["eagle_tree"]),
    (cli.generate_main, ["heads=h", "prompt=hi", "eagle_tree=x.json"], REPLACED["eagle_tree"]),
    (cli.eval_main, ["batch_size=[1,2]", "batch_chains=fixed"], REPLACED["batch_chains"]),
    (cli.eval_main, ["tree=auto"], "tree=auto is gone: give choice=auto"),
    (cli.generate_main, ["heads=h", "prompt=hi", "tree=auto"], "tree=auto is gone: give choice=auto"),
])
def test_replaced_keys_are_one_line_with_what_to_give(capsys, main, args, words):
    """Guards against an old key (eagle_tree=, batch_chains=, tree=auto) failing as an unknown key or a
    traceback instead of saying what replaced it, before anything loads."""
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], lines


def test_generate_help_loads_no_runtime():
    """Guards against medusa-generate --help waiting for torch: the schemas built from the method registry
    are built only when a command runs."""
    code = ("import sys; from inference.cli import generate_main; generate_main(['--help']); "
            "print('HEAVY', [m for m in ('torch', 'transformers') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout and "choice" in proc.stdout


@pytest.mark.parametrize("main, keys", [(cli.eval_main, EvalKeys), (cli.generate_main, GenerateKeys)])
def test_help_lists_every_command_key_with_default_and_help(capsys, main, keys):
    """Guards against --help listing the method keys but not the command's own (num_prompts, max_new_tokens,
    out, prompts_file, ...) while a typo's error points the user at --help: every key of the command, its
    default and its one-line help, read from the key's one declaration (no second hand-written list)."""
    main(["--help"])
    text = capsys.readouterr().out
    method_only = set(method_keys()) - {f.name for f in dataclasses.fields(keys)}
    schema = cli.EvalConfig if keys is EvalKeys else cli.GenerateConfig
    own = [f for f in dataclasses.fields(schema) if f.name not in method_only and not f.metadata.get("removed")]
    named = {"max_new_tokens", "mode", "temperature", "threads", "kernels", "graphs", "draft_weights", "seed"} | (
        {"num_prompts", "out", "prompts", "turns", "calibration_prompts", "progress_bar", "batch_rounds"}
        if keys is EvalKeys else {"prompts_file", "prompt", "system"})
    assert named <= {f.name for f in own}
    for f in own:
        help_line = f.metadata.get("help")
        assert help_line and "\n" not in help_line, f.name
        line = next((l for l in text.splitlines() if l.startswith(f"  {f.name} (default ")), None)
        assert line is not None and line.endswith(help_line), (f.name, line)


@pytest.mark.parametrize("main, args, words", [
    (cli.eval_main, ["num_promts=10"], "unknown key 'num_promts': did you mean num_prompts"),
    (cli.generate_main, ["heads=h", "prompt=hi", "max_new_token=3"], "did you mean max_new_tokens?"),
    (cli.eval_main, ["tempreature=0.5"], "did you mean temperature?"),
])
def test_mistyped_key_suggests_the_closest_keys_in_one_line(capsys, main, args, words):
    """Guards against a typo answered only with "Key 'num_promts' not in 'EvalConfig'", leaving the user to
    search the keys: the one error line names the closest valid key(s), before anything loads."""
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], lines


def test_max_new_tokens_one_says_the_speedups_are_of_prefills(capsys):
    """Guards against medusa-eval max_new_tokens=1 printing speedups without a word that no draft was verified
    (each method's one token comes from the prompt's forward): the note is on stderr before anything loads."""
    from inference.cli_checks import check_eval_keys
    check_eval_keys(dataclasses.replace(cli.EvalConfig(), max_new_tokens=1))
    assert "compare prefills" in capsys.readouterr().err
    check_eval_keys(cli.EvalConfig())
    assert "prefills" not in capsys.readouterr().err


def test_a_third_turn_under_turns_both_is_not_dropped_without_a_word(tmp_path, capsys):
    """Guards against medusa-eval turns=both answering the first two turns of a three-turn record and dropping the
    third without a word (MT-Bench has two; a user's own file may have more)."""
    import json

    from inference.cli_checks import eval_prompts
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"turns": ["a", "b", "c"]}) + "\n" + json.dumps({"turns": ["x", "y"]}) + "\n")
    eval_prompts(dataclasses.replace(cli.EvalConfig(), prompts=str(f), turns="both"), {}, {}, None)
    assert "1 of the 2 prompts have more than two turns: turns=both answers the first two" in capsys.readouterr().err
