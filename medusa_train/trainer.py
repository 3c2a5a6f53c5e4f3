"""Medusa-1 recipe: train K heads on a frozen backbone with a DeepSpeed engine.

Lifecycle: ``setup`` -> ``train`` (-> ``save_checkpoint`` every N steps) -> ``export`` -> ``cleanup``.

Feature                                   config key
----------------------------------------  ------------------------------------------------
backbone (embedded / HF id / path / tiny)  backbone.name_or_path, backbone.random_init, .dtype
chat data streamed, assistant-only labels  data.source, data.max_length, data.shuffle_buffer
packing (no padding) or length bucketing   data.packing
K heads x L residual blocks                heads.num_heads, heads.num_layers
projection own / shared / truncated        heads.projection, heads.truncated_vocab_size
loss weights lambda_k = decay^k            heads.loss_decay, heads.loss_weights
AdamW, warmup + cosine                     optim.*
ZeRO 0-3, fp32/bf16/fp16, accumulation     trainer.zero_stage, trainer.precision, trainer.global_batch_size
checkpoints every N steps, keep last M     trainer.save_every, trainer.keep_last
resume after a crash or kill               trainer.resume=auto|never|<dir>
wandb (offline default), JSONL, PNG        logger.*
offline hidden-state cache (features.py)   features.mode=off|build|train, features.cache_dir, .dtype
targets: dataset or backbone greedy tokens  heads.targets=data|backbone

The backbone is outside the DeepSpeed engine: no gradients, no optimizer state, eval mode,
run under ``torch.no_grad`` through its body only (the heads need the final hidden state,
not the backbone's 49k-vocabulary logits). With ``heads.targets=backbone`` its lm_head also runs,
in chunks, but only at the positions whose greedy token a target needs (``greedy_ids``).
"""

from __future__ import annotations

import math
import os
import signal
import socket
import time
from pathlib import Path

import torch
from torch import nn

from inference.errors import UserError
from inference.heads.native import save_heads
from inference.heads.projection import ProjectedHeads
from inference.heads.registry import init_heads
from inference.heads.spec import HeadsSpec, backbone_fingerprint
from . import checkpoint, features, lora
from inference.backbone import backbone_logits, decoder_body as body, lm_head_weight
from .backbone import load_backbone
from .config import HeadKind, Precision, derived_batch, loss_weights, validate
from .data.stream import ConversationStream, MicroBatches, eval_batches, token_frequencies
from .data.tokenize import IGNORE
from .deepspeed_config import check_consistent, deepspeed_config
from .losses import HeadMetrics, backbone_labels, greedy_positions, heads_loss, vocab_to_local
from .tracking import Tracker


class HeadsWithLoss(nn.Module):
    """What the DeepSpeed engine wraps: the heads, and their loss as ``forward``."""

    def __init__(self, heads: ProjectedHeads, weights: list[float], inv_map, teacher_weight: float = 0.0,
                 lm_head_weight: torch.Tensor | None = None):
        super().__init__()
        self.heads = heads
        self.weights = weights
        self.inv_map = inv_map
        self.teacher_weight = teacher_weight
        # A plain attribute, not a parameter or buffer: the frozen backbone's matrix is never
        # trained, cast, partitioned or checkpointed by DeepSpeed.
        self.lm_head_weight = lm_head_weight if teacher_weight > 0 else None
        self.metrics: HeadMetrics | None = None

    def forward(self, hidden, labels, doc_ids, input_ids=None):
        return heads_loss(self.heads, hidden, labels, doc_ids, self.weights, self.inv_map, self.metrics,
                          input_ids=input_ids, teacher_weight=self.teacher_weight,
                          lm_head_weight=self.lm_head_weight)


def block_causal_mask(doc_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask for packed rows: causal within a conversation, nothing across."""
    t = doc_ids.shape[1]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    allowed = (same & causal) | torch.eye(t, dtype=torch.bool, device=doc_ids.device)  # padding sees itself
    mask = torch.zeros(allowed.shape, dtype=dtype, device=doc_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


GREEDY_CHUNK = 1024  # rows per backbone lm_head product for greedy targets: bounds the [rows, vocab] logits


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_device(setting: str) -> torch.device:
    if setting == "cuda" and not torch.cuda.is_available():
        raise UserError("trainer.device=cuda but no CUDA device is available (use trainer.device=cpu)")
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(setting)


def init_distributed(device: torch.device):
    """Join the launcher's process group, or make a 1-process group when run without one."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    added = {}
    if "RANK" not in os.environ:
        added = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        os.environ.update(added)
    import logging

    import deepspeed
    import torch.distributed as dist

    deepspeed.utils.logger.setLevel(logging.WARNING)  # its INFO lines drown the progress bar
    if device.type == "cpu":
        # DeepSpeed's CPU shared-memory allreduce op is JIT-compiled on first use, leaves a
        # 66 MB buffer per rank in /dev/shm after every multi-process run (RAM, never freed),
        # and its bf16 kernels fault without AVX-512. gloo's allreduce is plenty for the heads.
        # (sys.modules: ``import deepspeed.comm.torch as m`` binds the real torch, which
        # deepspeed.comm re-exports under that name.)
        import importlib
        import sys

        importlib.import_module("deepspeed.comm.torch")
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    try:
        if not dist.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else "nccl", verbose=False)
    finally:
        for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if key in added:  # a child process started later must not inherit a stale rendezvous
                os.environ.pop(key, None)  # (DeepSpeed still reads LOCAL_RANK at initialize)
    return dist.get_rank(), dist.get_world_size()


class MedusaTrainer:
    def __init__(self, cfg):
        validate(cfg)
        self.cfg = cfg
        self.backbone_targets = cfg.heads.targets == "backbone"  # losses.backbone_labels
        self.output_dir = Path(cfg.output_dir)
        self.step = 0
        self.tracker: Tracker | None = None

    # -- setup -------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, t = self.cfg, self.cfg.trainer
        self.device = resolve_device(t.device)
        precision = Precision(t.precision)
        if precision is Precision.fp16 and self.device.type != "cuda":
            raise UserError("trainer.precision=fp16 needs a GPU; on CPU use fp32 (or bf16)")
        if t.threads:
            torch.set_num_threads(t.threads)
        self.rank, self.world_size = init_distributed(self.device)
        if self.device.type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", 0))
            self.device = torch.device("cuda", local)
            torch.cuda.set_device(self.device)
        self.is_main = self.rank == 0
        self.plan = derived_batch(t, self.world_size)
        torch.manual_seed(t.seed)

        self.backbone = load_backbone(cfg.backbone, self.device, seed=t.seed)
        model, tok = self.backbone.model, self.backbone.tokenizer
        self.body = body(model)
        self.peft_model = None
        if cfg.lora.enabled:  # Medusa-2: the body runs with a LoRA adapter and gradients
            self.peft_model = lora.apply_lora(model, cfg.lora, self.device)
            self.body = body(self.peft_model.get_base_model())
        self.pad_id = tok.pad_token_id
        hf_cfg = model.config

        self.resume_from = checkpoint.find_resume(self.output_dir, t.resume)
        self.train_stream = ConversationStream(cfg.data, tok, seed=t.seed, rank=self.rank,
                                               world_size=self.world_size)
        self.eval_stream = ConversationStream(cfg.data, tok, eval_split=True)
        token_map = self._token_map(hf_cfg.vocab_size) if cfg.heads.projection.value == "truncated" else None

        spec = HeadsSpec(
            num_heads=cfg.heads.num_heads, num_layers=cfg.heads.num_layers, hidden_size=hf_cfg.hidden_size,
            vocab_size=hf_cfg.vocab_size, projection=cfg.heads.projection.value,
            truncated_vocab_size=cfg.heads.truncated_vocab_size if token_map is not None else None,
            base_model=self.backbone.name, base_model_fingerprint=backbone_fingerprint(hf_cfg),
            kind=HeadKind(cfg.heads.kind).value, inner_dim=cfg.heads.inner_dim or None,
            tie_weights=cfg.heads.tie_weights, scale_input=cfg.heads.scale_input)
        lm_w, emb_w = lm_head_weight(model), model.get_input_embeddings().weight
        heads = init_heads(spec, lm_w.float(), emb_w, token_map).to(self.device)
        if self.peft_model is not None:
            spec.backbone_adapter = lora.ADAPTER_DIR
            lora.init_heads_from(heads, cfg.lora.init_heads, lm_w, emb_w)
        inv = vocab_to_local(heads.token_map, spec.vocab_size)
        if self.peft_model is not None:
            self.module = lora.JointWithLoss(self.peft_model, self.body, model.get_output_embeddings(), heads,
                                             loss_weights(cfg.heads), inv, cfg.lora, cfg.heads.teacher_weight)
        else:
            self.module = HeadsWithLoss(heads, loss_weights(cfg.heads), inv, cfg.heads.teacher_weight, lm_w)
        self.spec = spec
        self._build_engine()

        state = {"step": 0, "data": {"epoch": 0, "index": 0}}
        if self.resume_from is not None:
            state = checkpoint.load(self.engine, self.resume_from, self.rank)
            if self.is_main:
                print(f"[medusa-train] resumed from {self.resume_from} at step {state['step']}", flush=True)
        self.step = state["step"]
        data_state = state["data"]
        per_rank = state.get("data_per_rank")
        if per_rank and len(per_rank) == self.world_size:
            data_state = per_rank[self.rank]
        elif per_rank and self.is_main:
            print(f"[medusa-train] resuming with {self.world_size} processes instead of {len(per_rank)}: each rank "
                  "restarts its data shard at the saved epoch position of rank 0", flush=True)
        self.batches = MicroBatches(self.train_stream, self.plan.micro_batch_size, self.pad_id,
                                    buffer=cfg.data.bucket_buffer, **data_state)
        self.eval_set = eval_batches(self.eval_stream, max(self.plan.micro_batch_size, 4), self.pad_id)
        if features.enabled(cfg):  # offline features: batches carry stored hidden states (features.py)
            self.batches, self.eval_set = features.cached_batches(self, **data_state)
        self.data_state = self.batches.state()  # position after the last *completed* optimizer step
        self.output_dir.mkdir(parents=True, exist_ok=True)
        from omegaconf import OmegaConf

        self.tracker = Tracker(self.output_dir, cfg.logger, OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
                               if OmegaConf.is_config(cfg) else {}, t.max_steps, self.step,
                               enabled=self.is_main, progress=t.progress_bar)
        if self.is_main:
            n_train = sum(getattr(p, "ds_numel", p.numel()) for p in heads.parameters() if p.requires_grad)
            n_back = sum(p.numel() for p in model.parameters())
            frozen = "frozen"
            if self.peft_model is not None:
                n_lora = sum(p.numel() for p in self.peft_model.parameters() if p.requires_grad)
                frozen = f"LoRA r={cfg.lora.r}: {n_lora / 1e6:.2f}M adapter parameters train"
            self.tracker.write(
                f"[medusa-train] backbone {self.backbone.name} ({n_back / 1e6:.1f}M params, {frozen}) on {self.device}; "
                f"{spec.num_heads} heads x {spec.num_layers} layers, projection {spec.projection} "
                f"({n_train / 1e6:.2f}M trainable), targets {cfg.heads.targets}; world {self.world_size}, "
                f"micro {self.plan.micro_batch_size}, accum {self.plan.grad_accum}, "
                f"global batch {self.plan.global_batch_size}, ZeRO {t.zero_stage}")

    def _token_map(self, vocab_size: int) -> torch.Tensor:
        """Top-N assistant tokens of the training data (plus EOS), most frequent first."""
        d, h = self.cfg.data, self.cfg.heads
        n = h.truncated_vocab_size
        if n > vocab_size:
            raise UserError(f"heads.truncated_vocab_size={n} exceeds the backbone vocabulary ({vocab_size})")
        scan = ConversationStream(d, self.backbone.tokenizer, seed=self.cfg.trainer.seed)
        counts = token_frequencies(scan, vocab_size, d.vocab_scan_conversations)
        eos = self.backbone.tokenizer.eos_token_id
        if eos is not None:
            counts[eos] = counts.max() + 1  # the end of a reply must always be predictable
        order = torch.argsort(counts, descending=True, stable=True)
        token_map = order[:n].clone()
        coverage = counts[token_map].sum().item() / max(counts.sum().item(), 1)
        if self.rank == 0:
            print(f"[medusa-train] truncated vocabulary: top {n} of {vocab_size} tokens cover "
                  f"{coverage:.1%} of assistant tokens in {scan.stats.conversations} conversations", flush=True)
        self.vocab_coverage = coverage
        return token_map

    def _build_engine(self) -> None:
        import deepspeed

        t, o = self.cfg.trainer, self.cfg.optim
        ds_cfg = deepspeed_config(t, self.plan)
        check_consistent(ds_cfg)
        if self.peft_model is not None:
            params = lora.param_groups(self.module, o.lr, self.cfg.lora.heads_lr_multiplier)
        else:
            params = [p for p in self.module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                      weight_decay=o.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, t.max_steps, o))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=self.module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_cfg,
            dist_init_required=False)
        self.compute_dtype = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}.get(
            Precision(t.precision), torch.float32)

    # -- train -------------------------------------------------------------------------
    @torch.no_grad()
    def backbone_hidden(self, batch: dict) -> torch.Tensor:
        """The backbone's last hidden states in its own dtype (before the cast to the heads' precision)."""
        dev = self.device
        ids, pos, doc = batch["input_ids"].to(dev), batch["position_ids"].to(dev), batch["doc_ids"].to(dev)
        if self.cfg.data.packing:
            mask = block_causal_mask(doc, self.backbone.model.dtype)
        else:
            mask = (doc > 0).long()
        out = self.body(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        return out.last_hidden_state

    def hidden_states(self, batch: dict) -> torch.Tensor:
        """What the heads are fed: the last hidden states in the training precision."""
        return self.backbone_hidden(batch).to(self.compute_dtype)

    @torch.no_grad()
    def greedy_ids(self, hidden: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] the backbone's argmax over its full vocabulary where ``backbone_labels`` reads it,
        IGNORE elsewhere. ``hidden`` comes from ``backbone_hidden`` (backbone dtype, not the heads'
        rounding); the lm_head runs on ``GREEDY_CHUNK`` rows at a time so a 49k vocabulary stays small."""
        need = greedy_positions(labels.to(hidden.device), doc_ids.to(hidden.device))
        out = torch.full(need.shape, IGNORE, dtype=torch.long, device=hidden.device)
        rows = hidden[need]
        if rows.shape[0]:
            model = self.backbone.model
            out[need] = torch.cat([backbone_logits(model, rows[s:s + GREEDY_CHUNK]).argmax(-1)
                                   for s in range(0, rows.shape[0], GREEDY_CHUNK)])
        return out

    def loss(self, batch: dict) -> torch.Tensor:
        """The engine's loss on one micro-batch: frozen features (online or cached) -> heads, or
        Medusa-2's joint backbone + heads forward."""
        dev = self.device
        ids, labels, doc = batch["input_ids"].to(dev), batch["labels"].to(dev), batch["doc_ids"].to(dev)
        if self.peft_model is not None:
            self.module.step = self.step  # the heads-loss coefficient's warm-up
            pos = batch["position_ids"].to(dev)
            mask = block_causal_mask(doc, self.backbone.model.dtype) if self.cfg.data.packing else (doc > 0).long()
            return self.engine(ids, pos, mask, labels, doc)
        if "hidden" in batch:  # cached: no backbone (greedy ids were stored with the hidden states)
            hidden, greedy = batch["hidden"], batch.get("greedy")
        else:
            raw = self.backbone_hidden(batch)
            hidden = raw.to(self.compute_dtype)
            greedy = self.greedy_ids(raw, labels, doc) if self.backbone_targets else None
        if self.backbone_targets:
            if greedy is None:
                raise UserError(features.no_greedy_message(features.cache_dir(self.cfg)))
            labels = backbone_labels(labels, doc, greedy.to(dev))
        return self.engine(hidden, labels, doc, ids)

    def train(self) -> None:
        t = self.cfg.trainer
        metrics = HeadMetrics(self.spec.num_heads)
        self.module.metrics = metrics
        it = iter(self.batches)
        window_tokens, window_start, loss_sum = 0, time.perf_counter(), 0.0
        self.engine.train()
        while self.step < t.max_steps:
            step_loss = 0.0
            for _ in range(self.plan.grad_accum):
                batch = next(it)
                loss = self.loss(batch)
                self._check_finite(loss)
                self.engine.backward(loss)
                if self.engine.is_gradient_accumulation_boundary():
                    grad_norm = _grad_norm(self.engine, self.module)
                self.engine.step()
                metrics.batches += 1
                step_loss += float(loss.detach()) / self.plan.grad_accum
                window_tokens += int((batch["doc_ids"] > 0).sum()) * self.world_size
            if grad_norm is None:
                norm = self.engine.get_global_grad_norm()
                grad_norm = float(norm) if norm is not None else float("nan")
            self.step += 1
            self.data_state = self.batches.state()
            loss_sum += step_loss
            if self.tracker:
                self.tracker.advance()
            if self.step % t.log_every == 0 or self.step == t.max_steps:
                elapsed = time.perf_counter() - window_start
                n_steps = metrics.batches / self.plan.grad_accum
                record = {"loss": loss_sum / max(n_steps, 1), **metrics.summary(),
                          "tokens_per_s": window_tokens / max(elapsed, 1e-9),
                          "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                          "padding_fraction": self.train_stream.stats.padding_fraction,
                          **getattr(self.module, "last_parts", {})}
                self.tracker.log(self.step, record)
                metrics.reset()
                window_tokens, window_start, loss_sum = 0, time.perf_counter(), 0.0
            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps:
                paused = time.perf_counter()
                self.evaluate()
                window_start += time.perf_counter() - paused  # tokens/s counts training time only
            if t.save_every and self.step % t.save_every == 0 and self.step < t.max_steps:
                paused = time.perf_counter()
                self.save_checkpoint()
                window_start += time.perf_counter() - paused
        self.save_checkpoint()

    def _check_finite(self, loss: torch.Tensor) -> None:
        bad = torch.tensor([0.0 if torch.isfinite(loss.detach()).all() else 1.0])
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(bad)  # every rank stops together, none is left waiting
        if bad.item() > 0:
            last = checkpoint.find_resume(self.output_dir, "auto")
            keep = f"last good checkpoint kept: {last}" if last else "no checkpoint was written yet"
            raise UserError(f"loss became NaN/inf at step {self.step + 1}; training stopped ({keep}). "
                            "Try a lower optim.lr or trainer.precision=fp32")

    @torch.no_grad()
    def evaluate(self) -> dict:
        metrics = HeadMetrics(self.spec.num_heads)
        previous, self.module.metrics = self.module.metrics, metrics
        self.engine.eval()
        losses = []
        for batch in self.eval_set:
            losses.append(float(self.loss(batch)))
            metrics.batches += 1
        self.engine.train()
        # the accuracies are against the training targets (dataset or backbone greedy tokens): say which
        summary = {"loss": sum(losses) / max(len(losses), 1), **metrics.summary(), "targets": self.cfg.heads.targets}
        if self.tracker:
            self.tracker.log(self.step, summary, kind="eval")
        self.module.metrics = previous
        return summary

    def save_checkpoint(self) -> Path:
        # Each rank reads its own shard, so each has its own data position; an interrupted
        # step's micro-batches are not counted (the resumed run redoes that step whole).
        per_rank = [self.data_state]
        if self.world_size > 1:
            import torch.distributed as dist

            per_rank = [None] * self.world_size
            dist.all_gather_object(per_rank, self.data_state)
        state = {"step": self.step, "data": per_rank[0], "data_per_rank": per_rank, "heads": self.spec.to_dict(),
                 "world_size": self.world_size}
        return checkpoint.save(self.engine, self.output_dir, self.step, state, self.cfg.trainer.keep_last, self.rank)

    # -- export ------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 head weights gathered from any ZeRO stage (master weights under bf16/fp16)."""
        from deepspeed.utils import safe_get_full_fp32_param

        heads = self.engine.module.heads
        out = {}
        for name, p in heads.named_parameters():
            full = safe_get_full_fp32_param(p)
            out[name] = (full if full is not None else p.detach()).float().cpu().contiguous()
        for name, b in heads.named_buffers():
            if name in heads.state_dict():
                out[name] = b.detach().cpu().contiguous()
        return out

    def export(self) -> Path | None:
        state = self.full_state_dict()  # collective under ZeRO-3: every rank takes part
        adapter = self._gathered_adapter() if self.peft_model is not None else None  # collective too
        if not self.is_main:
            return None
        extra = None
        if adapter is not None:
            adapter = lora.adapter_state(self.peft_model, adapter)
            extra = lambda tmp: lora.save_adapter(self.peft_model, adapter, tmp / lora.ADAPTER_DIR,  # noqa: E731
                                                  self.backbone.name)
        heads_dir = save_heads(self.engine.module.heads, self.output_dir / "heads", state_dict=state, extra=extra)
        if self.peft_model is not None:
            self._export_lora_extras()
        return heads_dir

    def _gathered_adapter(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for name, p in self.engine.module.named_parameters():
            if p.requires_grad and name.startswith("peft_model."):
                full = safe_get_full_fp32_param(p)
                out[name] = (full if full is not None else p.detach()).float().cpu()
        return out

    def _export_lora_extras(self) -> None:
        """Medusa-2 only: how far the backbone drifted (held-out perplexity with / without the
        adapter) and, with lora.merge=true, the merged backbone."""
        import json

        report = lora.drift(self.peft_model, self.body, self.backbone.model.get_output_embeddings(),
                            self.eval_set, self.device)
        (self.output_dir / "drift.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"backbone drift on {report['heldout_tokens']} held-out tokens: perplexity "
              f"{report['perplexity_base']:.3f} -> {report['perplexity_tuned']:.3f}, argmax agreement "
              f"{report['argmax_agreement']:.1%}", flush=True)
        if self.cfg.lora.merge:
            merged = lora.save_merged(self.peft_model, self.backbone.tokenizer, self.output_dir / "merged")
            print(f"merged backbone: {merged}", flush=True)

    def cleanup(self, plot: bool = True) -> Path | None:
        png = None
        if self.tracker:
            png = self.tracker.close(self.output_dir / "training_curves.png" if plot else None)
        return png


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def lr_factor(step: int, max_steps: int, optim) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio``."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    span = max(max_steps - optim.warmup_steps, 1)
    progress = min((step - optim.warmup_steps) / span, 1.0)
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _grad_norm(engine, module: nn.Module) -> float | None:
    """Global gradient norm of the optimizer step about to be taken (call before ``engine.step``).

    DeepSpeed's ZeRO / bf16 optimizers report the norm of the step they took last; its plain
    fp32 stage-0 path computes it for clipping and discards it, so it is computed here from the
    (already all-reduced) gradients.
    """
    if engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled():
        return None   # the optimizer computes it during engine.step(): read it afterwards
    grads = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else 0.0


def format_accuracy_table(summary: dict, num_heads: int) -> str:
    lines = []
    if summary.get("targets") == "backbone":
        lines.append("held-out accuracy against the backbone's greedy tokens (heads.targets=backbone)")
    lines.append("head  top1   top2   top3   top4   top5   loss")
    for k in range(1, num_heads + 1):
        accs = "  ".join(f"{summary[f'head{k}/top{j}']:.3f}" for j in range(1, 6))
        lines.append(f"{k:>4}  {accs}  {summary[f'head{k}/loss']:.3f}")
    lines.append(f"simulated chain tau (1 + sum of products of top-1): {summary['sim_tau']:.3f}")
    return "\n".join(lines)


def run(cfg) -> dict:
    """The whole recipe: returns the final eval summary (rank 0) for callers and tests."""
    trainer = MedusaTrainer(cfg)
    trainer.setup()
    previous_handler = None
    if trainer.world_size == 1:  # a scheduler's SIGTERM saves a checkpoint like Ctrl-C does
        previous_handler = signal.signal(signal.SIGTERM, _raise_interrupt)
    summary: dict = {}
    try:
        if trainer.step < cfg.trainer.max_steps:
            try:
                trainer.train()
            except KeyboardInterrupt:
                path = trainer.save_checkpoint()
                raise UserError(f"interrupted at step {trainer.step}; checkpoint saved to {path}; "
                                "run the same command again to resume") from None
        summary = trainer.evaluate()
        heads_dir = trainer.export()
        if trainer.is_main:
            trainer.tracker.write("\n" + format_accuracy_table(summary, trainer.spec.num_heads))
            stats = trainer.train_stream.stats
            trainer.tracker.write(
                f"data: {trainer.train_stream.read_stats.summary()}; this run tokenized {stats.conversations} "
                f"conversations ({stats.truncated} truncated to {cfg.data.max_length} tokens), "
                f"padding {stats.padding_fraction:.1%} of batch tokens")
            trainer.tracker.write(f"heads exported to {heads_dir}")
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        png = trainer.cleanup()
    if trainer.is_main and png:
        print(f"curves: {png}", flush=True)
    if trainer.world_size > 1:
        # Leave the process group before the interpreter exits: gloo's threads torn down by
        # static destructors instead sometimes abort a rank ("terminate called without an
        # active exception", exit 250) after a run that succeeded. Success path only: a rank
        # that failed must not wait at a barrier its peers never reach.
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    summary["step"] = trainer.step
    return summary
