"""Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``).

Training-free and model-free: the proposal for the next tokens is what followed the latest
earlier occurrence of the context's last n tokens (prompt + generated text), trying
n = max_ngram down to min_ngram and taking the longest n that matches. Summaries, code edits,
answers that quote their question and structured output repeat their context, so the guess
is often right; when nothing matches, the step is a plain decoding step.

Each step: propose up to ``num_tokens`` tokens, score root + proposal in ONE target forward
(a chain), accept through ``verify.verify`` (greedy: token-identical to plain greedy; sample:
exact, since a looked-up proposal is a fixed guess; typical: Medusa's lossy rule), roll the
cache back to prompt + accepted tokens (``draft.verify_chain``).

The lookup is incremental: ``NGramIndex`` remembers, for every n-gram of every size, where
the latest occurrence that already has a following token ends, updated in O(max_ngram) per
new token, so a step never rescans the context. An occurrence counts only once its next token
exists, so the current suffix never matches itself.
Proposed per step = the proposal's length (0 when nothing matched).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..errors import UserError
from ..runtime.batch_decode import BatchTreeDecoder
from ..runtime.decode import prefill_token, seeded_generator
from ..runtime.graph_capture import to_device
from ..runtime.model import MedusaModel
from ..runtime.speculation import draft_tokens
from ..runtime.verify import SamplingConfig
from .draft import chain_buffers, chain_cursor, chain_sampling, check_chain_schedule, verify_chain
from .chain_choice import ChainShape
from .registry import Method, option, register, slot_costs


# The most tokens looked up a step and the longest suffix: a chain is verified in one forward pass (its rows
# cost every step), so beyond these nothing is gained and a typo (10^8) would only allocate gigabytes.
MAX_LOOKUP_TOKENS, MAX_NGRAM = 64, 16


def check_lookup_settings(o, label, min_tokens: int = 1) -> None:
    """Refuse, in one line, lookup settings ``o`` (num_tokens, max_ngram, min_ngram) a decoder cannot use;
    ``label(field)`` names a field as its options class does (prompt_lookup's, eagle3_lookup's keys);
    ``min_tokens``: the fewest tokens looked up a step (0 where the lookup can be switched off)."""
    for name in ("num_tokens", "max_ngram", "min_ngram"):
        v, low = getattr(o, name), (min_tokens if name == "num_tokens" else 1)
        high = MAX_LOOKUP_TOKENS if name == "num_tokens" else MAX_NGRAM
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            raise UserError(f"{label(name)} must be an integer in {low}..{high}, got {v!r}")
    if o.min_ngram > o.max_ngram:
        raise UserError(f"{label('min_ngram')} ({o.min_ngram}) exceeds {label('max_ngram')} ({o.max_ngram})")


@dataclass
class PromptLookupSettings:
    """num_tokens: most tokens proposed per step; max_ngram/min_ngram: suffix lengths tried."""

    num_tokens: int = option(10, "prompt_lookup_tokens", f"most tokens proposed per step (at most {MAX_LOOKUP_TOKENS})")
    max_ngram: int = option(3, "prompt_lookup_max_ngram", f"longest suffix looked up (at most {MAX_NGRAM})")
    min_ngram: int = option(1, "prompt_lookup_min_ngram", "shortest suffix looked up")
    # batches only: chains of at most num_tokens per batch size (medusa-eval sizes them); None: num_tokens
    schedule: Any = option(None, None, "a SpeculationSchedule of chains (batched decoding)")

    def __post_init__(self):
        check_lookup_settings(self, lambda name: f"prompt lookup {name}")
        check_chain_schedule(self.schedule, self.num_tokens, "prompt_lookup_tokens")

    @property
    def extra_kv_tokens(self) -> int:
        return self.num_tokens + 1


class NGramIndex:
    """The context and, per n-gram size, n-gram -> index of the token after its latest occurrence."""

    def __init__(self, min_ngram: int, max_ngram: int):
        self.sizes = range(min_ngram, max_ngram + 1)
        self.seq: list[int] = []
        self.last_match = 0   # the suffix length the last proposal was matched on
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.seq.append(int(t))
            end = len(self.seq) - 1          # the n-grams ending just before it now have a next token
            for n in self.sizes:
                if end >= n:
                    self.after[n][tuple(self.seq[end - n:end])] = end

    def propose(self, count: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching suffix (<= count). The
        suffix's length is kept in ``last_match`` (0: no match): a longer match is a surer sign that the
        text is being copied (``eagle3_lookup``'s switch reads it)."""
        for n in reversed(self.sizes):
            if len(self.seq) < n:
                continue
            start = self.after[n].get(tuple(self.seq[-n:]))
            if start is not None:
                self.last_match = n
                return self.seq[start:start + count]
        self.last_match = 0
        return []


def match_in_tree(children: Sequence[Sequence[int]], node_tokens: Sequence[int],
                  proposal: Sequence[int]) -> tuple[int, int]:
    """Walk ``proposal`` down a tree from its root (node 0) while a child of the current node carries
    its next token; ``children[i]``: node i's children, ``node_tokens[i]``: its token. Returns (the last
    matched node, how many proposal tokens matched): where the hybrids (medusa_lookup, eagle3_lookup)
    graft the unmatched rest, so that a looked-up prefix the tree already has costs no extra row."""
    node, n = 0, 0
    for tok in proposal:
        nxt = next((c for c in children[node] if node_tokens[c] == tok), None)
        if nxt is None:
            break
        node, n = nxt, n + 1
    return node, n


class PromptLookupDecoder:
    """Prompt lookup decoding state for one sequence; see the module docstring."""

    def __init__(self, m: MedusaModel, settings: Optional[PromptLookupSettings] = None,
                 sampling: Optional[SamplingConfig] = None, seed: Optional[int] = None):
        self.m = m
        self.s = settings or PromptLookupSettings()
        self.cfg = sampling or SamplingConfig()
        self.gen = seeded_generator(m.device, seed)
        self.index = NGramIndex(self.s.min_ngram, self.s.max_ngram)
        self.cache = None
        self.past = 0
        self.root: Optional[int] = None

    def prefill(self, prompt: torch.Tensor, max_new_tokens: int) -> int:
        n = prompt.shape[1]
        self.cache = self.m.new_cache(n + max_new_tokens + self.s.extra_kv_tokens)
        _, self.root = prefill_token(self.m, prompt, self.cache, self.cfg, self.gen)
        self.index.extend(prompt[0].tolist() + [self.root])
        self.past = n
        return self.root

    def step(self) -> tuple[list[int], int]:
        proposal = self.index.propose(self.s.num_tokens)
        accepted, bonus = verify_chain(self.m, self.cache, self.past, self.root, proposal, self.cfg, self.gen)
        new = accepted + [bonus]
        self.index.extend(new)
        self.past += 1 + len(accepted)
        self.root = bonus
        return new, len(proposal)


class LookupDrafter:
    """Batched prompt lookup (``BatchTreeDecoder``'s ``Drafter``): each row looks up its own context;
    the step verifies a chain as long as the longest row's proposal. A row with a shorter (or no)
    proposal pads its chain with -1 (computed, never accepted), so it accepts exactly what it would
    alone; only the looked-up tokens count as proposed (``row_proposed``). Proposals are cut to the
    length ``settings.schedule`` gives for the number of active rows (0: a plain step), else
    num_tokens."""

    def __init__(self, m: MedusaModel, settings: PromptLookupSettings):
        self.m, self.s = m, settings
        self.cursor = chain_cursor(settings.schedule, settings.num_tokens)
        self.max_nodes, self.max_depth = settings.num_tokens + 1, settings.num_tokens
        self.indexes: list[NGramIndex] = []
        self.seen: list[int] = []
        self.row_proposed: list[int] = []

    def draft(self, dec: BatchTreeDecoder):
        if not self.indexes:
            self.indexes = [NGramIndex(self.s.min_ngram, self.s.max_ngram) for _ in dec.history]
            self.seen = [0] * len(dec.history)
        cap = draft_tokens(self.cursor.next(dec.batch))
        props = []
        for b, hist in enumerate(dec.history):
            self.indexes[b].extend(hist[self.seen[b]:])
            self.seen[b] = len(hist)
            props.append(self.indexes[b].propose(cap) if cap else [])
        n = max(len(p) for p in props)
        self.row_proposed = [len(p) for p in props]
        cand = [p + [-1] * (n - len(p)) for p in props]
        return chain_buffers(n + 1, self.m.device), to_device(cand, self.m.device, torch.long), None

    def rows_kept(self, index: list[int]) -> None:
        if self.indexes:
            self.indexes = [self.indexes[i] for i in index]
            self.seen = [self.seen[i] for i in index]


register(Method(
    "prompt_lookup", "continue the latest earlier occurrence of the context's last n tokens (training-free)",
    PromptLookupSettings, decoder=lambda m, o, sampling, seed: PromptLookupDecoder(m, o, sampling, seed),
    batch_decoder=lambda m, o, sampling, seed, ragged: BatchTreeDecoder(
        m, LookupDrafter(m, o), chain_sampling(sampling or SamplingConfig()), seed, ragged),
    shape=ChainShape("num_tokens", varying=True),
    costs=lambda m, o, run_length: slot_costs(m, o.extra_kv_tokens)))
