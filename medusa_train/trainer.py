"""Train draft heads on a backbone with a DeepSpeed engine: Medusa-1, Hydra and MLP-speculator heads on the
frozen backbone (online or from the feature cache) and Medusa-2 (LoRA backbone + heads jointly).

Lifecycle: ``setup`` -> ``train`` (-> ``save_checkpoint`` every N steps) -> ``export`` -> ``cleanup``.
Where batches and the loss come from is one ``sources.BatchSource`` chosen in ``setup`` (online,
cached or joint LoRA); the loop below is the same for all of them.

Feature                                   config key
----------------------------------------  ------------------------------------------------
backbone (embedded / HF id / path / tiny)  backbone.name_or_path, backbone.random_init, .dtype
chat data streamed, assistant-only labels  data.source, data.max_length, data.shuffle_buffer
packing (no padding) or length bucketing   data.packing
K heads x L residual blocks, head family   heads.num_heads, heads.num_layers, heads=<kind> (recipes/heads/)
projection own / shared / truncated        heads.projection, heads.truncated_vocab_size
loss weights lambda_k = decay^k            heads.loss_decay, heads.loss_weights
AdamW, warmup + cosine                     optim.*
ZeRO 0-3, fp32/bf16/fp16, accumulation     trainer.zero_stage, trainer.precision, trainer.global_batch_size
checkpoints every N steps, keep last M     trainer.save_every, trainer.keep_last
resume after a crash or kill               trainer.resume=auto|never|<dir>
wandb (offline default), JSONL, PNG        logger.*
offline hidden-state cache (features.py)   features.mode=off|build|train, features.cache_dir, .dtype
targets: dataset or backbone greedy tokens  heads.targets=data|backbone
Medusa-2: LoRA backbone + heads (lora.py)  lora.enabled, lora.*

The frozen backbone is outside the DeepSpeed engine: no gradients, no optimizer state, eval mode,
run under ``torch.no_grad`` through its body only (``backbone_inputs.FrozenFeatures``: the heads need the
hidden states their family declares, not the backbone's 49k-vocabulary logits).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from inference.backbone import eos_token_ids, lm_head_weight, parse_dtype
from inference.chat_template import check_template_args
from inference.cli_support import enum_value
from inference.errors import UserError
from inference.heads.native import EXPORT_FILES, recover_dir, save_heads
from inference.heads.registry import family, init_heads
from inference.heads.spec import HeadsSpec, backbone_fingerprint
from . import checkpoint, features
from .backbone import backbone_identity, load_backbone
from .distill import distilled_by_another
from .config import derived_batch, loss_weights, validate
from .families import draft_depth, draft_vocabulary, training_family
from .data.readers import data_fingerprint
from .data.stream import ConversationStream, RankData, check_training_data, token_frequencies
from .data.tokenize import reply_end_ids
from .deepspeed_config import check_consistent, deepspeed_config
from .distributed import resolve_device, restore_handlers, start_process, stop_on_signals, swap_handlers
from .losses import HeadMetrics, vocab_to_local
from .lora import DRIFT_FILE, MERGED_WEIGHTS
from .sources import BatchSource, make_source
from .tracking import Tracker


class MedusaTrainer:
    def __init__(self, cfg, record: Callable[[], None] | None = None):
        validate(cfg)
        self.cfg = cfg
        # Writes the run's record (``launch.write_run_record``): called by setup once the data is accepted, not
        # before, so data refused at setup leaves an existing run's record as it was.
        self.record = record or (lambda: None)
        self.output_dir = Path(cfg.output_dir)
        self.step = 0
        self.tracker: Tracker | None = None
        self.finished: Path | None = None  # set by setup: the heads of a run already complete
        self.interrupts = Interrupts()  # ``run`` installs its signal handlers; ``train`` reads its request
        self.checkpointed: tuple[int, Path] | None = None  # (step, path) of the last checkpoint saved or resumed
        self.window_loss, self.resumed_window = 0.0, None   # the logging window's loss sum; a checkpoint's window
        self.window_tokens = 0   # this rank's real tokens trained in the logging window
        self.eval_empty_warned = False
        self.stopped_together = False  # set when every rank stopped at the same step on a Ctrl-C / SIGTERM
        self.phase = "starting"  # what ``setup`` is doing: named by the line a Ctrl-C / SIGTERM there ends with
        self.resume_from = None

    # -- setup -------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, t = self.cfg, self.cfg.trainer
        precision = enum_value(t.precision)
        if precision == "fp16" and resolve_device(t.device).type != "cuda":
            raise UserError("trainer.precision=fp16 needs a GPU; on CPU use fp32 (or bf16)")
        self.phase = "starting the process group"
        proc = start_process(t)
        self.device, self.rank, self.world_size = proc.device, proc.rank, proc.world_size
        self.is_main = proc.is_main
        self.plan = derived_batch(t, self.world_size)
        self.compute_dtype = parse_dtype(precision)  # what the heads are fed
        self.run_config = checkpoint.config_dict(cfg)
        self.data_fingerprint = data_fingerprint(cfg.data.source, cfg.data.split)  # None for a hub dataset

        # Before any weights (backbone or checkpoint) or data are touched: is there a checkpoint to
        # resume, was it trained under this configuration, and is that run already complete?
        self.phase = "looking for a checkpoint"
        self.resume_from, resume_state = checkpoint.resume_point(cfg, self.plan.global_batch_size)
        if resume_state is not None and self._already_exported(resume_state):
            self.step = int(resume_state["step"])
            if not checkpoint.keeps_trained_record(cfg):   # trains nothing: the heads' record stays theirs
                self.record()
            return

        # A random backbone is kept in <output_dir>/backbone, once ``_accept_data`` has read the data with its
        # tokenizer: nothing is written into output_dir for data that gives no training batch.
        self.phase = "loading the backbone"
        self.backbone = load_backbone(cfg.backbone, self.device, seed=t.seed, run_dir=self.output_dir,
                                      write=self.is_main, before_write=self._accept_data)
        tok = self.backbone.tokenizer
        note = distilled_by_another(cfg.data.source, backbone_identity(self.backbone)) if self.is_main else None
        if note:
            print(note, file=sys.stderr, flush=True)
        self.pad_id = tok.pad_token_id
        data = RankData(cfg.data, tok, t.seed, self.rank, self.world_size, self.plan.micro_batch_size, self.pad_id,
                        keep_unlabelled=cfg.heads.train_on == "all")
        cache_plan = features.cache_plan(cfg, self.plan.micro_batch_size, self.plan.grad_accum, self.pad_id,
                                         self.rank, self.world_size)
        cached = features.enabled(cfg) and not cfg.lora.enabled
        self.phase = "building the feature cache" if cached else "preparing the batch source"
        self.source: BatchSource = make_source(cfg, self.backbone, self.device, data, self.compute_dtype, cache_plan)

        self.phase = "building the heads"
        heads, self.spec = self._new_heads()
        self.module = self.source.wrap(heads, self.spec, loss_weights(cfg.heads),
                                       vocab_to_local(heads.token_map, self.spec.vocab_size))
        self.phase = "starting the DeepSpeed engine"
        self._build_engine()

        state = {"step": 0, "data": {"epoch": 0, "index": 0}}
        if self.resume_from is not None:
            self.phase = "loading the checkpoint"
            state = checkpoint.load(self.engine, self.resume_from, self.rank)  # its config was checked above
            restored = getattr(self.module.heads, "token_map", None)
            if restored is not None:   # the checkpoint's map, not this start's scan (a newer version may rank
                # the tokens otherwise): targets mapped through the scan's inverse trained each head on a neighbour
                self.module.inv_map = vocab_to_local(restored, self.spec.vocab_size)
            if self.is_main:
                print(f"[medusa-train] resumed from {self.resume_from} at step {state['step']}", flush=True)
            self.checkpointed = (int(state["step"]), Path(self.resume_from))
        self.step = state["step"]
        self.phase = "preparing the data"
        data_state = self._rank_data_state(state)
        if not data_state.pop("keeps_unlabelled", self.resume_from is None):
            data.train_stream.keep_unlabelled = False   # begun under the rule that dropped them: the same stream
        self.batches = self.source.batches(**data_state)
        self.eval_set = self.source.eval_batches()
        self.data_state = self.batches.state()  # position after the last *completed* optimizer step
        self.batch_counts = self.source.stats.batch_counts()  # the padding fraction's counters at that step
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.phase = "starting the logger"
        # A run resumed at (or past) max_steps evaluates at that step again (``run``): an eval record left there by
        # an attempt killed before its export is dropped, not duplicated.
        self.tracker = Tracker(self.output_dir, cfg.logger, self.run_config, t.max_steps, self.step,
                               enabled=self.is_main, progress=t.progress_bar,
                               redo_eval_at_start=self.step >= t.max_steps)
        if self.is_main:
            self._say_setup(heads)

    def _say_setup(self, heads) -> None:
        """The run's one line of what trains on what, where and how; a note when the warm-up outlasts the run."""
        cfg, t = self.cfg, self.cfg.trainer
        n_train = sum(getattr(p, "ds_numel", p.numel()) for p in heads.parameters() if p.requires_grad)
        n_back = self.backbone.parameter_count()
        self.tracker.write(
            f"[medusa-train] backbone {self.backbone.name} ({n_back / 1e6:.1f}M params, "
            f"{self.source.describe()}) on {self.device}; "
            f"{family(self.spec.kind).shape(self.spec)}, projection {self.spec.projection} "
            f"({n_train / 1e6:.2f}M trainable), targets {cfg.heads.targets}; world {self.world_size}, "
            f"micro {self.plan.micro_batch_size}, accum {self.plan.grad_accum}, "
            f"global batch {self.plan.global_batch_size}, ZeRO {t.zero_stage}")
        if cfg.optim.warmup_steps >= t.max_steps > 0:   # a smoke test's short run may mean it; a typo may not
            self.tracker.write(f"note: optim.warmup_steps={cfg.optim.warmup_steps} >= trainer.max_steps="
                               f"{t.max_steps}: the learning rate rises for the whole run and never reaches "
                               f"optim.lr={cfg.optim.lr}")

    def setup_interrupted(self) -> str:
        """The line a Ctrl-C / SIGTERM during ``setup`` stops the run with: where it was, what is kept (the
        checkpoint to resume, a feature cache's complete shards); exit 2 as a stop during training."""
        if self.resume_from is not None:
            done, again = f"nothing was trained since checkpoint {self.resume_from}", "resume"
        else:
            done, again = "nothing was trained", "start"
        kept = features.kept_shards(features.cache_dir(self.cfg)) if features.enabled(self.cfg) else ""
        return (f"interrupted during setup ({self.phase}): {done}{f'; {kept}' if kept else ''}; "
                f"run the same command again to {again}")

    def _accept_data(self, tokenizer) -> None:
        """Refuse data with no training conversation that keeps an assistant token within data.max_length
        (a hub dataset, or a max_length the reader alone cannot judge) before the first write of the run;
        then write the run's record."""
        cached = self.cfg.features.mode == "train" and (features.cache_dir(self.cfg) / features.MANIFEST).is_file()
        if not cached:   # a feature cache already built trains without the source (offline, a hub dataset)
            check_training_data(self.cfg.data, tokenizer)
        self.record()

    def _rank_data_state(self, state: dict) -> dict:
        """This rank's data position in checkpoint ``state`` (its own; under another world size the start of the
        next epoch), and the batch counters behind the logged padding fraction restored with it."""
        data_state, counts = state["data"], state.get("batch_counts_per_rank")
        per_rank = state.get("data_per_rank")
        if per_rank and len(per_rank) == self.world_size:
            data_state = per_rank[self.rank]
        elif per_rank:
            # a position inside an epoch counts micro-batches of another layout of the data over the ranks: applied
            # here it trained some conversations of that epoch twice (fewer processes) or never (more). Ranks with
            # shorter shards may be an epoch ahead: the next epoch after the furthest one any rank has begun
            last = max(int(p.get("epoch", 0)) for p in per_rank)
            begun = any(int(p.get("epoch", 0)) == last and int(p.get("index", 0)) > 0 for p in per_rank)
            data_state = {**per_rank[0], "epoch": last + 1 if begun else last, "index": 0}
            if begun and self.is_main:
                print(f"[medusa-train] resuming with {self.world_size} processes instead of {len(per_rank)}: the "
                      f"saved positions inside epoch {last} count the other layout's micro-batches, so this run "
                      f"starts epoch {last + 1} (the rest of epoch {last} is not trained; no conversation twice)",
                      flush=True)
        if counts:  # checkpoints written before the counters were saved: they restart (as they did)
            self.source.stats.restore_batch_counts(counts[self.rank] if len(counts) == self.world_size else counts[0])
        windows = state.get("log_window_per_rank")   # under another world size (or an older checkpoint): restarts
        self.resumed_window = windows[self.rank] if windows and len(windows) == self.world_size else None
        return data_state

    def _already_exported(self, state: dict) -> bool:
        """True (and ``self.finished`` set) when checkpoint ``state`` reached ``trainer.max_steps`` and its
        heads were exported after it (a complete export no older than the checkpoint): a rerun of a
        finished training then has nothing to do. A run killed between its last checkpoint and the
        end of its export is not finished: it evaluates and exports again."""
        if int(state.get("step", 0)) < self.cfg.trainer.max_steps:
            return False
        heads_dir = self.output_dir / "heads"
        done = False
        if self.is_main:  # one rank looks (and repairs), all follow its answer
            recover_dir(heads_dir)  # an export killed mid-swap: put the previous one back first
            outputs = [heads_dir / f for f in EXPORT_FILES]
            if self.cfg.lora.enabled:   # what after_export writes once the heads are exported
                outputs.append(self.output_dir / DRIFT_FILE)
                if self.cfg.lora.merge:   # its weights (a kill inside an older in-place save left config.json)
                    merged = self.output_dir / "merged"
                    recover_dir(merged)
                    outputs += [merged / "config.json", next((merged / f for f in MERGED_WEIGHTS
                                                              if (merged / f).exists()), merged / MERGED_WEIGHTS[0])]
            try:
                saved_at = (self.resume_from / checkpoint.STATE_FILE).stat().st_mtime
                done = all(p.exists() and p.stat().st_mtime >= saved_at for p in outputs)
            except OSError:
                done = False
        if self.world_size > 1:
            answer = [done]
            dist.broadcast_object_list(answer, src=0)
            done = bool(answer[0])
        if done:
            self.finished = heads_dir
        return done

    def _new_heads(self) -> tuple:
        """Freshly initialised heads (from the backbone's lm_head / embeddings) and their spec."""
        cfg, model = self.cfg, self.backbone.model
        hf_cfg = model.config
        projection, vocab_n = draft_vocabulary(cfg.heads, hf_cfg.vocab_size)
        token_map = None
        if projection == "truncated":   # stage 2 loads stage 1's heads and their token map: no scan for another
            # a placeholder: lora.JointSource.wrap loads stage 1's heads strictly, their token_map buffer too; a
            # resumed run loads the checkpoint's (a scan of the data there took minutes for nothing)
            restored = cfg.lora.init_heads or (self.resume_from is not None
                                               and checkpoint.holds_token_map(self.resume_from))
            token_map = torch.arange(vocab_n) if restored else self._token_map(hf_cfg.vocab_size, vocab_n)
        spec = HeadsSpec(
            num_heads=draft_depth(cfg.heads), num_layers=cfg.heads.num_layers, hidden_size=hf_cfg.hidden_size,
            vocab_size=hf_cfg.vocab_size, projection=projection,
            truncated_vocab_size=vocab_n if token_map is not None else None,
            base_model=self.backbone.name, base_model_fingerprint=backbone_fingerprint(hf_cfg),
            kind=cfg.heads.kind, settings=training_family(cfg.heads.kind).spec_settings(cfg.heads, hf_cfg),
            chat_template_args=check_template_args(getattr(cfg.backbone, "chat_template_args", None),
                                                   "backbone.chat_template_args"))
        # in the dtype the heads compute in: shared heads keep it, and a weight of another dtype was cast again by every
        # head's forward and kept for backward (2.1 GB a head in fp32 at Llama-3.1-8B's vocab); the backbone's own
        # tensor where the dtypes agree (no copy at all); fresh projections copy_ from it
        weight = lm_head_weight(model)
        weight = weight if weight.dtype == self.compute_dtype else weight.to(self.compute_dtype)
        heads = init_heads(spec, weight, model.get_input_embeddings().weight, token_map)
        return heads.to(self.device), spec

    def _token_map(self, vocab_size: int, n: int) -> torch.Tensor:
        """Top-N assistant tokens of the training data, most frequent first, after the tokens that end a reply."""
        d = self.cfg.data
        if n > vocab_size:
            key = training_family(self.cfg.heads.kind).vocabulary_keys(self.cfg.heads)[0]
            raise UserError(f"{key}={n} exceeds the backbone vocabulary ({vocab_size})")
        if self.rank == 0:   # a pass over the data before anything else is printed: say what it is
            print(f"[medusa-train] truncated vocabulary: counting the assistant tokens of up to "
                  f"{d.vocab_scan_conversations} conversations ...", flush=True)
        scan = ConversationStream(d, self.backbone.tokenizer, seed=self.cfg.trainer.seed)
        counts = token_frequencies(scan, vocab_size, d.vocab_scan_conversations)
        # The end of a reply must always be predictable: the template's end of turn (what the labels close a reply
        # with; Llama-3's <|eot_id|>, Gemma's <end_of_turn>, not the tokenizer's eos <|end_of_text|> / <eos>, which
        # no reply holds) and every id decoding stops at. A small vocabulary on little data left it out.
        tokenizer = self.backbone.tokenizer
        ends = set(reply_end_ids(tokenizer)) | set(eos_token_ids(self.backbone.model, tokenizer))
        top = counts.max() + 1
        for end in sorted(e for e in ends if 0 <= e < vocab_size):
            counts[end] = top
        order = torch.argsort(counts, descending=True, stable=True)
        token_map = order[:n].clone()
        coverage = counts[token_map].sum().item() / max(counts.sum().item(), 1)
        if self.rank == 0:
            print(f"[medusa-train] truncated vocabulary: top {n} of {vocab_size} tokens cover "
                  f"{coverage:.1%} of assistant tokens in {scan.stats.conversations} conversations", flush=True)
        return token_map

    def _build_engine(self) -> None:
        import deepspeed   # lazy: after start_process set DS_ACCELERATOR, which deepspeed reads when imported

        t, o = self.cfg.trainer, self.cfg.optim
        ds_cfg = deepspeed_config(t, self.plan)
        check_consistent(ds_cfg)
        optimizer = torch.optim.AdamW(self.source.param_groups(o.lr), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                      weight_decay=o.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, t.max_steps, o))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=self.module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_cfg,
            dist_init_required=False)

    # -- train -------------------------------------------------------------------------
    def loss(self, batch: dict) -> torch.Tensor:
        """The engine's loss on one micro-batch, as the batch source computes it."""
        return self.source.loss(self.engine, batch, self.step)

    def train(self) -> None:
        t = self.cfg.trainer
        metrics = HeadMetrics(self.spec.num_heads)
        self.module.metrics, self.window_loss = metrics, 0.0
        if self.resumed_window:   # the checkpoint's logging window: the next record spans it as it would have
            metrics.restore(self.resumed_window["metrics"])
            self.window_loss = self.resumed_window["loss_sum"]
            self.window_tokens = self.resumed_window.get("tokens", 0)   # absent from checkpoints before it was kept
        it = iter(self.batches)
        rate_from, window_start = self.window_tokens, time.perf_counter()   # tokens/s: this process's time only
        self.engine.train()
        while self.step < t.max_steps:
            # Here, between complete steps, the step counter, data position and engine agree: the only place a
            # Ctrl-C / SIGTERM (``Interrupts``) stops training, so its checkpoint is exactly this step's.
            if self._stop_requested():
                self._stop()
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
                self.window_tokens += int((batch["doc_ids"] > 0).sum())
            if grad_norm is None:
                norm = self.engine.get_global_grad_norm()
                grad_norm = float(norm) if norm is not None else float("nan")
            self.step += 1
            self.data_state = self.batches.state()
            self.batch_counts = self.source.stats.batch_counts()
            self.window_loss += step_loss
            if self.tracker:
                self.tracker.advance()
            if self.step % t.log_every == 0 or self.step == t.max_steps:
                record = self._window_record(metrics, rate_from, time.perf_counter() - window_start, grad_norm)
                self.tracker.log(self.step, record)
                metrics.reset()
                self.window_tokens, rate_from, window_start, self.window_loss = 0, 0, time.perf_counter(), 0.0
            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps:
                paused = time.perf_counter()
                self.evaluate()
                window_start += time.perf_counter() - paused  # tokens/s counts training time only
            if t.save_every and self.step % t.save_every == 0 and self.step < t.max_steps:
                paused = time.perf_counter()
                self.save_checkpoint()
                window_start += time.perf_counter() - paused
        self.save_checkpoint()

    def _window_record(self, metrics: HeadMetrics, rate_from: int, elapsed: float, grad_norm: float) -> dict:
        """The logging window's record over every rank's micro-batches: each sum added over the ranks (collective),
        since one rank's loss and accuracies are its shard's only, and its tokens are not the others' when shards
        differ in length. ``rate_from``: the window's tokens trained before this process started (a resume's)."""
        stats = self.source.stats
        sums = [self.window_loss, self.window_tokens, self.window_tokens - rate_from, stats.tokens, stats.padding,
                *metrics.as_sums()]
        if self.world_size > 1:
            total = torch.tensor(sums, dtype=torch.float64, device=self.device)
            dist.all_reduce(total)
            sums = total.tolist()
        loss_sum, tokens, timed_tokens, real, padding = sums[:5]
        window = metrics.from_sums(sums[5:])
        steps = window.batches / (self.plan.grad_accum * self.world_size)
        return {"loss": loss_sum / self.world_size / max(steps, 1), **window.summary(), "tokens": int(tokens),
                "tokens_per_s": timed_tokens / max(elapsed, 1e-9), "lr": self.scheduler.get_last_lr()[0],
                "grad_norm": grad_norm, "padding_fraction": padding / (real + padding) if real + padding else 0.0,
                **self.module.last_parts}

    def _stop_requested(self) -> bool:
        """Whether a stop was asked (SIGINT/SIGTERM) on any rank: every rank then stops after the same step."""
        stop = self.interrupts.requested is not None
        if self.world_size > 1:  # a signal may reach one rank only (a scheduler's), or the ranks at other steps
            flag = torch.tensor([1.0 if stop else 0.0], device=self.device)
            dist.all_reduce(flag)
            stop = flag.item() > 0
        return stop

    def _stop(self):
        """Stop training at the step boundary: checkpoint this step (unless it is already) and say so in one line."""
        if self.checkpointed is not None and self.checkpointed[0] == self.step:
            path = self.checkpointed[1]
        elif self.step == 0:
            raise UserError("interrupted before the first step; nothing was trained or saved; run the same command "
                            "again to start")
        else:
            path = self.save_checkpoint()
        self.stopped_together = True
        # trainer.resume=never would start over on the same command
        again = ("rerun with trainer.resume=auto to resume" if self.cfg.trainer.resume == "never"
                 else "run the same command again to resume")
        raise UserError(f"interrupted at step {self.step}; checkpoint saved to {path}; {again}")

    def _check_finite(self, loss: torch.Tensor) -> None:
        # on the loss's device: NCCL reduces CUDA tensors only (a CPU one fails on every multi-GPU step)
        bad = torch.tensor([0.0 if torch.isfinite(loss.detach()).all() else 1.0], device=loss.device)
        if self.world_size > 1:
            dist.all_reduce(bad)  # every rank stops together, none is left waiting
        if bad.item() > 0:
            last = checkpoint.find_resume(self.output_dir, "auto")
            keep = f"last good checkpoint kept: {last}" if last else "no checkpoint was written yet"
            raise UserError(f"loss became NaN/inf at step {self.step + 1}; training stopped ({keep}). "
                            "Try trainer.precision=fp32 (resumes from it), or a lower optim.lr in a new output_dir")

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Per-head loss and accuracies on the held-out batches (the same on every rank): each rank evaluates
        every world_size-th of them and the sums are added over the ranks, so N ranks take 1/N of the time and
        log what one rank evaluating all of them logs. Every rank runs as many forwards as the first (ZeRO-3
        gathers the partitioned parameters in each, collectively): one short of a batch repeats one uncounted."""
        metrics, uncounted = HeadMetrics(self.spec.num_heads), HeadMetrics(self.spec.num_heads)
        previous = self.module.metrics
        mine = self.eval_set[self.rank::self.world_size]
        rounds = -(-len(self.eval_set) // self.world_size)
        self.engine.eval()
        loss_sum = 0.0
        for i in range(rounds):
            self.module.metrics = metrics if i < len(mine) else uncounted
            loss = self.loss(mine[i] if i < len(mine) else self.eval_set[0])
            if i < len(mine):
                loss_sum += float(loss)
                metrics.batches += 1
        self.engine.train()
        self.module.metrics = previous
        if self.world_size > 1:
            total = torch.tensor([loss_sum, *metrics.as_sums()], dtype=torch.float64, device=self.device)
            dist.all_reduce(total)
            loss_sum, metrics = total[0].item(), metrics.from_sums(total[1:].tolist())
        if not any(metrics.count):
            # No held-out target token: every number would be 0/1 of nothing (loss 0, top-1 0, tau 1 logged as
            # real). Nothing is logged; one warning says why, once per run.
            if self.is_main and not self.eval_empty_warned:
                self.eval_empty_warned = True
                self._write(f"[medusa-train] warning: {empty_eval_reason(self.cfg.data)}; no held-out metrics are "
                            "logged")
            return {}
        # the accuracies are against the training targets (dataset or backbone greedy tokens): say which
        summary = {"loss": loss_sum / max(metrics.batches, 1), **metrics.summary(), "targets": self.cfg.heads.targets}
        if self.tracker:
            self.tracker.log(self.step, summary, phase="eval")
        return summary

    def _write(self, line: str) -> None:
        if self.tracker:
            self.tracker.write(line)
        else:
            print(line, flush=True)

    def save_checkpoint(self) -> Path:
        # Each rank reads its own shard, so each has its own data position; an interrupted
        # step's micro-batches are not counted (the resumed run redoes that step whole), in the data
        # position nor in the padding fraction's counters.
        metrics = getattr(self.module, "metrics", None)
        window = ({"loss_sum": self.window_loss, "metrics": metrics.state(), "tokens": self.window_tokens}
                  if metrics is not None else None)
        mine = (self.data_state, self.batch_counts, window)
        per_rank = [mine]
        if self.world_size > 1:
            per_rank = [None] * self.world_size
            dist.all_gather_object(per_rank, mine)
        data_per_rank = [data for data, _, _ in per_rank]
        state = {"step": self.step, "data": data_per_rank[0], "data_per_rank": data_per_rank,
                 "batch_counts_per_rank": [counts for _, counts, _ in per_rank], "heads": self.spec.to_dict(),
                 "log_window_per_rank": [window for _, _, window in per_rank],
                 "world_size": self.world_size, "global_batch_size": self.plan.global_batch_size,
                 "config": self.run_config,  # compared with the next run's on resume (checkpoint docstring)
                 "data_fingerprint": self.data_fingerprint}  # and what the data held (check_resume_data)
        path = checkpoint.save(self.engine, self.output_dir, self.step, state, self.cfg.trainer.keep_last, self.rank)
        self.checkpointed = (self.step, path)
        return path

    # -- export ------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 head weights gathered from any ZeRO stage (master weights under bf16/fp16)."""
        heads = self.engine.module.heads
        out = {name: checkpoint.full_fp32(p).contiguous() for name, p in heads.named_parameters()}
        for name, b in heads.named_buffers():
            if name in heads.state_dict():
                out[name] = b.detach().cpu().contiguous()
        return out

    def export(self) -> Path | None:
        state = self.full_state_dict()  # collective under ZeRO-3: every rank takes part
        extra = self.source.export_extra(self.engine)  # collective too (Medusa-2's adapter)
        heads_dir = None
        if self.is_main:
            heads_dir = save_heads(self.engine.module.heads, self.output_dir / "heads", state_dict=state, extra=extra)
        # Every rank: Medusa-2's drift forwards and merge gather ZeRO-3 partitions (collectives); main writes.
        self.source.after_export(self.output_dir, write=self.is_main)
        return heads_dir

    def cleanup(self, plot: bool = True) -> Path | None:
        png = None
        if self.tracker:
            png = self.tracker.close(self.output_dir / "training_curves.png" if plot else None)
        return png


class Interrupts:
    """Ctrl-C (SIGINT) and SIGTERM (a scheduler's preemption) while ``run`` trains (during ``setup``, before it,
    ``distributed.stop_on_signals`` stops at once: there is no step to finish nor anything to save).

    During training the first one only records the request (``requested``): ``MedusaTrainer.train`` stops
    between two complete steps, where step counter, data position and engine agree, and saves that step's
    checkpoint. A KeyboardInterrupt raised at the signal itself could land between ``engine.step()`` and the step
    counter and save an off-by-one checkpoint. A further Ctrl-C stops at once, without a checkpoint (the last one
    stays the resume point); a further SIGTERM changes nothing: the DeepSpeed launcher sends every rank one right
    after the terminal's SIGINT. Once training is over (``finishing``: final evaluation and export, the training
    already checkpointed) any of them stops at once."""

    def __init__(self, announce: bool = False):
        self.announce = announce  # one process tells the user that the stop is on its way
        self.requested: int | None = None
        self.immediate = False
        self.previous: dict = {}

    def install(self) -> None:
        self.previous.update(swap_handlers(self.handle))

    def restore(self) -> None:
        restore_handlers(self.previous)
        self.previous.clear()

    def finishing(self) -> None:
        self.immediate = True

    def handle(self, signum, frame) -> None:
        if self.immediate or (self.requested is not None and signum == signal.SIGINT):
            raise KeyboardInterrupt
        if self.requested is None and self.announce:
            # os.write, not print: a handler may run in the middle of a print to the same stream
            os.write(2, f"\n[medusa-train] {signal.Signals(signum).name}: stopping after the current step to save a "
                        "checkpoint (Ctrl-C again stops at once, without it)\n".encode())
        self.requested = signum


def empty_eval_reason(data) -> str:
    return (f"the held-out split is empty: none of the first {data.eval_conversations} conversations "
            f"(data.eval_conversations) has a token to predict within data.max_length={data.max_length}")


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
    if "chain_tau" in summary:   # what a top-1 chain accepts, position by position (the heads' errors correlate)
        lines.append(f"chain tau (1 + top-1 heads right in a row, per position): {summary['chain_tau']:.3f}")
    return "\n".join(lines)


def _last_checkpoint(trainer: MedusaTrainer) -> str:
    try:
        last = checkpoint.find_resume(trainer.output_dir, trainer.cfg.trainer.resume)
    except UserError:
        last = None
    return str(last) if last is not None else "none: it starts over"


def run(cfg, record: Callable[[], None] | None = None) -> dict:
    """The whole recipe: returns the final eval summary (rank 0) for callers and tests. ``record`` writes the
    run's record once the data is accepted (``MedusaTrainer``)."""
    trainer = MedusaTrainer(cfg, record)
    interrupts = trainer.interrupts
    interrupts.install()  # every rank: a Ctrl-C reaches them all, a scheduler's SIGTERM perhaps only some
    try:
        # Nothing to finish or save before the first step: a signal stops setup at once, in one line (the run's
        # handlers above take over once setup is done: a signal after it stops training before its first step).
        with stop_on_signals(trainer.setup_interrupted):
            trainer.setup()
    except BaseException:
        interrupts.restore()
        trainer.cleanup(plot=False)  # the logger, when setup got that far
        raise
    if trainer.finished is not None:  # a rerun of a complete training: say so, touch nothing
        interrupts.restore()
        if trainer.is_main:
            print(f"[medusa-train] already trained to step {trainer.step}/{cfg.trainer.max_steps}; nothing to do "
                  f"(heads in {trainer.finished})", flush=True)
        _leave_process_group(trainer.world_size)
        return {"step": trainer.step, "already_trained": True}
    interrupts.announce = trainer.is_main  # one process tells the user that the stop is on its way
    summary: dict = {}
    try:
        try:
            if trainer.step < cfg.trainer.max_steps:
                trainer.train()  # a Ctrl-C / SIGTERM: it checkpoints the step reached and says so (UserError)
        except KeyboardInterrupt:  # a second Ctrl-C: at once, wherever the step was, so nothing is saved
            raise UserError(f"interrupted again: stopped at once at step {trainer.step}, saving nothing; run the same "
                            f"command again to resume from the last checkpoint ({_last_checkpoint(trainer)})") from None
        interrupts.finishing()  # the training is checkpointed: from here a signal stops at once
        try:
            if interrupts.requested is not None:  # arrived while the last checkpoint was being written
                raise KeyboardInterrupt
            if trainer.is_main:   # minutes on a large backbone: not a silent, finished-looking progress bar
                trainer._write(f"[medusa-train] final evaluation on {len(trainer.eval_set)} held-out batch(es), "
                               "then the export ...")
            summary = trainer.evaluate()
            heads_dir = trainer.export()
            read, stats = trainer.source.data_counts()   # collective with 2+ ranks: every rank is here
        except KeyboardInterrupt:
            raise UserError(f"interrupted after training, during the final evaluation or export (checkpoint "
                            f"{_last_checkpoint(trainer)}); run the same command again to finish them") from None
        if trainer.is_main:
            if summary:
                trainer.tracker.write("\n" + format_accuracy_table(summary, trainer.spec.num_heads))
            else:
                trainer.tracker.write(f"\nno held-out accuracy: {empty_eval_reason(cfg.data)}")
            trainer.tracker.write(f"data: {read.summary()}; {tokenized_line(stats, cfg.data, cfg.heads.train_on)}")
            trainer.tracker.write(f"heads exported to {heads_dir}")
    finally:
        interrupts.restore()
        png = trainer.cleanup()
        if trainer.stopped_together:
            # every rank is here: rank 0 has written its curves before any rank exits (the launcher ends the
            # others as soon as one exits with an error)
            _leave_process_group(trainer.world_size)
    if trainer.is_main and png:
        print(f"curves: {png}", flush=True)
    _leave_process_group(trainer.world_size)
    summary["step"] = trainer.step
    return summary


def tokenized_line(stats, data, train_on: str = "assistant") -> str:
    """What tokenising the training conversations kept and lost, for the run's summary line."""
    lost = [f"{stats.truncated} truncated to {data.max_length} tokens"]
    if stats.no_labels:   # gone from training: a prompt that fills max_length, or no reply to learn from
        lost.append(f"{stats.no_labels} more dropped with no reply token to train on (a prompt filling "
                    f"{data.max_length} tokens, a reply to no user turn, or one the template rewrote)")
    if stats.unlabelled:   # kept by a train_on=all stream; a default run reading its feature cache trains none of it
        why = ("trained on their other positions: heads.train_on=all" if train_on == "all" else
               "no label in this run: the feature cache keeps them for heads.train_on=all")
        lost.append(f"{stats.unlabelled} kept with no reply token within {data.max_length} tokens ({why})")
    if stats.unlocated_replies:
        lost.append(f"{stats.unlocated_replies} replies left unlabelled: the chat template rewrote them")
    return (f"this run tokenized {stats.conversations} conversations ({'; '.join(lost)}), "
            f"padding {stats.padding_fraction:.1%} of batch tokens")


def _leave_process_group(world_size: int) -> None:
    """Leave the process group before the interpreter exits: gloo's threads torn down by static
    destructors instead sometimes abort a rank ("terminate called without an active exception",
    exit 250) after a run that succeeded. Success path only: a rank that failed must not wait at
    a barrier its peers never reach."""
    if world_size > 1:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
