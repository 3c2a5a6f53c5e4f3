"""The DeepSpeed config, generated from the recipe by one pure function.

Nothing else in the code base writes DeepSpeed keys. Batch sizes come from
``config.derived_batch`` so ``train_batch_size = micro x accumulation x world`` always holds;
optimizer and scheduler are torch objects passed to ``deepspeed.initialize`` (not DeepSpeed's
fused / CPU-Adam ops, which need a compiler toolchain and a GPU).
"""

from __future__ import annotations

from .config import BatchPlan, Precision


def deepspeed_config(trainer, plan: BatchPlan) -> dict:
    """A DeepSpeed config dict for the heads engine."""
    precision = Precision(trainer.precision)
    cfg: dict = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": float(trainer.grad_clip),
        "steps_per_print": 10**9,  # our own logger reports; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": int(trainer.zero_stage)},
        "bf16": {"enabled": precision is Precision.bf16},
        "fp16": {"enabled": precision is Precision.fp16, "loss_scale": 0, "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,  # torch AdamW under ZeRO is well tested upstream
    }
    if trainer.zero_stage >= 2:
        cfg["zero_optimization"].update({"overlap_comm": False, "contiguous_gradients": True,
                                         "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7})
    if trainer.zero_stage == 3:
        cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 1e4,
                                         "stage3_gather_16bit_weights_on_model_save": True})
    return cfg


def check_consistent(cfg: dict) -> None:
    """Fail naming the keys if the batch arithmetic of a (possibly hand-edited) config breaks."""
    tb, mb, ga = (cfg.get(k) for k in
                  ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"))
    if tb is None or mb is None or ga is None or tb % (mb * ga):
        raise ValueError(f"train_batch_size={tb} is not train_micro_batch_size_per_gpu={mb} x "
                         f"gradient_accumulation_steps={ga} x world_size")
    if cfg["bf16"]["enabled"] and cfg["fp16"]["enabled"]:
        raise ValueError("bf16.enabled and fp16.enabled cannot both be true")
