"""What generates the replies of self-distillation: transformers' ``generate`` or the runtime's batched decoding.

Three engines, one interface (``generate(prompts) -> [(new tokens without the end-of-turn token,
whether the turn ended)]``):

``generate``  transformers' ``generate`` on a left-padded batch with its KV cache.
``runtime``   the inference runtime's plain batched loop (``inference.methods.generate_batch``,
              method ``autoregressive``): rows of different lengths without padding compute,
              finished rows leave the batch.
``lookup``    the runtime's batched prompt lookup: chat replies often quote their prompt, and the
              drafts need no heads (distillation runs before any exist). Exact: greedy output is
              the plain loop's, sampled output follows the same distribution.

``distill.engine=auto`` (default), greedy (``distill.temperature=0``: every engine writes the same replies), times
every engine on one calibration batch of the run's own first prompts (outputs discarded, so the shards' seeded
sampling is untouched) and keeps the fastest by tokens/s. Sampling, the engines draw their samples differently, so
``auto`` takes the runtime (``generate`` where the runtime cannot decode the backbone) without timing: the same
command writes the same data on a busy machine or an idle one. Which engine ran is fixed at the first choice
(``engine-<digest>.json``, created once, so of processes choosing at once exactly one wins; recorded in
``distill.json``), so every process and a resumed run continue with the same one and write the shards the
uninterrupted run would have.
"""

from __future__ import annotations

import copy
import re
import time
from typing import Callable, Optional

import torch
from transformers import GenerationConfig

from inference.backbone import eos_token_ids
from inference.errors import UserError
from inference.methods import generate_batch
from inference.methods.hf_generate import model_defaults_off
from inference.runtime.model import MedusaModel, position_limit, positions_named
from inference.runtime.verify import SamplingConfig

from .data.tokenize import _render, reply_end_ids

ENGINES = ("generate", "runtime", "lookup")
CALIBRATION_TOKENS = 64   # new tokens per calibration prompt: enough steps for a stable rate


class Generator:
    """Batched generation with transformers' ``generate`` (left padding, KV cache)."""

    name = "generate"

    def __init__(self, model, tokenizer, cfg, device):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        g = cfg.distill
        # the chat template's end of a turn too: a checkpoint whose eos is another token (ChatML's <|im_end|> beside
        # an <|endoftext|> eos) would write the next, made-up turns into the reply, and training labels that end
        self.eos = sorted(set(eos_token_ids(model, tokenizer)) | set(reply_end_ids(tokenizer)))
        if not self.eos:
            raise UserError("the backbone's tokenizer and config name no end-of-sequence token; cannot end a reply")
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos[0]
        self.max_new_tokens = g.max_new_tokens
        # text a reply is decoded after (``_text``), and what it decodes to alone
        self.lead = tokenizer("a", add_special_tokens=False)["input_ids"]
        self.lead_text = tokenizer.decode(self.lead, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        sample = g.temperature > 0
        self.temperature, self.top_p = g.temperature, g.top_p
        self.config = GenerationConfig(
            max_new_tokens=g.max_new_tokens, do_sample=sample, temperature=g.temperature if sample else None,
            top_p=g.top_p if sample else None, top_k=0 if sample else None, eos_token_id=self.eos,
            pad_token_id=self.pad, use_cache=True)

    def encode(self, messages: list[dict]) -> list[int]:
        """The prompt's ids; a template that refuses it raises ``TemplateRefused``."""
        text = _render(self.tokenizer, messages, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]  # as training tokenises

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: Optional[int] = None) -> list[tuple[list[int], bool]]:
        """New tokens of each prompt (without the end-of-turn token) and whether it ended the turn."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        config = self.config
        if max_new_tokens is not None and max_new_tokens != config.max_new_tokens:
            config = copy.deepcopy(config)
            config.max_new_tokens = max_new_tokens
        # only this config's settings: a checkpoint's repetition_penalty, min_p, ... would change the replies
        with model_defaults_off(self.model):
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=config)
        return [self._split(row) for row in out[:, width:].tolist()]

    def _split(self, row: list[int]) -> tuple[list[int], bool]:
        ends = [j for j, t in enumerate(row) if t in self.eos]
        return (row[:ends[0]], True) if ends else (row, False)

    def decode(self, tokens: list[int]) -> str:
        """The reply's text; a character cut at its end (max_new_tokens) reads as one U+FFFD, which
        ``Replay.accept`` drops. Byte-level BPE decodes the cut bytes so; a byte-fallback tokenizer (Llama 2, Mistral,
        Gemma) turns every byte of the group of ``<0xNN>`` tokens holding them into a U+FFFD, the complete characters
        before them in the group too: those are decoded without the cut bytes."""
        text = self._text(tokens)
        cut = self._cut_bytes(tokens)
        if cut and text.endswith("\ufffd"):
            text = self._text(tokens[:-cut]) + "\ufffd"
        return text

    def _text(self, tokens: list[int]) -> str:
        """The text ``tokens`` add after the prompt. Decoded alone, a SentencePiece decoder (Llama 2, Mistral) strips
        the space their first token (``▁Hello``) starts with, one the backbone wrote (Mistral's ``[/INST]`` is
        followed by it): without it, the reply trains and prompts the next turn as other tokens than were generated."""
        # without transformers 4's space clean-up (Llama-3's config asks for it): "it 's" read back as "it's" is
        # another token sequence than the one generated, trained on and replayed as the next turn's history
        plain = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
        text = self.tokenizer.decode(self.lead + tokens, **plain)
        if self.lead_text and text.startswith(self.lead_text):
            return text[len(self.lead_text):]
        return self.tokenizer.decode(tokens, **plain)

    def _cut_bytes(self, tokens: list[int]) -> int:
        """How many byte-fallback tokens (``<0xF0>``) end ``tokens`` with the first bytes of a character (0: none)."""
        tail = []
        for piece in reversed(self.tokenizer.convert_ids_to_tokens(tokens[-3:])):   # a cut character: <= 3 bytes
            byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece or "")
            if byte is None:
                break
            tail.insert(0, int(byte.group(1), 16))
        for n in range(1, len(tail) + 1):
            lead = tail[-n]
            if lead & 0xC0 == 0x80:   # a continuation byte: its lead is further back
                continue
            size = 2 if lead & 0xE0 == 0xC0 else 3 if lead & 0xF0 == 0xE0 else 4 if lead & 0xF8 == 0xF0 else 1
            return n if n < size else 0
        return 0


class RuntimeGenerator(Generator):
    """The runtime's batched decoding (``runtime``: the plain batched loop; ``lookup``: batched prompt lookup)."""

    def __init__(self, model, tokenizer, cfg, device, method: str = "autoregressive"):
        super().__init__(model, tokenizer, cfg, device)
        self.method = method
        self.name = "runtime" if method == "autoregressive" else "lookup"
        try:
            self.m = MedusaModel(model=model, tokenizer=tokenizer, heads=None, eos_token_ids=list(self.eos))
        except UserError as e:
            raise UserError(f"distill.engine={self.name} cannot run this backbone ({e}); use distill.engine=generate") \
                from None
        longest = int(cfg.data.max_length) + int(self.max_new_tokens)
        limit = position_limit(self.m.config)
        if limit is not None and longest > limit:   # a sliding window shorter than the positions (Gemma-3's 1,024)
            raise UserError(f"distill.engine={self.name} cannot run this backbone: data.max_length + "
                            f"distill.max_new_tokens ({longest}) exceeds its {positions_named(self.m.config)}; use "
                            "distill.engine=generate")
        self.sampling = (SamplingConfig(mode="sample", temperature=self.temperature, top_p=self.top_p)
                         if self.temperature > 0 else SamplingConfig())

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: Optional[int] = None) -> list[tuple[list[int], bool]]:
        seed = int(torch.randint(0, 2**62, (1,)).item())   # from the shard's seeded stream: resumable
        out = generate_batch(self.m, prompts, self.method, max_new_tokens=max_new_tokens or self.max_new_tokens,
                             sampling=self.sampling, seed=seed, eos_token_ids=self.eos)
        return [self._split(row.tokens) for row in out.rows]


def make_engine(name: str, model, tokenizer, cfg, device) -> Generator:
    if name == "generate":
        return Generator(model, tokenizer, cfg, device)
    if name == "runtime":
        return RuntimeGenerator(model, tokenizer, cfg, device, "autoregressive")
    if name == "lookup":
        return RuntimeGenerator(model, tokenizer, cfg, device, "prompt_lookup")
    raise UserError(f"distill.engine must be auto or one of {', '.join(ENGINES)}, got {name!r}")


def time_engine(engine: Generator, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Generated tokens / wall time of one batch (outputs discarded; the RNG state is restored)."""
    state = torch.random.get_rng_state()
    try:
        t0 = time.perf_counter()
        outs = engine.generate(prompts, max_new_tokens)
        dt = time.perf_counter() - t0
    finally:
        torch.random.set_rng_state(state)
    tokens = sum(len(new) + int(ended) for new, ended in outs)
    return {"tokens": tokens, "seconds": round(dt, 3), "tokens_per_s": round(tokens / max(dt, 1e-9), 1)}


def choose_engine(engines: dict[str, Callable[[], Generator]], prompts: list[list[int]], max_new_tokens: int,
                  log: Callable[[str], None] = print) -> tuple[Generator, dict]:
    """Time each engine that can run (after one untimed warm-up batch each) on ``prompts`` and return
    the fastest by tokens/s, with the record of every engine's rate (engines that cannot run this
    backbone are recorded with why)."""
    built, record = {}, {}
    for name, make in engines.items():
        try:
            built[name] = make()
        except UserError as e:
            record[name] = {"unavailable": str(e)}
    warm = [p[-8:] for p in prompts[:2]]                  # kernels and allocations, not the measurement
    for name, engine in built.items():
        time_engine(engine, warm, 2)
    for name in built:   # twice, in rotated order, keeping the faster run of each (a stall is not the engine)
        record[name] = time_engine(built[name], prompts, max_new_tokens)
    for name in reversed(list(built)):
        again = time_engine(built[name], prompts, max_new_tokens)
        if again["tokens_per_s"] > record[name]["tokens_per_s"]:
            record[name] = again
    best = max(built, key=lambda n: record[n]["tokens_per_s"])
    log("[distill] engine: " + ", ".join(f"{n} {r.get('tokens_per_s', 'n/a')} tok/s" for n, r in record.items())
        + f" -> {best}")
    return built[best], {"chosen": best, "calibration": record, "calibration_prompts": len(prompts),
                         "calibration_new_tokens": max_new_tokens}
