"""Every user mistake on every command line, in one table: one ``<prog>: error: ...`` line, exit 2,
before anything heavy loads, and nothing written.

Each row is (command, argv, exit code, a phrase of the error line). ``{tmp}`` in an argument is the
test's folder, which holds a few fixtures (``setup``): a plain file, a 3-head export whose recorded
backbone does not exist (so a check that only happens after loading the backbone would fail with
"not found" instead of the row's phrase), a GPT-2 ``config.json`` with 2048 positions and no weights
(so a check that loads weights would fail differently), and a prompts file. medusa-train rows get
the tiny data and ``output_dir={tmp}/out`` unless they name their own output_dir.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import TINY_DATA, clean_env, console_script

HEADS = "{tmp}/heads3"
TRAIN, EVAL, GEN, EXPORT = "medusa-train", "medusa-eval", "medusa-generate", "medusa-export"

BAD_INPUT = [
    # -- medusa-train: words that are not overrides (defect 9) -----------------------------------------------
    (TRAIN, ["debug_tiny", "oops"], 2, "key=value overrides or Hydra flags, got 'oops'"),
    (TRAIN, ["debug_tiny", "--bogus"], 2, "unsupported flag '--bogus'"),
    (TRAIN, ["debug_tiny", "-m", "oops"], 2, "got 'oops'"),
    (TRAIN, ["debug_tiny", "--cfg"], 2, "--cfg takes job, hydra or all"),
    (TRAIN, ["nope"], 2, "unknown recipe 'nope'"),
    (TRAIN, ["debug_tiny", "trainer.nope=1"], 2, "trainer.nope"),
    # a heads key of no family is a typo: unknown, with the closest keys (not "no keys of its own")
    (TRAIN, ["debug_tiny", "heads.num_head=3"], 2, "unknown key heads.num_head: did you mean heads.num_heads?"),
    (TRAIN, ["debug_tiny", "heads=eagle3", "heads.ttt_step=3"], 2, "did you mean heads.ttt_steps?"),
    (TRAIN, ["debug_tiny", "trainer.max_steps=3", "trainer.max_steps=4"], 2, "trainer.max_steps is given twice"),
    # -- optimizer values (defect 7) ---------------------------------------------------------------------------
    (TRAIN, ["debug_tiny", "optim.lr=-1"], 2, "optim.lr must be finite and > 0"),
    (TRAIN, ["debug_tiny", "optim.lr=0"], 2, "optim.lr must be finite and > 0"),
    (TRAIN, ["debug_tiny", "optim.betas=[1.5,0.9]"], 2, "optim.betas must be two values in [0, 1)"),
    (TRAIN, ["debug_tiny", "optim.betas=[0.9]"], 2, "optim.betas must be two values"),
    (TRAIN, ["debug_tiny", "optim.weight_decay=-1"], 2, "optim.weight_decay must be finite and >= 0"),
    (TRAIN, ["debug_tiny", "optim.eps=-1"], 2, "optim.eps must be finite and > 0"),
    (TRAIN, ["debug_tiny", "optim.warmup_steps=-1"], 2, "optim.warmup_steps must be >= 0"),
    (TRAIN, ["debug_tiny", "optim.min_lr_ratio=2"], 2, "optim.min_lr_ratio must be in [0, 1]"),
    # -- output_dir (defect 8) ------------------------------------------------------------------------------------
    (TRAIN, ["debug_tiny", "output_dir={tmp}/afile"], 2, "is a file, not a folder"),
    (TRAIN, ["debug_tiny", "output_dir={tmp}/afile/run"], 2, "cannot be created"),
    # -- data.max_length against the backbone's positions and this machine's memory (defect 6) ----------------
    (TRAIN, ["debug_tiny", "data.max_length=1024"], 2, "exceeds the 512 positions of the backbone"),
    (TRAIN, ["debug_tiny", "backbone.name_or_path={tmp}/gpt2", "data.max_length=4096"], 2,
     "data.max_length=4096 exceeds the 2048 positions"),
    (TRAIN, ["debug_tiny", "backbone.random_init.max_position_embeddings=2000000", "data.max_length=1000000"], 2,
     "lower data.max_length or trainer.micro_batch_size"),
    # -- backbone named twice (defect 5: an explicit name_or_path alone clears random_init) -----------------------
    (TRAIN, ["debug_tiny", "backbone.name_or_path={tmp}/gpt2", "backbone.random_init.hidden_size=32"], 2,
     "both name a backbone"),
    (TRAIN, ["debug_tiny", "backbone.name_or_path=embedded:smollm2", "backbone.random_init.hidden_size=64"], 2,
     "both name a backbone"),  # the default's name: trained the random backbone
    (TRAIN, ["debug_tiny", "backbone.name_or_path={tmp}/missing"], 2, "path not found"),
    # -- eagle3 drafters that cannot fit the backbone, refused from its config alone ---------------------------------
    (TRAIN, ["debug_tiny", "heads.kind=eagle3", "backbone.name_or_path={tmp}/gpt2"], 2,
     "cannot build an EAGLE-3 decoder layer for gpt2"),
    (TRAIN, ["debug_tiny", "heads.kind=eagle3", "heads.aux_layers=[0,1,5]"], 2, "heads.aux_layers [5] are out of range"),
    # id 0 trained fully, then the export refused it (engines capture no residual before layer 0)
    (TRAIN, ["debug_tiny", "heads.kind=eagle3", "backbone.random_init.num_hidden_layers=4", "heads.aux_layers=[0,1,2]"],
     2, "heads.aux_layers cannot name 0, the embeddings"),
    (TRAIN, ["debug_tiny", "heads.kind=eagle3", "heads.aux_layers=[0,1]"], 2, "must name 3 backbone layers"),
    (TRAIN, ["debug_tiny", "heads.kind=eagle3", "backbone.random_init.num_hidden_layers=1"], 2,
     "this one has 1 layer(s): use heads.kind=hydra or medusa, or a target of 4+ layers (a random debug backbone: "
     "backbone.random_init.num_hidden_layers=4)"),
    (TRAIN, ["debug_tiny", "heads.kind=eagle3", "heads.draft_vocab_size=999"], 2,
     "heads.draft_vocab_size=999 exceeds the backbone vocabulary (320)"),
    # trained a 64-token lm_head, said only in the start-up line
    (TRAIN, ["debug_tiny", "heads.kind=eagle3", "heads.projection=own", "heads.draft_vocab_size=64"], 2,
     "heads.projection=own asks for a full-vocabulary lm_head but heads.draft_vocab_size=64 truncates it"),
    (TRAIN, ["debug_tiny", "heads.ttt_steps=2"], 2, "heads.ttt_steps is an eagle3 setting"),
    (TRAIN, ["debug_tiny", "heads.kind=eagle3", "heads.num_layers=2"], 2, "heads.num_layers must be 1"),
    # -- tree deeper than the heads, refused before the backbone loads (defect 10) ---------------------------------
    (GEN, [f"heads={HEADS}", "prompt=hi", "tree=chain6"], 2, "tree chain6 needs 5 heads, these heads have 3"),
    (GEN, [f"heads={HEADS}", "prompt=hi", "tree={tmp}/deep_tree.json"], 2, "has depth 4 but the heads only predict 3"),
    (EVAL, [f"heads={HEADS}", "tree=chain6", "prompts={tmp}/prompts.jsonl"], 2, "tree chain6 needs 5 heads"),
    (EVAL, [f"heads={HEADS}", "tree=nosuchtree", "prompts={tmp}/prompts.jsonl"], 2, "unknown tree 'nosuchtree'"),
    # -- keys the run would not read, taken silently and recorded in report.json as if applied ----------------------
    (EVAL, [f"heads={HEADS}", "prompts={tmp}/prompts.jsonl", "temperature=0.3"], 2,
     "temperature= is not read with mode=greedy (the default): it applies to mode=sample or typical"),
    (GEN, [f"heads={HEADS}", "prompt=hi", "mode=sample", "typical_delta=0.2"], 2,
     "typical_delta= is not read with mode=sample: it applies to mode=typical"),
    (EVAL, [f"heads={HEADS}", "prompts={tmp}/prompts.jsonl", "batch_rounds=3"], 2,
     "batch_rounds= is read by a batched evaluation only"),
    (EVAL, [f"heads={HEADS}", "prompts={tmp}/prompts.jsonl", "choice=fixed", "tree=chain3", "tree_budgets=[4]"], 2,
     "tree_budgets= is read when a choice is measured, and none is measured here (choice=fixed)"),
    (EVAL, [f"heads={HEADS}", "prompts={tmp}/prompts.jsonl", "choice=fixed", "calibration_prompts=1000000000"], 2,
     "calibration_prompts= is read when a choice is measured"),
    # 10^9 rounds ran until killed
    (EVAL, [f"heads={HEADS}", "prompts={tmp}/prompts.jsonl", "batch_size=[1,2]", "batch_rounds=1000000000"], 2,
     "batch_rounds must be an integer in 1..100"),
    # OmegaConf's "AnyNode is not a ListConfig, list or tuple"; YAML's "unacceptable character #xdce9"
    (EVAL, [f"heads={HEADS}", "prompts={tmp}/prompts.jsonl", "methods=medusa,draft"], 2,
     "methods= takes a list: methods=[medusa,draft]"),
    (GEN, [f"heads={HEADS}", "prompt=caf\udce9"], 2, "prompt= is not UTF-8 text (byte 0xe9)"),
    # a folder was "unknown tree 'pdir'", a device "prompts file not found"
    (GEN, [f"heads={HEADS}", "prompt=hi", "tree={tmp}"], 2, "is a folder, not a tree file"),
    (EVAL, [f"heads={HEADS}", "prompts=/dev/null"], 2, "/dev/null is not a regular file: give a JSONL file"),
    # -- bad prompt, missing files and required keys (inference/cli_support.py) ---------------------------------
    (GEN, [f"heads={HEADS}", "prompt=   "], 2, 'prompt="..." is required'),
    # -- chat template arguments: a mapping of template variables, never apply_chat_template's own settings ----
    (GEN, [f"heads={HEADS}", "prompt=hi", "chat_template_args={enable_thinking:false}"], 2,
     "'enable_thinking:false' is not a template variable name; write chat_template_args.<name>=<value>"),
    (GEN, [f"heads={HEADS}", "prompt=hi", "chat_template_args.tokenize=false"], 2,
     "chat_template_args.tokenize is apply_chat_template's own setting"),
    (EVAL, [f"heads={HEADS}", "prompts={tmp}/prompts.jsonl", "chat_template_args.add_generation_prompt=false"], 2,
     "chat_template_args.add_generation_prompt is apply_chat_template's own setting"),
    (TRAIN, ["debug_tiny", "backbone.chat_template_args.return_dict=true"], 2,
     "backbone.chat_template_args.return_dict is apply_chat_template's own setting"),
    (GEN, ["prompt=hi"], 2, "heads= is required"),
    (GEN, ["heads={tmp}/nowhere", "prompt=hi"], 2, "heads directory not found"),
    (GEN, [f"heads={HEADS}", "hello"], 2, "key=value overrides, got 'hello'"),
    (EVAL, [f"heads={HEADS}", "prompts={tmp}/missing.jsonl"], 2, "prompts file not found"),
    (EVAL, [f"heads={HEADS}", "num_prompts=0", "prompts={tmp}/prompts.jsonl"], 2, "num_prompts must be >= 1"),
    (EVAL, ["oops"], 2, "key=value overrides, got 'oops'"),
    # -- batched evaluation / generation (batch_size=, several prompts) -----------------------------------------
    (EVAL, [f"heads={HEADS}", "batch_size=0", "prompts={tmp}/prompts.jsonl"], 2,
     "batch_size must be an integer >= 1, got 0"),
    (EVAL, [f"heads={HEADS}", "batch_size=-4", "prompts={tmp}/prompts.jsonl"], 2,
     "batch_size must be an integer >= 1, got -4"),
    (EVAL, [f"heads={HEADS}", "batch_size=[4,8]", "batch_rounds=0", "prompts={tmp}/prompts.jsonl"], 2,
     "batch_rounds must be an integer in 1..100, got 0"),
    (EVAL, [f"heads={HEADS}", "batch_size=[4,8]", "batch_chains=short", "prompts={tmp}/prompts.jsonl"], 2,
     "batch_chains= is gone: give choice=auto (chain lengths sized per batch size) or choice=fixed"),
    (EVAL, [f"heads={HEADS}", "batch_size=2.5", "prompts={tmp}/prompts.jsonl"], 2,
     "batch_size must be an integer >= 1, got 2.5"),
    (EVAL, [f"heads={HEADS}", "batch_size=many", "prompts={tmp}/prompts.jsonl"], 2,
     "batch_size must be an integer >= 1, got 'many'"),
    (EVAL, [f"heads={HEADS}", "batch_size=[1,2,0]", "prompts={tmp}/prompts.jsonl"], 2,
     "batch_size must be an integer >= 1 or a list of them: 0 in [1, 2, 0]"),
    (EVAL, [f"heads={HEADS}", "batch_size=[1,x]", "prompts={tmp}/prompts.jsonl"], 2, "'x' in [1, 'x']"),
    (EVAL, ["methods=[lookahead]", "batch_size=4", "prompts={tmp}/prompts.jsonl"], 2,
     "method lookahead decodes one prompt at a time, so batch_size=4 cannot run it; methods that decode batches: "),
    (EVAL, ["compare=true", "batch_size=[2,4]", "prompts={tmp}/prompts.jsonl"], 2,
     "compare=true measures one prompt at a time"),
    (EVAL, [f"heads={HEADS}", "batch_size=2", "turns=both", "prompts={tmp}/prompts.jsonl"], 2,
     "batch_size decodes first turns only"),
    (GEN, [f"heads={HEADS}", "prompt=[hi, yo]", "batch_size=0"], 2, "batch_size must be an integer >= 1, got 0"),
    (GEN, [f"heads={HEADS}", "prompt=[hi, '']"], 2, "prompt 2 of 2 is empty"),
    (GEN, [f"heads={HEADS}", "prompt=hi", "prompts_file={tmp}/prompts.jsonl"], 2, "give one of prompt= or prompts_file="),
    (GEN, [f"heads={HEADS}", "prompts_file={tmp}/missing.jsonl"], 2, "prompts file not found"),
    (EXPORT, [f"heads={HEADS}"], 2, "format= and out= are required"),
    (EXPORT, ["heads={tmp}/nowhere", "format=vllm", "out={tmp}/o"], 2, "not found"),
    # a base_model= the engine could not load: written into its config and serve command with no word
    (EXPORT, [f"heads={HEADS}", "format=vllm", "out={tmp}/o", "base_model={tmp}/missing"], 2,
     "missing: no such folder"),
    (EXPORT, [f"heads={HEADS}", "format=tgi", "out={tmp}/o", "base_model=./typo_dir"], 2,
     "base_model=./typo_dir: no such folder"),
    (EXPORT, [f"heads={HEADS}", "format=vllm", "out={tmp}/o", "base_model={tmp}/gpt2_wide"], 2,
     "hidden"),
]


def _row_id(row):
    prog, argv, _, _ = row
    return f"{prog.split('-')[1]}:{' '.join(a.replace('{tmp}/', '') for a in argv)}"[:60]


@pytest.fixture
def setup(tmp_path) -> Path:
    from inference.heads.native import save_heads
    from inference.heads.registry import build_heads
    from inference.heads.spec import HeadsSpec

    (tmp_path / "afile").write_text("not a folder\n")
    heads = tmp_path / "heads3"
    spec = HeadsSpec(num_heads=3, num_layers=1, hidden_size=64, vocab_size=320, projection="own",
                     base_model=str(tmp_path / "no_such_backbone"))
    save_heads(build_heads(spec), heads)   # a sound header (checked before loading); never loaded: every row fails first
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "n_positions": 2048, "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 320,
        "bos_token_id": 0, "eos_token_id": 0}))
    (tmp_path / "gpt2_wide").mkdir()   # another model's folder: hidden size 128, the heads' 64
    (tmp_path / "gpt2_wide" / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "n_positions": 2048, "n_embd": 128, "n_layer": 2, "n_head": 2, "vocab_size": 320}))
    (tmp_path / "deep_tree.json").write_text(json.dumps([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]))  # Medusa choices
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "Say hello."}) + "\n")
    return tmp_path


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")}


@pytest.mark.parametrize("prog, argv, code, phrase", BAD_INPUT, ids=[_row_id(r) for r in BAD_INPUT])
def test_bad_input_is_one_line_before_loading(prog, argv, code, phrase, setup):
    """Guards against: a user mistake (bad recipe key or value, bare word, unsupported flag, output_dir that
    is a file, data.max_length beyond the backbone's positions or this machine's memory, a backbone named
    twice, a tree deeper than the heads, a bad prompt, a missing file or key) ending in a traceback, a
    multi-line Hydra/OmegaConf dump, a silent wrong run, or an error only after the backbone/data loaded;
    and against such a run writing anything (Hydra's .hydra folder, checkpoints, reports)."""
    tmp = setup
    args = [a.replace("{tmp}", str(tmp)) for a in argv]
    if prog == TRAIN and len(args) > 1:
        if not any(a.startswith("output_dir=") for a in args):
            args.append(f"output_dir={tmp / 'out'}")
        args += [f"data.source={TINY_DATA}", "logger.wandb=disabled", "trainer.progress_bar=false",
                 "trainer.threads=1"]
    before = _snapshot(tmp)
    proc = subprocess.run([console_script(prog), *args], capture_output=True, text=True, cwd=tmp, env=clean_env(),
                          timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[transformers]")]
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    assert phrase in lines[0], (phrase, lines[0])
    assert _snapshot(tmp) == before, "a refused command wrote files"
