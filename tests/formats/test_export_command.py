"""``medusa-export`` as a command: no argument, --help's keys, out= given as a symbolic link, a write
that fails (a full disk), and the TGI mlp_speculator serve line's ``--speculate``."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from conftest import call_main
from inference.export_cli import ExportConfig, export_main
from inference.heads.native import save_heads
from runtime_support import one_thread, random_heads, tiny_llama  # noqa: F401  (one_thread: autouse fixture)

VOCAB, HIDDEN = 96, 32


def run(argv, capsys):
    code, out, err = call_main(export_main, argv, capsys)
    return code, out, [line for line in err.splitlines() if line.strip()]


def snapshot(root):
    return {str(p.relative_to(root)): (p.readlink() if p.is_symlink() else p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def heads(tmp_path):
    h = random_heads(tiny_llama(vocab=VOCAB, hidden=HIDDEN))
    h.spec.base_model = "random:llama"
    return save_heads(h, tmp_path / "heads")


def test_no_argument_is_one_line_exit_2_and_help_alone_exits_0(capsys):
    """Guards against medusa-export with no argument printing its help and exiting 0 (a script that forgot every
    key went on as if an export had been written), unlike medusa-eval / medusa-generate, which refuse in one line
    naming the required keys; --help and -h alone still print the help and exit 0."""
    code, out, err = run([], capsys)
    assert code == 2 and out == "", (code, out)
    assert err == ["medusa-export: error: format=, heads= and out= are required (see medusa-export --help)"], err
    for flag in ("--help", "-h"):
        code, out, err = run([flag], capsys)
        assert code == 0 and err == [] and "medusa-export keys:" in out, (flag, code, err)


def test_help_lists_every_key_with_its_default():
    """Guards against --help omitting keys the command takes (overwrite=, trust_remote_code= were missing) or their
    defaults: every field of ExportConfig appears as ``<key> (default <value>)``, read from its one declaration,
    and no help line is wider than 120 columns."""
    from inference.export_cli import export_help

    text = export_help()
    shown = {"???": "required", None: "unset", False: "false", True: "true"}
    for f in dataclasses.fields(ExportConfig):
        default = shown.get(f.default, f.default) if not isinstance(f.default, str) or f.default == "???" \
            else f.default
        assert f"  {f.name} (default {default}):" in text, f.name
        assert f.metadata.get("help"), f.name
    assert max(map(len, text.splitlines())) <= 120


@pytest.mark.parametrize("target", ["export", "dangling"])
def test_out_as_a_symbolic_link_is_one_line_and_changes_nothing(target, heads, tmp_path, capsys):
    """Guards against out= naming a symbolic link: to a previous export with overwrite=true it was an
    IsADirectoryError traceback (the swap renames the link itself onto a folder) that left an empty
    ``.<out>.old-*`` folder behind; dangling, a NotADirectoryError traceback once everything was written to a temp
    folder. One line, exit 2, nothing on disk changed."""
    if target == "export":
        assert run([f"heads={heads}", "format=vllm", f"out={tmp_path / 'v'}"], capsys)[0] == 0
        (tmp_path / "link").symlink_to(tmp_path / "v")
    else:
        (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    before = snapshot(tmp_path)
    code, _, err = run([f"heads={heads}", "format=vllm", f"out={tmp_path / 'link'}", "overwrite=true"], capsys)
    assert code == 2 and len(err) == 1 and "is a symbolic link" in err[0], err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("fails", ["safetensors", "config"])
def test_a_full_disk_is_one_line_and_keeps_the_previous_export(fails, heads, tmp_path, capsys, monkeypatch):
    """Guards against a write that fails midway (a full disk, a quota) ending medusa-export in a traceback:
    safetensors reports its I/O errors as SafetensorError, the config's write as OSError. One line naming out=,
    exit 2, the previous export as it was and no temp folder left (exporting straight to format_export's
    ``export_heads`` still raises an OSError)."""
    import safetensors   # its save_file is what a full disk fails

    out = tmp_path / "v"
    assert run([f"heads={heads}", "format=vllm", f"out={out}"], capsys)[0] == 0
    before = snapshot(tmp_path)
    if fails == "safetensors":
        def full(*args, **kwargs):
            raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device")

        monkeypatch.setattr("safetensors.torch.save_file", full)
    else:
        real = Path.write_text

        def full(self, *args, **kwargs):
            if self.name == "config.json":
                raise OSError(28, "No space left on device")
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", full)
    code, _, err = run([f"heads={heads}", "format=tgi", f"out={out}", "overwrite=true"], capsys)
    assert code == 2 and len(err) == 1 and f"out={out} could not be written" in err[0], err
    assert "No space left on device" in err[0]
    assert snapshot(tmp_path) == before


def test_tgi_mlp_speculator_serve_line_keeps_speculate_at_the_trained_steps(tmp_path, capsys):
    """Guards against the TGI mlp_speculator export advising ``--speculate 1..n``. TGI's MLPSpeculatorModel
    (layers/mlp.py, 09a1de5c and db931fcf) takes ``state_weight = 0.5 ** (0.5 / get_speculate())``, the
    --speculate value, where vLLM and training use n_predict: with fewer steps even the first step's distribution
    is another one than the heads were trained for (checked here on TGI's forward as engine_specs restates it, with
    n_predict lowered as --speculate lowers it). The line names the trained count alone."""
    import torch

    from engine_specs import tgi_mlp_speculator_probs
    from inference.heads.registry import build_heads
    from inference.heads.spec import HeadsSpec

    spec = HeadsSpec(num_heads=3, num_layers=0, hidden_size=HIDDEN, vocab_size=VOCAB, kind="mlp_speculator",
                     base_model="org/base")
    heads = build_heads(spec)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    src = save_heads(heads, tmp_path / "mlp")
    code, out, err = run([f"heads={src}", "format=tgi", f"out={tmp_path / 'g'}"], capsys)
    assert code == 0, err
    serve = next(line for line in out.splitlines() if line.startswith("serve: text-generation-launcher"))
    assert "1..3" not in serve and "--speculate unset or give 3" in serve, serve

    fewer = tmp_path / "speculate2"
    shutil.copytree(tmp_path / "g", fewer)
    cfg = json.loads((fewer / "config.json").read_text())
    (fewer / "config.json").write_text(json.dumps({**cfg, "n_predict": 2}))
    hidden, ids = torch.randn(4, HIDDEN, generator=g), torch.randint(0, VOCAB, (4,), generator=g)
    trained, at_2 = tgi_mlp_speculator_probs(tmp_path / "g", hidden, ids), tgi_mlp_speculator_probs(fewer, hidden, ids)
    assert not torch.allclose(trained[:, 0], at_2[:, 0], atol=1e-4)


@pytest.mark.parametrize("fmt", ["vllm", "tgi", "tensorrt_llm"])
def test_a_format_without_an_exporter_for_the_kind_is_refused_before_the_target_is_read(fmt, tmp_path, capsys,
                                                                                         monkeypatch):
    """Guards against a format that has no exporter for the heads' family (an EAGLE-3 drafter with format=vllm)
    being refused only after the target's config was read: for heads recording a hub id offline that was half a
    minute of download retries and their log lines on stderr before the one line, though the heads' own
    config.json decides it."""
    import inference.backbone
    import inference.loading
    from inference.heads.eagle3 import Eagle3Drafter, draft_layer_config
    from inference.heads.spec import HeadsSpec

    target = tiny_llama(vocab=VOCAB, hidden=64, layers=8)
    spec = HeadsSpec(num_heads=2, num_layers=1, hidden_size=64, vocab_size=VOCAB, kind="eagle3",
                     base_model="org/a-hub-model", aux_layers=[2, 4, 6], draft_layer=draft_layer_config(target.config))
    src = save_heads(Eagle3Drafter(spec), tmp_path / "eagle3")

    def read(*args, **kwargs):
        raise AssertionError("the target's config was read before the refusal")

    for module in (inference.loading, inference.backbone):
        monkeypatch.setattr(module, "load_backbone_config", read)
    code, _, err = run([f"heads={src}", f"format={fmt}", f"out={tmp_path / 'o'}"], capsys)
    kinds = "medusa" if fmt == "tensorrt_llm" else "medusa, mlp_speculator"
    assert code == 2 and err == [f"medusa-export: error: format {fmt} has no exporter for heads of kind 'eagle3' "
                                 f"(it exports kinds: {kinds})"], err
    assert not (tmp_path / "o").exists()


def test_lora_trained_heads_without_base_model_are_refused_before_the_target_is_read(tmp_path, capsys, monkeypatch):
    """Guards against Medusa-2 heads (trained with a LoRA adapter on the backbone) exported with no base_model= and
    no <run>/merged being refused only after the target's config was read (a hub download for heads recording a
    hub id; offline, half a minute of retries and their log lines first), though their config alone decides it."""
    import inference.backbone
    import inference.loading

    heads = random_heads(tiny_llama(vocab=VOCAB, hidden=HIDDEN))
    heads.spec.base_model, heads.spec.backbone_adapter = "org/a-hub-model", "adapter"
    src = save_heads(heads, tmp_path / "run" / "heads")

    def read(*args, **kwargs):
        raise AssertionError("the target's config was read before the refusal")

    for module in (inference.loading, inference.backbone):
        monkeypatch.setattr(module, "load_backbone_config", read)
    code, _, err = run([f"heads={src}", "format=vllm", f"out={tmp_path / 'o'}"], capsys)
    assert code == 2 and len(err) == 1 and "LoRA adapter" in err[0] and "base_model=" in err[0], err
    assert not (tmp_path / "o").exists()
