"""Written specifications of how each serving engine loads Medusa heads, to check exports against.

The engines do not run here, so each ``check_*`` function restates, in plain Python, what that
engine's loader reads: file names, config keys (and the defaults it silently falls back to),
tensor names, shapes and dtypes, and what it silently ignores. Each returns a list of problems
(empty = the engine would load every weight where it belongs). They were read from:

  vLLM          vllm-project/vllm
                  vllm/model_executor/models/medusa.py       commit 01dbb08195ca9c70ac9044786a906a353e07fcdf
                  vllm/transformers_utils/configs/medusa.py  commit 0531c2226a6a25cd96ccc856f3bda3f0bb4efb5f
                  vllm/config/speculative.py (method auto-detected from model_type "medusa")
  TensorRT-LLM  NVIDIA/TensorRT-LLM
                  tensorrt_llm/models/medusa/weight.py (load_medusa_hf)  commit 27712aa7720aa3e6a594ad3cc678625490cb479d
                  examples/medusa/convert_checkpoint.py                  commit 063e02f73410f2f9172a581ca5e3f41d0d3dab8e
                    (same flag handling at b93e14ca093e446615f3009cae6ca5a33c4f2f56)
                  tensorrt_llm/models/medusa/config.py (MedusaConfig.from_hugging_face)
                                                                         commit 084a8843ce92c0d349a90e0d4f8ed1232fe8ddbb
                  examples/medusa/README.md (run.py --medusa_choices: a list of paths)
  TGI           huggingface/text-generation-inference
                  server/text_generation_server/layers/medusa.py       commit 91560ed931b217ddb1ee152891d20440fef331d4
                  server/text_generation_server/layers/speculative.py  commit c09f5bc93071e2701e201bb374d488e4673fac3d
                  server/text_generation_server/models/__init__.py (get_model: "medusa_num_heads" in config)
                  launcher/src/main.rs (resolve_attention, RawConfig -> Config) and
                  router/src/server.rs (legacy_tokenizer_handle)       commit db931fcf42da018a3657580c64bf2720f167f9ab
  Medusa        FasterDecoding/Medusa medusa/model/medusa_model.py     commit 60eeab92e98adb0e787987493b11fa38535a8260
                  (from_pretrained's fallback: medusa_num_heads = 5, strict=False; utils.py TOPK = 10;
                  the same at e2a5d20c048a9b0a4092e6933c34313687422518)
  vLLM mlp_speculator  vllm/model_executor/models/mlp_speculator.py and
                  vllm/transformers_utils/configs/mlp_speculator.py (v0.8-v0.10, read through the
                  stored index; the MLPSpeculator class there: emb/proj/ln/head, tie_weights, scale_input)

If an engine changes its loader, update the matching function here and the exporter with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _dtype_problems(tensors: dict[str, torch.Tensor], integer_names=()) -> list[str]:
    out = []
    for name, t in tensors.items():
        if name in integer_names:
            if t.dtype != torch.int64:
                out.append(f"{name} must be int64 (it indexes logits), got {t.dtype}")
        elif t.dtype not in FLOAT_DTYPES:
            out.append(f"{name} has dtype {t.dtype}, engines load float32/float16/bfloat16")
    return out


# -- vLLM --------------------------------------------------------------------------------------
def vllm_config(raw: dict) -> dict:
    """``MedusaConfig.from_pretrained`` + ``__init__``: key renaming and silent defaults."""
    cfg = dict(raw)
    for k in list(cfg):
        if "num" in k:
            if "heads" in k:
                cfg["num_heads"] = cfg.pop(k)
            elif "layers" in k:
                cfg["num_hidden_layers"] = cfg.pop(k)
    defaults = dict(hidden_size=4096, vocab_size=32001, num_heads=5, num_hidden_layers=1)
    for k, v in defaults.items():
        cfg.setdefault(k, v)
    if cfg.get("truncated_vocab_size") is None:
        cfg["truncated_vocab_size"] = cfg["vocab_size"]
    return cfg


def check_vllm(d: Path, hidden_size: int, vocab_size: int) -> list[str]:
    """vLLM's Medusa drafter (``Medusa.__init__`` + ``load_weights``) against a directory."""
    problems = []
    if not (d / "config.json").is_file():
        return ["config.json is missing"]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        return ["no *.safetensors weights"]
    raw = json.loads((d / "config.json").read_text())
    if raw.get("model_type") != "medusa":
        problems.append("model_type must be 'medusa' (vLLM picks the Medusa drafter from it)")
    for key in ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers"):
        if key not in raw:
            problems.append(f"config lacks {key}: vLLM would silently use its default")
    renamed = [k for k in raw if "num" in k and ("heads" in k or "layers" in k)
               and k not in ("num_heads", "num_hidden_layers")]
    if renamed:
        problems.append(f"keys {renamed} are renamed to num_heads/num_hidden_layers by MedusaConfig")
    cfg = vllm_config(raw)
    if cfg["hidden_size"] != hidden_size or cfg["vocab_size"] != vocab_size:
        problems.append(f"config sizes ({cfg['hidden_size']}, {cfg['vocab_size']}) differ from the backbone's "
                        f"({hidden_size}, {vocab_size})")
    K, L, T, V = cfg["num_heads"], cfg["num_hidden_layers"], cfg["truncated_vocab_size"], cfg["vocab_size"]
    bias = bool(cfg.get("medusa_fc_bias", False))
    original = bool(cfg.get("original_lm_head", False))
    # Parameters Medusa.__init__ creates (lm head rows: truncated_vocab_size; vLLM pads internally).
    params = {}
    for h in range(K):
        for l in range(L):
            params[f"blocks.{h}.layers.{l}.weight"] = (cfg["hidden_size"], cfg["hidden_size"])
            if bias:
                params[f"blocks.{h}.layers.{l}.bias"] = (cfg["hidden_size"],)
    if original:
        params["lm_head.weight"] = (T, cfg["hidden_size"])
    else:
        for h in range(K):
            params[f"lm_heads.{h}.weight"] = (T, cfg["hidden_size"])
    tensors = {}
    for f in files:
        tensors.update({k.replace("medusa_heads.", ""): v for k, v in _tensors(f).items()})
    problems += _dtype_problems(tensors, integer_names=("token_map",))
    # load_weights: token_map used only when truncated; known params loaded; the rest ignored.
    token_map = tensors.get("token_map") if T < V else None
    loaded = set()
    for name, t in tensors.items():
        target = name
        if name == "token_map":
            if T < V and tuple(t.shape) != (T,):
                problems.append(f"token_map has shape {tuple(t.shape)}, truncated_vocab_size is {T}")
            if T < V and (t.min() < 0 or t.max() >= V or t.unique().numel() != t.numel()):
                problems.append("token_map must hold distinct ids in [0, vocab_size)")
            continue
        if name not in params and original and name == "lm_heads.0.weight":
            target = "lm_head.weight"
        if target not in params:
            problems.append(f"{name} is silently ignored by vLLM")
            continue
        shape = tuple(t.shape)
        if "lm_head" in target and token_map is not None and shape[0] > token_map.shape[0]:
            shape = (token_map.shape[0], shape[1])  # vLLM slices a full head by the token map
        if shape != params[target]:
            problems.append(f"{name} has shape {tuple(t.shape)}, vLLM expects {params[target]}")
        loaded.add(target)
    for name in sorted(set(params) - loaded):
        problems.append(f"{name} is never loaded: vLLM keeps its random init (0% acceptance)")
    if T < V and "token_map" not in tensors:
        problems.append("truncated_vocab_size < vocab_size without a token_map: vLLM's loader asserts")
    return problems


# -- TensorRT-LLM ------------------------------------------------------------------------------
TRTLLM_DEFAULT_HEADS = 4   # convert_checkpoint.py --num_medusa_heads default
TRTLLM_DEFAULT_LAYERS = 1  # convert_checkpoint.py --num_medusa_layers default


def tensorrt_llm_flags(command: str) -> dict:
    """The ``--num_medusa_heads`` / ``--num_medusa_layers`` values a printed convert command passes."""
    import re

    return {k: int(m[1]) for k in ("num_medusa_heads", "num_medusa_layers")
            if (m := re.search(rf"--{k}[ =](\d+)", command))}


def tensorrt_llm_convert(d: Path, num_medusa_heads: int | None = None, num_medusa_layers: int | None = None) -> dict:
    """What ``convert_checkpoint.py --medusa_model_dir d`` + ``trtllm-build`` end up with.

    The flags default to 4 heads and 1 layer. The engine config.json is written from the flags
    first; only then are the heads' config read: ``args.num_medusa_layers = config.get(
    'medusa_num_layers', args.num_medusa_layers)`` (so ``load_medusa_hf`` reads every layer) and the
    heads' ``medusa_num_heads`` only if the flag is None (never, with its default). trtllm-build builds
    ``num_medusa_layers`` from the engine config and only warns about the checkpoint's unused tensors.
    Returns {"engine_heads", "engine_layers", "loaded_layers"}.
    """
    heads = TRTLLM_DEFAULT_HEADS if num_medusa_heads is None else num_medusa_heads
    engine_layers = TRTLLM_DEFAULT_LAYERS if num_medusa_layers is None else num_medusa_layers
    cfg = json.loads((d / "config.json").read_text())
    loaded_layers = cfg.get("medusa_num_layers", engine_layers)
    return {"engine_heads": heads, "engine_layers": engine_layers, "loaded_layers": loaded_layers}


def tensorrt_llm_llmapi_counts(d: Path) -> tuple:
    """``MedusaConfig.from_hugging_face`` (LLM API) without a speculative_config: the keys it reads here."""
    cfg = json.loads((d / "config.json").read_text())
    return cfg.get("num_medusa_heads"), cfg.get("medusa_num_layers")


def check_tensorrt_llm(d: Path, hidden_size: int, vocab_size: int, num_medusa_heads: int,
                       num_medusa_layers: int | None = None) -> list[str]:
    """``load_medusa_hf`` as ``convert_checkpoint.py --num_medusa_heads K [--num_medusa_layers L]`` calls it."""
    problems = []
    if (d / "medusa_lm_head.pt").exists():
        problems.append("medusa_lm_head.pt exists: TensorRT-LLM reads it before the safetensors file")
    f = d / "medusa_lm_head.safetensors"
    if not f.is_file() or not (d / "config.json").is_file():
        return problems + ["needs config.json and medusa_lm_head.safetensors"]
    cfg = json.loads((d / "config.json").read_text())
    L = cfg.get("medusa_num_layers", 1)  # argparse default 1 when the key is missing
    if "medusa_num_layers" not in cfg:
        problems.append("config lacks medusa_num_layers: TensorRT-LLM would assume 1")
    if cfg.get("medusa_num_heads") != num_medusa_heads:
        problems.append(f"config medusa_num_heads {cfg.get('medusa_num_heads')} != {num_medusa_heads}")
    llm_heads, llm_layers = tensorrt_llm_llmapi_counts(d)
    if llm_heads != num_medusa_heads:
        problems.append(f"config num_medusa_heads {llm_heads} != {num_medusa_heads}: the LLM API's "
                        "MedusaConfig.from_hugging_face reads that key")
    built = tensorrt_llm_convert(d, num_medusa_heads, num_medusa_layers)
    if built["engine_layers"] != built["loaded_layers"]:
        problems.append(f"the engine is built with {built['engine_layers']} layer(s) per head (--num_medusa_layers), "
                        f"the heads have {built['loaded_layers']}: trtllm-build silently drops the rest")
    tensors = _tensors(f)
    problems += _dtype_problems(tensors)
    wanted = {}
    for h in range(num_medusa_heads):
        for l in range(L):
            wanted[f"{h}.{l}.linear.weight"] = (hidden_size, hidden_size)
            wanted[f"{h}.{l}.linear.bias"] = (hidden_size,)
        wanted[f"{h}.{L}.weight"] = (vocab_size, hidden_size)  # the head's own lm_head: required
    for name, shape in wanted.items():
        if name not in tensors:
            problems.append(f"{name} is missing (KeyError in load_medusa_hf)")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    for name in sorted(set(tensors) - set(wanted)):
        problems.append(f"{name} is never read by TensorRT-LLM")
    return problems


# -- Medusa trees (medusa_choices) -------------------------------------------------------------
REFERENCE_TOPK = 10   # FasterDecoding medusa/model/utils.py TOPK: candidates per head
REFERENCE_HEADS = 5   # FasterDecoding MedusaModel.from_pretrained fallback: medusa_num_heads = 5


def check_tree_file(path: Path, trained_heads: int) -> list[str]:
    """A ``medusa_choices`` list as ``generate_medusa_buffers`` / ``run.py --medusa_choices`` take it.

    Nodes at depth d are scored by head d-1: a path deeper than the trained heads consults a head
    the reference loader left at its random init (strict=False), and a rank >= TOPK indexes past the
    candidates FasterDecoding gathers."""
    if not path.is_file():
        return [f"{path.name} is missing: the engines' default trees (depth 4) would be used"]
    choices = json.loads(path.read_text())
    if not isinstance(choices, list) or not all(
            isinstance(p, list) and p and all(isinstance(r, int) and r >= 0 for r in p) for p in choices):
        return [f"{path.name} must be a bare list of paths such as [[0], [0, 0], [1]]"]
    problems = []
    paths = {tuple(p) for p in choices}
    if len(paths) != len(choices):
        problems.append(f"{path.name} repeats a path")
    for p in paths:
        if len(p) > 1 and p[:-1] not in paths:
            problems.append(f"path {list(p)} has no parent in {path.name}")
            break
    depth = max((len(p) for p in paths), default=0)
    if depth > trained_heads:
        problems.append(f"tree depth {depth} > {trained_heads} trained heads: deeper nodes use random heads")
    if any(r >= REFERENCE_TOPK for p in paths for r in p):
        problems.append(f"a rank >= {REFERENCE_TOPK}: FasterDecoding gathers only the top {REFERENCE_TOPK} per head")
    return problems


# -- TGI ---------------------------------------------------------------------------------------
def tgi_layout(d: Path) -> str | None:
    """Which of TGI's loaders succeeds: MedusaHeadV1 first, MedusaHeadV2 when V1 raises."""
    cfg = json.loads((d / "config.json").read_text())
    tensors = _tensors(d / "medusa_lm_head.safetensors")
    K, L = cfg.get("medusa_num_heads"), cfg.get("medusa_num_layers")
    if K is None or L is None:
        return None
    v1 = all(f"{h}.{l}.linear.{p}" in tensors for h in range(K) for l in range(L) for p in ("weight", "bias")) \
        and all(f"{h}.{L}.weight" in tensors for h in range(K))
    if v1:
        return "v1"
    v2 = L == 1 and all(f"{h}.0.linear.{p}" in tensors for h in range(K) for p in ("weight", "bias"))
    return "v2" if v2 else None


def tgi_launcher_attention(d: Path, compute_capability=(9, 0), env: dict | None = None) -> tuple[str, str]:
    """(PREFIX_CACHING, ATTENTION) as TGI's launcher resolves them from ``d/config.json``.

    ``RawConfig -> Config``: head_dim = ``head_dim`` or ``hidden_size / num_attention_heads`` when it
    divides (``text_config.head_dim`` as a fallback; ``gemma3`` -> 256). ``resolve_attention``: VLM /
    encoder-decoder configs disable prefix caching; a head size of 64, 128 or 256 keeps flashinfer
    (falcon / deepseek_v2 force the fallback); any other or unknown head size forces the fallback
    ("flashdecoding" from compute capability 8, else "paged") and disables prefix caching."""
    env = env or {}
    raw = json.loads((d / "config.json").read_text())
    prefix_caching, attention = env.get("PREFIX_CACHING"), env.get("ATTENTION")
    hidden = raw.get("hidden_size") or raw.get("n_embd")
    heads = raw.get("num_attention_heads")
    head_dim = raw.get("head_dim") or (hidden // heads if hidden and heads and hidden % heads == 0 else None)
    if head_dim is None:
        head_dim = (raw.get("text_config") or {}).get("head_dim")
    if head_dim is None and raw.get("model_type") == "gemma3":
        head_dim = 256
    if prefix_caching is None and (raw.get("vision_config") is not None or raw.get("is_encoder_decoder")):
        prefix_caching = "0"
    fallback = "paged" if compute_capability is None or compute_capability[0] < 8 else "flashdecoding"
    if head_dim in (64, 128, 256):
        if raw.get("model_type") in ("falcon", "deepseek_v2"):
            attention = attention or fallback
            if fallback == "paged" and prefix_caching is None:
                prefix_caching = "0"
    else:
        attention = attention or fallback
        prefix_caching = prefix_caching or "0"
    if attention == "paged" and prefix_caching is None:
        prefix_caching = "0"
    return prefix_caching or "true", attention or "flashinfer"


def check_tgi(d: Path, hidden_size: int, vocab_size: int) -> list[str]:
    """``get_model`` + ``SpeculativeHead.load`` + ``MedusaHeadV1`` / ``MedusaHeadV2``."""
    problems = []
    f = d / "medusa_lm_head.safetensors"
    if not f.is_file() or not (d / "config.json").is_file():
        return ["needs config.json and medusa_lm_head.safetensors (TGI reads no .pt)"]
    cfg = json.loads((d / "config.json").read_text())
    if "medusa_num_heads" not in cfg:
        problems.append("no medusa_num_heads: TGI would treat the dir as a plain model")
    if not cfg.get("base_model_name_or_path"):
        problems.append("no base_model_name_or_path: TGI loads the backbone from it")
    if "architectures" in cfg:
        problems.append("an 'architectures' key makes TGI look for an MLP speculator and drop the heads")
    if "model_type" in cfg:
        problems.append("a 'model_type' key stops TGI's router from taking the tokenizer from base_model_name_or_path")
    if "medusa_num_layers" not in cfg:
        problems.append("no medusa_num_layers: KeyError in both Medusa loaders")
    tensors = _tensors(f)
    problems += _dtype_problems(tensors)
    layout = tgi_layout(d)
    if layout is None:
        return problems + ["neither MedusaHeadV1 nor MedusaHeadV2 can load these tensors"]
    K, L = cfg["medusa_num_heads"], cfg["medusa_num_layers"]
    for name, t in tensors.items():
        parts = name.split(".")
        if name.endswith(".linear.weight"):
            expect = (hidden_size, hidden_size)
        elif name.endswith(".linear.bias"):
            expect = (hidden_size,)
        elif len(parts) == 3 and parts[2] == "weight" and layout == "v1":
            expect = (vocab_size, hidden_size)
        else:
            problems.append(f"{name} is never read by TGI ({layout})")
            continue
        if int(parts[0]) >= K or (name.endswith("linear.weight") or name.endswith("linear.bias")) and int(parts[1]) >= L:
            problems.append(f"{name} is beyond medusa_num_heads/medusa_num_layers: never read")
        if tuple(t.shape) != expect:
            problems.append(f"{name} has shape {tuple(t.shape)}, TGI expects {expect}")
    return problems


# -- reference Medusa --------------------------------------------------------------------------
def check_reference_medusa(d: Path, hidden_size: int, vocab_size: int) -> list[str]:
    """``MedusaModel.from_pretrained``: MedusaConfig keys and ``medusa_head.load_state_dict(strict=False)``.

    The reference reads ``medusa_lm_head.pt``; exports are safetensors only (README explains the
    one-line conversion), so the tensors are checked in the safetensors file."""
    problems = []
    f = d / "medusa_lm_head.safetensors"
    if not f.is_file() or not (d / "config.json").is_file():
        return ["needs config.json and medusa_lm_head.safetensors"]
    cfg = json.loads((d / "config.json").read_text())
    for key in ("medusa_num_heads", "medusa_num_layers", "base_model_name_or_path"):
        if key not in cfg:
            problems.append(f"config lacks {key}: MedusaConfig would silently use its default")
    # from_pretrained's fallback path (AutoConfig cannot read a config without model_type) builds
    # REFERENCE_HEADS heads whatever medusa_num_heads says; strict=False leaves the missing ones random.
    K_trained, L = cfg.get("medusa_num_heads", 4), cfg.get("medusa_num_layers", 1)
    K = min(K_trained, REFERENCE_HEADS)
    if K_trained < REFERENCE_HEADS:
        problems += [f"with {K_trained} heads: " + p for p in check_tree_file(d / "medusa_choices.json", K_trained)]
    tensors = _tensors(f)
    problems += _dtype_problems(tensors)
    # The state dict of ModuleList([Sequential(*[ResBlock] * L, Linear(H, V, bias=False))] * K).
    wanted = {}
    for h in range(K):
        for l in range(L):
            wanted[f"{h}.{l}.linear.weight"] = (hidden_size, hidden_size)
            wanted[f"{h}.{l}.linear.bias"] = (hidden_size,)
        wanted[f"{h}.{L}.weight"] = (vocab_size, hidden_size)
    for name, shape in wanted.items():
        if name not in tensors:
            problems.append(f"{name} is missing: strict=False loading would leave it at its initial value")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    for name in sorted(set(tensors) - set(wanted)):
        problems.append(f"{name} is silently ignored (strict=False)")
    return problems


# -- vLLM mlp_speculator ----------------------------------------------------------------------
def check_vllm_mlp_speculator(d: Path, hidden_size: int, vocab_size: int) -> list[str]:
    """vLLM's ``MLPSpeculator.__init__`` + ``load_weights`` against a directory.

    Config: ``MLPSpeculatorConfig(vocab_size, emb_dim, inner_dim (0 = emb_dim), n_predict,
    top_k_tokens_per_head, n_candidates, tie_weights, scale_input)``; num_lookahead_tokens =
    n_predict. Parameters: emb.{i}.weight [vocab, inner] (VocabParallelEmbedding),
    proj.{i}.weight [inner, emb_dim if i == 0 else inner] (no bias), head.{i}.weight [vocab, inner]
    (ParallelLMHead, no bias), ln.{i}.weight / ln.{i}.bias [inner]; with tie_weights one module is
    repeated, so named_parameters holds emb.0, proj.0, proj.1, head.0, ln.0 only. ``load_weights``
    strips "speculator." and skips names it does not know (silently: an uninitialised tensor).
    """
    problems = []
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        return ["missing config.json"]
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("model_type") != "mlp_speculator":
        problems.append(f"model_type must be mlp_speculator, got {cfg.get('model_type')!r}")
    for key in ("vocab_size", "emb_dim", "inner_dim", "n_predict", "tie_weights", "scale_input"):
        if key not in cfg:
            problems.append(f"config lacks {key} (vLLM would use its default)")
    if problems:
        return problems
    if cfg["emb_dim"] != hidden_size:
        problems.append(f"emb_dim {cfg['emb_dim']} != backbone hidden size {hidden_size}")
    if cfg["vocab_size"] != vocab_size:
        problems.append(f"vocab_size {cfg['vocab_size']} != backbone vocab {vocab_size}")
    n, emb, inner = cfg["n_predict"], cfg["emb_dim"], cfg["inner_dim"] or cfg["emb_dim"]
    tie = bool(cfg["tie_weights"])
    expected = {}
    for i in range(1 if tie else n):
        expected[f"emb.{i}.weight"] = (cfg["vocab_size"], inner)
        expected[f"head.{i}.weight"] = (cfg["vocab_size"], inner)
        expected[f"ln.{i}.weight"] = (inner,)
        expected[f"ln.{i}.bias"] = (inner,)
    for i in range(2 if tie else n):
        expected[f"proj.{i}.weight"] = (inner, emb if i == 0 else inner)
    files = [f for f in d.iterdir() if f.suffix == ".safetensors"]
    if not files:
        return problems + ["no .safetensors weights"]
    tensors = {}
    for f in files:
        tensors.update({k.removeprefix("speculator."): v for k, v in _tensors(f).items()})
    for name, shape in expected.items():
        if name not in tensors:
            problems.append(f"missing {name} (would stay uninitialised)")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(tensors[name].shape)}, vLLM allocates {shape}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        problems.append(f"names vLLM would silently skip: {extra[:4]}")
    return problems + _dtype_problems(tensors)
