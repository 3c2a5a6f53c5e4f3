"""The decoding loops: Medusa tree decoding, the plain autoregressive baseline, calibration.

One Medusa step, for batch size 1:
  1. the root is the token already chosen by the backbone (prefill or previous bonus);
  2. the heads run once, on the hidden state of the last accepted position only, and their
     top-k guesses (or sampled drafts) fill the tree (``verify.propose``);
  3. one forward of the stock transformers decoder over all N tree nodes, with position ids
     past + depth and a [1, 1, N, past + N] additive mask (a node sees the prefix, its
     ancestors and itself); the lm_head runs on those N hidden states only;
  4. ``verify.verify`` picks the accepted path and the bonus token;
  5. the KV cache keeps prefix + accepted nodes (``TreeKVCache.keep``); the accepted tokens
     and the bonus are emitted; the bonus is the next root.
Tokens per step (tau) = accepted nodes + 1. The baseline (``autoregressive_generate``) uses
the same model wrapper, cache and token choice, one token per forward.

Streaming: ``medusa_stream``/``autoregressive_stream`` return a ``TokenStream`` that yields
the new token ids of each step; after iteration ``.result`` holds the ``GenerationOutput``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch

from ..errors import UserError
from .model import MedusaModel
from .tree import MedusaTree, grow_tree, resolve_tree
from .verify import SamplingConfig, choose_token, verify


@dataclass
class GenerationOutput:
    """What one generation produced and how long it took."""

    tokens: list[int]
    prompt_tokens: int
    finish_reason: str                                    # "eos", "length" or "steps"
    accept_lengths: list[int] = field(default_factory=list)  # tokens produced by each step
    step_s: list[float] = field(default_factory=list)     # wall time of each step
    prefill_s: float = 0.0
    decode_s: float = 0.0
    proposed: list[int] = field(default_factory=list)     # draft tokens each step put up for verification

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (the bonus token is not a draft token)."""
        total = sum(self.proposed)
        return sum(n - 1 for n in self.accept_lengths) / total if total else 0.0

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens per verification step (bonus included; plain decoding = 1.0)."""
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
        self.result = yield from self._gen


# -- shared plumbing ----------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompt_tensor(m: MedusaModel, input_ids) -> torch.Tensor:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise UserError(f"batch size {input_ids.shape[0]} is not supported: decode one sequence at a time")
        if input_ids.dim() not in (1, 2):
            raise UserError("input_ids must be a list of ids or a [1, L] / [L] tensor")
        ids = input_ids.reshape(-1).tolist()
    elif isinstance(input_ids, str):
        raise UserError("input_ids must be token ids; encode text first (e.g. MedusaModel.encode_chat)")
    else:
        ids = [int(i) for i in input_ids]
    if not ids:
        raise UserError("the prompt is empty: give at least one token")
    v = m.vocab_size
    if min(ids) < 0 or max(ids) >= v:
        raise UserError(f"prompt token ids must lie in 0..{v - 1}")
    return torch.tensor([ids], dtype=torch.long, device=m.device)


def _check_budget(m: MedusaModel, prompt_len: int, max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = m.max_positions
    if limit and prompt_len + max_new_tokens > limit:
        raise UserError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                        f"backbone's {limit} positions")


def _generator(device: torch.device, seed: Optional[int]) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


def _eos_set(m: MedusaModel, eos_token_ids) -> set[int]:
    return set(m.eos_token_ids) if eos_token_ids is None else {int(e) for e in eos_token_ids}


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


def _prefill(m: MedusaModel, prompt: torch.Tensor, cache, cfg: SamplingConfig, gen):
    n = prompt.shape[1]
    pos = torch.arange(n, device=m.device)[None]
    h = m.hidden(prompt, pos, cache)[0, -1]
    logits = m.logits(h)  # lm_head on the last position only
    return h, int(choose_token(logits, cfg, gen))


# -- Medusa -------------------------------------------------------------------------------
class TreeDecoder:
    """Medusa decoding state for one sequence: ``prefill`` once, then ``step`` repeatedly.

    After each step: ``cache`` holds prompt + every emitted token except the current root
    (``past`` entries), ``root`` is the last emitted token, ``last_path`` the accepted nodes.
    The generation functions below drive it; it is public for tools that need the state.
    """

    def __init__(self, m: MedusaModel, tree, sampling: Optional[SamplingConfig] = None,
                 seed: Optional[int] = None):
        if m.heads is None:
            raise UserError("this model has no Medusa heads: use autoregressive_generate")
        self.m = m
        self.tree: MedusaTree = resolve_tree(tree, m.num_heads)
        self.tree.check_fits(m.num_heads, getattr(m.heads.spec, "output_size", m.vocab_size))
        self.buf = self.tree.buffers(m.device)
        self.cfg = sampling or SamplingConfig()
        m.heads.check_sampling(self.cfg)
        self.gen = _generator(m.device, seed)
        self.cache = None
        self.past = 0
        self.root: Optional[int] = None
        self.h_last: Optional[torch.Tensor] = None
        self.last_path: list[int] = []

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor, max_new_tokens: int) -> int:
        """Run the prompt [1, L]; returns the first generated token (the first root)."""
        self.past = prompt.shape[1]
        self.cache = self.m.new_cache(self.past + max_new_tokens + self.buf.num_nodes)
        self.h_last, self.root = _prefill(self.m, prompt, self.cache, self.cfg, self.gen)
        return self.root

    @torch.inference_mode()
    def step(self) -> tuple[list[int], int]:
        """One draft-verify-compact step; returns (accepted tokens + the bonus token, nodes proposed)."""
        m, buf, past = self.m, self.buf, self.past
        cand, draft_q = m.heads.draft_tree(buf, self.h_last, self.root, self.cfg, self.gen, m.vocab_size)
        tokens = torch.cat([torch.tensor([self.root], device=m.device), cand])
        positions = (buf.position_offsets + past)[None]
        h_tree = m.hidden(tokens[None], positions, self.cache, buf.additive_mask(past, m.dtype))[0]
        verdict = verify(buf, tokens, m.logits(h_tree), self.cfg, draft_q, self.gen)
        self.cache.keep(past, verdict.path)
        self.last_path = verdict.path
        self.h_last = h_tree[verdict.path[-1]]
        self.past = past + len(verdict.path)
        self.root = verdict.bonus
        return tokens[verdict.path[1:]].tolist() + [verdict.bonus], buf.num_nodes - 1


def run_decoder(decoder, m: MedusaModel, input_ids, max_new_tokens: int, eos_token_ids, max_steps: Optional[int]):
    """Generator shared by every speculative method: prefill, then ``decoder.step()`` (returning
    (new tokens, draft tokens proposed)) until EOS / max_new_tokens / max_steps. Yields each step's
    emitted tokens and returns the ``GenerationOutput``: one timing and cut-off rule for all methods,
    so they compare like for like."""
    prompt = _prompt_tensor(m, input_ids)
    _check_budget(m, prompt.shape[1], max_new_tokens)
    emit = _Emitter(max_new_tokens, _eos_set(m, eos_token_ids))
    out = GenerationOutput(tokens=emit.tokens, prompt_tokens=prompt.shape[1], finish_reason="length")
    t0 = time.perf_counter()
    with torch.inference_mode():
        root = decoder.prefill(prompt, max_new_tokens)
    _sync(m.device)
    out.prefill_s = time.perf_counter() - t0
    yield emit.add([root])
    while not emit.finish and (max_steps is None or out.steps < max_steps):
        t = time.perf_counter()
        with torch.inference_mode():
            new, proposed = decoder.step()
        _sync(m.device)
        out.step_s.append(time.perf_counter() - t)
        out.accept_lengths.append(len(new))
        out.proposed.append(proposed)
        chunk = emit.add(new)
        if chunk:
            yield chunk
    out.decode_s = time.perf_counter() - t0 - out.prefill_s
    out.finish_reason = emit.finish or "steps"
    return out


def _medusa_steps(m: MedusaModel, input_ids, tree, max_new_tokens: int, cfg: SamplingConfig, seed, eos_token_ids,
                  max_steps: Optional[int]):
    return run_decoder(TreeDecoder(m, tree, cfg, seed), m, input_ids, max_new_tokens, eos_token_ids, max_steps)


def medusa_stream(m: MedusaModel, input_ids, *, tree="tree8", max_new_tokens: int = 128,
                  sampling: Optional[SamplingConfig] = None, seed: Optional[int] = None,
                  eos_token_ids: Optional[Iterable[int]] = None, max_steps: Optional[int] = None) -> TokenStream:
    """Stream Medusa decoding (see module docstring).

    tree: a ``MedusaTree``, a default name (``tree.DEFAULT_TREE_NAMES``), a tree JSON path or a
    choices list. eos_token_ids: None = the model's, ``()`` = never stop early.
    """
    return TokenStream(_medusa_steps(m, input_ids, tree, max_new_tokens, sampling or SamplingConfig(),
                                     seed, eos_token_ids, max_steps))


def medusa_generate(m: MedusaModel, input_ids, *, tree="tree8", max_new_tokens: int = 128,
                    sampling: Optional[SamplingConfig] = None, seed: Optional[int] = None,
                    eos_token_ids: Optional[Iterable[int]] = None, max_steps: Optional[int] = None,
                    on_tokens: Optional[Callable[[list[int]], None]] = None) -> GenerationOutput:
    """Run Medusa decoding to the end; ``on_tokens`` is called with each step's new tokens."""
    stream = medusa_stream(m, input_ids, tree=tree, max_new_tokens=max_new_tokens, sampling=sampling,
                           seed=seed, eos_token_ids=eos_token_ids, max_steps=max_steps)
    for chunk in stream:
        if on_tokens is not None:
            on_tokens(chunk)
    return stream.result


# -- plain autoregressive baseline --------------------------------------------------------
@torch.inference_mode()
def _autoregressive_steps(m: MedusaModel, input_ids, max_new_tokens: int, cfg: SamplingConfig, seed, eos_token_ids):
    prompt = _prompt_tensor(m, input_ids)
    past = prompt.shape[1]
    _check_budget(m, past, max_new_tokens)
    gen = _generator(m.device, seed)
    emit = _Emitter(max_new_tokens, _eos_set(m, eos_token_ids))
    out = GenerationOutput(tokens=emit.tokens, prompt_tokens=past, finish_reason="length")
    cache = m.new_cache(past + max_new_tokens)
    t0 = time.perf_counter()
    _, tok = _prefill(m, prompt, cache, cfg, gen)
    _sync(m.device)
    out.prefill_s = time.perf_counter() - t0
    yield emit.add([tok])
    step_input = torch.empty(1, 1, dtype=torch.long, device=m.device)
    while not emit.finish:
        t = time.perf_counter()
        step_input.fill_(tok)
        pos = torch.full((1, 1), past, dtype=torch.long, device=m.device)
        h = m.hidden(step_input, pos, cache)[0, -1]
        tok = int(choose_token(m.logits(h), cfg, gen))
        past += 1
        _sync(m.device)
        out.step_s.append(time.perf_counter() - t)
        out.accept_lengths.append(1)
        yield emit.add([tok])
    out.decode_s = time.perf_counter() - t0 - out.prefill_s
    out.finish_reason = emit.finish
    return out


def _as_medusa_model(model) -> MedusaModel:
    if isinstance(model, MedusaModel):
        return model
    return MedusaModel(model=model, tokenizer=None, heads=None)


def autoregressive_stream(model, input_ids, *, max_new_tokens: int = 128, sampling: Optional[SamplingConfig] = None,
                          seed: Optional[int] = None, eos_token_ids: Optional[Iterable[int]] = None) -> TokenStream:
    """One token per forward with the same cache and token choice as Medusa (the speedup baseline).

    ``model`` is a ``MedusaModel`` or a bare transformers causal LM (loaded with sdpa/eager).
    Typical mode samples like sample mode here (there is nothing to accept).
    """
    return TokenStream(_autoregressive_steps(_as_medusa_model(model), input_ids, max_new_tokens,
                                             sampling or SamplingConfig(), seed, eos_token_ids))


def autoregressive_generate(model, input_ids, *, max_new_tokens: int = 128, sampling: Optional[SamplingConfig] = None,
                            seed: Optional[int] = None, eos_token_ids: Optional[Iterable[int]] = None,
                            on_tokens: Optional[Callable[[list[int]], None]] = None) -> GenerationOutput:
    stream = autoregressive_stream(model, input_ids, max_new_tokens=max_new_tokens, sampling=sampling,
                                   seed=seed, eos_token_ids=eos_token_ids)
    for chunk in stream:
        if on_tokens is not None and chunk:
            on_tokens(chunk)
    return stream.result


# -- calibration --------------------------------------------------------------------------
@dataclass
class HeadAccuracy:
    """How often head k's rank-r guess equals the backbone's own greedy token (k+2 ahead)."""

    hits: torch.Tensor    # [K, topk] long
    totals: torch.Tensor  # [K] long: positions evaluated per head

    @property
    def per_rank(self) -> torch.Tensor:
        """[K, topk]: P(rank r is right); the matrix ``tree.grow_tree`` takes."""
        return self.hits.double() / self.totals.clamp(min=1)[:, None].double()

    @property
    def topk(self) -> torch.Tensor:
        """[K, topk]: cumulative top-k accuracy."""
        return self.per_rank.cumsum(1)

    def to_dict(self) -> dict:
        return {"per_rank": self.per_rank.tolist(), "topk": self.topk.tolist(),
                "totals": self.totals.tolist()}


@torch.inference_mode()
def measure_head_accuracy(m: MedusaModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
                          topk: int = 10, progress: Optional[Callable[[int, int], None]] = None) -> HeadAccuracy:
    """Per-head, per-rank accuracy against the backbone's greedy continuation of each prompt.

    For every position t from the last prompt token on, head k's top-k at t is compared with
    the greedy token at t+k+2 (the backbone's own output, not the dataset's text: what
    greedy Medusa decoding will have to match). Dependent heads are fed the greedy tokens
    t+1..t+k+1 (the path they extend when every earlier guess was right), so their accuracy
    is conditional on a correct prefix, which is what a tree node's value multiplies.
    """
    if m.heads is None:
        raise UserError("this model has no Medusa heads to calibrate")
    k_heads = m.num_heads
    out_size = getattr(m.heads.spec, "output_size", m.vocab_size)
    if not 1 <= topk <= out_size:
        raise UserError(f"topk must be in 1..{out_size}, got {topk}")
    if not prompts:
        raise UserError("calibration needs at least one prompt")
    hits = torch.zeros(k_heads, topk, dtype=torch.long)
    totals = torch.zeros(k_heads, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        gen = autoregressive_generate(m, list(prompt), max_new_tokens=max_new_tokens)
        seq = list(prompt) + gen.tokens
        n0, n = len(prompt), len(seq)
        ids = torch.tensor([seq], device=m.device)
        h = m.hidden(ids, torch.arange(n, device=m.device)[None], m.new_cache(n))[0]
        for k in range(k_heads):
            t = torch.arange(n0 - 1, n - k - 2, device=m.device)   # positions with a target in range
            if t.numel() == 0:
                continue
            future = ids[0, t[:, None] + 1 + torch.arange(k + 1, device=m.device)]  # x_{t+1..t+k+1}
            logits = m.heads.path_logits(h[t], future, k)
            guesses = m.heads.to_vocab_ids(logits.topk(topk, dim=-1).indices)
            target = ids[0, t + k + 2]
            hits[k] += (guesses == target[:, None]).sum(0).cpu()
            totals[k] += t.numel()
        if progress is not None:
            progress(i + 1, len(prompts))
    return HeadAccuracy(hits, totals)


def calibrated_tree(m: MedusaModel, prompts: Sequence[Sequence[int]], num_nodes: int, *, max_new_tokens: int = 64,
                    topk: int = 10, name: Optional[str] = None) -> tuple[MedusaTree, float, HeadAccuracy]:
    """Measure the heads on ``prompts`` and grow the best tree of ``num_nodes`` tokens (root
    included) for them; returns (tree, expected tau, the measured accuracies)."""
    if num_nodes < 1:
        raise UserError(f"a tree has at least 1 node (the root), got {num_nodes}")
    acc = measure_head_accuracy(m, prompts, max_new_tokens=max_new_tokens, topk=topk)
    tree, tau = grow_tree(acc.per_rank, num_nodes - 1, name=name or f"calibrated{num_nodes}")
    return tree, tau, acc


# -- measurement --------------------------------------------------------------------------
def measure_step_latency(m: MedusaModel, input_ids, trees: Sequence, *, steps: int = 8, warmup: int = 2,
                         sampling: Optional[SamplingConfig] = None) -> dict[str, float]:
    """Median wall time of one Medusa step (heads + tree forward + verify + compaction) per tree.

    EOS is ignored so every tree runs ``warmup + steps`` steps on the same prompt.
    """
    result = {}
    for spec in trees:
        tree = resolve_tree(spec, m.num_heads)
        out = medusa_generate(m, input_ids, tree=tree, max_new_tokens=(warmup + steps + 1) * (tree.max_depth + 1),
                              sampling=sampling, eos_token_ids=(), max_steps=warmup + steps, seed=0)
        times = out.step_s[warmup:]
        result[tree.name or f"{tree.num_nodes} nodes"] = statistics.median(times) if times else float("nan")
    return result
