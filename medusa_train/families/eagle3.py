"""EAGLE-3 drafters in training: their keys, checks, depth, draft vocabulary and unrolled memory.

The drafter (inference/heads/eagle3.py) reads three backbone layers, has its own lm_head over a draft
vocabulary and is trained by unrolling its draft steps (training-time test), so its keys are the layers
(``aux_layers``), the vocabulary's size (``draft_vocab_size``) and the steps (``ttt_steps``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from inference.backbone import text_config
from inference.cli_support import enum_value
from inference.errors import UserError
from inference.heads.eagle3 import (Eagle3Settings, NUM_AUX, default_aux_layers, draft_layer_config,
                                    refuse_repeated_aux_layers)

from . import HeadsConfig, TrainingFamily, register_training_family

MAX_TTT_STEPS = 32  # draft steps unrolled in training (heads.ttt_steps); engines draft 3-8


@dataclass
class Eagle3HeadsConfig(HeadsConfig):
    kind: str = "eagle3"
    # The three backbone hidden_states ids the drafter reads (null = EAGLE-3's (2, N//2, N-3)).
    aux_layers: Optional[List[int]] = None
    # Its draft vocabulary (null = truncated_vocab_size with projection=truncated, the whole vocabulary
    # otherwise; the same token map as truncated heads).
    draft_vocab_size: Optional[int] = None
    # The training-time-test depth: how many draft steps are unrolled (null = num_heads).
    ttt_steps: Optional[int] = None


class Eagle3Training(TrainingFamily):
    config = Eagle3HeadsConfig

    def validate(self, cfg) -> None:
        """Ranges that need no backbone (the rest is ``spec_settings``, from the backbone's config)."""
        h = cfg.heads
        if not 1 <= self.depth(h) <= MAX_TTT_STEPS:
            # Training unrolls the drafter once per step and keeps every step's activations for backward:
            # memory grows with the square of the steps (each attends to the chain before it).
            raise UserError(f"{self.depth_key(h)} must be in 1..{MAX_TTT_STEPS} for heads.kind=eagle3 (the "
                            f"training-time-test steps unrolled per batch; SpecForge unrolls 7), got {self.depth(h)}")
        if h.draft_vocab_size is not None and h.draft_vocab_size < 1:
            raise UserError(f"heads.draft_vocab_size must be >= 1, got {h.draft_vocab_size}")
        if h.aux_layers is not None and len(h.aux_layers) != NUM_AUX:
            raise UserError(f"heads.aux_layers must name 3 backbone layers (vLLM and SGLang read three), "
                            f"got {list(h.aux_layers)}")
        if h.aux_layers is not None and len(set(h.aux_layers)) != len(h.aux_layers):
            # vLLM and SGLang capture each listed layer once: fc would get 2H at serve time and fail.
            raise UserError(f"heads.aux_layers names a layer more than once ({list(h.aux_layers)}): vLLM and SGLang "
                            "capture each layer once, so name three distinct layers")
        if enum_value(h.projection) == "shared":
            raise UserError("heads.kind=eagle3 has its own lm_head: use heads.projection=own or truncated "
                            "(or heads.draft_vocab_size)")
        if h.num_layers != 1:
            raise UserError(f"heads.kind=eagle3 has one decoder layer: heads.num_layers must be 1, got {h.num_layers}")
        if cfg.lora.enabled:
            raise UserError("heads.kind=eagle3 trains on the frozen backbone: set lora.enabled=false")

    def depth(self, h) -> int:
        return int(h.ttt_steps) if h.ttt_steps is not None else int(h.num_heads)

    def depth_key(self, h) -> str:
        return "heads.ttt_steps" if h.ttt_steps is not None else "heads.num_heads"

    def vocabulary(self, h, vocab_size: int) -> tuple[str, Optional[int]]:
        """``heads.draft_vocab_size`` (the truncated projection's size; the whole vocabulary means projection
        own) or the projection keys."""
        n = h.draft_vocab_size
        if n is None:
            return super().vocabulary(h, vocab_size)
        if n > vocab_size:
            raise UserError(f"heads.draft_vocab_size={n} exceeds the backbone vocabulary ({vocab_size}); use at most "
                            f"{vocab_size} (all of it means a full-vocabulary lm_head)")
        if n < vocab_size and enum_value(h.projection) == "own":   # was trained truncated, said in the start-up line
            raise UserError(f"heads.projection=own asks for a full-vocabulary lm_head but heads.draft_vocab_size={n} "
                            f"truncates it: set heads.draft_vocab_size=null (or {vocab_size}) for all of it, or drop "
                            "heads.projection=own")
        return ("own", None) if n == vocab_size else ("truncated", int(n))

    def vocabulary_keys(self, h) -> tuple[str, ...]:
        return ("heads.draft_vocab_size",) if h.draft_vocab_size is not None else super().vocabulary_keys(h)

    def size_keys(self, h) -> tuple[str, ...]:
        return ("heads.draft_vocab_size",)  # one layer: its lm_head over the draft vocabulary is the size

    def spec_settings(self, h, hf_config) -> Eagle3Settings:
        """The aux layer ids and decoder-layer sizes, from the backbone's config; one line if the backbone
        cannot host the family (no Llama-style layer, too shallow, ids out of range or repeated)."""
        layer = draft_layer_config(text_config(hf_config))
        n = layer["target_layers"]
        # default_aux_layers refuses a target too shallow for three distinct servable layers (fewer than 4)
        aux = list(h.aux_layers) if h.aux_layers is not None else default_aux_layers(n)
        bad = [i for i in aux if not 0 <= int(i) < n]
        if bad:
            raise UserError(f"heads.aux_layers {bad} are out of range: the backbone has hidden states 0..{n - 1} "
                            f"(0 = embeddings, i = layer i's input; {n} layers)")
        if 0 in [int(i) for i in aux]:   # refused here, not after training: the export refuses it (formats/eagle3)
            raise UserError("heads.aux_layers cannot name 0, the embeddings: vLLM and SGLang capture hidden_states + "
                            f"residual before each layer and there is no residual before layer 0; use ids 1..{n - 1}")
        refuse_repeated_aux_layers(aux, "heads.aux_layers")
        # Ascending, the order vLLM and SGLang capture them (walking the layers): a fresh fc learns its columns
        # in that order, so the spec, the features cache and the export all say the layers actually read.
        return Eagle3Settings(aux_layers=sorted(int(i) for i in aux), draft_layer=layer)

    def resolved(self, h, hf_config) -> dict:
        vocab = int(text_config(hf_config).vocab_size)
        return {"heads.aux_layers": self.spec_settings(h, hf_config).aux_layers, "heads.ttt_steps": self.depth(h),
                "heads.draft_vocab_size": self.vocabulary(h, vocab)[1] or vocab}

    def loss_bytes(self, h, hf_config, length: int, batch: int) -> int:
        return 0   # each step's logits are counted with the unroll

    def unroll_bytes(self, h, hf_config, length: int, batch: int, dtype_bytes: int) -> int:
        """What the training-time test keeps for backward over a ``[batch, length]`` micro-batch: per step, the
        drafter layer's per-token tensors (inputs, q/k/v, attention, SwiGLU, norms) and the fp32 logits +
        log-softmax of the draft vocabulary; and step j's attention over the j + 1 blocks of keys, values and
        mask before it, so the unroll grows with the square of the steps."""
        text = text_config(hf_config)
        hidden, vocab = int(text.hidden_size), int(text.vocab_size)
        inter = int(getattr(text, "intermediate_size", 0) or 4 * hidden)
        steps = self.depth(h)
        draft_vocab = self.vocabulary(h, vocab)[1] or vocab
        per_step = (18 * hidden + 4 * inter) * dtype_bytes + 2 * draft_vocab * 4
        per_block = (2 * hidden + length) * dtype_bytes  # a step's keys + values and its mask row, per earlier step
        return batch * length * (steps * per_step + steps * (steps + 1) // 2 * per_block)


register_training_family(Eagle3Training("eagle3"))
