"""The chat template's own variables (``backbone.chat_template_args`` in training and distillation,
``chat_template_args`` in the inference commands and ``load_medusa``): Qwen3 served with ``enable_thinking=false``
needs heads trained, distilled and evaluated on prompts rendered that way, every rendering of a run the same."""

from __future__ import annotations

import pytest

from inference.chat_template import check_template_args, set_template_args, template_args
from inference.errors import UserError
from inference.runtime.model import chat_ids
from medusa_train import distill, features
from medusa_train.backbone import CHATML_TEMPLATE, byte_tokenizer, load_backbone
from medusa_train.checkpoint import flatten, schema_defaults, unsafe_changes
from medusa_train.data.tokenize import _render, encode_conversation

# ChatML with Qwen3's switch: thinking off puts an empty think block after the generation prompt
THINKING = CHATML_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\n' }}",
    "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}")
CHAT = [{"role": "user", "content": "Hi"}]


def thinking_tokenizer(args=None):
    tok = byte_tokenizer()
    tok.chat_template = THINKING
    if args is not None:
        set_template_args(tok, args)
    return tok


def test_every_rendering_reads_the_arguments():
    """Guards against: a setting that reaches one rendering and not another (training data rendered with thinking
    off, evaluation prompts with it on), which trains heads on prompts the served model never sees."""
    plain, off = thinking_tokenizer(), thinking_tokenizer({"enable_thinking": False})
    assert "<think>" not in _render(plain, CHAT, add_generation_prompt=True)
    assert _render(off, CHAT, add_generation_prompt=True).endswith("<think>\n\n</think>\n\n")
    ids = chat_ids(off, "Hi")
    assert off.decode(ids).endswith("<think>\n\n</think>\n\n") and len(ids) > len(chat_ids(plain, "Hi"))
    with_reply = CHAT + [{"role": "assistant", "content": "Hello"}]
    assert encode_conversation(off, with_reply, 256) is not None


@pytest.mark.parametrize("args, words", [
    ([1, 2], "must map template variables to values"),
    ({"enable_thinking:false": None}, "'enable_thinking:false' is not a template variable name"),
    ({"tokenize": False}, "apply_chat_template's own setting"),
    ({"messages": []}, "apply_chat_template's own setting"),
    ({"x": float("nan")}, "must be a JSON value"),
    ({"x": object()}, "must be a JSON value"),
])
def test_bad_arguments_are_refused_in_one_line(args, words):
    """Guards against: a mapping typed as ``{a:b}`` on a command line (read as the key "a:b"), an argument that
    would change what apply_chat_template returns (``tokenize``) or replace the conversation, or a value no
    record can hold, reaching the template."""
    with pytest.raises(UserError, match=words) as err:
        check_template_args(args)
    assert "\n" not in str(err.value)


def test_the_trainer_sets_them_on_the_backbones_tokenizer_and_notes_a_variable_the_template_never_reads(
        compose_tiny, capsys):
    """Guards against: ``backbone.chat_template_args`` composed but never given to the tokenizer, and a misspelt
    variable (the template never mentions it) changing nothing in silence."""
    cfg = compose_tiny("backbone.chat_template_args.enable_thinking=false")
    backbone = load_backbone(cfg.backbone, "cpu", seed=0)
    assert template_args(backbone.tokenizer) == {"enable_thinking": False}
    err = capsys.readouterr().err
    assert "never mentions enable_thinking" in err and len(err.strip().splitlines()) == 1
    assert template_args(load_backbone(compose_tiny().backbone, "cpu", seed=0).tokenizer) == {}


def test_the_arguments_are_part_of_what_a_cache_distillation_or_resume_was_made_with(compose_tiny, tiny_backbone):
    """Guards against: a features cache, distilled data or a checkpoint made with thinking on being continued
    with thinking off (other token sequences mixed into one dataset), and records made before the setting existed
    no longer matching a run that does not set it."""
    plain, off = compose_tiny(), compose_tiny("backbone.chat_template_args.enable_thinking=false")
    assert "chat_template_args" not in distill.run_identity(plain)["backbone"]
    assert distill.run_identity(off)["backbone"]["chat_template_args"] == {"enable_thinking": False}
    assert "chat_template_args" not in features.cache_identity(plain, tiny_backbone)["data"]
    assert features.cache_identity(off, tiny_backbone)["data"]["chat_template_args"] == {"enable_thinking": False}
    def run(args):
        return flatten({"backbone": {"name_or_path": "x", **({} if args is None else {"chat_template_args": args})}})

    for before, after in (({}, {"enable_thinking": False}), (None, {"enable_thinking": False}),   # None: a checkpoint
                          ({"enable_thinking": False, "effort": "low"}, {"effort": "low"}),      # from before the key
                          ({"effort": "low"}, {"effort": "high"})):
        assert unsafe_changes(run(before), run(after), schema_defaults()) == ["backbone.chat_template_args"]
    assert unsafe_changes(run(None), run({}), schema_defaults()) == []


def test_load_medusa_renders_the_models_prompts_with_them(tmp_path):
    """Guards against: the Python API's ``chat_template_args`` checked but not given to the tokenizer that
    ``generate("text")`` encodes with, or a bad one refused only after the backbone loaded."""
    from inference.heads.native import save_heads
    from inference.loading import load_medusa

    from runtime_support import random_heads, tiny_llama

    model = tiny_llama(seed=4)
    d = save_heads(random_heads(model, projection="own"), tmp_path / "heads")
    with pytest.raises(UserError, match="apply_chat_template's own setting"):
        load_medusa(d, backbone="/nonexistent/backbone", chat_template_args={"tokenize": True})
    tok = thinking_tokenizer()
    m = load_medusa(d, backbone=model, tokenizer=tok, kernels="stock", chat_template_args={"enable_thinking": False})
    assert tok.decode(m.encode_chat("Hi")).endswith("</think>\n\n")


def test_decoding_adopts_the_arguments_the_heads_were_trained_with(tmp_path, capsys):
    """Guards against: heads trained with ``backbone.chat_template_args.enable_thinking=false`` evaluated and decoded
    (medusa-eval / medusa-generate / load_medusa given no chat_template_args) on prompts rendered with the template's
    default, which they never saw: their run's record is read, said in one line, and a given value still wins."""
    from inference.chat_template import template_args_for
    from inference.heads.native import save_heads
    from inference.loading import load_medusa
    from omegaconf import OmegaConf

    from runtime_support import random_heads, tiny_llama

    model = tiny_llama(seed=4)
    heads = save_heads(random_heads(model, projection="own"), tmp_path / "run" / "heads")
    (tmp_path / "run" / ".hydra").mkdir()
    OmegaConf.save({"backbone": {"chat_template_args": {"enable_thinking": False}}},
                   tmp_path / "run" / ".hydra" / "config.yaml")
    assert template_args_for(str(heads), {}) == {"enable_thinking": False}
    assert "chat_template_args.enable_thinking=false" in capsys.readouterr().err
    assert template_args_for(str(heads), {"enable_thinking": True}) == {"enable_thinking": True}
    assert template_args_for(str(heads), {"effort": "high"}) == {"enable_thinking": False, "effort": "high"}
    assert template_args_for(str(tmp_path / "elsewhere"), None) == {}
    tok = thinking_tokenizer()
    m = load_medusa(heads, backbone=model, tokenizer=tok, kernels="stock")
    assert tok.decode(m.encode_chat("Hi")).endswith("</think>\n\n")


def test_the_heads_folder_carries_them_wherever_it_goes(compose_tiny, tmp_path, capsys):
    """Guards against: heads trained with thinking off, copied or moved away from their run (the record under
    ``.hydra`` left behind), decoded on prompts rendered with the template's default; a config.json with a bad
    value adopted in silence; heads trained without them gaining a key older readers refuse (with them: format 2, which
    a reader from before calls newer instead of naming an unknown key)."""
    import json
    import shutil

    from inference.chat_template import template_args_for
    from inference.heads.native import read_native_spec
    from medusa_train import trainer as T

    args = ("trainer.max_steps=1", "trainer.save_every=0", "trainer.eval_every=0", "logger.plot=false")
    T.run(compose_tiny(*args, "backbone.chat_template_args.enable_thinking=false", out=tmp_path / "off"))
    moved = shutil.copytree(tmp_path / "off" / "heads", tmp_path / "moved" / "heads")
    written = json.loads((moved / "config.json").read_text())
    assert written["chat_template_args"] == {"enable_thinking": False} and written["format_version"] == 2
    assert read_native_spec(moved).chat_template_args == {"enable_thinking": False}
    capsys.readouterr()
    assert template_args_for(str(moved), None) == {"enable_thinking": False}
    assert "chat_template_args.enable_thinking=false" in capsys.readouterr().err
    T.run(compose_tiny(*args, out=tmp_path / "plain"))
    plain = json.loads((tmp_path / "plain" / "heads" / "config.json").read_text())
    assert "chat_template_args" not in plain and plain["format_version"] == 1   # older readers still load these
    bad = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**bad, "chat_template_args": {"tokenize": True}}))
    with pytest.raises(UserError, match="apply_chat_template's own setting"):
        template_args_for(str(moved), None)
    with pytest.raises(UserError, match="apply_chat_template's own setting"):
        read_native_spec(moved)
