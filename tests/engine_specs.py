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
                  vllm/transformers_utils/configs/mlp_speculator.py (v0.8-v0.9.2, read through the
                  stored index; the MLPSpeculator class there: emb/proj/ln/head, tie_weights, scale_input)
  TGI mlp_speculator  server/text_generation_server/layers/mlp.py (MLPSpeculatorModel / ModelTied / Head) and
                  layers/speculative.py, models/__init__.py (get_model: model_type mlp_speculator)
                  commit 09a1de5cd112a7ff940a2de7ebce7077af5b937c; releases: tags v2.2.0, v2.3.0, v3.3.7, db931fcf

  EAGLE-3       vLLM vllm/model_executor/models/llama_eagle3.py     commit 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190
                  (LlamaDecoderLayer.forward, LlamaModel.load_weights, Eagle3LlamaForCausalLM.load_weights /
                  compute_logits), vllm/model_executor/models/llama.py commit e06c9ba2a6ea923a84add30f5dafaea126429b81
                  (aux capture: hidden_states + residual before layer idx; default (2, N//2, N-3)),
                  v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config (top level, then eagle_config);
                  norm_before_residual (_norm_before_residual: residual = hidden_norm(h)) and logit_scale
                  (LogitsProcessor(scale=)) at that commit; norm_output (EAGLE-3.1: the post-norm state fed to the
                  next depth) from vLLM PR 42764 as NVIDIA NeMo-AutoModel's EAGLE-3 draft model describes it;
                  norm_before_fc (input_norm over the 3H concat; eagle_config first, then the top level) and
                  fc_norm (fc_norm.{i} per aux layer, after input_norm) from llama_eagle3.py's LlamaModel.__init__,
                  combine_hidden_states and load_weights (skip_substrs "input_norm.") after PRs 38111, 42143 and
                  42764, read through the stored index (a copy of the file, not a pinned upstream commit);
                SGLang python/sglang/srt/models/llama_eagle3.py  commit 03d5a7771f6082e7737a5f19cae7d1e863087013
                  (LlamaDecoderLayer.forward, LlamaModel.forward, LlamaForCausalLMEagle3.load_weights: d2t ->
                  hot_token_id), python/sglang/srt/models/llama.py commit 00239548f1cd1a06ca145a5447a86738090a48f1
                  (set_eagle3_layers_to_capture: eagle_config ids + 1), model_runner (eagle_config only)
                TensorRT-LLM tensorrt_llm/_torch/models/modeling_speculative.py
                  commit 00679c66c3e38f6d2651ad0a5bef0f94d862e36c (Eagle3DraftModel, Eagle3ForCausalLM), with
                  _torch/speculative/eagle3.py, utils.py, llmapi/llm_args.py, models/modeling_llama.py and
                  modules/attention.py at the commits listed above ``check_trtllm_eagle3``

If an engine changes its loader, update the matching function here and the exporter with it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _unloaded(params: dict, expect: dict, engine: str, consequence: str) -> list[str]:
    """What an engine allocates (``expect``: name -> shape) that its load left unfilled or filled mis-shaped."""
    problems = []
    for name, shape in expect.items():
        if name not in params:
            problems.append(f"{name} is never loaded: {consequence}")
        elif tuple(params[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(params[name].shape)}, {engine} allocates {shape}")
    return problems


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


# -- TGI mlp_speculator ------------------------------------------------------------------------
def check_tgi_mlp_speculator(d: Path, hidden_size: int, vocab_size: int, release: str = "current") -> list[str]:
    """TGI's ``get_model`` + ``SpeculativeHead.load`` + ``MLPSpeculatorHead.load`` against a directory, as
    ``release`` ships them: "current" is v2.3.0 up to v3.3.7 and HEAD db931fcf (tied heads load; the untied
    ``MLPSpeculatorModel.__init__`` ends with ``self.emb.weight *= self.emb_weight`` on a ``ModuleList``, an
    AttributeError), "2.2" is v2.2.0 and older (one embedding, projection, norm and head per step, always:
    tied heads miss ``speculator.emb.1``; ``scale_input`` is not read).

    ``get_model``: model_type ``mlp_speculator`` -> a speculator dir; the backbone is ``base_model_name_or_path``
    (a KeyError without it); ``n_predict`` bounds ``--speculate``; every ``.safetensors`` file of the dir is routed.
    ``SpeculativeHead.load``: ``architectures[0] == "MLPSpeculatorPreTrainedModel"`` or no speculator at all (and
    a KeyError without ``architectures`` sends it to the Medusa loaders). ``MLPSpeculatorModel`` reads
    ``speculator.emb.{i}.weight``, ``speculator.proj.{i}.weight`` (no bias), ``speculator.head.{i}.weight``,
    ``speculator.ln.{i}.weight`` / ``.bias`` with ``weights.get_tensor`` (a missing name fails the load); tied:
    emb.0, proj.0, proj.1, head.0, ln.0. ``inner_dim`` from the config (0 would zero the embedding term); the
    output size is the backbone's vocab_size. ``scale_input`` is read from the same config.json (TGI v2.3.0 on,
    ``tgi_mlp_speculator_probs``)."""
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        return ["missing config.json"]
    cfg = json.loads(cfg_path.read_text())
    problems = []
    if cfg.get("model_type") != "mlp_speculator":
        problems.append(f"model_type must be mlp_speculator, got {cfg.get('model_type')!r}")
    if (cfg.get("architectures") or [None])[0] != "MLPSpeculatorPreTrainedModel":
        problems.append("architectures[0] must be MLPSpeculatorPreTrainedModel (else TGI runs no speculator)")
    for key in ("base_model_name_or_path", "n_predict", "inner_dim"):
        if not cfg.get(key):
            problems.append(f"config lacks a non-empty {key}")
    if problems:
        return problems
    n, inner, tie = cfg["n_predict"], cfg["inner_dim"], bool(cfg.get("tie_weights"))
    if release == "current" and not tie:
        return ["untied MLPSpeculatorModel: self.emb.weight *= self.emb_weight on a ModuleList (AttributeError)"]
    tie = tie and release == "current"   # v2.2.0 reads one module per step whatever the config says
    expected = {}
    for i in range(1 if tie else n):
        expected[f"speculator.emb.{i}.weight"] = (vocab_size, inner)
        expected[f"speculator.head.{i}.weight"] = (vocab_size, inner)
        expected[f"speculator.ln.{i}.weight"] = (inner,)
        expected[f"speculator.ln.{i}.bias"] = (inner,)
    for i in range(2 if tie else n):
        expected[f"speculator.proj.{i}.weight"] = (inner, hidden_size if i == 0 else inner)
    tensors = {}
    for f in d.iterdir():
        if f.suffix == ".safetensors":
            tensors.update(_tensors(f))
    for name, shape in expected.items():
        if name not in tensors:
            problems.append(f"missing {name} (get_tensor fails)")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(tensors[name].shape)}, TGI needs {shape}")
    return problems + _dtype_problems(tensors)


def tgi_mlp_speculator_probs(d: Path, hidden: torch.Tensor, input_ids: torch.Tensor,
                             release: str = "current") -> torch.Tensor:
    """TGI's ``MLPSpeculatorModel.forward`` (top-1 per head, as ``top_k_tokens_per_head = [1] * n``) restated in
    fp32: [b, n_predict, vocab] probabilities from the backbone's last hidden states [b, H] and its greedy tokens
    [b]. With ``scale_input`` in the config, ``MLPSpeculatorHead.forward`` first (TGI v2.3.0 on, commit d9fbbaaf;
    not in ``release`` "2.2"): ``simple_norm``, an RMS norm with eps 1e-6 and no weight, times 1/sqrt 2."""
    cfg = json.loads((d / "config.json").read_text())
    t = {}
    for f in d.iterdir():
        if f.suffix == ".safetensors":
            t.update({k: v.float() for k, v in _tensors(f).items()})
    n, inner, tie = cfg["n_predict"], cfg["inner_dim"], bool(cfg.get("tie_weights"))
    state_weight = 0.5 ** (0.5 / n)
    emb_weight = math.sqrt(1 - state_weight ** 2)

    def ln(x, i):   # MLPSpeculatorLayerNorm, eps 1e-6
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return t[f"speculator.ln.{i}.weight"] * x + t[f"speculator.ln.{i}.bias"]

    state, ind, probs = hidden.float(), input_ids, []
    if cfg.get("scale_input") and release == "current":
        state = state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + 1e-6) * 2 ** -0.5
    for i in range(n):
        e, h, p = (0, 0, min(i, 1)) if tie else (i, i, i)
        z = torch.nn.functional.embedding(ind, t[f"speculator.emb.{e}.weight"]) * (emb_weight * math.sqrt(inner / 2))
        state = state @ t[f"speculator.proj.{p}.weight"].T * state_weight + z
        state = torch.nn.functional.gelu(ln(state, e))
        step = torch.log_softmax(state @ t[f"speculator.head.{h}.weight"].T, dim=-1)
        probs.append(step.exp())
        ind = step.argmax(-1)
    return torch.stack(probs, dim=1)


# -- EAGLE-3 (vLLM and SGLang) ---------------------------------------------------------------------
# Both engines load the same directory into a one-layer Llama drafter; they differ in parameter
# names (vLLM ``model.layers.0.``, SGLang ``model.midlayer.``), in how they read the aux layer ids and
# in how draft ids reach the target vocabulary. What is restated below runs on CPU in fp32.
EAGLE3_VLLM_ARCHS = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")  # registry.py _SPECULATIVE_DECODING_MODELS
EAGLE3_SGLANG_ARCHS = ("LlamaForCausalLMEagle3",)                        # llama_eagle3.py EntryClass
_STACKED = ((".qkv_proj", ".q_proj", 0), (".qkv_proj", ".k_proj", 1), (".qkv_proj", ".v_proj", 2),
            (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))


def _eagle3_files(d: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = json.loads((d / "config.json").read_text())
    return cfg, _tensors(d / "model.safetensors")


def _eagle3_shapes(cfg: dict, prefix: str) -> dict[str, tuple]:
    """The drafter's parameters as both engines build them (``prefix``: vLLM ``model.layers.0.``,
    SGLang ``model.midlayer.``); qkv and gate_up are the stacked ones."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, hd = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads
    inner, target_h = cfg["intermediate_size"], cfg.get("target_hidden_size", h)
    draft_vocab = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    shapes = {f"{prefix}self_attn.qkv_proj.weight": ((heads + 2 * kv) * hd, 2 * h),
              f"{prefix}self_attn.o_proj.weight": (h, heads * hd),
              f"{prefix}mlp.gate_up_proj.weight": (2 * inner, h), f"{prefix}mlp.down_proj.weight": (h, inner),
              **{f"{prefix}{n}.weight": (h,) for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")},
              "model.fc.weight": (h, 3 * target_h), "model.norm.weight": (h,), "lm_head.weight": (draft_vocab, h)}
    if prefix == "model.layers.0.":  # the norms on fc's input: vLLM builds them, SGLang (at the commit read) never
        before_fc, per_layer = vllm_eagle3_fc_flags(cfg)
        if before_fc:
            shapes["model.input_norm.weight"] = (3 * target_h,)
        if per_layer:
            shapes.update({f"model.fc_norm.{i}.weight": (target_h,) for i in range(3)})
    return shapes


def vllm_eagle3_fc_flags(cfg: dict) -> tuple[bool, bool]:
    """(norm_before_fc, fc_norm) as vLLM's ``llama_eagle3.py`` reads them (after vllm-project/vllm#38111, #42143
    and #42764, read through the stored index): norm_before_fc from ``eagle_config`` first, else the top level
    (NVIDIA's checkpoints); fc_norm from the top level."""
    eagle = cfg.get("eagle_config") or {}
    return bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))), bool(cfg.get("fc_norm", False))


def _stack(params: dict, name: str, t: torch.Tensor) -> bool:
    """The stacked-parameter branch of both loaders: q/k/v into qkv_proj, gate/up into gate_up_proj
    (shards concatenated on dim 0 in shard order). False when ``name`` is no shard."""
    for param, shard, idx in _STACKED:
        if shard in name:
            params.setdefault(name.replace(shard, param), {})[idx] = t
            return True
    return False


def _eagle3_config_problems(cfg: dict, hidden_size: int, vocab_size: int, archs: tuple) -> list[str]:
    problems = []
    if not set(cfg.get("architectures") or ()) & set(archs):
        problems.append(f"architectures {cfg.get('architectures')} name none of {archs}")
    if cfg.get("model_type") != "llama":
        problems.append("model_type must be llama (the engines build a LlamaConfig)")
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "draft_vocab_size"):
        if key not in cfg:
            problems.append(f"config lacks {key}: the engine would use LlamaConfig's default")
    if cfg.get("num_hidden_layers") != 1:
        problems.append("num_hidden_layers must be 1: only midlayer is in the checkpoint")
    if cfg.get("hidden_size") != hidden_size or cfg.get("vocab_size") != vocab_size:
        problems.append(f"sizes ({cfg.get('hidden_size')}, {cfg.get('vocab_size')}) differ from the target's "
                        f"({hidden_size}, {vocab_size})")
    if cfg.get("tie_word_embeddings", False):
        problems.append("tie_word_embeddings: SGLang makes lm_head the embedding table")
    sglang_ignores = {"norm_before_residual": False, "norm_output": False, "logit_scale": 1.0,  # its llama_eagle3
                      "norm_before_fc": False, "fc_norm": False}
    for flag, default in sglang_ignores.items():
        if archs == EAGLE3_SGLANG_ARCHS and flag in cfg and cfg[flag] != default:
            problems.append(f"{flag}: SGLang's drafter does not compute it")
    for key in ("attention_bias", "mlp_bias", "bias"):
        if cfg.get(key):
            problems.append(f"{key}: the drafter weights have no bias")
    return problems


def captured_layers(ids, num_layers: int) -> tuple:
    """The layers a target captures for ``ids``, in the order fc receives them: both engines' Llama
    forward walks the layers and appends ``hidden_states + residual`` when ``idx in aux_layers``, so
    ascending and each layer once whatever order (or repeats) the config lists."""
    wanted = set(ids)
    return tuple(idx for idx in range(num_layers) if idx in wanted)


def vllm_eagle3_aux_ids(cfg: dict, num_layers: int) -> tuple:
    """gpu_model_runner ``_get_eagle3_aux_layers_from_config``, else the target's
    ``get_eagle3_aux_hidden_state_layers``; llama.py captures the *input* of layer idx, so these are
    transformers hidden_states ids as they are, captured while walking the layers (``captured_layers``)."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return captured_layers(ids if ids else (2, num_layers // 2, num_layers - 3), num_layers)


def sglang_eagle3_aux_ids(cfg: dict, num_layers: int) -> tuple:
    """model_runner reads ``eagle_config["eagle_aux_hidden_state_layer_ids"]`` only;
    ``set_eagle3_layers_to_capture`` adds 1 (its ids name layer outputs); llama.py captures the input
    of each listed layer while walking the layers (``captured_layers``). Default (2, N//2, N-3), taken as is."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = [i + 1 for i in ids] if ids is not None else (2, num_layers // 2, num_layers - 3)
    return captured_layers(ids, num_layers)


def engine_aux_features(hidden_states, layer_ids) -> torch.Tensor:
    """What the target hands the drafter: the captured layers' states concatenated in capture order.
    ``hidden_states``: transformers' tuple (index i = the input of layer i, = vLLM's hidden + residual);
    ``layer_ids`` from ``vllm_eagle3_aux_ids`` / ``sglang_eagle3_aux_ids``."""
    return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)


def vllm_eagle3_load(d: Path, hidden_size: int, vocab_size: int) -> tuple[dict, dict, list[str]]:
    """``Eagle3LlamaForCausalLM.load_weights`` then ``LlamaModel.load_weights``: t2d skipped, d2t ->
    draft_id_to_target_id, every name but lm_head prefixed ``model.``, ``midlayer.`` -> ``layers.0.``,
    q/k/v and gate/up stacked; an unknown name is a KeyError, an unloaded parameter an error (the
    model loader checks every weight was initialised), embed_tokens and draft_id_to_target_id may be
    absent (shared from the target / left at zeros). The norms on fc's input (``vllm_eagle3_fc_flags``): built
    when their flag is set; ``input_norm.`` skipped when norm_before_fc is not (its ``skip_substrs``); a flagged
    norm the checkpoint lacks keeps its init (ones), reported as a problem. Returns (params, config, problems)."""
    cfg, tensors = _eagle3_files(d)
    problems = _eagle3_config_problems(cfg, hidden_size, vocab_size, EAGLE3_VLLM_ARCHS)
    expect = _eagle3_shapes(cfg, "model.layers.0.")
    draft_vocab = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    params, stacked = {"draft_id_to_target_id": torch.zeros(draft_vocab, dtype=torch.long)}, {}
    for name, t in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        if _stack(stacked, name, t) or ("input_norm." in name and not vllm_eagle3_fc_flags(cfg)[0]):
            continue
        if name in expect or name == "draft_id_to_target_id" or name == "model.embed_tokens.weight":
            params[name] = t
        else:
            problems.append(f"{name}: KeyError in vLLM's load_weights (no such parameter)")
    for name, shards in stacked.items():
        params[name] = torch.cat([shards[i] for i in sorted(shards)], 0)
    for name, shape in expect.items():
        if name not in params and ("input_norm." in name or "fc_norm." in name):
            params[name] = torch.ones(shape)
            problems.append(f"{name} is never loaded: vLLM keeps its init (ones)")
        elif name not in params:
            problems.append(f"{name} is never loaded: vLLM refuses the checkpoint")
        elif tuple(params[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(params[name].shape)}, vLLM allocates {shape}")
    if params["draft_id_to_target_id"].dtype != torch.int64:
        problems.append("d2t must be int64 (vLLM's draft_id_to_target_id is a long parameter)")
    problems += _dtype_problems({k: v for k, v in tensors.items() if k not in ("d2t", "t2d")})
    return params, cfg, problems


def sglang_eagle3_load(d: Path, hidden_size: int, vocab_size: int) -> tuple[dict, dict, list[str]]:
    """``LlamaForCausalLMEagle3.load_weights``: d2t -> ``hot_token_id = d2t + arange`` (kept under that
    key here), t2d skipped, q/k/v and gate/up stacked, a name not among the parameters tried again with
    ``model.`` and otherwise silently skipped (a parameter nobody loads keeps its random init).
    Returns (params, config, problems)."""
    cfg, tensors = _eagle3_files(d)
    problems = _eagle3_config_problems(cfg, hidden_size, vocab_size, EAGLE3_SGLANG_ARCHS)
    if cfg.get("draft_vocab_size") is None:
        problems.append("no draft_vocab_size: SGLang loads the target's lm_head instead of the drafter's")
    expect = _eagle3_shapes(cfg, "model.midlayer.")
    params, stacked = {}, {}
    for name, t in tensors.items():
        if "d2t" in name:
            params["hot_token_id"] = t + torch.arange(t.shape[0])
            continue
        if "t2d" in name:
            continue
        if _stack(stacked, name, t):
            continue
        full = name if name in expect else f"model.{name}"
        if full in expect:
            params[full] = t
        elif full != "model.embed_tokens.weight":  # set_embed replaces it with the target's anyway
            problems.append(f"{name} is silently skipped by SGLang")
    for name, shards in stacked.items():
        full = name if name in expect else f"model.{name}"
        params[full] = torch.cat([shards[i] for i in sorted(shards)], 0)
    problems += _unloaded(params, expect, "SGLang", "SGLang keeps its random init")
    return params, cfg, problems


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _inv_freq(base: float, d: int) -> torch.Tensor:
    """RotaryEmbedding._compute_inv_freq (both engines)."""
    return 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


def _llama3_inv_freq(rope: dict, inv: torch.Tensor) -> torch.Tensor:
    """Llama3RotaryEmbedding._compute_inv_freq (vLLM llama3_rope.py; SGLang rope_variant.py)."""
    f, low, high, omax = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], \
        rope["original_max_position_embeddings"]
    wave = 2 * math.pi / inv
    smooth = (omax / wave - low) / (high - low) if low != high else 0
    return torch.where(wave < omax / high, inv, torch.where(wave > omax / low, inv / f,
                                                              (1 - smooth) * inv / f + smooth * inv))


def _yarn_inv_freq(rope: dict, base: float, d: int) -> tuple[torch.Tensor, float]:
    """YaRNScalingRotaryEmbedding (vLLM yarn_scaling_rope.py + common.py; SGLang yarn.py): the ramp over
    original_max_position_embeddings, cos/sin times yarn_get_mscale(factor) * attn_factor (SGLang)."""
    f, omax = rope["factor"], rope["original_max_position_embeddings"]

    def corr(rot):
        return (d * math.log(omax / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr(rope.get("beta_fast", 32))), 0)
    high = min(math.ceil(corr(rope.get("beta_slow", 1))), d - 1)
    high = high + 0.001 if low == high else high
    pos = base ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    mask = 1 - torch.clamp((torch.arange(d // 2, dtype=torch.float) - low) / (high - low), 0, 1)
    mscale = (1.0 if f <= 1 else 0.1 * math.log(f) + 1.0) * rope.get("attn_factor", 1)
    return (1.0 / (f * pos)) * (1 - mask) + (1.0 / pos) * mask, mscale


def _longrope_inv_freq(cfg: dict, rope: dict, base: float, d: int, positions: torch.Tensor, sglang: bool):
    """Phi3LongRoPEScaledRotaryEmbedding: mscale from max_position / original (short_mscale / long_mscale
    override it); SGLang takes the long factors when a position of the batch is > original, vLLM at every
    position once max_model_len > original (restated as always: the case longrope is served for)."""
    omax, scale = rope["original_max_position_embeddings"], cfg["max_position_embeddings"] / \
        rope["original_max_position_embeddings"]
    default = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(omax))
    use_long = bool((positions > omax).any()) if sglang else True
    factors = torch.tensor(rope["long_factor" if use_long else "short_factor"], dtype=torch.float32)
    mscale = rope.get("long_mscale" if use_long else "short_mscale") or default
    return 1.0 / (factors * base ** (torch.arange(0, d, 2, dtype=torch.float) / d)), mscale


def engine_rope_cos_sin(cfg: dict, d: int, positions: torch.Tensor, sglang: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos / sin [T, D/2] rows get_rope's cos_sin_cache holds at ``positions`` for a Llama drafter
    config: vLLM get_rope (rotary_embedding/__init__.py, commit 07b12f1b16d5568eeb29a52fd8c9296a51f478ed;
    llama3 045d7575, yarn 0cd57848, linear 0f17ee06, dynamic 3cfbaf33, longrope 17d618b0) reads
    rope_scaling copied into rope_parameters; SGLang get_rope (layers/rotary_embedding/factory.py, commit
    108c36c008291c3a1ea524342837056c503c5724; rope_variant.py / yarn.py 0b1fd02d) reads config.rope_scaling.
    Both take rope_theta as the base; linear divides the positions; dynamic fixes one base for the whole
    cache (max_len = max_position x factor): vLLM 3cfbaf33 base x (max_len / max_position - (factor - 1))^(D/(D-2))
    = the base itself, SGLang base x (factor x max_len / max_position - (factor - 1))^(D/(D-2))."""
    base, max_pos = cfg.get("rope_theta", 10000.0), cfg.get("max_position_embeddings", 8192)
    rope = cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    t, inv, mscale = positions.float(), _inv_freq(base, d), 1.0
    if kind == "linear":
        t = t / rope["factor"]
    elif kind == "dynamic":
        f = rope["factor"]
        stretch = (f if sglang else 1.0) * (max_pos * f) / max_pos
        inv = _inv_freq(base * (stretch - (f - 1)) ** (d / (d - 2)), d)
    elif kind == "llama3":
        inv = _llama3_inv_freq(rope, inv)
    elif kind == "yarn":
        inv, mscale = _yarn_inv_freq(rope, base, d)
    elif kind == "longrope":
        inv, mscale = _longrope_inv_freq(cfg, rope, base, d, positions, sglang)
    elif kind != "default":
        raise ValueError(f"Unknown RoPE scaling type {kind}")  # both engines
    ang = t[:, None] * inv[None]
    return ang.cos() * mscale, ang.sin() * mscale


def _rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """is_neox_style=True, both engines' Llama default: the two halves rotate together.
    x [T, heads, D], cos / sin [T, D/2]."""
    d = x.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def eagle3_engine_forward(params: dict, cfg: dict, layer: str, embed: torch.Tensor, tokens: torch.Tensor,
                          hidden: torch.Tensor, positions: torch.Tensor, past=None):
    """One drafter pass over T new rows, as both engines compute it (``layer``: ``model.layers.0.`` or
    ``model.midlayer.``). tokens [T]; hidden [T, 3H] (fc first: vLLM's ``combine_hidden_states``, SGLang's
    ``if hidden.shape[-1] != embeds.shape[-1]``) or [T, H] (a previous pre-norm state); positions [T];
    past (k, v) [S, kv, D] of earlier rows, all visible; causal among the new rows.

      embeds = input_layernorm(embed[tokens]); residual = hidden; hidden = hidden_norm(hidden)
      x = cat([embeds, hidden]) -> qkv_proj -> RoPE -> attention -> o_proj
      residual = x + residual; x = mlp(post_attention_layernorm(residual))     (fused add + norm)
      prenorm = x + residual; normed = norm(prenorm)                            (fused add + norm)
    vLLM only (``model.layers.0.``): ``norm_before_residual`` takes residual = hidden_norm(hidden), ``norm_output``
    feeds normed to the next step instead of prenorm, ``norm_before_fc`` / ``fc_norm`` norm fc's input
    (``_engine_fc``).
    Returns (normed [T, H] for compute_logits, the state [T, H] fed to the next step, (k, v))."""
    eps = cfg.get("rms_norm_eps", 1e-6)
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, hd = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads
    vllm = layer == "model.layers.0."
    if hidden.shape[-1] != h:
        hidden = _engine_fc(params, cfg, hidden, vllm)
    e = _rms(embed[tokens], params[f"{layer}input_layernorm.weight"], eps)
    residual = _rms(hidden, params[f"{layer}hidden_norm.weight"], eps) if vllm and cfg.get("norm_before_residual") \
        else hidden
    x = torch.cat([e, _rms(hidden, params[f"{layer}hidden_norm.weight"], eps)], -1)
    qkv = x @ params[f"{layer}self_attn.qkv_proj.weight"].T
    q, k, v = qkv.split([heads * hd, kv * hd, kv * hd], -1)
    t = q.shape[0]
    cos, sin = engine_rope_cos_sin(cfg, hd, positions, sglang=layer == "model.midlayer.")
    q = _rope_neox(q.view(t, heads, hd), cos, sin)
    k = _rope_neox(k.view(t, kv, hd), cos, sin)
    v = v.view(t, kv, hd)
    if past is not None:
        k_all, v_all = torch.cat([past[0], k]), torch.cat([past[1], v])
    else:
        k_all, v_all = k, v
    s = k_all.shape[0]
    rep = heads // kv
    scores = torch.einsum("thd,shd->hts", q, k_all.repeat_interleave(rep, 1)) / hd ** 0.5
    visible = torch.ones(t, s, dtype=torch.bool).tril(s - t)
    attn = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    ctx = torch.einsum("hts,shd->thd", attn, v_all.repeat_interleave(rep, 1)).reshape(t, heads * hd)
    x = ctx @ params[f"{layer}self_attn.o_proj.weight"].T
    residual = x + residual
    gate, up = (_rms(residual, params[f"{layer}post_attention_layernorm.weight"], eps)
                @ params[f"{layer}mlp.gate_up_proj.weight"].T).chunk(2, -1)
    x = (torch.nn.functional.silu(gate) * up) @ params[f"{layer}mlp.down_proj.weight"].T
    prenorm = x + residual
    normed = _rms(prenorm, params["model.norm.weight"], eps)
    return normed, normed if vllm and cfg.get("norm_output") else prenorm, (k, v)


def _engine_fc(params: dict, cfg: dict, hidden: torch.Tensor, vllm: bool) -> torch.Tensor:
    """fc over the captured layers [T, 3H] (vLLM's ``combine_hidden_states``): with norm_before_fc one RMSNorm
    over the 3H concat (``input_norm``), then with fc_norm one per layer's H block (``fc_norm.{i}``), in that
    order; SGLang (at the commit read) applies neither."""
    fc, eps = params["model.fc.weight"], cfg.get("rms_norm_eps", 1e-6)
    if hidden.shape[-1] != fc.shape[1]:  # e.g. a layer named twice: captured once, fc gets 2H
        raise RuntimeError(f"fc expects {fc.shape[1]} features, the target captured {hidden.shape[-1]} "
                           "(shape error at serve time)")
    before_fc, per_layer = vllm_eagle3_fc_flags(cfg) if vllm else (False, False)
    if before_fc:
        hidden = _rms(hidden, params["model.input_norm.weight"], eps)
    if per_layer:
        hidden = torch.cat([_rms(block, params[f"model.fc_norm.{i}.weight"], eps)
                            for i, block in enumerate(hidden.chunk(3, -1))], -1)
    return hidden @ fc.T


def vllm_eagle3_logits(params: dict, cfg: dict, normed: torch.Tensor) -> torch.Tensor:
    """``compute_logits``: draft logits (times ``logit_scale``) scattered to ``arange(draft_vocab) +
    draft_id_to_target_id``, -inf at every other target id."""
    logits = normed @ params["lm_head.weight"].T * cfg.get("logit_scale", 1.0)
    targets = torch.arange(logits.shape[-1]) + params["draft_id_to_target_id"]
    out = logits.new_full((logits.shape[0], cfg["vocab_size"]), float("-inf"))
    out[:, targets] = logits
    return out


def sglang_eagle3_logits(params: dict, cfg: dict, normed: torch.Tensor) -> torch.Tensor:
    """The draft logits SGLang samples from (its LogitsProcessor over draft_vocab_size), put at the
    target ids its worker maps the drafted ids to (``hot_token_id``; none: the same ids)."""
    logits = normed @ params["lm_head.weight"].T
    hot = params.get("hot_token_id", torch.arange(logits.shape[-1]))
    out = logits.new_full((logits.shape[0], cfg["vocab_size"]), float("-inf"))
    out[:, hot] = logits
    return out


# -- EAGLE-3 (TensorRT-LLM) ------------------------------------------------------------------------
# TensorRT-LLM's PyTorch backend (NVIDIA/TensorRT-LLM, read through the stored index):
#   tensorrt_llm/_torch/models/modeling_speculative.py  commit 00679c66c3e38f6d2651ad0a5bef0f94d862e36c
#     (Eagle3Attention, Eagle3DecoderLayer, Eagle3DraftModel, Eagle3ForCausalLM.load_weights / apply_eagle3_fc,
#     _build_eagle3_one_model_draft, SpecDecOneEngineForCausalLM: draft config from speculative_model's config.json)
#   tensorrt_llm/_torch/speculative/eagle3.py           commit 001e67005b4f64b69b0045456870be48ab7b2cf0
#     (Eagle3OneModelSpecMetadata: default capture, maybe_capture_hidden_states; Eagle3OneModelWorker: drafter
#     inputs, positions, draft_decoder's d2t)
#   tensorrt_llm/_torch/speculative/utils.py            commit 011d0933dcb5e592f5fa2626beaf42a96324c578
#     (get_spec_metadata: layers_to_capture = EagleDecodingConfig.eagle3_layers_to_capture)
#   tensorrt_llm/llmapi/llm_args.py                     commit 0004396720054fd8e205cbf616f21f0b57c6b412
#     (EagleDecodingConfig: eagle3_layers_to_capture default {1, N//2-1, N-4}, eagle3_one_model forced true,
#     speculative_model alias speculative_model_dir, max_draft_len)
#   tensorrt_llm/_torch/models/modeling_llama.py        commit 3a5901cd0d77bed18baaf402d1d12fab468d44a9
#     (LlamaDecoderLayer.forward: capture after the MLP; the same at 012cf9099ed6935c6b42a7b4c91356cbfa81b442)
#   tensorrt_llm/_torch/modules/attention.py            commit c6d3bb2aae305e0b5ac1b97b7954dcf87d653322
#     (head_dim from the config, else hidden // heads), modeling_utils.py _load_weights_impl (stored index)
# Restated for one-layer Llama drafters (eagle3_model_arch "llama3", no MLA, no eh_proj), plain RoPE only.
TRTLLM_STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def trtllm_eagle3_aux_ids(layers_to_capture, num_layers: int) -> tuple:
    """The transformers hidden_states ids TensorRT-LLM feeds fc, in fc's order: ``eagle3_layers_to_capture`` (or,
    unset, (1, N//2-1, N-4), refused on N <= 5), sorted; LlamaDecoderLayer captures hidden + residual *after*
    decoder layer j, i.e. hidden_states[j + 1]. The embeddings cannot be named; -1 (the final post-norm state)
    is no decoder layer's output and is refused here."""
    if layers_to_capture is None:
        if num_layers <= 5:
            raise ValueError("Not enough hidden layers for default EAGLE3 capture")
        layers_to_capture = (1, num_layers // 2 - 1, num_layers - 4)
    ids = sorted(set(int(j) for j in layers_to_capture))
    if any(not 0 <= j < num_layers for j in ids):
        raise ValueError(f"layers {ids} are not decoder layers 0..{num_layers - 1} of the target")
    return tuple(j + 1 for j in ids)


def trtllm_eagle3_flags(cfg: dict) -> dict:
    """The drafter flags as Eagle3DraftModel reads them: norm_before_fc from ``eagle_config`` only, fc_norm from the
    top level, the post-norm state fed back with eagle_config's return_hidden_post_norm or top-level norm_output;
    apply_eagle3_fc runs fc_norm *or* input_norm (fc_norm first), never both."""
    eagle = cfg.get("eagle_config") or {}
    fc_norm = bool(cfg.get("fc_norm", False))
    return {"norm_before_fc": bool(eagle.get("norm_before_fc", False)), "fc_norm": fc_norm,
            "post_norm": bool(eagle.get("return_hidden_post_norm", False) or cfg.get("norm_output", False))}


def _trtllm_config_problems(cfg: dict, hidden_size: int, vocab_size: int) -> list[str]:
    problems = []
    eagle = cfg.get("eagle_config") or {}
    if cfg.get("model_type") != "llama":
        problems.append("model_type must be llama (ModelConfig.from_pretrained builds a LlamaConfig)")
    if cfg.get("num_hidden_layers") != 1:
        problems.append("num_hidden_layers must be 1: more builds midlayer.{i}, which midlayer.* does not fill")
    if cfg.get("hidden_size") != hidden_size or cfg.get("vocab_size") != vocab_size:
        problems.append(f"sizes ({cfg.get('hidden_size')}, {cfg.get('vocab_size')}) differ from the target's "
                        f"({hidden_size}, {vocab_size})")
    if cfg.get("draft_vocab_size") is None:
        problems.append("no draft_vocab_size: TensorRT-LLM takes vocab_size (with a warning)")
    if cfg.get("kv_lora_rank"):
        problems.append("kv_lora_rank: TensorRT-LLM builds an MLA (DeepSeek-V3 style) draft layer")
    if eagle.get("eh_proj_before_attn"):
        problems.append("eagle_config.eh_proj_before_attn: TensorRT-LLM adds enorm / eh_proj and drops input_layernorm")
    if cfg.get("target_hidden_size") not in (None, cfg.get("hidden_size")):
        problems.append("target_hidden_size != hidden_size: TensorRT-LLM then needs the drafter's own embed_tokens")
    if cfg.get("tie_word_embeddings", False):
        problems.append("tie_word_embeddings: TensorRT-LLM skips lm_head.weight")
    for key in ("attention_bias", "mlp_bias", "bias"):
        if cfg.get(key):
            problems.append(f"{key}: the drafter weights have no bias")
    if cfg.get("rope_scaling"):
        problems.append("rope_scaling: TensorRT-LLM's RopeParams are not restated here (plain RoPE only)")
    # flags vLLM honours that TensorRT-LLM computes otherwise
    flags = trtllm_eagle3_flags(cfg)
    if cfg.get("norm_before_residual"):
        problems.append("norm_before_residual: TensorRT-LLM's decoder layer keeps the un-normed state as residual")
    if cfg.get("logit_scale", 1.0) != 1.0:
        problems.append("logit_scale: TensorRT-LLM does not scale the draft logits")
    if cfg.get("norm_before_fc") and not flags["norm_before_fc"]:
        problems.append("norm_before_fc at the top level only: TensorRT-LLM reads it from eagle_config, no input_norm")
    if flags["norm_before_fc"] and flags["fc_norm"]:
        problems.append("norm_before_fc with fc_norm: TensorRT-LLM applies fc_norm only")
    return problems


def check_trtllm_eagle3(d: Path, hidden_size: int, vocab_size: int, num_capture_layers: int = 3):
    """``Eagle3ForCausalLM`` (one-model, eagle3_model_arch llama3) built from the dir's config.json and its
    ``load_weights``: ``layers.0.`` -> ``midlayer.``, ``model.`` before every name but lm_head (a checkpoint's own
    lm_head replaces the target's), q/k/v and gate/up fused; each module copies its own parameters from the
    names under it, so a parameter without a tensor is an AssertionError (d2t, the norms) or left unloaded (the
    linears), and a tensor without a parameter is silently ignored (t2d, a shared embed_tokens). fc is
    [H, num_capture_layers x H] (``num_capture_layers``: len(eagle3_layers_to_capture), else 3); d2t is an int32
    parameter only when draft_vocab_size != vocab_size. Returns (params, config, problems)."""
    cfg = json.loads((d / "config.json").read_text())
    tensors = _tensors(d / "model.safetensors")
    problems = _trtllm_config_problems(cfg, hidden_size, vocab_size)
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") if isinstance(cfg.get("head_dim"), int) else h // heads  # modules/attention.py
    inner, draft_vocab = cfg["intermediate_size"], cfg.get("draft_vocab_size") or cfg["vocab_size"]
    flags, mid = trtllm_eagle3_flags(cfg), "model.midlayer."
    expect = {f"{mid}self_attn.qkv_proj.weight": ((heads + 2 * kv) * hd, 2 * h),
              f"{mid}self_attn.o_proj.weight": (h, heads * hd),
              f"{mid}mlp.gate_up_proj.weight": (2 * inner, h), f"{mid}mlp.down_proj.weight": (h, inner),
              **{f"{mid}{n}.weight": (h,) for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")},
              "model.norm.weight": (h,), "lm_head.weight": (draft_vocab, h)}
    if num_capture_layers > 1:
        expect["model.fc.weight"] = (h, num_capture_layers * h)
    if flags["norm_before_fc"]:
        expect["model.input_norm.weight"] = (num_capture_layers * h,)
    if flags["fc_norm"]:
        expect.update({f"model.fc_norm.{i}.weight": (h,) for i in range(num_capture_layers)})
    if draft_vocab != cfg["vocab_size"]:
        expect["model.d2t"] = (draft_vocab,)
    renamed = {}
    for name, t in tensors.items():
        name = re.sub(r"^layers\.0\.", "midlayer.", name)
        renamed[name if "lm_head" in name else "model." + name] = t
    params, shards = {}, {}
    for name, t in renamed.items():
        fused = next(((f, parts.index(p)) for f, parts in TRTLLM_STACKED.items() for p in parts
                      if name.endswith(f".{p}.weight")), None)
        if fused:
            key = name.rsplit(".", 2)[0] + f".{fused[0]}.weight"
            shards.setdefault(key, {})[fused[1]] = t
        elif name in expect:
            params[name] = t.to(torch.int32) if name == "model.d2t" else t
        elif name not in ("model.t2d", "model.embed_tokens.weight"):
            problems.append(f"{name} is silently ignored by TensorRT-LLM (no such parameter)")
    for name, parts in shards.items():
        params[name] = torch.cat([parts[i] for i in sorted(parts)], 0)
    problems += _unloaded(params, expect, "TensorRT-LLM",
                          "TensorRT-LLM fails (AssertionError) or keeps it uninitialised")
    if "d2t" in tensors and tensors["d2t"].is_floating_point():
        problems.append("d2t must be integers (TensorRT-LLM copies it into an int32 parameter)")
    problems += _dtype_problems({k: v for k, v in tensors.items() if k not in ("d2t", "t2d")})
    return params, cfg, problems


def trtllm_eagle3_fc(params: dict, cfg: dict, hidden: torch.Tensor) -> torch.Tensor:
    """``apply_eagle3_fc``: when the input is not H wide, fc_norm per captured layer if set, else input_norm over
    the concat if eagle_config sets norm_before_fc, then fc."""
    flags, eps = trtllm_eagle3_flags(cfg), cfg.get("rms_norm_eps", 1e-6)
    if flags["fc_norm"]:
        n = params["model.fc.weight"].shape[1] // cfg["hidden_size"]
        hidden = torch.cat([_rms(b, params[f"model.fc_norm.{i}.weight"], eps)
                            for i, b in enumerate(hidden.chunk(n, -1))], -1)
    elif flags["norm_before_fc"]:
        hidden = _rms(hidden, params["model.input_norm.weight"], eps)
    return hidden @ params["model.fc.weight"].T


def trtllm_eagle3_forward(params: dict, cfg: dict, embed: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
                          positions: torch.Tensor, past=None):
    """One Eagle3DraftModel pass (the same arguments as ``eagle3_engine_forward``): fc first when ``hidden`` is the
    captured concat; Eagle3DecoderLayer: residual = hidden, [input_layernorm(embeds); hidden_norm(hidden)] -> qkv
    -> neox RoPE -> attention -> o_proj, fused add + post_attention_layernorm, MLP, fused add + norm (no
    norm_before_residual); the state fed to the next step is the pre-norm sum unless the post-norm flag is set.
    Returns (normed, next state, (k, v))."""
    if cfg.get("rope_scaling"):
        raise NotImplementedError("TensorRT-LLM's scaled RoPE is not restated")
    if hidden.shape[-1] != cfg["hidden_size"]:
        hidden = trtllm_eagle3_fc(params, cfg, hidden)
    # the layer's math is the midlayer one restated above, with none of vLLM's flags
    plain = {k: v for k, v in cfg.items() if k not in ("norm_before_residual", "norm_output")}
    normed, prenorm, kv = eagle3_engine_forward(params, plain, "model.midlayer.", embed, tokens, hidden, positions,
                                                past)
    return normed, normed if trtllm_eagle3_flags(cfg)["post_norm"] else prenorm, kv


def trtllm_eagle3_logits(params: dict, cfg: dict, normed: torch.Tensor) -> torch.Tensor:
    """The draft logits (lm_head, unscaled) put at the target ids draft_decoder maps them to (i + d2t[i]; no d2t:
    the same ids), -inf at every other target id."""
    logits = normed @ params["lm_head.weight"].T
    d2t = params.get("model.d2t")
    targets = torch.arange(logits.shape[-1]) + (d2t.long() if d2t is not None else 0)
    out = logits.new_full((logits.shape[0], cfg["vocab_size"]), float("-inf"))
    out[:, targets] = logits
    return out


def trtllm_eagle3_draft_tokens(params: dict, normed: torch.Tensor) -> torch.Tensor:
    """``draft_decoder``: argmax over the draft vocabulary, then d2t[i] + i (int32 target ids)."""
    ids = (normed @ params["lm_head.weight"].T).argmax(-1)
    d2t = params.get("model.d2t")
    return (ids + d2t[ids] if d2t is not None else ids).to(torch.int32)
