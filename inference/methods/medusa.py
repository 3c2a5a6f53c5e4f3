"""Medusa tree decoding (method ``medusa``).

One step, for batch size 1:
  1. the root is the token already chosen by the backbone (prefill or previous bonus);
  2. the heads run once, on the hidden state of the last accepted position only, and their
     top-k guesses (or sampled drafts) fill the tree (the heads' ``draft_tree``);
  3. one forward of the stock transformers decoder over all N tree nodes, with position ids
     past + depth and a [1, 1, N, past + N] additive mask (a node sees the prefix, its
     ancestors and itself); the lm_head runs on those N hidden states only;
  4. ``verify.verify`` picks the accepted path and the bonus token;
  5. the KV cache keeps prefix + accepted nodes (``TreeKVCache.keep``); the accepted tokens
     and the bonus are emitted; the bonus is the next root.
Tokens per step (tau) = accepted nodes + 1. Proposed per step, for the acceptance rate: the
tree's depth (the most a step can accept), so a tree's rate compares with a chain's.

``tree``: a ``MedusaTree``, a default name (``tree.DEFAULT_TREE_NAMES``), a tree JSON path or a
choices list; None decodes plainly (what ``choice=auto`` picks when no tree beats plain decoding). Its
speculation shape (``medusa_choice.MedusaTreeShape``) chooses the tree on this machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import UserError
from ..heads.drafting import static_tree_refusal
from ..runtime.batch_decode import BatchTreeDecoder, root_only
from ..runtime.decode import prefill_token, seeded_generator
from ..runtime.model import MedusaModel
from ..runtime.speculation import ScheduleCursor, SpeculationSchedule, as_schedule
from ..runtime.tree import MedusaTree, resolve_tree
from ..runtime.verify import SamplingConfig, verify
from .autoregressive import AutoregressiveDecoder
from .medusa_choice import MedusaTreeShape
from .registry import Method, heads_costs, option, register


@dataclass
class MedusaOptions:
    tree: Any = option("tree8", "tree", "the Medusa tree: a default name (tree4, tree8, chain3, ...), a tree JSON path, "
                       "calibrated:N (medusa-eval: the best N-node tree for these heads, grown from their accuracy "
                       "measured on the calibration prompts and kept whatever its speed: compare heads at one budget) "
                       "or choices; "
                       "given, choice=auto leaves it as named")


def check_tree_heads(m: MedusaModel, missing: str = "this model has no Medusa heads: use method autoregressive"
                     ) -> None:
    """Before any decoding (not at the first step's ``draft_tree``), and before a tree is resolved against the heads'
    count: heads are there (else ``missing``) and they draft a fixed tree (``static_tree_refusal``)."""
    if m.heads is None:
        raise UserError(missing)
    reason = static_tree_refusal(m.heads.spec)
    if reason:
        raise UserError(reason)


def checked_tree(m: MedusaModel, tree: MedusaTree) -> MedusaTree:
    """``tree``, once it is known to fit the heads' count and output size (a clear error otherwise)."""
    tree.check_fits(m.num_heads, getattr(m.heads.spec, "output_size", m.vocab_size))
    return tree


class TreeDecoder:
    """Medusa decoding state for one sequence: ``prefill`` once, then ``step`` repeatedly.

    After each step: ``cache`` holds prompt + every emitted token except the current root
    (``past`` entries), ``root`` is the last emitted token, ``last_path`` the accepted nodes.
    """

    def __init__(self, m: MedusaModel, tree, sampling: Optional[SamplingConfig] = None,
                 seed: Optional[int] = None):
        check_tree_heads(m)
        self.m = m
        self.tree: MedusaTree = checked_tree(m, resolve_tree(tree, m.num_heads))
        self.buf = self.tree.buffers(m.device)
        self.cfg = sampling or SamplingConfig()
        m.heads.check_sampling(self.cfg)
        self.gen = seeded_generator(m.device, seed)
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
        self.h_last, self.root = prefill_token(self.m, prompt, self.cache, self.cfg, self.gen)
        return self.root

    @torch.inference_mode()
    def step(self) -> tuple[list[int], int]:
        """One draft-verify-compact step; returns (accepted tokens + the bonus token, the tree's depth: what
        it proposed, as the module docstring counts it and the batched decoder does)."""
        m, buf, past = self.m, self.buf, self.past
        cand, draft_q = m.draft_tree(buf, self.h_last, self.root, self.cfg, self.gen)
        # torch.full, not torch.tensor([root]): a copy from host memory waits for the draft queued before it
        tokens = torch.cat([torch.full((1,), self.root, dtype=torch.long, device=m.device), cand])
        positions = (buf.position_offsets + past)[None]
        h_tree = m.hidden(tokens[None], positions, self.cache, buf.additive_mask(past, m.dtype))[0]
        verdict = verify(buf, tokens, m.logits(h_tree), self.cfg, draft_q, self.gen)
        self.cache.keep(past, verdict.path)
        self.last_path = verdict.path
        self.h_last = h_tree[verdict.path[-1]]
        self.past = past + len(verdict.path)
        self.root = verdict.bonus
        return verdict.accepted_tokens(tokens) + [verdict.bonus], buf.max_depth


class HeadsDrafter:
    """Batched drafting from heads (``BatchTreeDecoder``'s ``Drafter``): each step the heads fill the
    tree the schedule picks for the number of active rows (one tree for every batch size when
    given a tree; plain steps where the schedule says none pays)."""

    def __init__(self, m: MedusaModel, tree):
        check_tree_heads(m)
        self.m = m
        self.schedule = as_schedule(tree if isinstance(tree, SpeculationSchedule) or tree is None
                                    else resolve_tree(tree, m.num_heads))
        trees = [t for t in self.schedule.choices.values() if t is not None]
        for t in trees:
            checked_tree(m, t)
        self._buffers = {id(t): t.buffers(m.device) for t in trees}
        self.max_nodes = max([t.num_nodes for t in trees], default=1)
        self.max_depth = max([t.max_depth for t in trees], default=0)
        self.cursor = ScheduleCursor(self.schedule)

    def check_sampling(self, cfg: SamplingConfig) -> None:
        self.m.heads.check_sampling(cfg)

    def draft(self, dec: BatchTreeDecoder):
        tree = self.cursor.next(dec.batch)
        if tree is None:
            return root_only(self.m.device), torch.empty(dec.batch, 0, dtype=torch.long, device=self.m.device), None
        buf = self._buffers[id(tree)]
        cand, draft_q = self.m.draft_tree(buf, dec.h_last, dec.root, dec.cfg, dec.gen)
        return buf, cand, draft_q

    def rows_kept(self, index: list[int]) -> None:
        pass


# the tree every Medusa-tree method decodes with (medusa, medusa_lookup): one choice for all of them
MEDUSA_TREE = MedusaTreeShape(HeadsDrafter)


def tree_nodes(m: MedusaModel, tree) -> int:
    return resolve_tree(tree, m.num_heads).num_nodes if tree is not None else 0


def tree_depth(tree) -> int:
    return tree.max_depth if isinstance(tree, MedusaTree) else 0


register(Method(
    "medusa", "Medusa heads draft a tree, verified in one forward (needs heads=; tree=)", MedusaOptions,
    decoder=lambda m, o, sampling, seed: (TreeDecoder(m, o.tree, sampling, seed) if o.tree is not None
                                          else AutoregressiveDecoder(m, sampling, seed)),
    batch_decoder=lambda m, o, sampling, seed, ragged: BatchTreeDecoder(m, HeadsDrafter(m, o.tree), sampling, seed,
                                                                       ragged),
    costs=lambda m, o, run_length: heads_costs(m, tree_nodes(m, o.tree)),
    proposed=lambda o: tree_depth(o.tree), needs_heads=True, shape=MEDUSA_TREE, refuses=static_tree_refusal))
