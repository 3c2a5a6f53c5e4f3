"""Medusa-2: the backbone fine-tuned jointly with its heads through a LoRA adapter (``peft``).

Medusa-1 freezes the backbone, so the heads chase a distribution they cannot change. Medusa-2
(arXiv 2401.10774, sec. 2.3.2) trains a LoRA adapter on the backbone together with the heads:

    loss = backbone_weight * L_backbone + c(step) * sum_k lambda_k CE_k(heads)

L_backbone is ``kl`` (default): KL(teacher || student) on the assistant tokens, the teacher
being the *same* model with the adapter disabled (``peft``'s ``disable_adapter``: no second
copy of the weights in memory), which keeps the fine-tuned backbone close to the original
(self-distillation, the paper's recipe when the original training data is unavailable); or
``ce``: cross-entropy on the data's labels. c(step) warms up linearly from 0 to
``heads_coefficient`` over ``heads_warmup_steps`` (fresh heads' large gradients would
otherwise wreck the backbone early on); heads get their own learning rate
(``optim.lr * heads_lr_multiplier``). Two-stage recipe: train heads alone first
(``medusa1_*``), then start this one from them with ``lora.init_heads=<heads export>``.

Export (``save_adapter``): the heads directory as for Medusa-1 with ``backbone_adapter:
"adapter"`` in its config, plus ``heads/adapter/`` in peft format (``adapter_config.json`` +
``adapter_model.safetensors``) and, with ``lora.merge=true``, ``<output_dir>/merged/``: the
full backbone with the adapter merged in (safetensors + tokenizer). The runtime applies the
adapter itself (``inference/runtime/adapter.py``, no peft needed) or loads the merged model.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F
from safetensors.torch import save_file

from inference.backbone import decoder_body, lm_head_weight, logit_scaling, scale_logits
from inference.cli_support import enum_value
from inference.errors import UserError
from inference.heads.native import make_temp_dir, open_permissions, release_temp_dir, swap_dir_into_place
from inference.heads.registry import family, setting_names
from inference.loading import load_heads

from .checkpoint import full_fp32
from .data.masks import attention_mask, block_causal_mask
from .data.tokenize import IGNORE
from .losses import heads_loss, vocab_to_local
from .manifest import write_text_atomic

ADAPTER_DIR = "adapter"


def apply_lora(model, lcfg, heads_share_lm_head: bool = False):
    """Wrap ``model`` with a fresh LoRA adapter; base weights stay frozen. Returns the peft model.
    ``heads_share_lm_head``: the heads project through the backbone's own lm_head (``heads.projection=shared``)."""
    from peft import LoraConfig as PeftLoraConfig, get_peft_model   # lazy: 3 s to import, for LoRA runs only

    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = [t for t in lcfg.target_modules if t not in names]
    if missing:
        raise UserError(f"lora.target_modules {missing} are not linear layers of this backbone "
                        f"(it has: {', '.join(sorted(names))})")
    emb = model.get_input_embeddings()
    tied = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and emb is not None and m.weight is emb.weight}
    if tied & set(lcfg.target_modules):
        # its merge adds the change into the one tensor the input embedding shares: the merged model (and the
        # runtime's merge) is not the model trained, and the heads' shared projection moves with it
        raise UserError(f"lora.target_modules {sorted(tied & set(lcfg.target_modules))}: this backbone ties that "
                        "layer's weight to its input embedding, so no adapter on it can be merged; leave it out")
    out = model.get_output_embeddings()
    adapted_out = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if out is not None and m is out}
                         & set(lcfg.target_modules))
    if heads_share_lm_head and adapted_out:
        # the loss hands the heads the layer's base weight (peft's ``.weight``), while decoding, the merge and the
        # engines' exports give them the merged one: trained on one lm_head, decoded on another
        raise UserError(f"lora.target_modules {adapted_out}: heads.projection=shared projects the heads through "
                        "that layer, which the adapter would change under them; leave it out of "
                        "lora.target_modules, or give the heads their own (heads.projection=own or truncated)")
    peft_cfg = PeftLoraConfig(r=lcfg.r, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout,
                              target_modules=list(lcfg.target_modules), bias="none", task_type="CAUSAL_LM")
    for p in model.parameters():
        p.requires_grad_(False)
    peft_model = get_peft_model(model, peft_cfg)
    peft_model.train()  # LoRA dropout on; the backbone has no other dropout in Llama-style models
    if lcfg.gradient_checkpointing and getattr(model, "supports_gradient_checkpointing", False):
        # non-reentrant: no input needs requires_grad, and the recompute replays the same dropout (RNG kept).
        # the method's new name (transformers 5.25, where the old one warns); 5.17 has the old one only
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return peft_model


def heads_coefficient(step: int, lcfg) -> float:
    """c(step): linear warm-up from 0 to ``heads_coefficient`` over ``heads_warmup_steps``."""
    if lcfg.heads_warmup_steps <= 0:
        return lcfg.heads_coefficient
    return lcfg.heads_coefficient * min(1.0, (step + 1) / lcfg.heads_warmup_steps)


class JointWithLoss(nn.Module):
    """What the DeepSpeed engine wraps in Medusa-2: the LoRA backbone, the heads, the joint loss.

    ``forward(input_ids, position_ids, attention_mask, labels, doc_ids)`` runs the backbone with
    gradients (through the adapter only), the teacher without the adapter under ``no_grad``,
    and returns the total loss; the parts are left in ``last_parts`` for logging.
    """

    def __init__(self, peft_model, body, lm_head: nn.Module, heads, weights: list[float], inv_map,
                 lcfg, teacher_weight: float = 0.0, feature_noise: float = 0.0, scaling: tuple = (None, None)):
        super().__init__()
        self.feature_noise = feature_noise
        # The backbone's logit scale / soft-cap after its lm_head (``backbone_inputs.logit_scaling``): the KL / CE
        # must be on the distribution the tuned model samples from, not on the raw lm_head product.
        self.scaling = scaling
        self.peft_model = peft_model
        self.heads = heads
        self.weights = weights
        self.inv_map = inv_map
        self.lcfg = lcfg
        self.teacher_weight = teacher_weight
        self.step = 0
        self.metrics = None
        self.last_parts: dict[str, float] = {}
        # Plain attributes (not submodules): reached through peft_model already; registering
        # them twice would list their parameters twice.
        self.__dict__["body"] = body
        self.__dict__["lm_head"] = lm_head

    def forward(self, input_ids, position_ids, attention_mask, labels, doc_ids):
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False).last_hidden_state
        # Positions t whose next token is an assistant token of the same conversation.
        nxt = torch.full_like(labels, IGNORE)
        nxt[:, :-1] = labels[:, 1:]
        same = torch.zeros_like(labels, dtype=torch.bool)
        same[:, :-1] = (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, :-1] > 0)
        where = (nxt != IGNORE) & same
        student = scale_logits(self.lm_head(hidden[where]).float(), *self.scaling)
        if self.lcfg.backbone_loss == "kl":
            with torch.no_grad(), self.peft_model.disable_adapter():
                t_hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                     use_cache=False).last_hidden_state
                teacher = torch.log_softmax(scale_logits(self.lm_head(t_hidden[where]).float(), *self.scaling), dim=-1)
            backbone = F.kl_div(torch.log_softmax(student, dim=-1), teacher, log_target=True,
                                reduction="batchmean") if student.shape[0] else student.sum() * 0.0
        else:
            backbone = F.cross_entropy(student, nxt[where]) if student.shape[0] else student.sum() * 0.0
        heads = heads_loss(self.heads, hidden, labels, doc_ids, self.weights, self.inv_map, self.metrics,
                           input_ids=input_ids, teacher_weight=self.teacher_weight,
                           lm_head_weight=self.lm_head.weight, feature_noise=self.feature_noise,
                           logit_scaling=self.scaling)
        c = heads_coefficient(self.step, self.lcfg)
        self.last_parts = {"backbone_loss": float(backbone.detach()), "heads_loss": float(heads.detach()),
                           "heads_coefficient": c}
        return self.lcfg.backbone_weight * backbone + c * heads


def param_groups(module: JointWithLoss, lr: float, heads_multiplier: float) -> list[dict]:
    """LoRA parameters at ``lr``, head parameters at ``lr * heads_multiplier``."""
    head_ids = {id(p) for p in module.heads.parameters()}
    lora = [p for p in module.peft_model.parameters() if p.requires_grad and id(p) not in head_ids]
    heads = [p for p in module.heads.parameters() if p.requires_grad]
    return [{"params": lora, "lr": lr, "name": "lora"}, {"params": heads, "lr": lr * heads_multiplier, "name": "heads"}]


def adapter_state(peft_model, full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors in peft's file naming, from a gathered ``{name: tensor}`` of the joint
    module (``peft_model.<peft name>``); peft drops the adapter name ("default") on save."""
    out = {}
    for name, t in full_state.items():
        if not name.startswith("peft_model.") or "lora_" not in name:
            continue
        key = name.removeprefix("peft_model.").replace(".default.", ".")
        out[key] = t.detach().cpu().contiguous()
    return out


def save_adapter(peft_model, tensors: dict[str, torch.Tensor], out_dir: Path, base_model: str) -> Path:
    """peft-format adapter dir (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = peft_model.peft_config["default"].to_dict()
    cfg["base_model_name_or_path"] = base_model
    for k, v in list(cfg.items()):
        if isinstance(v, set):
            cfg[k] = sorted(v)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out_dir / "adapter_config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")
    return out_dir


def save_merged(peft_model, tokenizer, out_dir: Path, write: bool = True,
                adapter_fp32: Optional[dict[str, torch.Tensor]] = None) -> Optional[Path]:
    """The backbone with the adapter merged in, as a full-precision (fp32) transformers model directory: merged in
    fp32 from ``adapter_fp32`` (the adapter's fp32 master weights, ``export_extra``'s, by the engine's parameter
    names), not from the live bf16 copy (a bf16 merge rounded ~15% of each layer's change away).

    Collective under ZeRO-3 (every rank calls it: its parameters are gathered whole); ``write`` is false off the
    main process, which then writes nothing and gets None."""
    if any(hasattr(p, "ds_id") for p in peft_model.parameters()):
        # ZeRO-3 leaves each parameter an empty shard whose data DeepSpeed's hooks fetch: a deep copy would merge
        # and save those empty shards, so the merge runs on an unpartitioned replica of the gathered weights.
        merged = _gathered_replica(peft_model, keep=write)
    else:
        merged = copy.deepcopy(peft_model) if write else None  # the live model keeps its adapter unmerged
    if merged is None:
        return None
    merged = merged.float()
    if adapter_fp32:
        masters = {name.removeprefix("peft_model."): t for name, t in adapter_fp32.items()}
        unknown = [k for k in masters if k not in merged.state_dict()]
        if unknown:   # every master must land on its layer: a renamed one would merge the bf16 copy, silently
            raise RuntimeError(f"the adapter's fp32 weights do not fit the model to merge: {unknown[:3]}")
        merged.load_state_dict(masters, strict=False)
    merged = merged.merge_and_unload()
    _drop_gguf_marking(merged)
    # written whole beside ``out_dir`` and swapped in, as heads/ is: a kill mid-write left a partial (or empty)
    # merged/ that a finished run's rerun took for done, and that the export then pointed engines at
    out_dir = Path(out_dir)
    tmp = make_temp_dir(out_dir)
    try:
        merged.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        open_permissions(tmp)
        swap_dir_into_place(tmp, out_dir)
    finally:
        release_temp_dir(tmp)
    return out_dir


def _gathered_replica(peft_model, keep: bool):
    """A CPU copy of ``peft_model`` (base model and LoRA layers) holding every parameter whole, built from its
    ZeRO-3 partitions one parameter at a time (collective: every rank gathers; None where ``keep`` is false)."""
    import deepspeed   # lazy: deepspeed takes 0.5 s to import, and only a ZeRO-3 merge gathers
    from peft import get_peft_model   # lazy: as in apply_lora
    try:   # lazy: transformers takes 1.3 s to import; the module moved in transformers 5
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights

    state, seen = {}, {}
    # Every rank walks the parameters in the same order: each gather is a collective. Tied weights (one
    # parameter under two names) are gathered once and keep sharing one tensor.
    for name, p in peft_model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                seen[id(p)] = p.detach().cpu().clone() if keep else None
        state[name] = seen[id(p)]
    if not keep:
        return None
    for name, b in peft_model.state_dict().items():  # buffers: never partitioned
        state.setdefault(name, b.detach().cpu().clone())
    base = peft_model.get_base_model()
    with no_init_weights():  # every weight is assigned from the gathered state right after
        replica = type(base)(copy.deepcopy(base.config))
    # a model built from its config derives a generation config from config.json alone: the checkpoint's own (its
    # list of end ids, Llama-3's <|eot_id|> among them; its sampling defaults) would not be saved with the merge
    replica.generation_config = copy.deepcopy(base.generation_config)
    replica = get_peft_model(replica, copy.deepcopy(peft_model.peft_config["default"]))
    # assign: the replica takes the gathered tensors themselves (their dtype, no second copy in memory)
    replica.load_state_dict(state, strict=True, assign=True)
    replica.get_base_model().tie_weights()
    return replica.eval()


def _drop_gguf_marking(model) -> None:
    """Forget a GGUF origin whose weights are plain floats (the ``embedded:`` backbone's cached conversion keeps
    ``quantization_config: gguf`` in its config.json): transformers would refuse to save the merged model, or
    write a config that claims a quantization its dequantized weights do not have."""
    qcfg = getattr(model.config, "quantization_config", None)
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else getattr(qcfg, "quant_method", None)
    if str(getattr(method, "value", method)) != "gguf":
        return
    if not all(p.dtype.is_floating_point for p in model.parameters()):
        return  # still in GGUF blocks: transformers' own refusal to save stands
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)  # its attributes on the model, and the config's entry
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


MERGED_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")   # save_pretrained's, one or sharded
DRIFT_FILE = "drift.json"   # written after the heads export: a finished run's rerun checks it is there


@torch.no_grad()
def drift(peft_model, body, lm_head, batches, device, scaling: tuple = (None, None)) -> dict:
    """Held-out perplexity with and without the adapter, and how often their argmax agrees (``scaling``: the
    backbone's logit scale / soft-cap, ``JointWithLoss``)."""
    sums = {"nll_tuned": 0.0, "nll_base": 0.0, "agree": 0, "n": 0}
    was_training = peft_model.training
    peft_model.eval()
    for batch in batches:
        ids, pos, doc = batch["input_ids"].to(device), batch["position_ids"].to(device), batch["doc_ids"].to(device)
        labels = batch["labels"].to(device)
        mask = block_causal_mask(doc, lm_head.weight.dtype)
        nxt = torch.full_like(labels, IGNORE)
        nxt[:, :-1] = labels[:, 1:]
        where = nxt != IGNORE
        if not bool(where.any()):
            continue
        tuned = lm_head(body(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state[where]).float()
        with peft_model.disable_adapter():
            base = lm_head(body(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state[where]).float()
        tuned, base = scale_logits(tuned, *scaling), scale_logits(base, *scaling)
        tgt = nxt[where]
        sums["nll_tuned"] += float(F.cross_entropy(tuned, tgt, reduction="sum"))
        sums["nll_base"] += float(F.cross_entropy(base, tgt, reduction="sum"))
        sums["agree"] += int((tuned.argmax(-1) == base.argmax(-1)).sum())
        sums["n"] += int(tgt.numel())
    if was_training:
        peft_model.train()
    n = sums["n"]
    if not n:   # no held-out token (an empty held-out split): nothing measured, not a perplexity of 1
        return {"heldout_tokens": 0, "perplexity_base": None, "perplexity_tuned": None, "argmax_agreement": None}
    return {"heldout_tokens": n, "perplexity_base": math.exp(sums["nll_base"] / n),
            "perplexity_tuned": math.exp(sums["nll_tuned"] / n), "argmax_agreement": sums["agree"] / n}


class JointSource:
    """The Medusa-2 batch source (``sources.BatchSource``): this rank's online stream, the LoRA backbone
    and the heads in one module, the joint loss. The adapter is applied at construction, before the
    heads are made (the trainer's order, so a seed gives the same initial weights)."""

    def __init__(self, cfg, backbone, device: torch.device, data):
        self.cfg, self.backbone, self.device, self.data = cfg, backbone, device, data
        self.stats, self.read_stats = data.stats, data.read_stats
        self.peft_model = apply_lora(backbone.model, cfg.lora,
                                     heads_share_lm_head=enum_value(cfg.heads.projection) == "shared")
        self.body = decoder_body(self.peft_model.get_base_model())
        self.adapter_fp32: Optional[dict[str, torch.Tensor]] = None   # set by export_extra: what the merge reads

    def wrap(self, heads, spec, weights, inv_map) -> nn.Module:
        model = self.backbone.model
        spec.backbone_adapter = ADAPTER_DIR
        init_heads_from(heads, self.cfg.lora.init_heads, lm_head_weight(model), model.get_input_embeddings().weight)
        if self.cfg.lora.init_heads and getattr(heads, "token_map", None) is not None:
            # Stage 1's heads bring their own token map: this run's scan (other data, another max_length) may order
            # the top-N differently, and targets mapped through its inverse would train each head on wrong tokens.
            inv_map = vocab_to_local(heads.token_map, spec.vocab_size)
        self.module = JointWithLoss(self.peft_model, self.body, model.get_output_embeddings(), heads, weights,
                                    inv_map, self.cfg.lora, self.cfg.heads.teacher_weight,
                                    self.cfg.heads.feature_noise, logit_scaling(model))
        return self.module

    def param_groups(self, lr: float) -> list[dict]:
        return param_groups(self.module, lr, self.cfg.lora.heads_lr_multiplier)

    def describe(self) -> str:
        n_lora = sum(getattr(p, "ds_numel", p.numel()) for p in self.peft_model.parameters() if p.requires_grad)
        return f"LoRA r={self.cfg.lora.r}: {n_lora / 1e6:.2f}M adapter parameters train"

    def batches(self, epoch: int = 0, index: int = 0):
        return self.data.batches(epoch, index)

    def eval_batches(self) -> list[dict]:
        return self.data.eval_batches()

    def data_counts(self):
        return self.data.run_counts()

    def loss(self, engine, batch: dict, step: int) -> torch.Tensor:
        dev = self.device
        ids, labels, doc = batch["input_ids"].to(dev), batch["labels"].to(dev), batch["doc_ids"].to(dev)
        self.module.step = step  # the heads-loss coefficient's warm-up
        mask = attention_mask(doc, self.cfg.data.packing, self.backbone.model.dtype)
        return engine(ids, batch["position_ids"].to(dev), mask, labels, doc)

    def export_extra(self, engine):
        """Gather the adapter (collective: every rank calls this) and return the writer of
        ``heads/adapter/`` for ``save_heads`` (None off the main process)."""
        gathered = {name: full_fp32(p) for name, p in engine.module.named_parameters()
                    if p.requires_grad and name.startswith("peft_model.")}
        self.adapter_fp32 = gathered   # the merge (``after_export``) starts from these, not the live bf16 copy
        tensors = adapter_state(self.peft_model, gathered)

        def write(tmp: Path) -> None:
            save_adapter(self.peft_model, tensors, tmp / ADAPTER_DIR, self.backbone.name)

        return write

    def after_export(self, output_dir: Path, write: bool = True) -> None:
        """How far the backbone drifted (held-out perplexity with / without the adapter) and, with
        ``lora.merge=true``, the merged backbone. Every rank calls this: under ZeRO-3 the forward passes and the
        merge gather partitioned parameters (collectives; the held-out batches are the same on every rank);
        files and messages come from the ``write`` rank only."""
        if not write and not any(hasattr(p, "ds_id") for p in self.peft_model.parameters()):
            return   # only ZeRO-3's partitioned forwards and merge need every rank (collectives)
        report = drift(self.peft_model, self.body, self.backbone.model.get_output_embeddings(),
                       self.eval_batches(), self.device, logit_scaling(self.backbone.model))
        if write:
            write_text_atomic(output_dir / DRIFT_FILE, json.dumps(report, indent=2) + "\n")
            if report["heldout_tokens"]:
                print(f"backbone drift on {report['heldout_tokens']} held-out tokens: perplexity "
                      f"{report['perplexity_base']:.3f} -> {report['perplexity_tuned']:.3f}, argmax agreement "
                      f"{report['argmax_agreement']:.1%}", flush=True)
            else:
                print("backbone drift not measured: the held-out split has no token to predict", flush=True)
        if self.cfg.lora.merge:
            merged = save_merged(self.peft_model, self.backbone.tokenizer, output_dir / "merged", write=write,
                                 adapter_fp32=self.adapter_fp32)
            if write:
                print(f"merged backbone: {merged}", flush=True)


def init_heads_from(heads, heads_dir: Optional[str], lm_head_weight=None, input_embeddings=None) -> None:
    """Stage 2 of the two-stage recipe: start from a stage-1 heads export of the same shape
    (weights and, for truncated heads, its token map)."""
    if not heads_dir:
        return
    loaded = load_heads(heads_dir, lm_head_weight=lm_head_weight, input_embeddings=input_embeddings)
    keys = ("kind", "num_heads", "num_layers", "hidden_size", "vocab_size", "projection", "truncated_vocab_size",
            *setting_names(family(heads.spec.kind)))  # the shape, and the family's own settings
    a, b = loaded.spec.to_dict(), heads.spec.to_dict()
    diff = [k for k in keys if a.get(k) != b.get(k)]
    if diff:
        raise UserError(f"lora.init_heads={heads_dir} holds heads that differ from this recipe's in "
                        + ", ".join(f"{k} ({a[k]} vs {b[k]})" for k in diff))
    heads.load_state_dict(loaded.state_dict(), strict=True)
