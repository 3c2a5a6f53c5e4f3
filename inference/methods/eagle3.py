"""EAGLE-3 drafter, EAGLE-2 dynamic draft trees (method ``eagle3``).

The drafter (``heads/eagle3.py``) keeps its own KV cache (``DraftKV``): one committed entry per
backbone position p whose features are known, fed (fc(aux_p), x_{p+1}) at RoPE position p, whose
output guesses x_{p+2}. Between steps the backbone cache and the committed draft entries both
cover positions 0..past-1, ``root`` (x_past) is chosen but not yet run, and the last committed
entry (p = past-1, fed the root) gave the root's children's distribution (``root_logits``) and
the state depth 1 continues from (``root_state``).

One step, batch 1:
  1. depth 1: the top-k of the root's draft distribution, scored by log-probability;
  2. depths 2..D: the k best-scored nodes of the last depth are expanded in ONE drafter call
     (rows = those nodes, at position past-1+d, each fed its token and its parent's pre-norm
     state, seeing the committed entries, its ancestors' draft entries and itself through an
     additive mask); their entries go after the committed ones; each row's top-k become its
     children, scored parent score + log q (EAGLE-2: k^2 candidates per depth, k expanded);
  3. rerank: the N best-scored drafted nodes form the tree, less those whose draft probability
     (exp score) is below ``eagle_min_prob``: a verified row costs on a CPU (~7% of a plain step
     each on SmolLM2), so a guess the drafter itself rates unlikely is not worth one there. A child
     never scores above its parent and ties go to the earlier (shallower) node, so every kept node's
     ancestors are kept; drafting order puts parents first, as ``TreeBuffers`` need;
  4. one backbone forward over root + tree (tree mask, positions past + depth, as Medusa), the
     tap reading the drafter's three aux layers on the way; ``verify`` (greedy; typical; exact
     sampling, the candidates being deterministic: draft=topk) picks the path and the bonus;
  5. the backbone cache keeps the path (``TreeKVCache.keep``); the draft entries are dropped and
     the drafter catches up over the path's positions with their TRUE aux features (the tap's
     rows of the accepted nodes, which saw exactly their causal context), fed the next accepted
     token / the bonus, in one call: committed; its last row is the next root's distribution.
Per step: D-1 expansion calls, one verification forward, one catch-up call. Tokens per step =
accepted + 1; proposed per step = the kept tree's depth (the most it could accept, as Medusa).

Batches (``generate_batch``): ``eagle3_batch``, every row its own tree grown as here, all rows'
trees verified in one forward.

With static steps (``graphs=``, ``MedusaModel.static``) the drafter's cache is a fixed-shape one and steps 1-2
(one call per setting) and 5 (one per accepted length) are captured calls (``eagle3_static``): the same
drafts, without their few dozen kernel launches from Python a step on a GPU. A step also reranks in that call: its
tree comes out at the setting's fixed size N + 1, built on the device (``runtime.static_tree``: the nodes below
eagle_min_prob kept as masked nodes, never accepted), so the step's one host read is its verdict (every mode), where
``select_nodes`` / ``tree_buffers`` read three or more times. graphs=off keeps ``DraftKV`` and the host-built tree.

Options (``medusa-eval`` keys): eagle_nodes N (draft tokens verified per step, root excluded;
0 = plain decoding), eagle_depth D, eagle_topk k, eagle_min_prob p (0: every one of the N);
choice=auto lets an evaluation choose (N, D, k[, p]), or plain decoding when no setting beats it
(the method's speculation shape, ``eagle3_choice.Eagle3Shape``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from ..errors import UserError
from ..heads.eagle3 import DraftKV, StaticDraftKV, draft_kv_bytes_per_slot
from ..runtime.batch_decode import BatchTreeDecoder, PlainDrafter
from ..runtime.decode import seeded_generator
from ..runtime.graph_capture import to_device
from ..runtime.model import MedusaModel
from ..runtime.tree import select_nodes, tree_buffers
from ..runtime.static_tree import StaticTree
from ..runtime.verify import SamplingConfig, choose_token, verify
from .autoregressive import AutoregressiveDecoder
from .eagle3_choice import Eagle3Shape
from .eagle3_expand import expand
from .eagle3_batch import Eagle3BatchDrafter
from .eagle3_static import catch_up_call, draft_cache, draft_call, tag, tree_step
from .registry import Costs, Method, heads_costs, option, register

# The largest eagle_* settings taken: a step costs D-1 drafter calls over k^2 candidates, then one verification of
# N + 1 rows, so eagle_depth=100000 is 10^5 calls a step. Far above any setting that pays: EAGLE-2's own default is
# (59 nodes, depth 6, top-10), SGLang's speculative_num_steps / speculative_eagle_topk / speculative_num_draft_tokens
# are served in the single digits / ~10 / <= 64, and this runtime's choices stop at (32, 6, 8) (EAGLE3_GRID).
EAGLE_BOUNDS = {"nodes": (0, 256), "depth": (1, 32), "topk": (1, 64)}
HEADS_KIND = "eagle3"   # the drafter family (heads registry kind) this method and eagle3_lookup decode with


@dataclass
class Eagle3Options:
    # nodes / depth left None are fitted to the drafter when the options meet the model (``fitted``)
    nodes: Optional[int] = option(None, "eagle_nodes", "N: draft tokens verified per step (root excluded), at most "
                                  "256; 0: plain decoding; unset: fitted to the drafter (at most 8)")
    depth: Optional[int] = option(None, "eagle_depth", "D: tree depth (D-1 drafter calls per step), at most 32; "
                                  "unset: the drafter's trained draft steps (at most 4)")
    topk: int = option(4, "eagle_topk", "k: children per expanded node, nodes expanded per depth; at most 64")
    min_prob: float = option(0.0, "eagle_min_prob", "p: of the N best drafted nodes, verify only those whose "
                             "draft probability (the product along their path) is at least p; 0: all N")
    # batches only: a setting (or None: plain steps) per batch size, as a batched evaluation sizes it
    schedule: Any = option(None, None, "a SpeculationSchedule of eagle3 settings (batched decoding)")
    METHOD: ClassVar[str] = "eagle3"    # the method these options are for (its name in refusals)

    def __post_init__(self):
        for name, (low, high) in EAGLE_BOUNDS.items():
            v = getattr(self, name)
            if v is None and name != "topk":
                continue   # fitted to the drafter later
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise UserError(f"eagle_{name} must be an integer in {low}..{high}, got {v!r}")
        p = self.min_prob
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
            raise UserError(f"eagle_min_prob must be a probability in [0, 1) (0 verifies all eagle_nodes), got {p!r}")
        if self.nodes is None or self.depth is None:
            return
        most = max_nodes(self.depth, self.topk)
        if self.nodes > most:
            raise UserError(f"eagle_nodes={self.nodes} is more than depth {self.depth} x top-{self.topk} drafts "
                            f"(k + (D-1) k^2 = {most})")

    def fitted(self, spec) -> "Eagle3Options":
        """These options with eagle_nodes / eagle_depth left unset fitted to the drafter of ``spec``
        (``fitted_tree``); unchanged when both are given."""
        if self.nodes is not None and self.depth is not None:
            return self
        nodes, depth = fitted_tree(spec, self.nodes, self.depth, self.topk)
        return dataclasses.replace(self, nodes=nodes, depth=depth)

    @property
    def label(self) -> str:
        if self.nodes is None or self.depth is None:
            return "fitted to the drafter"
        if not self.nodes:
            return "plain decoding"
        return f"n{self.nodes}-d{self.depth}-k{self.topk}" + (f"-p{self.min_prob:g}" if self.min_prob else "")

    @property
    def min_score(self) -> Optional[float]:
        """The lowest cumulative log-probability a verified node may have (None: no floor)."""
        return math.log(self.min_prob) if self.min_prob else None

    def fixed_choice(self):
        """What these options decode at every batch size, as a schedule records it (None: plain decoding)."""
        return self if self.nodes else None

    @property
    def steps_vary(self) -> bool:
        """Whether steps of one setting differ in the rows they verify by themselves (a looked-up branch
        grafted on some steps only, or nodes dropped below eagle_min_prob on some): the latency-aware
        choices then cost a setting by its mean step."""
        return self.min_prob > 0

    def batch_drafter(self, m: MedusaModel, schedule) -> Eagle3BatchDrafter:
        """The batched drafter of ``schedule``'s settings for this method (``eagle3_lookup`` adds its branch)."""
        return Eagle3BatchDrafter(m, schedule)

    def check_model(self, m: MedusaModel) -> None:
        """Refuse, in one line, decoding ``m`` with these options: no EAGLE-3 heads, more children than the
        drafter has outputs."""
        if m.heads is None:
            raise UserError(f"method {self.METHOD} needs EAGLE-3 heads (heads=<export directory>)")
        reason = refuse_heads(m.heads.spec, self.METHOD)
        if reason:
            raise UserError(reason)
        self.check_spec(m.heads.spec)

    def check_spec(self, spec) -> None:
        """Refuse, in one line, what the drafter's config (``spec``) alone rules out: more children per node
        than it has outputs. Called before the backbone loads, and again by ``check_model``."""
        outputs = getattr(spec, "output_size", None) if getattr(spec, "kind", None) == HEADS_KIND else None
        if outputs and self.topk > outputs:
            raise UserError(f"eagle_topk={self.topk} is more than the drafter's {outputs} outputs")


def max_nodes(depth: int, topk: int) -> int:
    """Nodes a step drafts: k at depth 1, then k^2 at each deeper depth (k parents x k children)."""
    return topk + (depth - 1) * topk * topk


FITTED_MAX_DEPTH, FITTED_MAX_NODES = 4, 8   # caps of the tree fitted for unset eagle_depth / eagle_nodes


def fitted_tree(spec, nodes: Optional[int], depth: Optional[int], topk: Any) -> tuple[int, int]:
    """(eagle_nodes, eagle_depth) for the keys / options left unset (None), from the drafter: a tree no
    deeper than it was trained to draft (its spec's ``num_heads``, the training-time-test steps; at most 4)
    and as many nodes as that depth and top-k hold (at most 8). A drafter trained one step deep has never
    continued from its own features, so its deeper drafts are guesses it never learned: on 2 CPU cores the
    recipe's one-step drafter decodes n8-d4-k4 no faster than plain decoding (0.99x) and n4-d1-k4 at 1.16-1.21x
    (benchmarks/history.md "Decoding defaults fitted to the drafter"). Given keys are kept as they are
    (Eagle3Options checks them)."""
    if depth is None:
        trained = getattr(spec, "num_heads", None) if getattr(spec, "kind", None) == HEADS_KIND else None
        depth = max(1, min(FITTED_MAX_DEPTH, int(trained or FITTED_MAX_DEPTH)))
    if nodes is None:
        def valid(v):  # a bad depth / top-k is refused by Eagle3Options, naming that key, not eagle_nodes
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        nodes = min(FITTED_MAX_NODES, max_nodes(depth, topk)) if valid(depth) and valid(topk) else FITTED_MAX_NODES
    return nodes, depth


def refuse_heads(spec, method: str = "eagle3") -> Optional[str]:
    """Why ``method`` (eagle3, or a method built on it) cannot decode with heads of ``spec`` (one line), or None."""
    kind = getattr(spec, "kind", "medusa")
    if kind != HEADS_KIND:
        return f"method {method} needs EAGLE-3 heads (kind eagle3), these are {kind} heads: use methods=[medusa]"
    return None


class Eagle3Decoder:
    """EAGLE-3 decoding state for one sequence: ``prefill`` once, then ``step`` repeatedly
    (module docstring). After each step ``cache`` and ``dkv`` hold ``past`` entries."""

    def __init__(self, m: MedusaModel, options: Eagle3Options, sampling: Optional[SamplingConfig] = None,
                 seed: Optional[int] = None):
        options.check_model(m)
        options = options.fitted(m.heads.spec)    # constructed directly, not through generate()
        self.m, self.o, self.drafter = m, options, m.heads
        self.cfg = sampling or SamplingConfig()
        self.drafter.check_sampling(self.cfg)
        self.gen = seeded_generator(m.device, seed)
        self.tap = m.aux_tap(self.drafter.spec.settings.aux_layers)
        self.cache = self.dkv = None
        self.past = 0
        self.root: Optional[int] = None
        self.root_logits = self.root_state = None
        self.last_path: list[int] = []
        self.extra_nodes = 0        # tree nodes a step may add beyond the drafted ones (eagle3_lookup's graft)
        self.claimed = 0            # with static steps: this generation's claim on the shared drafter cache
        self.also_read: list[int] = []   # what ``_static_tree`` asked the last step's verdict read to bring besides

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor, max_new_tokens: int) -> int:
        """Run the prompt [1, L] through the backbone (tapped) and the drafter; returns the first root."""
        m, o = self.m, self.o
        n = prompt.shape[1]
        self.past = n
        self.cache = m.new_cache(n + max_new_tokens + o.nodes + 1 + self.extra_nodes)
        # committed entries (<= n + max_new_tokens + the deepest tree) plus one step's draft entries
        need = n + max_new_tokens + o.depth + 1 + self.extra_nodes + (o.depth - 1) * o.topk
        if m.on_static(self.cache):     # the drafter's calls go through captured calls (eagle3_static)
            self.dkv = draft_cache(m, 1, need)
            self.claimed = self.dkv.claim()
        else:
            self.dkv = DraftKV(need)
        h, aux = m.hidden_aux(prompt, torch.arange(n, device=m.device)[None], self.cache, self.tap)
        self.root = int(choose_token(m.logits(h[0, -1]), self.cfg, self.gen))
        self._catch_up(aux[0], torch.cat([prompt[0, 1:], prompt.new_tensor([self.root])]), 0)
        return self.root

    def _catch_up(self, aux: torch.Tensor, nxt: torch.Tensor, start: int) -> None:
        """Commit the drafter entries of backbone positions start..start+n-1: true features aux
        [n, 3H], each fed the token after it nxt [n]; the last row drafts the next root's children."""
        if isinstance(self.dkv, StaticDraftKV):
            return self._catch_up_static(aux, nxt, start)
        d = self.drafter
        pos = torch.arange(start, start + nxt.numel(), device=nxt.device)[None]
        past = self.dkv.view() if self.dkv.length else None
        normed, pre, (k, v) = d.forward_step(nxt[None], d.combine(aux)[None], pos, past)
        self.dkv.append(k, v)
        self.root_logits, self.root_state = d.project(normed[0, -1]), pre[0, -1]

    def _catch_up_static(self, aux: torch.Tensor, nxt: torch.Tensor, start: int) -> None:
        """``_catch_up`` on the static cache: a captured call per row count, ``start`` a device input. The
        prompt's (start 0: once per generation, of any length) runs the same function eagerly."""
        n, kv = nxt.numel(), self.dkv
        kv.check(self.claimed)
        if start + n > kv.capacity:
            raise RuntimeError(f"draft KV cache full ({kv.capacity} slots)")
        fn = catch_up_call(self.drafter, kv, n)
        inputs = (aux, nxt, torch.full((), start, dtype=torch.long, device=nxt.device))
        if start == 0:
            out = fn(*inputs)
        else:
            out = self.m.static.calls.run(f"eagle3.catchup{n}:{tag(kv)}", fn, inputs, keep=kv)
        self.root_logits, self.root_state = out
        kv.length = start + n

    def _draft(self):
        """Grow the dynamic tree (steps 1-2, ``eagle3_expand.expand``): token, score, parent (-1: the root) and depth
        of every drafted node, in drafting order. Draft entries are appended after the committed ones."""
        if isinstance(self.dkv, StaticDraftKV):    # one captured call per setting (eagle3_static.draft_call)
            o, kv = self.o, self.dkv
            return self.m.static.calls.run(f"eagle3.draft-d{o.depth}k{o.topk}:{tag(kv)}",
                                           draft_call(self.drafter, kv, o.depth, o.topk), self._draft_inputs(), keep=kv)
        d, dev, committed = self.drafter, self.m.device, self.dkv.length
        neg = torch.finfo(self.m.dtype).min

        def attend(level, entries, rows, tok, state, sees):    # over the committed and this step's draft entries
            mask = torch.full((1, 1, rows, committed + entries + rows), neg, dtype=self.m.dtype, device=dev)
            mask[..., :committed] = 0
            mask[0, 0, :, committed:].masked_fill_(sees[0, :, :entries + rows], 0)   # ancestors' and its own
            positions = torch.full((1, rows), committed - 1 + level, dtype=torch.long, device=dev)
            normed, pre, (kk, vv) = d.forward_step(tok, state, positions, self.dkv.view(), mask)
            self.dkv.append(kk, vv)
            return normed, pre
        out = expand(d, self.root_logits[None], self.root_state[None], self.o.depth, self.o.topk, attend)
        return tuple(x[0] for x in out)

    def _draft_inputs(self) -> tuple[torch.Tensor, ...]:
        """The static draft's inputs (root distribution, root state, committed count), once the cache is checked to
        be this generation's and to hold a step's draft entries."""
        o, kv = self.o, self.dkv
        kv.check(self.claimed)
        if kv.length + (o.depth - 1) * o.topk > kv.capacity:
            raise RuntimeError(f"draft KV cache full ({kv.capacity} slots)")
        return self.root_logits, self.root_state, torch.full((), kv.length, dtype=torch.long, device=self.m.device)

    def _static_tree(self) -> tuple[StaticTree, tuple]:
        """Steps 1-3 as one captured call (``eagle3_static.tree_call``): this step's tree at the setting's fixed size,
        built on the device, so a step reads the host once (its verdict); and device scalars for
        that read to bring besides (none here; ``eagle3_lookup``'s nodes grafted), left in ``also_read``."""
        o, kv = self.o, self.dkv
        root = torch.full((), self.root, dtype=torch.long, device=self.m.device)
        name, fn = tree_step(self.drafter, kv, o)     # named by every value it freezes (the floor too)
        fields = self.m.static.calls.run(name, fn, (*self._draft_inputs(), root), keep=kv)
        return StaticTree(*fields), ()

    def tree(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This step's tree (steps 1-3): tokens, parents (-1: the root) and depths [T] of the root and
        the N best-scored drafted nodes (those below eagle_min_prob dropped), parents before children.
        ``eagle3_lookup`` grafts onto it."""
        tok, score, parent, depth = self._draft()
        keep, parents = select_nodes(score, parent, self.o.nodes, self.o.min_score)
        depths = torch.cat([depth.new_zeros(1), depth[keep]])
        return torch.cat([tok.new_tensor([self.root]), tok[keep]]), parents, depths

    @torch.inference_mode()
    def step(self) -> tuple[list[int], int]:
        """One draft-verify-compact step; returns (accepted tokens + the bonus token, the tree's depth)."""
        m, past, dev = self.m, self.past, self.m.device
        one_read = isinstance(self.dkv, StaticDraftKV)
        self.also_read = []
        if one_read:                                 # the tree built on the device: the verdict is the one host read
            buf, extra = self._static_tree()
            tokens, depths = buf.tokens, buf.position_offsets
            ids = tokens.clamp(min=0)                # a masked node's -1 is for verification, not the embedding
        else:
            tokens, parents, depths = self.tree()
            buf, ids = tree_buffers(parents, depths, int(depths.max())), tokens
        h, aux = m.hidden_aux(ids[None], (depths + past)[None], self.cache, self.tap, buf.additive_mask(past, m.dtype))
        logits = m.logits(h[0])
        if one_read:
            verdict = verify(buf, tokens, logits, self.cfg, None, self.gen, also=[depths.max(), *extra])
            max_depth, self.also_read = verdict.also[0], verdict.also[1:]
        else:
            verdict, max_depth = verify(buf, tokens, logits, self.cfg, None, self.gen), buf.max_depth
        self.cache.keep(past, verdict.path)
        self.dkv.truncate(past)                      # drop the draft entries
        new = verdict.accepted_tokens(tokens) + [verdict.bonus]
        self._catch_up(aux[0, to_device(verdict.path, dev)], to_device(new, dev), past)
        self.last_path = verdict.path
        self.past = past + len(verdict.path)
        self.root = verdict.bonus
        return new, max_depth


def fit_options(m: MedusaModel, o: Eagle3Options) -> Eagle3Options:
    """``Method.fit``: the options with an unset tree fitted to ``m``'s drafter (no heads: the caps)."""
    return o.fitted(m.heads.spec if m.heads is not None else None)


def eagle3_costs(m: MedusaModel, o: Eagle3Options, run_length: int) -> Costs:
    """The drafter's parameters, the tree's backbone KV slots and the drafter's own KV cache (one
    layer, the whole run plus one step's draft entries)."""
    if not o.nodes:
        return heads_costs(m, 0)
    costs = heads_costs(m, o.nodes + 1)
    per_slot = draft_kv_bytes_per_slot(m.heads.spec, m.dtype)
    costs.extra_kv_cache_bytes += (run_length + o.depth + 1 + (o.depth - 1) * o.topk) * per_slot
    return costs


def eagle3_batch_decoder(m: MedusaModel, o: Eagle3Options, sampling: Optional[SamplingConfig], seed, ragged: str):
    """Batched eagle3 (``eagle3_batch``): every row its own dynamic tree, with the options' setting or
    the setting ``o.schedule`` gives per batch size, through the options' own batched drafter (so
    ``eagle3_lookup`` adds its branch here too); eagle_nodes=0 (or a schedule plain at every size) is
    the plain batched loop, as batch 1 decodes plainly then."""
    settings = o.schedule if o.schedule is not None else o
    if o.schedule is not None:
        speculates = any(c is not None for c in o.schedule.choices.values())   # else plain at every size
    else:
        speculates = bool(o.nodes)
    drafter = o.batch_drafter(m, settings) if speculates else PlainDrafter()
    return BatchTreeDecoder(m, drafter, sampling, seed, ragged)


register(Method(
    "eagle3", "EAGLE-3 drafter grows a dynamic tree (EAGLE-2), verified in one forward (needs eagle3 heads=; "
    "eagle_* keys)", Eagle3Options,
    decoder=lambda m, o, sampling, seed: (Eagle3Decoder(m, o, sampling, seed) if o.nodes
                                          else AutoregressiveDecoder(m, sampling, seed)),
    batch_decoder=eagle3_batch_decoder,
    costs=eagle3_costs, needs_heads=True, refuses=refuse_heads, fit=fit_options, shape=Eagle3Shape(),
    # n-alpha per depth 1..D (a kept tree may be shallower in a step; then its deeper depths count as
    # proposed and not accepted, so the rates are lower bounds)
    proposed=lambda o: o.depth if o.nodes else 0))
