"""Lookahead decoding (Fu et al. 2024, hao-ai-lab/LookaheadDecoding): Jacobi guesses + an n-gram pool.

Training-free. Each step runs ONE forward of the target over three groups of tokens, placed
with position ids and one additive 4D attention mask (the mechanism the Medusa trees use):

  root          the token already chosen (position past);
  lookahead     a 2D window of L <= N-1 levels x W columns. Token (level j, column i) sits at
                position past+1+i+j and sees the prefix, the root, level 0's columns 0..i and
                its own column at levels 1..j, i.e. the sequence
                level0[0..i], level1[i], .., level_j[i]: one Jacobi trajectory per column.
                The argmax at the last level is each column's next Jacobi guess;
  verification  up to G candidate (N-1)-grams from the pool whose first token is the root,
                merged into a trie (shared prefixes verified once) and checked exactly like a
                Medusa tree: node at depth d sits at past+d and sees the prefix, the root and
                its ancestors.

After the forward: ``verify.verify`` picks the longest accepted trie path and the bonus token
(greedy: the output is token-identical to plain greedy decoding, whatever the guesses;
sample: exact, by the point-mass rule for fixed candidates; typical: Medusa's lossy rule);
the KV cache keeps the prefix, the root and the accepted nodes (``TreeKVCache.keep``), dropping
the window. Then every column i yields the n-gram (level0[i], .., level_{N-2}[i], guess[i])
for the pool, level 0 is dropped and the guesses become the last level: with one token per
step the window stays aligned (old level j+1 sat where new level j sits). It is not re-aligned
after longer acceptances (as in the reference implementation): the window is a heuristic
source of guesses and exactness never depends on it. The window starts as a contiguous slice
of the prompt (level j, column i = slice[i + j]), so every column begins as a real prompt
n-gram and there is no warm-up phase.

The pool maps a first token to its most recent G distinct continuations (newest first).
Proposed per step = the trie's depth (N-1 with candidates, else 0): what the step could accept.
Cost per step: 1 + L*W + (trie nodes) tokens in the forward; the lm_head runs only on the
root, the trie and the last window level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import torch

from ..errors import UserError
from ..runtime.decode import prefill_token, seeded_generator
from ..runtime.model import MedusaModel
from ..runtime.tree import MedusaTree, TreeBuffers
from ..runtime.verify import SamplingConfig, choose_token, verify
from .draft import chain_sampling
from .registry import Method, option, register, slot_costs


@dataclass
class LookaheadSettings:
    """window W (Jacobi columns), ngram N (n-gram size; N-1 window levels), guesses G (pool
    candidates verified per step)."""

    window: int = option(5, "lookahead_window", "W: Jacobi window columns (at most 64)")
    ngram: int = option(4, "lookahead_ngram", "N: n-gram size (N-1 window levels; at most 16)")
    guesses: int = option(5, "lookahead_guesses", "G: pool candidates verified per step (at most 64)")

    # (low, high) per key: a step verifies 1 + (N-1)(W+G) rows, so the highs already make a step of ~2000 rows
    BOUNDS: ClassVar[dict] = {"window": (2, 64), "ngram": (2, 16), "guesses": (1, 64)}

    def __post_init__(self):
        for name, (low, high) in self.BOUNDS.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise UserError(f"lookahead {name} must be an integer in {low}..{high}, got {v!r}")

    @property
    def extra_kv_tokens(self) -> int:
        """Cache slots beyond prompt + max_new_tokens: one step's window and trie."""
        return 1 + (self.ngram - 1) * (self.window + self.guesses)


class NGramPool:
    """First token -> its latest ``size`` distinct continuations (each N-1 tokens), newest last."""

    def __init__(self, size: int):
        self.size = size
        self.by_first: dict[int, list[tuple[int, ...]]] = {}

    def add(self, gram: Sequence[int]) -> None:
        first, rest = int(gram[0]), tuple(int(t) for t in gram[1:])
        entries = self.by_first.setdefault(first, [])
        if rest in entries:
            entries.remove(rest)          # seen again: becomes the newest
        entries.append(rest)
        if len(entries) > self.size:
            del entries[0]

    def candidates(self, first: int) -> list[tuple[int, ...]]:
        return list(reversed(self.by_first.get(first, [])))

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_first.values())


def build_trie(candidates: Sequence[Sequence[int]]) -> tuple[Optional[MedusaTree], list[int]]:
    """Merge candidate continuations into a tree; returns (tree or None, token of each node,
    node 0 = root placeholder). Children are ranked by first appearance (newest candidate first)."""
    kids: dict[tuple, list[int]] = {}
    paths = set()
    for cand in candidates:
        rank_path: tuple = ()
        for tok in cand:
            siblings = kids.setdefault(rank_path, [])
            if tok not in siblings:
                siblings.append(tok)
            rank_path = rank_path + (siblings.index(tok),)
            paths.add(rank_path)
    if not paths:
        return None, [-1]
    tree = MedusaTree(paths)
    tokens = [-1] + [kids[p[:-1]][p[-1]] for p in tree.paths]
    return tree, tokens


@dataclass
class LookaheadInputs:
    """One step's forward: tokens [T], position ids [T], additive mask [1, 1, T, past + T], and
    the layout: T = 1 (root) + window_size + (trie nodes - 1)."""

    tokens: list[int]
    positions: torch.Tensor
    mask: torch.Tensor
    window_size: int
    trie: Optional[TreeBuffers]
    trie_tokens: list[int]     # node 0 = the root placeholder (-1)


class LookaheadDecoder:
    """Lookahead decoding state for one sequence; see the module docstring."""

    def __init__(self, m: MedusaModel, settings: Optional[LookaheadSettings] = None,
                 sampling: Optional[SamplingConfig] = None, seed: Optional[int] = None):
        self.m = m
        self.s = settings or LookaheadSettings()
        self.cfg = chain_sampling(sampling or SamplingConfig())
        self.gen = seeded_generator(m.device, seed)
        self.pool = NGramPool(self.s.guesses)
        self.levels: list[list[int]] = []   # N-1 rows of W guesses
        self.cache = None
        self.past = 0
        self.root: Optional[int] = None
        self.last_path: list[int] = []
        self._window_vis, self._window_offsets = self._window_layout()
        self._tries: dict[tuple, TreeBuffers] = {}

    def _window_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(visibility [1+LW, 1+LW] bool, root included; position offsets [LW]), L = N-1 levels."""
        w, levels = self.s.window, self.s.ngram - 1
        n = 1 + levels * w
        vis = torch.zeros(n, n, dtype=torch.bool)
        vis[:, 0] = True
        offsets = []
        for j in range(levels):
            for i in range(w):
                r = 1 + j * w + i
                vis[r, 1:2 + i] = True                       # level 0, columns 0..i
                for k in range(1, j + 1):
                    vis[r, 1 + k * w + i] = True             # own column, levels 1..j
                offsets.append(1 + i + j)
        return vis.to(self.m.device), torch.tensor(offsets, device=self.m.device)

    def _trie(self, candidates) -> tuple[Optional[TreeBuffers], list[int]]:
        tree, tokens = build_trie(candidates)
        if tree is None:
            return None, tokens
        key = tree.paths
        if key not in self._tries:                 # trie shapes recur: build their buffers once
            self._tries[key] = tree.buffers(self.m.device)
        return self._tries[key], tokens

    def prefill(self, prompt: torch.Tensor, max_new_tokens: int) -> int:
        n = prompt.shape[1]
        self.cache = self.m.new_cache(n + max_new_tokens + self.s.extra_kv_tokens)
        _, self.root = prefill_token(self.m, prompt, self.cache, self.cfg, self.gen)
        self.past = n
        w, levels = self.s.window, self.s.ngram - 1
        ids = prompt[0].tolist()
        span = w + levels - 1
        start = int(torch.randint(0, max(1, n - span + 1), (1,), generator=self.gen, device=self.m.device))
        piece = [ids[(start + t) % n] for t in range(span)]          # cycles when the prompt is short
        self.levels = [piece[j:j + w] for j in range(levels)]
        return self.root

    def inputs(self) -> LookaheadInputs:
        """Root + window + candidate trie for the current state (see the module docstring)."""
        m, past = self.m, self.past
        lw = len(self._window_offsets)
        buf, trie_tokens = self._trie(self.pool.candidates(self.root))
        total = 1 + lw + (0 if buf is None else buf.num_nodes - 1)
        vis = torch.zeros(total, total, dtype=torch.bool, device=m.device)
        vis[:1 + lw, :1 + lw] = self._window_vis
        positions = [torch.tensor([past], device=m.device), self._window_offsets + past]
        if buf is not None:
            vis[1 + lw:, 0] = True                                 # the trie sees the root ...
            vis[1 + lw:, 1 + lw:] = buf.tree_mask[1:, 1:]          # ... and its own ancestors
            positions.append(buf.position_offsets[1:] + past)
        mask = torch.zeros(1, 1, total, past + total, dtype=m.dtype, device=m.device)
        mask[0, 0, :, past:].masked_fill_(~vis, torch.finfo(m.dtype).min)
        tokens = [self.root] + [t for level in self.levels for t in level] + trie_tokens[1:]
        return LookaheadInputs(tokens, torch.cat(positions), mask, lw, buf, trie_tokens)

    def step(self) -> tuple[list[int], int]:
        m, past, w = self.m, self.past, self.s.window
        x = self.inputs()
        lw, buf = x.window_size, x.trie
        ids = torch.tensor([x.tokens], dtype=torch.long, device=m.device)
        h = m.hidden(ids, x.positions[None], self.cache, x.mask)[0]

        guessed = m.logits(h[1 + lw - w:1 + lw]).argmax(-1)    # the last level's next tokens, read with the verdict
        if buf is None:
            path = [0]
            bonus, *guesses = torch.cat([choose_token(m.logits(h[:1]), self.cfg, self.gen), guessed]).tolist()
        else:
            rows = torch.cat([torch.zeros(1, dtype=torch.long, device=m.device),
                              torch.arange(1 + lw, len(x.tokens), device=m.device)])
            verdict = verify(buf, torch.tensor([self.root] + x.trie_tokens[1:], device=m.device), m.logits(h[rows]),
                             self.cfg, None, self.gen, also=[guessed])
            path, bonus, guesses = verdict.path, verdict.bonus, verdict.also
        self.cache.keep(past, [0] + [lw + v for v in path[1:]])  # drop the window and rejected nodes
        new = [x.trie_tokens[v] for v in path[1:]] + [bonus]

        for i in range(w):
            self.pool.add([level[i] for level in self.levels] + [guesses[i]])
        self.levels = self.levels[1:] + [guesses]
        self.last_path = path
        self.past = past + len(path)
        self.root = bonus
        return new, (buf.max_depth if buf is not None else 0)


register(Method(
    "lookahead", "Jacobi window + n-gram pool, verified in one forward (training-free)", LookaheadSettings,
    decoder=lambda m, o, sampling, seed: LookaheadDecoder(m, o, sampling, seed),
    costs=lambda m, o, run_length: slot_costs(m, o.extra_kv_tokens)))
