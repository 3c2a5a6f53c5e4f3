"""The arguments a backbone's chat template is rendered with (``chat_template_args``): Qwen3's and GLM-4.5's
``enable_thinking``, a template's ``reasoning_effort``, any variable a template reads beside the messages.

They are set once on the tokenizer (``set_template_args``) and read wherever a chat is rendered: the training data,
self-distillation's prompts, the inference prompts (``template_args``). So every rendering of one run agrees, and
a model served with thinking off gets heads trained, distilled and evaluated on prompts rendered that way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping, Optional

from .errors import UserError

ATTRIBUTE = "medusa_chat_template_args"   # on the tokenizer object: it goes wherever the tokenizer goes
# apply_chat_template's own parameters and the template's messages: as template arguments they would change what
# apply_chat_template returns, or replace the conversation, instead of reaching the template
RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
                      "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                      "tokenizer_kwargs"})
_NOTED: set = set()   # (template, variables it never mentions) already said in this process


def check_template_args(args: Any, key: str = "chat_template_args") -> dict:
    """``args`` as a plain dict of template variables, or one line saying what is wrong (``key``: how the user
    wrote the setting). None is no arguments."""
    if args is None:
        return {}
    if hasattr(args, "_get_node"):   # an OmegaConf node (the commands' key): its plain values
        from omegaconf import OmegaConf   # lazy: only a command's configuration holds one

        args = OmegaConf.to_container(args, resolve=True)
    if not isinstance(args, Mapping):
        raise UserError(f"{key} must map template variables to values (e.g. {key}.enable_thinking=false), "
                        f"got {args!r}")
    for name, value in args.items():
        if not isinstance(name, str) or not name.isidentifier():
            # {enable_thinking:false} on a command line (no space) reads as the key "enable_thinking:false"
            raise UserError(f"{key}: {name!r} is not a template variable name; write {key}.<name>=<value> "
                            f"(e.g. {key}.enable_thinking=false)")
        if name in RESERVED:
            raise UserError(f"{key}.{name} is apply_chat_template's own setting, not a template variable; "
                            "the runtime sets it")
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            raise UserError(f"{key}.{name} must be a JSON value (a number, string, boolean, list or mapping), "
                            f"got {value!r}") from None
    return dict(args)


def set_template_args(tokenizer, args: Any, key: str = "chat_template_args", whose: str = "") -> None:
    """Render every later chat of ``tokenizer`` with ``args`` (checked), saying in one line on stderr which of them
    its template never mentions (``whose``: the backbone, for that line): a variable the template does not read
    changes nothing, and a misspelt one would otherwise pass in silence."""
    args = check_template_args(args, key)
    setattr(tokenizer, ATTRIBUTE, args)
    template = getattr(tokenizer, "chat_template", None)
    text = json.dumps(template) if isinstance(template, dict) else str(template or "")
    unread = [name for name in args if name not in text]
    if unread and text and (text, tuple(unread)) not in _NOTED:   # once: a command's check and its load share it
        _NOTED.add((text, tuple(unread)))
        print(f"note: the chat template{whose} never mentions {', '.join(unread)}: "
              f"{key}.{unread[0]} changes nothing", file=sys.stderr)


def template_args(tokenizer) -> dict:
    """The arguments ``set_template_args`` gave ``tokenizer`` ({} when none)."""
    return dict(getattr(tokenizer, ATTRIBUTE, None) or {})


def recorded_template_args(heads_dir) -> dict:
    """The ``backbone.chat_template_args`` the training run that wrote ``heads_dir`` rendered its data with: the
    heads' own ``config.json`` holds them (wherever the folder was moved); heads exported before it did are read from
    their run's record beside them (``<run>/.hydra/config.yaml``); {} when neither names any."""
    heads = Path(heads_dir).expanduser().resolve()
    try:
        config = json.loads((heads / "config.json").read_text())
    except (OSError, ValueError):   # no config.json (a foreign layout's other file) or not JSON: the loader says so
        config = None
    if isinstance(config, dict) and "chat_template_args" in config and "format_version" in config:
        return check_template_args(config["chat_template_args"], f"{heads / 'config.json'}: chat_template_args")
    record = heads.parent / ".hydra" / "config.yaml"
    if not record.is_file():
        return {}
    try:
        from omegaconf import OmegaConf   # lazy: only where a run's record is read

        return check_template_args(OmegaConf.select(OmegaConf.load(record), "backbone.chat_template_args"))
    except Exception:   # noqa: BLE001 (a record this version cannot read, or one with bad values: nothing adopted)
        return {}


def template_args_for(heads_dir: Optional[str], given: Any, key: str = "chat_template_args") -> dict:
    """The arguments to render a decoding's prompts with: the ones the heads were trained with
    (``recorded_template_args``, said in one line), each given one taking its place or joining them. Heads trained on
    Qwen3 with thinking off, evaluated with the template's default, were measured on prompts they never saw."""
    args = check_template_args(given, key)
    recorded = recorded_template_args(heads_dir) if heads_dir else {}
    kept = {k: v for k, v in recorded.items() if k not in args}
    if kept:
        shown = ", ".join(f"{key}.{k}={json.dumps(v)}" for k, v in kept.items())
        print(f"note: prompts are rendered with the chat template variables the heads were trained with ({shown}); "
              f"give {key}.<name>=<value> to change one", file=sys.stderr)
    return {**kept, **args}
