"""Before any weight or data loads: does the run fit the backbone and this machine, and can its heads
family be built on that backbone? Each check reads the backbone's config alone and refuses in one line.

``preflight`` runs them all (``medusa-train`` calls it once a configuration is accepted): a readable local
data source, a known attention implementation, ``data.max_length`` within the backbone's positions (for a
distillation, with ``distill.max_new_tokens`` added: ``check_distill_positions``) and the
run within this machine's memory (``check_fits``: the frozen forward, the weights, the heads' parameters with
their gradients and optimizer state, and what the family's training adds, ``TrainingFamily.unroll_bytes``),
the family's settings on this backbone (``check_family``), and for a training of heads the vocabulary, the
device for the precision, the stage-1 heads ``lora.init_heads`` names (``check_init_heads``: their config.json
alone) and a resumable checkpoint trained under this configuration; a ``features.cache_dir`` that can become a
feature cache (``features.check_cache_dir``: not a file, not another run's folder); last, a local data
source that gives the task a conversation (``check_data_usable``, reading no more than its first ones).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import torch

from inference.backbone import parse_dtype, text_config
from inference.cli_support import enum_value
from inference.errors import UserError, first_line
from inference.heads.registry import build_heads, family, setting_names
from inference.heads.spec import HeadsSpec, check_compatible
from inference.runtime.memory import free_memory_bytes

from .backbone import backbone_config
from .checkpoint import checkpoints_dir, resume_point, trained_record_changes
from .config import check_data_source, check_output_outside_data, derived_batch, launch_world_size, local_world_size
from .data.readers import ReadStats, iter_conversations, local_files
from .data.stream import check_training_data
from .distill import unfinished as unfinished_distillation
from .distributed import resolve_device
from .features import check_cache_dir
from .tracking import check_wandb_credentials
from .families import draft_depth, draft_vocabulary, training_family


def parameter_count(hf_config, trust_remote_code: bool = False) -> int:
    """Parameters of the model ``hf_config`` describes, counted on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM   # lazy: 0.8 s, not for the refusals before this check

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


def available_memory(device: torch.device) -> tuple[int, str] | None:
    """(bytes free, what) on ``device``: GPU memory free, or RAM available (a container's limit included)."""
    free = free_memory_bytes(device)
    if free is None:
        return None
    return free, (f"GPU memory free on {device}" if device.type == "cuda" else "RAM available")


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


def recipe_heads_spec(heads_cfg, hf_config) -> HeadsSpec:
    """The spec of the heads ``heads.*`` describes on this backbone (the trainer's ``_new_heads``), from the
    backbone's config alone: what the memory estimate builds and what ``lora.init_heads`` must match."""
    text = text_config(hf_config)
    vocab = int(text.vocab_size)
    projection, size = draft_vocabulary(heads_cfg, vocab)
    return HeadsSpec(num_heads=draft_depth(heads_cfg), num_layers=int(heads_cfg.num_layers),
                     hidden_size=int(text.hidden_size), vocab_size=vocab, projection=projection,
                     truncated_vocab_size=min(size, vocab) if size else None, kind=str(heads_cfg.kind),
                     settings=training_family(heads_cfg.kind).spec_settings(heads_cfg, hf_config))


def head_parameter_count(heads_cfg, hf_config) -> int:
    """Parameters of the heads ``heads.*`` describes on this backbone, asked of their family: the module
    ``inference.heads.build_heads`` would build from the spec the trainer writes, built on the meta device."""
    spec = recipe_heads_spec(heads_cfg, hf_config)
    with torch.device("meta"):
        heads = build_heads(spec)
    return sum(p.numel() for p in heads.parameters())


# Per trained head parameter: the fp32 weight (or bf16 weight + fp32 master), its gradient and AdamW's two fp32
# moments: 4 + 4 + 8 bytes either way, in one process.
HEAD_STATE_BYTES = 16


def head_state_bytes(trainer_cfg, world_size: int) -> float:
    """``HEAD_STATE_BYTES`` as one of ``world_size`` processes holds them: ZeRO stage 1 shards the fp32 master
    and moments over the processes, stage 2 the gradients too, stage 3 the weights too (8 GPUs at stage 2 hold
    ~4 bytes a parameter each, not 16: heads refused on any number of GPUs fitted on 8). What DeepSpeed 0.19 adds:
    bf16 at stage 1 runs its BF16 optimizer, which keeps a full fp32 gradient on every rank; fp32 at stages 1-2
    keeps an fp32 master partition beside the weight."""
    stage, n = int(trainer_cfg.zero_stage), max(int(world_size), 1)
    fp32 = enum_value(trainer_cfg.precision) == "fp32"
    weight, grad, state = (4, 4, 8) if fp32 else (2, 2, 12)   # fp32: the weight is its own master copy
    if stage < 1:
        return weight + grad + state
    extra = (4 / n if stage <= 2 else 0) if fp32 else (4 if stage == 1 else 0)
    return weight / (n if stage >= 3 else 1) + grad / (n if stage >= 2 else 1) + state / n + extra


def joint_bytes(cfg, hf_config, length: int, batch: int, dtype_bytes: int) -> int:
    """What Medusa-2 (``lora.enabled``) keeps for the backbone's own gradients over a micro-batch: with
    ``lora.gradient_checkpointing`` each layer's input and one layer's tensors recomputed, else every layer's
    (about 10 x hidden + 5 x intermediate values a token, measured from the saved tensors at small scale); and the
    backbone's loss over the full vocabulary in fp32 (student and teacher log-probabilities with a gradient)."""
    if not cfg.lora.enabled:
        return 0
    text = text_config(hf_config)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    inter = int(getattr(text, "intermediate_size", 0) or 4 * hidden)
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    layer = (10 * hidden + 5 * inter) * dtype_bytes
    kept = layers * hidden * dtype_bytes + layer if cfg.lora.gradient_checkpointing else layers * layer
    return batch * length * (kept + 15 * int(getattr(text, "vocab_size", 0) or 0))


def head_state_advice(heads_cfg) -> str:
    """Which keys size the heads' parameters (their family's ``size_keys``): what the line that refuses them
    asks to lower."""
    keys = training_family(heads_cfg.kind).size_keys(heads_cfg)
    advice = f"lower {', '.join(keys[:-1])} or {keys[-1]}" if len(keys) > 1 else f"lower {keys[0]}"
    return advice + (" (or use heads.projection=truncated)" if enum_value(heads_cfg.projection) == "own" else "")


def check_fits(cfg) -> None:
    """Refuse, before any weight or data loads, a ``data.max_length`` the backbone has no positions for
    (its config's ``max_position_embeddings``) or a run this machine cannot hold: a micro-batch
    (``trainer.micro_batch_size`` rows of that length through the frozen forward), the weights, and the heads'
    own parameters with their gradients and optimizer state, and what the family's training keeps beyond them."""
    task = enum_value(cfg.task)
    if task == "distill":
        check_distill_positions(cfg)
        return
    if task != "train":
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
    unroll = training_family(cfg.heads.kind).unroll_bytes(cfg.heads, hf_config, length, batch, head_bytes)
    try:
        weights = parameter_count(hf_config, cfg.backbone.trust_remote_code) * dtype_bytes
    except Exception as e:  # noqa: BLE001 (an architecture transformers cannot build here: the loader says why)
        if cfg.backbone.random_init:   # built from these values alone: nothing later says it better
            raise UserError(f"backbone.random_init does not build a model: {type(e).__name__}: "
                            f"{first_line(e)}") from None
        weights = 0
    trained = enum_value(cfg.features.mode) != "build"  # a cache build trains no heads
    params = head_parameter_count(cfg.heads, hf_config) if trained else 0
    heads = int(params * head_state_bytes(cfg.trainer, launch_world_size()))
    # what the loss keeps for backward: the heads' logits, and with LoRA the backbone's own activations and loss
    loss = (training_family(cfg.heads.kind).loss_bytes(cfg.heads, hf_config, length, batch)
            + joint_bytes(cfg, hf_config, length, batch, dtype_bytes)) if trained else 0
    processes = local_world_size() if device.type == "cpu" else 1
    kept = None  # what a released backbone keeps, for a run trained from the feature cache
    if trained and enum_value(cfg.features.mode) == "train" and not cfg.lora.enabled:
        # the backbone runs while the cache is built, then its body is freed before the heads are built
        # (``sources.CachedSource``): two phases, the larger of them at once
        kept = _embedding_bytes(hf_config, dtype_bytes)
        peak = max(activations + weights, unroll + loss + heads + kept)
    else:
        peak = activations + unroll + loss + weights + heads
    need = peak * max(processes, 1)
    if need > free[0]:
        _refuse_fit(cfg, need, free, (activations, unroll, loss, weights, kept), (params, heads), processes)


def _embedding_bytes(hf_config, dtype_bytes: int) -> int:
    """The input embeddings and the lm_head (one matrix when tied): what a released backbone keeps."""
    text = text_config(hf_config)
    matrix = int(getattr(text, "vocab_size", 0) or 0) * int(getattr(text, "hidden_size", 0) or 0) * dtype_bytes
    tied = getattr(hf_config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False))
    return matrix * (1 if tied else 2)


def check_distill_positions(cfg) -> None:
    """Refuse a distillation whose longest generation would not fit the backbone's positions: a prompt of up to
    ``data.max_length`` tokens plus ``distill.max_new_tokens`` new ones. Found only mid-run otherwise, and
    then ``data.max_length`` cannot be lowered in that output_dir (it is part of the data's identity)."""
    positions = getattr(text_config(backbone_config(cfg.backbone)), "max_position_embeddings", None)
    length, new = int(cfg.data.max_length), int(cfg.distill.max_new_tokens)
    if positions and length + new > int(positions):
        raise UserError(f"data.max_length={length} (the longest prompt) + distill.max_new_tokens={new} exceeds the "
                        f"{int(positions)} positions of the backbone (max_position_embeddings of its config); "
                        f"use data.max_length <= {max(int(positions) - new, 0)} or lower distill.max_new_tokens")


def _refuse_fit(cfg, need, free, parts_bytes, heads_state, processes) -> None:
    """The one line ``check_fits`` refuses with: what each part needs and which keys to lower."""
    have, what = free
    activations, unroll, loss, weights, kept = parts_bytes
    params, heads = heads_state
    length, batch, depth = int(cfg.data.max_length), int(cfg.trainer.micro_batch_size), draft_depth(cfg.heads)
    per_process = f", x{processes} processes" if processes > 1 else ""
    backbone_grads = " and the backbone's own gradients (LoRA)" if cfg.lora.enabled else ""
    forward = f"{_gb(activations)} for one micro-batch through the frozen backbone"
    trained = ((f"{_gb(unroll)} for the {depth} draft steps its training unrolls, " if unroll else "")
               + (f"{_gb(loss)} for the heads' logits{backbone_grads}, " if loss else "")
               + f"{_gb(heads)} for the heads' parameters, gradients and AdamW state")
    if kept is None:
        parts = f"{forward}, {_gb(weights)} of weights, {trained}{per_process}"
    else:
        parts = (f"the larger of building the feature cache ({forward}, {_gb(weights)} of weights) and training "
                 f"from it ({trained}, {_gb(kept)} for the embeddings and lm_head kept){per_process}")
    if heads > activations + unroll + loss + weights:  # the heads themselves are what does not fit
        h = cfg.heads
        raise UserError(f"heads.kind={h.kind} with heads.num_heads={h.num_heads}, heads.num_layers={h.num_layers} has "
                        f"{params:,} parameters: the run needs about {_gb(need)} ({parts}) but only "
                        f"{_gb(have)} of {what}; {head_state_advice(h)}")
    keys = ["data.max_length", "trainer.micro_batch_size"]
    if unroll:  # a family that unrolls its draft steps in training (EAGLE-3's test): they are the third factor
        keys.append(training_family(cfg.heads.kind).depth_key(cfg.heads))
    sizes = " x ".join(f"{k}={v}" for k, v in zip(keys, (length, batch, depth)))
    raise UserError(f"{sizes} needs about {_gb(need)} ({parts}) but only {_gb(have)} of {what}; "
                    f"lower {', '.join(keys[:-1])} or {keys[-1]}")


ATTENTION_DEFAULT = ("auto", "eager", "sdpa", "flash_attention_2", "flex_attention")


def check_attn_implementation(backbone_cfg) -> None:
    """Refuse a ``backbone.attn_implementation`` transformers does not know (a random backbone would ignore
    it silently, a pretrained one fail with a traceback): ``eager`` or a registered attention interface
    (sdpa, flash_attention_2/3, flex_attention, ...), a hub kernel (``org/repo``), or ``auto`` (sdpa, or eager for
    a class without it: ``inference.backbone.with_attention``)."""
    value = backbone_cfg.attn_implementation
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS   # lazy: an older transformers lacks it

        known = ["auto", "eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    except ImportError:  # an older transformers: its documented values
        known = list(ATTENTION_DEFAULT)
    if value is None or str(value) in known or "/" in str(value):
        return
    raise UserError(f"backbone.attn_implementation must be one of {', '.join(known)}, got {value!r}")




def check_family(cfg) -> None:
    """The heads family fits the backbone's config (e.g. an EAGLE-3 drafter: a Llama-style layer can be built,
    its aux layer ids exist, its draft vocabulary is no larger than the vocabulary): the family's own
    ``vocabulary`` and ``spec_settings`` refuse in one line."""
    fam = training_family(cfg.heads.kind)
    hf_config = text_config(backbone_config(cfg.backbone))
    fam.vocabulary(cfg.heads, int(hf_config.vocab_size))
    fam.spec_settings(cfg.heads, hf_config)
    if enum_value(cfg.task) == "train":
        from inference.runtime.model import check_backbone_config, position_limit   # lazy: transformers is read by
        name = cfg.backbone.name_or_path if not cfg.backbone.random_init else None    # now, not at --help
        try:
            check_backbone_config(hf_config, name)
        except UserError as e:   # heads for engines that serve such backbones still train
            print(f"note: {e}: medusa-eval and medusa-generate will refuse these heads; serving engines decode "
                  "them (medusa-export)", file=sys.stderr)
            return
        window, positions = position_limit(hf_config), getattr(hf_config, "max_position_embeddings", None)
        if window is not None and window != positions:
            print(f"note: {f'backbone {name!r}' if name else 'the backbone'} attends within a {window}-token sliding "
                  "window: medusa-eval and medusa-generate decode requests within it (serving engines decode longer "
                  "ones)", file=sys.stderr)


def check_draft_vocabulary(cfg) -> None:
    """Refuse a truncated vocabulary larger than the backbone's, from its config alone."""
    vocab = int(text_config(backbone_config(cfg.backbone)).vocab_size)
    _, size = draft_vocabulary(cfg.heads, vocab)  # a family's own vocabulary key refuses beyond it itself
    if size is not None and size > vocab:
        raise UserError(f"heads.truncated_vocab_size={size} exceeds the backbone vocabulary ({vocab}); use at most "
                        f"{vocab} (or heads.projection=own for all of it)")


def check_init_heads(cfg) -> None:
    """Refuse a ``lora.init_heads`` that Medusa-2's second stage could not start from, reading the heads folder's
    config.json alone (no weights) and the backbone's config: a missing path, a file, a folder that is no heads
    export, Medusa-2 heads (their adapter would be dropped), heads of another family (``kind``), of another shape
    (what ``lora.init_heads_from`` compares) or made for another backbone (hidden size, vocabulary, config
    fingerprint). Found only once the backbone had loaded
    otherwise, and heads of another family then failed on the embeddings' shape without naming the key."""
    path = cfg.lora.init_heads
    if not (cfg.lora.enabled and path):
        return
    from inference.loading import read_heads_spec   # lazy: the importers' registry, for stage-2 runs only

    where = f"lora.init_heads={path}"
    if os.path.isfile(path):   # the reader would name it heads=, medusa-eval's key
        raise UserError(f"{where} is a file, not a heads folder: give the folder holding config.json and "
                        "model.safetensors (<stage-1 run>/heads)")
    hf_config = text_config(backbone_config(cfg.backbone))
    try:
        spec = read_heads_spec(path, hf_config)
    except UserError as e:   # the reader's own words (not found, a file, not a heads export), naming the key
        raise UserError(f"{where}: {e}") from None
    if spec.backbone_adapter:   # its heads read the adapted backbone: started on the bare one, half of it is lost
        raise UserError(f"{where} holds Medusa-2 heads trained with a LoRA adapter ({spec.backbone_adapter}/), which "
                        "stage 2 would drop: start it from stage-1 heads (the heads of a run without lora)")
    kind = str(cfg.heads.kind)
    if spec.kind != kind:   # checked first: the shapes of another family say nothing useful
        raise UserError(f"{where} holds {spec.kind} heads, this recipe trains heads.kind={kind}: start stage 2 "
                        f"from a {kind} heads export (or train heads={spec.kind})")
    try:
        check_compatible(spec, hf_config, where=f"the heads in {where}")
    except UserError as e:   # made for another backbone: its hidden size, vocabulary or config fingerprint
        raise UserError(f"{e}; give stage-1 heads trained on this backbone") from None
    mine = recipe_heads_spec(cfg.heads, hf_config)
    # the very keys lora.init_heads_from compares once the backbone has loaded, so both say the same
    keys = ("num_heads", "num_layers", "hidden_size", "vocab_size", "projection", "truncated_vocab_size",
            *setting_names(family(kind)))
    a, b = spec.to_dict(), mine.to_dict()
    diff = [k for k in keys if a.get(k) != b.get(k)]
    if diff:
        raise UserError(f"{where} holds heads that differ from this recipe's in "
                        + ", ".join(f"{k} ({a.get(k)} vs {b.get(k)})" for k in diff))


def check_precision_device(trainer) -> None:
    """fp16 trains only on a GPU (DeepSpeed's loss scaling); refused before anything loads."""
    if enum_value(trainer.precision) == "fp16" and resolve_device(trainer.device).type != "cuda":
        raise UserError("trainer.precision=fp16 needs a GPU; on CPU use fp32 (or bf16)")


def check_resume(cfg) -> Optional[dict]:
    """The checkpoint ``trainer.resume`` names (or ``auto`` finds) exists and was trained under this configuration
    (``checkpoint.resume_point``): refused here, before the run's record is written over. Returns its state (None:
    a fresh run)."""
    return resume_point(cfg, derived_batch(cfg.trainer, launch_world_size()).global_batch_size)[1]


# What other commands leave at the top of their folders: a training run writes heads/, checkpoints/ and its record
# there, so a folder holding one of these is another command's output, which the run would mix its files into.
FOREIGN_OUTPUTS = (("distill.json", "self-distillation data"), ("features.json", "a features cache"),
                   ("report.json", "an evaluation report"), ("config.json", "heads or an engine export"),
                   ("model.safetensors", "heads or an engine export"))


def check_run_folder(cfg, resumed: bool) -> None:
    """A training run's ``output_dir`` holds no other command's output (``FOREIGN_OUTPUTS``) and no finished run of
    another configuration: a run whose checkpoints were deleted is compared by its record (``.hydra/config.yaml``)
    as a checkpoint would be (``checkpoint.unsafe_changes``), since training there replaces its heads.
    ``trainer.resume=never`` starts over in such a folder, as it does beside checkpoints."""
    out = Path(os.path.expanduser(str(cfg.output_dir)))
    if not out.is_dir():
        return
    names = {e.name for e in out.iterdir()}
    if cfg.features.cache_dir and Path(os.path.expanduser(str(cfg.features.cache_dir))).resolve() == out.resolve():
        names.discard("features.json")   # the run's own folder named as its cache: its own features
    for marker, what in FOREIGN_OUTPUTS:
        if marker in names:
            raise UserError(f"output_dir={cfg.output_dir} holds {what} ({marker}), not a training run: give the run "
                            "a folder of its own")
    resume = str(cfg.trainer.resume)
    if resume not in ("auto", "never"):
        _check_resume_into(out, Path(os.path.expanduser(resume)), cfg)
    if resumed or resume == "never":
        return
    diff = trained_record_changes(cfg)
    if diff:
        raise UserError(f"output_dir={cfg.output_dir} holds a finished run trained with another configuration "
                        f"({', '.join(diff[:4])}{', ...' if len(diff) > 4 else ''} differ), whose heads this run "
                        "would replace: use a new output_dir, or trainer.resume=never to train over it")


def _check_resume_into(out: Path, checkpoint: Path, cfg) -> None:
    """A checkpoint of another folder resumes into an ``output_dir`` without a run of its own: that run's checkpoints
    of the same steps and its heads were written over, its metrics appended to with another run's."""
    own = checkpoints_dir(out)
    if checkpoint.resolve().parent == own.resolve():
        return
    held = sorted(p.name for p in own.glob("step-*")) if own.is_dir() else []
    if held or (out / "heads").is_dir():
        what = f"checkpoints {', '.join(held[:3])}{', ...' if len(held) > 3 else ''}" if held else "heads"
        raise UserError(f"trainer.resume={cfg.trainer.resume} is another folder's checkpoint but output_dir="
                        f"{cfg.output_dir} holds a run of its own ({what}), which resuming there would write over: "
                        "give the resumed run an empty output_dir; trainer.resume=auto continues the folder's own "
                        "(this resume's, if an earlier attempt of this command saved them)")


def check_data_usable(cfg) -> None:
    """A local (or embedded) data source gives what the task reads: a training conversation after the held-out
    ones (``data.stream.check_training_data``), or for ``task: distill`` a conversation at all. The stream would
    find out only once the run's record and random backbone were written into ``output_dir``. A hub dataset is
    left to the trainer's own check (``trainer.MedusaTrainer.setup``): streaming it is not for a preflight."""
    source = str(cfg.data.source)
    if not (source.startswith("embedded:") or os.path.exists(os.path.expanduser(source))):
        return
    if enum_value(cfg.task) == "distill":
        stats = ReadStats()
        if next(iter_conversations(source, cfg.data.split, stats, cfg.data.system_prompt), None) is None:
            raise UserError(f"data source {source!r} gave no conversations to distill ({stats.summary()})")
        return
    check_training_data(cfg.data)


def preflight(cfg, resume: bool = True) -> None:
    """What a run needs from disk, checked before any weight or data loads: a readable local data source,
    a ``data.max_length`` the backbone has positions (and this machine memory) for, the heads family on this
    backbone, a feature cache folder that is one (or can become one), and for a training of heads: a truncated
    vocabulary the backbone has tokens for, stage-1 heads that fit it (``lora.init_heads``), a device for
    the precision, and a checkpoint to resume that was trained under this configuration (not with
    ``resume=False``: a sweep's jobs resume from folders Hydra names only when each runs), and data that gives
    the task a conversation to read."""
    check_data_source(cfg.data.source)
    local_files(str(cfg.data.source), cfg.data.split)   # the split is there (a folder's files name it)
    check_output_outside_data(cfg.data.source, cfg.output_dir)
    if cfg.features.cache_dir and enum_value(cfg.features.mode) != "off":
        check_output_outside_data(cfg.data.source, cfg.features.cache_dir, "features.cache_dir")
    check_attn_implementation(cfg.backbone)
    check_fits(cfg)
    check_family(cfg)
    check_cache_dir(cfg)
    if enum_value(cfg.task) == "train" and enum_value(cfg.features.mode) != "build":
        check_draft_vocabulary(cfg)
        check_precision_device(cfg.trainer)
        state = check_resume(cfg) if resume else None
        check_run_folder(cfg, resumed=state is not None or not resume)
        if not (state and int(state.get("step", 0)) >= cfg.trainer.max_steps):
            check_init_heads(cfg)   # a finished run's rerun has nothing to do: stage 1's heads may be gone by then
            check_wandb_credentials(cfg.logger)   # nor logs anything
    wrong = unfinished_distillation(cfg.data.source)   # a training or another distillation reading it
    if wrong:
        raise UserError(wrong)
    check_data_usable(cfg)  # last: the only check that reads the data
