"""The step driver every decoding method shares, and what a generation returns.

A decoding method is a ``Decoder``: ``prefill(prompt [1, L], max_new_tokens)`` runs the prompt
and returns the first generated token; ``step()`` returns (the tokens this step emits, the draft
tokens it put up for verification). ``run_decoder`` drives any of them with one timing and
cut-off rule (EOS kept, max_new_tokens, max_steps), so methods compare like for like: the
autoregressive baseline (``methods/autoregressive.py``) is a Decoder driven by the same loop.
Which decoders exist, and ``generate`` / ``stream`` over them, is ``inference.methods``.

A ``TokenStream`` yields the new token ids of each step; after iteration ``.result`` holds the
``GenerationOutput``.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Protocol, Sequence

import torch

from ..errors import UserError
from .model import MedusaModel, position_limit, positions_named
from .verify import SamplingConfig, choose_token


@dataclass
class GenerationOutput:
    """What one generation produced and how long it took."""

    tokens: list[int]
    prompt_tokens: int
    finish_reason: str                                    # "eos", "length" or "steps"
    accept_lengths: list[int] = field(default_factory=list)  # tokens each step emitted (cut at EOS / the budget)
    # tokens each step's verification accepted (drafts + the bonus), before that cut: what the drafter earned,
    # for the acceptance rate and the calibrations that estimate a shape's tau over a long reply
    accepted: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)     # wall time of each step
    prefill_s: float = 0.0
    decode_s: float = 0.0
    proposed: list[int] = field(default_factory=list)     # draft tokens each step put up for verification

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (the bonus token is not a draft token)."""
        total = sum(self.proposed)
        return sum(n - 1 for n in self.verified) / total if total else 0.0

    @property
    def verified(self) -> list[int]:
        """Tokens each step's verification accepted (``accepted``; the emitted counts where none were recorded)."""
        return self.accepted or self.accept_lengths

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification step (bonus included; plain decoding = 1.0; 0.0 where no step ran:
        the first token, from the prompt, is no step's)."""
        return sum(self.accept_lengths) / max(1, self.steps)

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_s + self.decode_s
        return len(self.tokens) / total if total > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first one / decode time (excludes prefill)."""
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else 0.0


class TokenStream:
    """Iterate to get each step's new token ids; ``result`` is set once iteration ends."""

    def __init__(self, gen: Iterator[list[int]]):
        self._gen = gen
        self.result: Optional[GenerationOutput] = None

    def __iter__(self):
        result = yield from self._gen
        if result is not None:   # iterated again: the spent generator returns None, the result stays
            self.result = result


# an incomplete multi-byte character (its last byte in a later token) decodes to this until that byte comes
REPLACEMENT_CHARACTER = "\ufffd"


def answer_text(tokenizer, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
    """The text of an answer's tokens, as every command and ``stream_text`` writes it: without transformers 4's
    ``clean_up_tokenization_spaces`` (Llama-3's tokenizer config sets it), which rewrites text a later token
    follows ("it 's" -> "it's", " ." -> "."): a stream could never take back what it printed (and transformers 5
    no longer applies it to these tokenizers)."""
    return tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def stream_text(tokenizer, chunks: Iterable[Sequence[int]], skip_special_tokens: bool = True) -> Iterator[str]:
    """The text of streamed token chunks (a ``TokenStream``), piece by piece: the pieces join to ``answer_text`` of
    all the tokens. Each step decodes a window (as vLLM's incremental detokenizer does): the tokens from the last
    piece's start, less the text those before the new ones had, so a SentencePiece word's leading space survives
    and a step costs the window, not the whole answer. A trailing U+FFFD is held back until a later token completes
    its character: decoding each chunk alone, or printing what a partial character decodes to, shows U+FFFD in
    place of every character whose bytes span two tokens."""
    tokens: list[int] = []
    start = read = 0   # the window's first token; the tokens up to ``read`` are already shown
    shown = 0          # characters written in all
    for chunk in chunks:
        if is_integer(chunk):   # a GenerationOutput's tokens: one id at a time, not the stream's chunks
            raise UserError("stream_text reads a stream's chunks (lists of token ids); for a finished answer's tokens "
                            "use answer_text(tokenizer, tokens)")
        tokens += chunk
        before = answer_text(tokenizer, tokens[start:read], skip_special_tokens)
        text = answer_text(tokenizer, tokens[start:], skip_special_tokens)
        if len(text) > len(before) and not text.endswith(REPLACEMENT_CHARACTER):
            yield text[len(before):]
            shown += len(text) - len(before)
            start, read = read, len(tokens)
    whole = answer_text(tokenizer, tokens, skip_special_tokens)   # what stayed incomplete, as decoded
    if len(whole) > shown:
        yield whole[shown:]


# -- shared plumbing ----------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompt_tensor(m: MedusaModel, input_ids) -> torch.Tensor:
    """One prompt's token ids as a [1, L] tensor on the model's device, from a list or tuple of ids or a [L] /
    [1, L] tensor or numpy array, or a tokenizer's output of one row (``encoding_rows``); anything else refused in
    one line (bytes were read as ids, a set in its hash order)."""
    if isinstance(input_ids, torch.Tensor) or is_array(input_ids):
        kind, shape = ("a tensor" if isinstance(input_ids, torch.Tensor) else "an array"), tuple(input_ids.shape)
        if len(shape) == 2 and shape[0] != 1:
            raise UserError(f"batch size {shape[0]} is not supported: decode one sequence at a time "
                            "(a batch: generate_batch)")
        if len(shape) not in (1, 2):
            raise UserError(f"input_ids must be a list of ids or a [1, L] / [L] tensor, got {kind} of shape {shape}")
        if any(word in str(input_ids.dtype) for word in ("float", "complex", "bool")):
            raise UserError(f"input_ids must be integer token ids, got {kind} of {input_ids.dtype}")
        ids = input_ids.reshape(-1).tolist()
    elif isinstance(input_ids, Mapping):   # a tokenizer's BatchEncoding: iterating it would give its keys
        rows = encoding_rows(input_ids)
        if not rows:
            raise UserError("the prompt is empty: give at least one token")
        if len(rows) != 1:
            raise UserError(f"batch size {len(rows)} is not supported: decode one sequence at a time "
                            "(a batch: generate_batch)")
        return prompt_tensor(m, rows[0])
    elif isinstance(input_ids, (str, bytes, bytearray)):
        raise UserError("input_ids must be token ids; encode text first (e.g. MedusaModel.encode_chat)")
    elif not isinstance(input_ids, Sequence):   # a set has no order; a generator would be spent by this check
        raise UserError(f"input_ids must be a list of token ids or a tensor, got {type(input_ids).__name__}")
    else:
        bad = next((i for i in input_ids if not is_integer(i)), None)
        if bad is not None:   # int() would truncate 5.9 to 5 and take a nested list's error for a bug's
            raise UserError(f"input_ids must be integer token ids, got {short_repr(bad)}")
        ids = [int(i) for i in input_ids]
    if not ids:
        raise UserError("the prompt is empty: give at least one token")
    v = m.vocab_size
    if min(ids) < 0 or max(ids) >= v:
        raise UserError(f"prompt token ids must lie in 0..{v - 1}")
    refuse_padding(m, ids, "the prompt")
    return torch.tensor([ids], dtype=torch.long, device=m.device)


def encoding_rows(enc: Mapping) -> list[list[int]]:
    """A tokenizer's output (``tokenizer(texts, padding=True, return_tensors="pt")``) as each row's own ids: the
    runtime decodes rows of their own lengths, so the padding its ``attention_mask`` marks (left or right) is
    dropped here instead of being decoded as part of a prompt. A mask with a hole inside a row is refused."""
    if "input_ids" not in enc:
        raise UserError(f"a mapping of prompts needs 'input_ids' (a tokenizer's output), got keys {sorted(enc)[:5]}")

    def rows_of(x, key: str) -> list:
        x = x.tolist() if isinstance(x, torch.Tensor) or is_array(x) else x
        if isinstance(x, Sequence) and not isinstance(x, (str, bytes)):   # a list of row tensors or arrays
            x = [r.tolist() if isinstance(r, torch.Tensor) or is_array(r) else r for r in x]
        if isinstance(x, Sequence) and x and not isinstance(x[0], Sequence):   # one row
            x = [x]
        if not isinstance(x, Sequence) or isinstance(x, (str, bytes)) or not all(isinstance(r, Sequence) for r in x):
            raise UserError(f"{key} must be a [B, L] tensor or a list of id lists, got {type(x).__name__}")
        return [list(r) for r in x]

    ids = rows_of(enc["input_ids"], "input_ids")
    if enc.get("attention_mask") is None:
        return ids
    mask = rows_of(enc["attention_mask"], "attention_mask")
    if [len(r) for r in mask] != [len(r) for r in ids]:
        raise UserError("attention_mask must have input_ids' shape")
    rows = []
    for i, (row, keep) in enumerate(zip(ids, mask)):
        kept = [j for j, k in enumerate(keep) if k]
        if kept and kept[-1] - kept[0] + 1 != len(kept):
            raise UserError(f"row {i}'s attention_mask has a hole inside the prompt: only padding at the start or "
                            "the end can be dropped")
        rows.append(row[kept[0]:kept[-1] + 1] if kept else [])
    return rows


def refuse_padding(m: MedusaModel, ids: list[int], what: str) -> None:
    """Refuse a prompt that starts or ends with the tokenizer's pad token (``tokenizer(texts, padding=True)``): the
    runtime has no attention mask to give, so the padding was decoded as part of the prompt. A pad token that is
    also an end or start of text (SmolLM2's, Llama-3's usual setting) cannot be told from a prompt's own: let be."""
    tok = getattr(m, "tokenizer", None)
    pad = getattr(tok, "pad_token_id", None) if tok is not None else None
    if not isinstance(pad, int) or pad in set(m.eos_token_ids) or pad == getattr(tok, "bos_token_id", None):
        return
    if ids[0] == pad or ids[-1] == pad:
        raise UserError(f"{what} {'starts' if ids[0] == pad else 'ends'} with the tokenizer's pad token (id {pad}): "
                        "padding would be decoded as part of it; give prompts unpadded (tokenizer(texts).input_ids, "
                        "without padding=True: a batch's rows may differ in length)")


def is_array(x) -> bool:
    """A numpy array (read by its interface: numpy is not imported here)."""
    return hasattr(x, "__array_interface__") and hasattr(x, "ndim") and hasattr(x, "tolist")


def short_repr(x, limit: int = 60) -> str:
    """``repr(x)`` on one line, cut at ``limit`` characters (an array's repr spans lines)."""
    text = " ".join(repr(x).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def is_integer(x) -> bool:
    """An int (numpy's too, a 0-d integer tensor), not a bool and not an integral float."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_max_new_tokens(max_new_tokens) -> None:
    if not is_integer(max_new_tokens) or max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


def check_call(max_new_tokens, seed, eos_token_ids, max_steps, sampling) -> None:
    """A decoding call's own arguments, each refused in one line naming it: a float budget failed deep in a cache's
    allocation (or was rounded), NaN never stopped transformers' ``generate``, a string of EOS ids stopped on its
    digits, a seed beyond torch's range or a sampling dict failed with a traceback."""
    check_max_new_tokens(max_new_tokens)
    if max_steps is not None and (not is_integer(max_steps) or max_steps < 1):
        raise UserError(f"max_steps must be None or an integer >= 1, got {max_steps!r}")
    if seed is not None and (not is_integer(seed) or not -2 ** 63 <= seed < 2 ** 64):
        raise UserError(f"seed must be None or an integer in [-2**63, 2**64), got {seed!r}")
    if eos_token_ids is not None and not is_integer(eos_token_ids):
        entries = list(eos_token_ids) if isinstance(eos_token_ids, Iterable) and not isinstance(
            eos_token_ids, (str, bytes, Iterator)) else None   # an iterator: this check would have spent it
        if entries is None or not all(is_integer(e) for e in entries):
            raise UserError("eos_token_ids must be a token id or a list of them (None: the model's; (): never stop "
                            f"early), got {eos_token_ids!r}")
    if sampling is not None and not isinstance(sampling, SamplingConfig):
        raise UserError(f"sampling must be a SamplingConfig (inference.runtime.verify), got {type(sampling).__name__}")


def check_eos_ids(m: MedusaModel, eos_token_ids) -> None:
    """EOS ids the backbone can emit: one outside its vocabulary (a typo, -1 for "none") never stopped a reply, which
    then looked like a model that never ends."""
    if eos_token_ids is None:
        return
    ids = [eos_token_ids] if is_integer(eos_token_ids) else list(eos_token_ids)
    bad = next((int(i) for i in ids if not 0 <= int(i) < m.vocab_size), None)
    if bad is not None:
        raise UserError(f"eos_token_ids must lie in 0..{m.vocab_size - 1} (the backbone's vocabulary), got {bad} "
                        "(None: the model's; (): never stop early)")


def check_budget(m: MedusaModel, prompt_len: int, max_new_tokens: int, what: str = "prompt",
                 key: str = "max_new_tokens") -> None:
    """Refuse a prompt (``what`` names it) whose tokens + ``max_new_tokens`` (the setting ``key``) exceed the
    backbone's positions."""
    check_max_new_tokens(max_new_tokens)
    limit = getattr(m, "max_positions", None)   # None: no positional limit known
    if limit and prompt_len + max_new_tokens > limit:
        named = positions_named(m.config) if getattr(m, "config", None) is not None else f"{limit} positions"
        raise UserError(f"{what} ({prompt_len} tokens) + {key} ({max_new_tokens}) exceeds the "
                        f"backbone's {named}")


def check_positions(config, max_new_tokens: int) -> None:
    """Refuse, from the backbone's config alone (before its weights load), a ``max_new_tokens`` that leaves no
    position for even a one-token prompt; each prompt is checked once encoded (``check_budget``)."""
    limit = position_limit(config)
    if limit is not None and max_new_tokens >= limit:
        raise UserError(f"max_new_tokens={max_new_tokens} does not fit the backbone's {positions_named(config)} with "
                        f"a prompt: at most {limit - 1}, less the prompt's tokens")


def seeded_generator(device: torch.device, seed: Optional[int]) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


def eos_set(m: MedusaModel, eos_token_ids) -> set[int]:
    if eos_token_ids is None:
        return set(m.eos_token_ids)
    return {int(eos_token_ids)} if is_integer(eos_token_ids) else {int(e) for e in eos_token_ids}


class _Emitter:
    """Appends tokens, cutting at EOS (kept) or at max_new_tokens."""

    def __init__(self, max_new: int, eos: set[int]):
        self.tokens: list[int] = []
        self.max_new, self.eos = max_new, eos
        self.finish: Optional[str] = None

    def add(self, new: Sequence[int]) -> list[int]:
        out = []
        for t in new:
            if self.finish:
                break
            self.tokens.append(t)
            out.append(t)
            if t in self.eos:
                self.finish = "eos"
            elif len(self.tokens) >= self.max_new:
                self.finish = "length"
        return out


def prefill_token(m: MedusaModel, prompt: torch.Tensor, cache, cfg: SamplingConfig, gen) -> tuple[torch.Tensor, int]:
    """Run the prompt into ``cache``; returns (the last position's hidden state, the first token)."""
    n = prompt.shape[1]
    pos = torch.arange(n, device=m.device)[None]
    h = m.hidden(prompt, pos, cache)[0, -1]
    logits = m.logits(h)  # lm_head on the last position only
    return h, int(choose_token(logits, cfg, gen))


class Decoder(Protocol):
    """One sequence's decoding state; ``run_decoder`` drives it (see the module docstring)."""

    def prefill(self, prompt: torch.Tensor, max_new_tokens: int) -> int:
        """Run the prompt [1, L]; returns the first generated token."""

    def step(self) -> tuple[list[int], int]:
        """One step: (the tokens it emits, the draft tokens it proposed for verification)."""


@contextmanager
def handed_out(decoder) -> Iterator[None]:
    """Mark the decoder's static KV views (its ``cache``, a draft model's ``dcache``: what has ``check_current``)
    as held by a stream suspended at a ``yield``: a generation the same thread starts meanwhile (two streams read in
    turn, an asyncio server's pattern) decodes beside it on the dynamic cache instead of taking the buffer over,
    which killed this stream at its next step (``StaticSteps._take``)."""
    views = [v for v in (getattr(decoder, "cache", None), getattr(decoder, "dcache", None))
             if hasattr(v, "check_current")]
    for v in views:
        v.in_stream = True
    try:
        yield
    finally:
        for v in views:
            v.in_stream = False


def run_decoder(decoder: Decoder, m: MedusaModel, input_ids, max_new_tokens: int, eos_token_ids,
                max_steps: Optional[int]) -> Iterator[list[int]]:
    """Prefill, then ``decoder.step()`` until EOS / max_new_tokens / max_steps. Yields each step's
    emitted tokens and returns the ``GenerationOutput``. Each step is timed from before ``step()``
    to after the device sync: what the step costs, the same for every method and the baseline. The time the
    generator spends suspended at a ``yield`` (the caller printing a piece, an ``on_tokens`` callback) is the
    caller's: left out of ``decode_s`` and so of every tokens/s."""
    prompt = prompt_tensor(m, input_ids)
    check_budget(m, prompt.shape[1], max_new_tokens)
    emit = _Emitter(max_new_tokens, eos_set(m, eos_token_ids))
    out = GenerationOutput(tokens=emit.tokens, prompt_tokens=prompt.shape[1], finish_reason="length")
    t0 = time.perf_counter()
    with torch.inference_mode():
        root = decoder.prefill(prompt, max_new_tokens)
    _sync(m.device)
    out.prefill_s = time.perf_counter() - t0
    away = time.perf_counter()
    with handed_out(decoder):
        yield emit.add([root])
    t0 += time.perf_counter() - away   # the caller's time, not decoding's
    while not emit.finish and (max_steps is None or out.steps < max_steps):
        t = time.perf_counter()
        with torch.inference_mode(), m.stepping():
            new, proposed = decoder.step()
        _sync(m.device)
        out.step_s.append(time.perf_counter() - t)
        chunk = emit.add(new)
        out.accept_lengths.append(len(chunk))   # what the step emitted: tokens past EOS / the budget are not output
        out.accepted.append(len(new))
        out.proposed.append(proposed)
        if chunk:
            away = time.perf_counter()
            with handed_out(decoder):
                yield chunk
            t0 += time.perf_counter() - away
    out.decode_s = time.perf_counter() - t0 - out.prefill_s
    out.finish_reason = emit.finish or "steps"
    return out


def as_medusa_model(model) -> MedusaModel:
    """A ``MedusaModel``, or a bare transformers causal LM (sdpa/eager) wrapped without heads."""
    if isinstance(model, MedusaModel):
        return model
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"the model must be a MedusaModel (inference.loading.load_medusa) or a transformers causal "
                        f"LM, got {type(model).__name__}")
    return MedusaModel(model=model, tokenizer=None, heads=None)
