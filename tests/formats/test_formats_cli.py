"""``medusa-export``: key=value overrides, one-line errors with exit code 2, backbone only when needed."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from conftest import call_main, console_script
from engine_specs import check_tensorrt_llm, check_tgi, check_vllm
from inference.export_cli import export_main
from inference.heads.native import save_heads
from runtime_support import one_thread, random_heads, tiny_llama  # noqa: F401  (one_thread: autouse fixture)

VOCAB, HIDDEN = 259, 32  # 259: the byte tokenizer the saved backbone ships with


@pytest.fixture(scope="module")
def backbone_dir(tmp_path_factory):
    """A tiny Llama saved with a tokenizer, as a local backbone path ``load_backbone`` can read."""
    from medusa_train.backbone import byte_tokenizer

    d = tmp_path_factory.mktemp("backbone")
    model = tiny_llama(vocab=VOCAB, hidden=HIDDEN)
    model.save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d, model


def heads_dir(tmp_path, model, projection="own", num_layers=1, base_model="random:llama"):
    heads = random_heads(model, projection=projection, num_layers=num_layers,
                         truncated=40 if projection == "truncated" else None)
    heads.spec.base_model = base_model
    return save_heads(heads, tmp_path / f"heads-{projection}")


def run(argv, capsys):
    """(exit code, stdout, stderr lines) of an in-process ``medusa-export`` call."""
    code, out, err = call_main(export_main, argv, capsys)
    return code, out, [l for l in err.splitlines() if l.strip()]


def assert_one_line_error(code, err, *words):
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("medusa-export: error: "), err
    for w in words:
        assert w in err[0], (w, err[0])


def test_export_to_vllm_writes_the_dir_and_says_how_to_serve(backbone_dir, tmp_path, capsys):
    """Guards against: the command writing something other than the engine layout, or leaving the
    user without the serve command and the warning that 'random:' is no engine-loadable model."""
    _, model = backbone_dir
    src = heads_dir(tmp_path, model)
    code, out, err = run([f"heads={src}", "format=vllm", f"out={tmp_path / 'v'}"], capsys)
    assert code == 0, err
    assert check_vllm(tmp_path / "v", HIDDEN, VOCAB) == []
    assert "vllm serve" in out and "num_speculative_tokens\": 3" in out
    assert "pass base_model=" in out and "wrote" in out


def test_base_model_override_is_written_to_the_config(backbone_dir, tmp_path, capsys):
    """Guards against: engines being pointed at the recorded name when the user gave the real hub id."""
    _, model = backbone_dir
    src = heads_dir(tmp_path, model)
    code, out, err = run([f"heads={src}", "format=tgi", f"out={tmp_path / 'g'}", "base_model=org/real-model"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "g" / "config.json").read_text())["base_model_name_or_path"] == "org/real-model"
    assert check_tgi(tmp_path / "g", HIDDEN, VOCAB) == []


def test_shared_heads_read_the_backbone_only_when_the_format_needs_it(backbone_dir, tmp_path, capsys):
    """Guards against: loading a (possibly large) backbone for TGI v2, which needs no lm_head copy, and
    materialising for TensorRT-LLM without the backbone's real lm_head."""
    bdir, model = backbone_dir
    src = heads_dir(tmp_path, model, projection="shared", base_model=str(bdir))
    code, out, err = run([f"heads={src}", "format=tgi", f"out={tmp_path / 'g'}"], capsys)
    assert code == 0 and not any("reading the lm_head" in l for l in err), err
    code, out, err = run([f"heads={src}", "format=tensorrt_llm", f"out={tmp_path / 't'}", "materialize=true"], capsys)
    assert code == 0, err
    assert any("reading the lm_head" in l for l in err) and "materialised for tensorrt_llm" in out
    assert check_tensorrt_llm(tmp_path / "t", HIDDEN, VOCAB, num_medusa_heads=3) == []
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(tmp_path / "t" / "medusa_lm_head.safetensors"))["2.1.weight"],
                       model.get_output_embeddings().weight)


def test_not_a_heads_dir_is_one_line_exit_2(tmp_path, capsys):
    """Guards against: a traceback for a directory that holds no heads."""
    (tmp_path / "empty").mkdir()
    code, _, err = run([f"heads={tmp_path / 'empty'}", "format=vllm", f"out={tmp_path / 'o'}"], capsys)
    assert_one_line_error(code, err, "is not a heads export")


def test_unknown_format_is_one_line_exit_2(backbone_dir, tmp_path, capsys):
    """Guards against: a typo in format= loading anything or writing anything."""
    code, _, err = run([f"heads={tmp_path}", "format=onnx", f"out={tmp_path / 'o'}"], capsys)
    assert_one_line_error(code, err, "unknown format 'onnx'", "vllm", "tensorrt_llm")
    assert not (tmp_path / "o").exists()


def test_non_empty_out_without_overwrite_is_one_line_exit_2(backbone_dir, tmp_path, capsys):
    """Guards against: replacing a directory the user did not ask to replace; and overwrite=true deleting a
    folder that is no export (here: files without a config.json), where a previous export is replaced."""
    _, model = backbone_dir
    src = heads_dir(tmp_path, model)
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x").write_text("keep")
    code, _, err = run([f"heads={src}", "format=vllm", f"out={tmp_path / 'o'}"], capsys)
    assert_one_line_error(code, err, "is not empty", "overwrite=true")
    code, _, err = run([f"heads={src}", "format=vllm", f"out={tmp_path / 'o'}", "overwrite=true"], capsys)
    assert_one_line_error(code, err, "is not an export")
    assert (tmp_path / "o" / "x").read_text() == "keep"
    code, _, err = run([f"heads={src}", "format=vllm", f"out={tmp_path / 'v'}"], capsys)
    assert code == 0, err
    code, _, err = run([f"heads={src}", "format=tgi", f"out={tmp_path / 'v'}", "overwrite=true"], capsys)
    assert code == 0, err   # a previous export: replaced


@pytest.mark.parametrize("victim", ["model", "heads", "download"])
def test_overwrite_never_replaces_a_model_other_heads_or_a_foreign_drafter(victim, backbone_dir, tmp_path, capsys):
    """Guards against the data loss of overwrite=true on a flat folder with a config.json that is no export of
    ours: a model folder (a backbone with its tokenizer), another run's heads, a downloaded drafter holding
    other files (a .pt). Each was replaced by the export, exit 0. Nothing may change on disk."""
    from inference.heads.native import save_heads as save

    bdir, model = backbone_dir
    src = heads_dir(tmp_path, model)
    out = tmp_path / "victim"
    if victim == "model":
        model.save_pretrained(out)
        (out / "generation_config.json").write_text("{}")
    elif victim == "heads":
        save(random_heads(model, seed=3), out)
    else:
        assert run([f"heads={src}", "format=tgi", f"out={out}"], capsys)[0] == 0
        (out / "medusa_lm_head.pt").write_bytes(b"a download's own weights")
    capsys.readouterr()   # save_pretrained's progress lines
    before = _snapshot(out)
    for fmt in ("vllm", "tgi"):
        code, _, err = run([f"heads={src}", f"format={fmt}", f"out={out}", "overwrite=true"], capsys)
        assert_one_line_error(code, err, "is not an export")
        assert _snapshot(out) == before


def test_every_exported_file_is_one_overwrite_may_replace(backbone_dir, tmp_path, capsys):
    """Guards against: an exporter writing a file name it did not declare (``register_exporter(files=)``), so that its own export could
    not be replaced with overwrite=true (refused as no export)."""
    from inference.formats.export import export_files

    bdir, model = backbone_dir
    src = heads_dir(tmp_path, model, base_model=str(bdir))
    for fmt in ("vllm", "tgi", "tensorrt_llm", "medusa_v1"):
        out = tmp_path / fmt
        assert run([f"heads={src}", f"format={fmt}", f"out={out}"], capsys)[0] == 0
        assert {f.name for f in out.iterdir()} <= export_files()
        code, _, err = run([f"heads={src}", f"format={fmt}", f"out={out}", "overwrite=true"], capsys)
        assert code == 0, err


def _snapshot(root):
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("out, words", [
    ("run", ("holds heads=", "would delete the heads it reads")),             # the run folder the heads are in
    ("link_to_run", ("holds heads=", "would delete the heads it reads")),     # the same, through a symlink
    (".", ("holds heads=",)),                                                 # two levels up
    ("run/heads/sub", ("is inside heads=",)),
    ("run/heads", ("must differ from heads=",)),
    ("other_run", ("is not an export",)),                                     # a training run: checkpoints/
])
def test_out_holding_or_inside_the_heads_or_a_run_is_refused_whatever_overwrite_says(out, words, backbone_dir,
                                                                                     tmp_path, capsys, monkeypatch):
    """Guards against the data loss of medusa-export heads=RUN/heads out=RUN overwrite=true: exit 0 and the
    whole run folder, the heads it read included, deleted (the atomic replace renames out= aside and removes
    it); out= inside the heads; and overwrite=true deleting a training run's folder (checkpoints/) that is
    no export. Nothing may change on disk."""
    _, model = backbone_dir
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    src = save_heads(random_heads(model), run_dir / "heads")
    (run_dir / "checkpoints" / "step1").mkdir(parents=True)
    (run_dir / "checkpoints" / "step1" / "state.pt").write_bytes(b"weights")
    (run_dir / "metrics.jsonl").write_text("{}\n")
    other = tmp_path / "other_run"
    (other / "checkpoints").mkdir(parents=True)
    (other / "config.json").write_text("{}")
    (tmp_path / "link_to_run").symlink_to(run_dir)
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path)
    code, _, err = run([f"heads={src}", "format=vllm", f"out={out}", "overwrite=true"], capsys)
    assert_one_line_error(code, err, *words)
    assert _snapshot(tmp_path) == before


def test_other_head_kinds_are_refused_before_loading(tmp_path, capsys):
    """Guards against: Hydra heads reaching a Medusa exporter, or failing on some load-time detail
    instead of the one line that says this format has no exporter for their kind."""
    d = tmp_path / "hydra"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_heads": 2, "num_layers": 1, "hidden_size": HIDDEN,
                                               "vocab_size": VOCAB, "kind": "hydra"}))
    (d / "model.safetensors").write_bytes(b"")
    code, _, err = run([f"heads={d}", "format=tensorrt_llm", f"out={tmp_path / 'o'}"], capsys)
    assert_one_line_error(code, err, "format tensorrt_llm has no exporter for heads of kind 'hydra'")


def test_pickle_needing_code_is_one_line_exit_2(tmp_path, capsys):
    """Guards against: re-exporting a downloaded .pt that would run code when unpickled."""

    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    d = tmp_path / "evil"
    d.mkdir()
    torch.save({"0.0.linear.weight": Payload()}, d / "medusa_lm_head.pt")
    code, out, err = run([f"heads={d}", "format=vllm", f"out={tmp_path / 'o'}"], capsys)
    assert_one_line_error(code, err, "needs arbitrary code to unpickle")
    assert "ran" not in out


def test_reference_dir_reexports_with_the_weight_count_warning(tmp_path, capsys):
    """Guards against: a wrong config head count being hidden from the user during re-export."""
    g = torch.Generator().manual_seed(0)
    sd = {}
    for h in range(2):
        sd[f"{h}.0.linear.weight"] = torch.randn(HIDDEN, HIDDEN, generator=g)
        sd[f"{h}.0.linear.bias"] = torch.randn(HIDDEN, generator=g)
        sd[f"{h}.1.weight"] = torch.randn(VOCAB, HIDDEN, generator=g)
    d = tmp_path / "ref"
    d.mkdir()
    torch.save(sd, d / "medusa_lm_head.pt")
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "medusa_num_layers": 1,
                                               "base_model_name_or_path": "org/base"}))
    code, out, err = run([f"heads={d}", "format=vllm", f"out={tmp_path / 'v'}"], capsys)
    assert code == 0, err
    assert err == ["medusa-export: warning: " + err[0].removeprefix("medusa-export: warning: ")]
    assert "medusa_num_heads=5" in err[0] and "holds 2" in err[0]
    assert check_vllm(tmp_path / "v", HIDDEN, VOCAB) == []


def test_console_script_exits_2_with_one_line(tmp_path):
    """Guards against: the installed entry point (not just export_main) losing the one-line / exit 2
    contract, e.g. through an import-time crash."""
    proc = subprocess.run([console_script("medusa-export"), f"heads={tmp_path}", "format=nope", f"out={tmp_path}/o"],
                          capture_output=True, text=True, timeout=120)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "unknown format 'nope'" in lines[0], proc.stderr


def test_tensorrt_llm_command_passes_the_layer_count_and_the_tree(backbone_dir, tmp_path, capsys):
    """Guards against: the printed convert command leaving --num_medusa_layers at its default (1), so
    trtllm-build silently keeps one of two layers per head; and no tree no deeper than the heads."""
    from engine_specs import check_tree_file, tensorrt_llm_convert, tensorrt_llm_flags

    _, model = backbone_dir
    src = heads_dir(tmp_path, model, num_layers=2)
    code, out, err = run([f"heads={src}", "format=tensorrt_llm", f"out={tmp_path / 't'}"], capsys)
    assert code == 0, err
    serve = next(l for l in out.splitlines() if l.startswith("serve: "))
    flags = tensorrt_llm_flags(serve)
    assert flags == {"num_medusa_heads": 3, "num_medusa_layers": 2}
    assert tensorrt_llm_convert(tmp_path / "t", **flags)["engine_layers"] == 2
    assert check_tensorrt_llm(tmp_path / "t", HIDDEN, VOCAB, **flags) == []
    assert "medusa_choices.json" in serve and "medusa_choices.json" in out.splitlines()[-1]  # in "wrote ..."
    assert check_tree_file(tmp_path / "t" / "medusa_choices.json", 3) == []


def test_medusa_v1_export_prints_how_to_pass_its_tree(backbone_dir, tmp_path, capsys):
    """Guards against: FasterDecoding's 5-head loader running its depth-4 default trees on 3 trained
    heads (the other two random) because the user was not told to pass the shipped tree."""
    from engine_specs import check_reference_medusa

    _, model = backbone_dir
    src = heads_dir(tmp_path, model)
    code, out, err = run([f"heads={src}", "format=medusa_v1", f"out={tmp_path / 'm'}"], capsys)
    assert code == 0, err
    assert f"medusa_choices=json.load(open('{tmp_path / 'm'}/medusa_choices.json'))" in out
    assert "no deeper than 3" in out
    assert check_reference_medusa(tmp_path / "m", HIDDEN, VOCAB) == []


def test_serve_commands_name_the_out_dir_not_a_placeholder(backbone_dir, tmp_path, capsys):
    """Guards against: the printed serve commands naming the export folder "<this dir>" (e.g. ``"model": "<this
    dir>"``), which a user pastes and the engine cannot find: each names the out= folder itself."""
    bdir, model = backbone_dir
    src = heads_dir(tmp_path, model, base_model=str(bdir))
    for fmt in ("vllm", "tgi", "tensorrt_llm", "medusa_v1"):
        out_dir = tmp_path / f"served-{fmt}"
        code, out, err = run([f"heads={src}", f"format={fmt}", f"out={out_dir}"], capsys)
        assert code == 0, err
        assert "<this dir>" not in out, (fmt, out)
        assert any(str(out_dir) in line for line in out.splitlines() if not line.startswith("wrote ")), (fmt, out)
    code, out, err = run([f"heads={src}", "format=vllm", f"out={tmp_path / 'v2'}"], capsys)
    assert f'"model": "{tmp_path / "v2"}"' in out, out


def test_tgi_export_reads_only_the_backbone_config_for_the_launcher(backbone_dir, tmp_path, capsys):
    """Guards against: a TGI dir without the head size TGI's launcher needs (it would force its fallback
    attention and disable prefix caching), or loading backbone weights just to write it."""
    bdir, model = backbone_dir
    src = heads_dir(tmp_path, model, base_model=str(bdir))
    code, out, err = run([f"heads={src}", "format=tgi", f"out={tmp_path / 'g'}"], capsys)
    assert code == 0 and not any("reading the lm_head" in l for l in err), err
    cfg = json.loads((tmp_path / "g" / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["head_dim"]) == (4, HIDDEN // 4)
    assert check_tgi(tmp_path / "g", HIDDEN, VOCAB) == []
    code, out, err = run([f"heads={heads_dir(tmp_path / 'r', model)}", "format=tgi", f"out={tmp_path / 'r' / 'g'}"],
                         capsys)
    assert code == 0 and "PREFIX_CACHING" in out  # random: backbone, no config: say what TGI will do


def test_mlp_speculator_export_says_it_needs_vllms_v0_engine(tmp_path, capsys):
    """Guards against: users serving an mlp_speculator export on vLLM's V1 engine, which has no
    mlp_speculator path ("Unknown speculative decoding method"), without being told."""
    from inference.heads.registry import build_heads
    from inference.heads.spec import HeadsSpec

    spec = HeadsSpec(num_heads=2, num_layers=0, hidden_size=HIDDEN, vocab_size=VOCAB, kind="mlp_speculator",
                     base_model="org/base")
    src = save_heads(build_heads(spec), tmp_path / "mlp")
    code, out, err = run([f"heads={src}", "format=vllm", f"out={tmp_path / 'v'}"], capsys)
    assert code == 0, err
    assert "vLLM 0.9.2 and older" in out and "Unknown speculative decoding method" in out


def test_tgi_export_carries_the_backbone_tokenizer_and_chat_template(backbone_dir, tmp_path, capsys):
    """Guards against: a TGI dir without the tokenizer files TGI's router reads from it. Its launcher hands
    the dir itself to the router as the tokenizer, and the router takes the chat template only from the
    dir's tokenizer_config.json / chat_template.json: without them every /v1/chat/completions request fails
    with "template not found"."""
    from transformers import AutoTokenizer

    bdir, model = backbone_dir
    src = heads_dir(tmp_path, model, base_model=str(bdir))
    code, out, err = run([f"heads={src}", "format=tgi", f"out={tmp_path / 'g'}"], capsys)
    assert code == 0, err
    backbone_tokenizer = AutoTokenizer.from_pretrained(bdir)
    template = tgi_router_chat_template(tmp_path / "g")
    assert template == backbone_tokenizer.chat_template
    # What the router's Python side loads from the dir (py_resolve_tokenizer: AutoTokenizer on it) renders a
    # chat exactly as the backbone's own tokenizer does.
    chat = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    exported = AutoTokenizer.from_pretrained(tmp_path / "g")
    assert exported.apply_chat_template(chat, tokenize=False) == backbone_tokenizer.apply_chat_template(
        chat, tokenize=False)
    assert exported("a sentence")["input_ids"] == backbone_tokenizer("a sentence")["input_ids"]
    assert check_tgi(tmp_path / "g", HIDDEN, VOCAB) == []   # the extra files change nothing TGI's loader reads
    # No tokenizer to read (a random: test backbone): the export says how to give TGI the template.
    code, out, err = run([f"heads={heads_dir(tmp_path / 'r', model)}", "format=tgi", f"out={tmp_path / 'r' / 'g'}"],
                         capsys)
    assert code == 0 and "--tokenizer-config-path" in out and tgi_router_chat_template(tmp_path / "r" / "g") is None


def tgi_router_chat_template(d):
    """The chat template TGI's router would use for model dir ``d`` (router/src/server.rs): chat_template.json's
    ``chat_template`` wins over tokenizer_config.json's; None when neither has one (TemplateNotFound)."""
    for name in ("chat_template.json", "tokenizer_config.json"):
        f = d / name
        if f.is_file() and json.loads(f.read_text()).get("chat_template"):
            return json.loads(f.read_text())["chat_template"]
    return None


@pytest.mark.parametrize("fmt", ["vllm", "tgi", "tensorrt_llm"])
def test_heads_trained_with_a_backbone_adapter_name_the_merged_backbone_or_are_refused(fmt, backbone_dir, tmp_path,
                                                                                      capsys):
    """Guards against: exporting Medusa-2 heads (trained with a LoRA adapter on the backbone) with the
    un-adapted backbone as the engine's base model. Engines serve that model as it is and cannot apply the
    adapter, so the heads would read hidden states they were never trained on; the runtime merges the
    adapter, so medusa-eval's figures would not carry over. Refused in one line, writing nothing, unless the
    merged backbone is named (base_model=) or lies beside the heads (lora.merge=true's <run>/merged)."""
    bdir, model = backbone_dir
    run_dir = tmp_path / "run"
    heads = random_heads(model)
    heads.spec.base_model, heads.spec.backbone_adapter = str(bdir), "adapter"
    src = save_heads(heads, run_dir / "heads")
    materialize = ["materialize=true"] if fmt == "tensorrt_llm" else []
    code, out, err = run([f"heads={src}", f"format={fmt}", f"out={tmp_path / 'e'}", *materialize], capsys)
    assert_one_line_error(code, err, "LoRA adapter", "base_model=", "lora.merge=true")
    assert not (tmp_path / "e").exists()

    code, out, err = run([f"heads={src}", f"format={fmt}", f"out={tmp_path / 'e'}", "base_model=org/merged",
                          *materialize], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "e" / "config.json").read_text())["base_model_name_or_path"] == "org/merged"

    merged = run_dir / "merged"
    model.save_pretrained(merged)   # stands in for lora.merge=true's merged backbone
    code, out, err = run([f"heads={src}", f"format={fmt}", f"out={tmp_path / 'f'}", *materialize], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "f" / "config.json").read_text())["base_model_name_or_path"] == str(merged.resolve())
    assert "merged backbone" in out


def test_a_local_base_model_is_written_by_its_absolute_path(backbone_dir, tmp_path, capsys, monkeypatch):
    """Guards against: ``base_model=models/x`` written into the engine config and the serve command as typed, which
    names nothing once the engine runs from another directory."""
    folder, model = backbone_dir
    src = heads_dir(tmp_path, model)
    monkeypatch.chdir(folder.parent)
    code, out, err = run([f"heads={src}", "format=tgi", f"out={tmp_path / 'g'}", f"base_model=./{folder.name}"],
                         capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "g" / "config.json").read_text())["base_model_name_or_path"] == str(folder)


def test_a_recorded_base_model_missing_here_is_said(backbone_dir, tmp_path, capsys):
    """Guards against: heads whose recorded backbone folder is gone exported with exit 0 and no word, the heads
    checked against nothing and the engine config naming a folder the engine will not find."""
    _, model = backbone_dir
    src = heads_dir(tmp_path, model, base_model=str(tmp_path / "moved_away"))
    code, out, err = run([f"heads={src}", "format=vllm", f"out={tmp_path / 'v'}"], capsys)
    assert code == 0, err
    assert "moved_away is not found here: the export was not checked against it" in out


def test_a_backbone_given_by_a_relative_or_home_path_is_recorded_by_its_absolute_path(backbone_dir, monkeypatch):
    """Guards against: ``backbone.name_or_path=models/x`` (or ``~/x``) recorded as typed as the heads' base model,
    so the heads, ``medusa-eval heads=`` and the engine configs exported from them worked only from the folder
    the training ran in."""
    from inference.backbone import load_backbone

    folder, _ = backbone_dir
    monkeypatch.chdir(folder.parent)
    assert load_backbone(f"./{folder.name}")[2] == str(folder)
    monkeypatch.setenv("HOME", str(folder.parent))
    assert load_backbone(f"~/{folder.name}")[2] == str(folder)


def test_an_interrupted_saves_previous_heads_are_not_replaced_without_overwrite(backbone_dir, tmp_path, capsys):
    """Guards against: an export into a folder whose save was killed between its two renames (out= missing, the
    previous content in ``.<out>.old-*``) passing the "not empty" check, then putting that content back and
    replacing it: a run's trained heads deleted without overwrite=true."""
    _, model = backbone_dir
    src = heads_dir(tmp_path, model)
    trained = save_heads(random_heads(model, projection="own"), tmp_path / "run" / "heads")
    backup = trained.rename(tmp_path / "run" / ".heads.old-99999999-abcdefgh")   # a dead writer's backup
    code, out, err = run([f"heads={src}", "format=vllm", f"out={trained}"], capsys)
    assert code == 2 and "is not empty: pass overwrite=true" in err[0], err
    assert (trained / "model.safetensors").is_file() and not backup.exists()


def test_an_export_says_which_chat_template_variables_to_serve_with(tmp_path, capsys):
    """Guards against: heads trained on prompts rendered with chat_template_args (Qwen3 with thinking off) exported
    for an engine without a word, so they are served on the template's default rendering and accept fewer drafts."""
    from inference.heads.registry import build_heads
    from inference.heads.spec import HeadsSpec

    spec = HeadsSpec(num_heads=2, num_layers=1, hidden_size=HIDDEN, vocab_size=VOCAB, base_model="org/base",
                     chat_template_args={"enable_thinking": False})
    src = save_heads(build_heads(spec), tmp_path / "h")
    code, out, err = run([f"heads={src}", "format=vllm", f"out={tmp_path / 'v'}"], capsys)
    assert code == 0, err
    assert '"chat_template_kwargs": {"enable_thinking": false}' in out


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_format_warnings_reach_eval_and_generate_as_one_line(command, backbone_dir, tmp_path, capsys):
    """Guards against: a FormatWarning raised while loading heads (a vLLM dir whose config.json disagrees with its
    weights) reaching medusa-eval / medusa-generate as Python's two-line warning (``.../loading.py:189:
    FormatWarning: ...`` and a source line) where medusa-export prints one ``medusa-export: warning: ...`` line."""
    from inference.cli import eval_main, generate_main
    from inference.formats.export import ExportOptions, export_heads

    bdir, model = backbone_dir
    heads = random_heads(model)
    heads.spec.base_model = str(bdir)
    out = export_heads(heads, "vllm", tmp_path / "v", options=ExportOptions()).path
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_heads": 5}))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Hi."}) + "\n")
    argv = {"generate": ["prompt=hi"],
            "eval": [f"prompts={tmp_path / 'p.jsonl'}", "methods=[medusa]", "choice=fixed", f"out={tmp_path / 'e'}"]}
    main = {"generate": generate_main, "eval": eval_main}[command]
    code, _, err = call_main(main, [f"heads={out}", f"backbone={bdir}", "tree=chain2", "max_new_tokens=2",
                                    *argv[command]], capsys)
    assert code == 0, err
    said = [line for line in err.splitlines() if "num_heads=5" in line]
    assert len(said) == 1 and said[0].startswith(f"medusa-{command}: warning: "), err
    assert "FormatWarning" not in err and "warnings.warn" not in err, err
