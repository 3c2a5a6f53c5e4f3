"""Load the backbone (frozen) and its tokenizer: embedded SmolLM2, any HF id/path, or tiny random;
run it for what the heads learn from (``FrozenFeatures``), and name it (``backbone_identity``).

Pretrained backbones go through the runtime's own loader (``inference.backbone``), so what
trains also decodes. The backbone never trains in Medusa-1: it is put in eval mode with ``requires_grad=False``
on every parameter, and the trainer runs it under ``torch.no_grad``. Only its body is run
during training (the heads need the last hidden state, not the backbone's own logits), which
skips the 49k-vocabulary lm_head product on every token.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from inference import backbone as runtime_backbone
from inference.backbone import HiddenStateTap, backbone_logits, decoder_body, parse_dtype, text_config
from inference.errors import UserError

from .config import draft_depth
from .data.masks import attention_mask
from .data.tokenize import IGNORE

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class Backbone:
    model: Any  # a transformers *ForCausalLM
    tokenizer: Any
    name: str  # what the export records as base model
    identity: str | None = None  # what caches and distilled data key on, when not ``name`` (a kept random backbone)


def byte_tokenizer():
    """A 259-token byte-level tokenizer with a ChatML template: no files, no network (tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


BYTE_TOKENIZER_SIZE = 259


def random_config(config: dict):
    """The transformers config of a ``backbone.random_init`` dict (no weights)."""
    from transformers import AutoConfig

    cfg = dict(config)
    model_type = cfg.pop("model_type", "llama")
    cfg.setdefault("vocab_size", BYTE_TOKENIZER_SIZE)
    if cfg["vocab_size"] < BYTE_TOKENIZER_SIZE:
        raise UserError(f"backbone.random_init.vocab_size must be >= {BYTE_TOKENIZER_SIZE} (the byte tokenizer)")
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except (ValueError, TypeError) as e:
        raise UserError(f"backbone.random_init: {str(e).strip().splitlines()[0]}") from None


def random_backbone(config: dict, seed: int = 0) -> Backbone:
    from transformers import AutoModelForCausalLM

    tokenizer = byte_tokenizer()
    assert len(tokenizer) == BYTE_TOKENIZER_SIZE
    hf_config = random_config(config)
    model_type = hf_config.model_type
    hf_config.eos_token_id = tokenizer.eos_token_id
    hf_config.pad_token_id = tokenizer.pad_token_id
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    return Backbone(model, tokenizer, f"random:{model_type}")


RANDOM_BACKBONE_DIR = "backbone"  # <output_dir>/backbone: a random backbone saved with its run


def load_backbone(cfg, device: torch.device | str = "cpu", seed: int = 0, run_dir=None,
                  write: bool = True) -> Backbone:
    """Build the frozen backbone described by a ``BackboneConfig``.

    With ``run_dir``, a random backbone (``random_init``) is kept with the run: saved (model +
    tokenizer, safetensors) into ``<run_dir>/backbone`` (by the process with ``write``) and named
    by that folder's absolute path, which the heads then record as their base model, so the
    runtime (``medusa-eval heads=<run_dir>/heads``) rebuilds exactly it."""
    if cfg.random_init:
        backbone = random_backbone(dict(cfg.random_init), seed=seed)
        if run_dir is not None:  # cached features stay keyed on "random:<type>" + weights, wherever the run is
            backbone.identity = backbone.name
            backbone.name = keep_random_backbone(backbone, Path(run_dir) / RANDOM_BACKBONE_DIR, write)
    else:
        backbone = _load_pretrained(cfg)
    model = backbone.model
    if cfg.dtype != "auto":
        model.to(parse_dtype(cfg.dtype))
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    if backbone.tokenizer.pad_token is None:
        backbone.tokenizer.pad_token = backbone.tokenizer.eos_token
    if not backbone.tokenizer.chat_template:
        raise UserError(f"tokenizer of {backbone.name} has no chat template; use a chat (instruct) model")
    return backbone


def keep_random_backbone(backbone: Backbone, folder: Path, write: bool = True) -> str:
    """Save a random backbone (fp32 safetensors + its tokenizer) into ``folder``; its absolute path is
    the name heads record. A rerun (resume) rebuilds the same weights and rewrites the same files."""
    folder = folder.resolve()
    if write:
        from transformers.utils import logging as hf_logging

        folder.mkdir(parents=True, exist_ok=True)
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # "Writing model shards" for a few hundred kB
        try:
            backbone.model.save_pretrained(folder, safe_serialization=True)
            backbone.tokenizer.save_pretrained(folder)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
    return str(folder)


def _load_pretrained(cfg) -> Backbone:
    model, tokenizer, name = runtime_backbone.load_backbone(
        cfg.name_or_path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision,
        gguf_file=cfg.gguf_file, attn_implementation=cfg.attn_implementation)
    return Backbone(model, tokenizer, name)


# -- running the frozen backbone -----------------------------------------------------------------------------
GREEDY_CHUNK = 1024  # rows per backbone lm_head product for greedy targets: bounds the [rows, vocab] logits


class FrozenFeatures:
    """What the frozen backbone gives the heads: last hidden states and, for ``heads.targets=backbone``, its
    greedy tokens. Used by the online batch source on every micro-batch and by the feature-cache builder
    once per batch, so both store/feed exactly the same tensors (the online == cached(fp32) guarantee)."""

    def __init__(self, model, packed: bool, compute_dtype: torch.dtype, device: torch.device):
        self.model, self.packed = model, packed
        self.compute_dtype, self.device = compute_dtype, device
        self.body = decoder_body(model)

    @torch.no_grad()
    def backbone_hidden(self, batch: dict, aux_layers=None):
        """The backbone's last hidden states in its own dtype (before the cast to the heads' precision);
        with ``aux_layers`` also (hidden, aux): those layers' hidden states concatenated [B, T, 3H]."""
        dev = self.device
        ids, pos, doc = batch["input_ids"].to(dev), batch["position_ids"].to(dev), batch["doc_ids"].to(dev)
        mask = attention_mask(doc, self.packed, self.model.dtype)
        if not aux_layers:
            return self.body(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
        with HiddenStateTap(self.model, aux_layers) as tap:
            last = self.body(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
        return last, tap.features()

    def hidden_states(self, batch: dict) -> torch.Tensor:
        """What the heads are fed: the last hidden states in the training precision."""
        return self.backbone_hidden(batch).to(self.compute_dtype)

    @torch.no_grad()
    def greedy_ids(self, hidden: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor,
                   everywhere: bool = False) -> torch.Tensor:
        """[B, T] the backbone's argmax over its full vocabulary where ``losses.backbone_labels`` reads it,
        IGNORE elsewhere. ``hidden`` comes from ``backbone_hidden`` (backbone dtype, not the heads'
        rounding); the lm_head runs on ``GREEDY_CHUNK`` rows at a time so a 49k vocabulary stays small.
        ``everywhere``: at every in-document position (``heads.train_on=all``), not only the replies'."""
        from .losses import greedy_positions

        need = greedy_positions(labels.to(hidden.device), doc_ids.to(hidden.device), everywhere)
        out = torch.full(need.shape, IGNORE, dtype=torch.long, device=hidden.device)
        rows = hidden[need]
        if rows.shape[0]:
            out[need] = torch.cat([backbone_logits(self.model, rows[s:s + GREEDY_CHUNK]).argmax(-1)
                                   for s in range(0, rows.shape[0], GREEDY_CHUNK)])
        return out

    def features(self, batch: dict, greedy: bool = True, aux_layers=None, greedy_everywhere: bool = False) -> dict:
        """``hidden`` (training precision), with ``greedy`` the ``greedy`` ids (at every in-document position
        with ``greedy_everywhere``) and with ``aux_layers`` the ``aux`` features (training precision) the
        eagle3 drafter reads: one backbone forward for all."""
        out = {}
        raw = self.backbone_hidden(batch, aux_layers)
        if aux_layers:
            raw, aux = raw
            out["aux"] = aux.to(self.compute_dtype)
        out["hidden"] = raw.to(self.compute_dtype)
        if greedy:
            out["greedy"] = self.greedy_ids(raw, batch["labels"], batch["doc_ids"], greedy_everywhere)
        return out


# -- identity --------------------------------------------------------------------------------------------------
def weights_fingerprint(model) -> str:
    """A hash of every weight tensor's name, shape, dtype and leading values: other weights, other hash.

    Reading all bytes of an 8B model would take a minute; the first 64 values of each tensor
    change under any fine-tune or merged adapter, and cost nothing.
    """
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        head = p.detach().reshape(-1)[:64].float().cpu().contiguous()
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        h.update(head.numpy().tobytes())
    return h.hexdigest()[:16]


def backbone_identity(backbone: Backbone) -> dict:
    """What generated data or cached features depend on: architecture and weights."""
    from inference.heads.spec import backbone_fingerprint

    model = backbone.model
    return {"name": backbone.identity or backbone.name, "config": backbone_fingerprint(model.config),
            "weights": weights_fingerprint(model)}


# -- before loading: does data.max_length fit the backbone and this machine? ----------------------------------
def backbone_config(cfg):
    """The backbone's transformers config, read without its weights (``AutoConfig`` or ``random_init``)."""
    if cfg.random_init:
        return random_config(dict(cfg.random_init))
    return runtime_backbone.load_backbone_config(cfg.name_or_path, gguf_file=cfg.gguf_file,
                                                 trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)


def parameter_count(hf_config, trust_remote_code: bool = False) -> int:
    """Parameters of the model ``hf_config`` describes, counted on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    return sum(p.numel() for p in model.parameters())


def micro_batch_bytes(hf_config, length: int, batch: int, dtype_bytes: int) -> int:
    """Peak memory of one frozen forward over a ``[batch, length]`` micro-batch (no gradients, one layer
    live at a time): the additive block-causal mask with its boolean intermediates (``data.masks``:
    [B, T, T] in the model dtype plus about four bytes per entry; SDPA does not materialise the scores)
    and the per-token tensors of a layer (residual, norm, q/k/v, attention output, gate/up/act)."""
    text = text_config(hf_config)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    inter = int(getattr(text, "intermediate_size", 0) or getattr(text, "n_inner", 0) or 4 * hidden)
    per_token = (6 * hidden + 3 * inter) * dtype_bytes
    mask = length * length * (dtype_bytes + 4)
    return batch * (length * per_token + mask)


def ttt_unroll_bytes(heads_cfg, hf_config, length: int, batch: int, dtype_bytes: int) -> int:
    """Memory an eagle3 drafter's training-time test keeps for backward over a ``[batch, length]`` micro-batch
    (0 for other kinds): per step, the drafter layer's per-token tensors (inputs, q/k/v, attention, SwiGLU,
    norms) and the fp32 logits + log-softmax of the draft vocabulary; and step j's attention over the
    j + 1 blocks of keys, values and mask before it, so the unroll grows with the square of the steps."""
    if str(heads_cfg.kind) != "eagle3":
        return 0
    text = text_config(hf_config)
    hidden, vocab = int(text.hidden_size), int(text.vocab_size)
    inter = int(getattr(text, "intermediate_size", 0) or 4 * hidden)
    steps = draft_depth(heads_cfg)
    draft_vocab = draft_vocabulary(heads_cfg, vocab)[1] or vocab
    per_step = (18 * hidden + 4 * inter) * dtype_bytes + 2 * draft_vocab * 4
    per_block = (2 * hidden + length) * dtype_bytes  # a step's keys + values and its mask row, per earlier step
    return batch * length * (steps * per_step + steps * (steps + 1) // 2 * per_block)


def available_memory(device: torch.device) -> tuple[int, str] | None:
    """(bytes free, what) on ``device``: GPU memory free, or RAM available (cgroup limit included)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device.index if device.index is not None else torch.cuda.current_device())
        return free, f"GPU memory free on {device}"
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:  # a container's memory limit (cgroup v2)
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit != "max":
            used = int(open("/sys/fs/cgroup/memory.current").read().strip())
            avail = min(avail, int(limit) - used) if avail is not None else int(limit) - used
    except (OSError, ValueError):
        pass
    return (avail, "RAM available") if avail is not None else None


def _gb(n: float) -> str:
    return f"{n / 2**30:.1f} GB"


def _backbone_dtype_bytes(backbone_cfg, hf_config) -> int:
    """Bytes per backbone weight and activation: ``backbone.dtype`` (``auto``: the config's own dtype)."""
    if backbone_cfg.dtype == "auto":
        dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    else:
        dtype = parse_dtype(backbone_cfg.dtype)
    return torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4


def head_parameter_count(heads_cfg, hf_config) -> int:
    """Parameters of the heads ``heads.*`` describes on this backbone, asked of their family: the module
    ``inference.heads.build_heads`` would build from the spec the trainer writes, built on the meta device."""
    from inference.heads.registry import build_heads
    from inference.heads.spec import HeadsSpec

    text = text_config(hf_config)
    vocab = int(text.vocab_size)
    projection, size = draft_vocabulary(heads_cfg, vocab)
    spec = HeadsSpec(num_heads=draft_depth(heads_cfg), num_layers=int(heads_cfg.num_layers),
                     hidden_size=int(text.hidden_size), vocab_size=vocab, projection=projection,
                     truncated_vocab_size=min(size, vocab) if size else None, kind=str(heads_cfg.kind),
                     inner_dim=int(heads_cfg.inner_dim) or None, tie_weights=bool(heads_cfg.tie_weights),
                     scale_input=bool(heads_cfg.scale_input), **family_fields(heads_cfg, hf_config))
    with torch.device("meta"):
        heads = build_heads(spec)
    return sum(p.numel() for p in heads.parameters())


# Per trained head parameter: the fp32 weight (or bf16 weight + fp32 master), its gradient and AdamW's two fp32
# moments: 4 + 4 + 8 bytes either way.
HEAD_STATE_BYTES = 16


def head_state_advice(heads_cfg) -> str:
    """Which keys size the heads' parameters: what the line that refuses them asks to lower."""
    from inference.cli_support import enum_value

    kind, projection = str(heads_cfg.kind), enum_value(heads_cfg.projection)
    keys = ["heads.draft_vocab_size"] if kind == "eagle3" else ["heads.num_heads", "heads.num_layers"]
    if kind == "mlp_speculator":
        keys.append("heads.inner_dim")
    if kind != "eagle3" and projection == "truncated":
        keys.append("heads.truncated_vocab_size")
    advice = f"lower {', '.join(keys[:-1])} or {keys[-1]}"
    return advice + (" (or use heads.projection=truncated)" if projection == "own" else "")


def check_fits(cfg) -> None:
    """Refuse, before any weight or data loads, a ``data.max_length`` the backbone has no positions for
    (its config's ``max_position_embeddings``) or a run this machine cannot hold: a micro-batch
    (``trainer.micro_batch_size`` rows of that length through the frozen forward), the weights, and the heads'
    own parameters with their gradients and optimizer state."""
    from inference.cli_support import enum_value

    from .distributed import resolve_device

    if enum_value(cfg.task) != "train":
        return
    hf_config = backbone_config(cfg.backbone)
    length, batch = int(cfg.data.max_length), int(cfg.trainer.micro_batch_size)
    positions = getattr(text_config(hf_config), "max_position_embeddings", None)
    if positions and length > int(positions):
        raise UserError(f"data.max_length={length} exceeds the {int(positions)} positions of the backbone "
                        f"(max_position_embeddings of its config); use data.max_length <= {int(positions)}")
    dtype_bytes = _backbone_dtype_bytes(cfg.backbone, hf_config)
    device = resolve_device(cfg.trainer.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    free = available_memory(device)
    if free is None:
        return
    activations = micro_batch_bytes(hf_config, length, batch, dtype_bytes)
    head_bytes = 4 if enum_value(cfg.trainer.precision) == "fp32" else 2  # what the heads compute in
    unroll = ttt_unroll_bytes(cfg.heads, hf_config, length, batch, head_bytes)
    try:
        weights = parameter_count(hf_config, cfg.backbone.trust_remote_code) * dtype_bytes
    except Exception:  # an architecture transformers cannot build here: the loader will say so
        weights = 0
    trained = enum_value(cfg.features.mode) != "build"  # a cache build trains no heads
    heads = head_parameter_count(cfg.heads, hf_config) * HEAD_STATE_BYTES if trained else 0
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    need = (activations + unroll + weights + heads) * max(processes, 1)
    if need > free[0]:
        _refuse_fit(cfg, need, free, activations, unroll, weights, heads, processes)


def _refuse_fit(cfg, need, free, activations, unroll, weights, heads, processes) -> None:
    """The one line ``check_fits`` refuses with: what each part needs and which keys to lower."""
    have, what = free
    length, batch, depth = int(cfg.data.max_length), int(cfg.trainer.micro_batch_size), draft_depth(cfg.heads)
    per_process = f", x{processes} processes" if processes > 1 else ""
    parts = (f"{_gb(activations)} for one micro-batch through the frozen backbone"
             + (f", {_gb(unroll)} for the drafter unrolled over its {depth} TTT steps" if unroll else "")
             + f", {_gb(weights)} of weights, {_gb(heads)} for the heads' parameters, gradients and AdamW state"
             + per_process)
    if heads > activations + unroll + weights:  # the heads themselves are what does not fit
        h = cfg.heads
        raise UserError(f"heads.kind={h.kind} with heads.num_heads={h.num_heads}, heads.num_layers={h.num_layers} has "
                        f"{heads // HEAD_STATE_BYTES:,} parameters: the run needs about {_gb(need)} ({parts}) but only "
                        f"{_gb(have)} of {what}; {head_state_advice(h)}")
    keys = ["data.max_length", "trainer.micro_batch_size"]
    if unroll:  # an eagle3 drafter: its unrolled steps are the third factor
        keys.append("heads.ttt_steps" if cfg.heads.ttt_steps is not None else "heads.num_heads")
    sizes = " x ".join(f"{k}={v}" for k, v in zip(keys, (length, batch, depth)))
    raise UserError(f"{sizes} needs about {_gb(need)} ({parts}) but only {_gb(have)} of {what}; "
                    f"lower {', '.join(keys[:-1])} or {keys[-1]}")


ATTENTION_DEFAULT = ("eager", "sdpa", "flash_attention_2", "flex_attention")


def check_attn_implementation(backbone_cfg) -> None:
    """Refuse a ``backbone.attn_implementation`` transformers does not know (a random backbone would ignore
    it silently, a pretrained one fail with a traceback): ``eager`` or a registered attention interface
    (sdpa, flash_attention_2/3, flex_attention, ...), or a hub kernel (``org/repo``)."""
    value = backbone_cfg.attn_implementation
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    except ImportError:  # an older transformers: its documented values
        known = list(ATTENTION_DEFAULT)
    if value is None or str(value) in known or "/" in str(value):
        return
    raise UserError(f"backbone.attn_implementation must be one of {', '.join(known)}, got {value!r}")


# -- head families that read more of the backbone than its last layer (eagle3) --------------------------------
def draft_vocabulary(heads_cfg, vocab_size: int) -> tuple[str, Optional[int]]:
    """(projection, truncated size) of the heads: ``heads.draft_vocab_size`` (eagle3's name for the
    truncated projection's size; the whole vocabulary means projection own) or the projection keys."""
    from inference.cli_support import enum_value

    n = heads_cfg.draft_vocab_size
    if n is not None:
        if n > vocab_size:
            raise UserError(f"heads.draft_vocab_size={n} exceeds the backbone vocabulary ({vocab_size}); use at most "
                            f"{vocab_size} (all of it means a full-vocabulary lm_head)")
        return ("own", None) if n == vocab_size else ("truncated", int(n))
    projection = enum_value(heads_cfg.projection)
    return projection, (int(heads_cfg.truncated_vocab_size) if projection == "truncated" else None)


def family_fields(heads_cfg, hf_config) -> dict:
    """The ``HeadsSpec`` fields an eagle3 drafter adds (its aux layer ids and decoder-layer sizes, from
    the backbone's config), ``{}`` for other kinds; one line if the backbone cannot host the family."""
    if str(heads_cfg.kind) != "eagle3":
        return {}
    from inference.heads.eagle3 import default_aux_layers, draft_layer_config, refuse_repeated_aux_layers

    layer = draft_layer_config(text_config(hf_config))
    n = layer["target_layers"]
    # default_aux_layers refuses a target too shallow for three distinct servable layers (fewer than 4)
    aux = list(heads_cfg.aux_layers) if heads_cfg.aux_layers is not None else default_aux_layers(n)
    bad = [i for i in aux if not 0 <= int(i) < n]
    if bad:
        raise UserError(f"heads.aux_layers {bad} are out of range: the backbone has hidden states 0..{n - 1} "
                        f"(0 = embeddings, i = layer i's input; {n} layers)")
    refuse_repeated_aux_layers(aux, "heads.aux_layers")
    # Ascending, the order vLLM and SGLang capture them (walking the layers): a fresh fc learns its columns
    # in that order, so the spec, the features cache and the export all say the layers actually read.
    return {"aux_layers": sorted(int(i) for i in aux), "draft_layer": layer}


def check_family(cfg) -> None:
    """Before any weight loads: the heads family fits the backbone's config (eagle3: a Llama-style layer
    can be built, aux ids in range, draft vocabulary no larger than the vocabulary)."""
    if str(cfg.heads.kind) != "eagle3":
        return
    hf_config = text_config(backbone_config(cfg.backbone))
    draft_vocabulary(cfg.heads, int(hf_config.vocab_size))
    family_fields(cfg.heads, hf_config)
