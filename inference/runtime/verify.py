"""Turning head guesses into tree tokens, and deciding which of them the backbone accepts.

Three modes (``SamplingConfig.mode``):

greedy   Lossless. A node is accepted when its token equals the backbone's argmax at its
         parent; the longest accepted root-to-node path is kept and the backbone's argmax at
         its last node is the bonus token. Output is token-identical to plain greedy decoding
         (up to float ties: the tree pass and a one-token pass round differently by ~1e-6).

typical  Medusa's "typical acceptance" (lossy by design, NOT distribution-exact): a node is
         accepted when p(x) > min(epsilon, delta * exp(-H(p))), p the backbone's softmax at
         temperature T at its parent. Among the longest accepted paths the most likely one is
         kept; the bonus is sampled from the filtered p at its last node. With T = 0 it is greedy.

sample   Exact: every generated token follows the backbone's own sampling distribution
         (temperature, then top-k, then top-p: ``filter_probs``), whatever the heads are.
         Two candidate schemes (``SamplingConfig.draft``):

  draft="topk" (default). Children are the heads' deterministic top-k guesses. At an
         accepted node with target p we draw Y ~ p; if a child carries Y it is accepted and we
         descend, otherwise Y is the bonus token and the step ends. Y ~ p at every depth, so
         the output is exactly p's. This equals SpecInfer/EAGLE recursive rejection with the
         *correct* proposal for a deterministic candidate x, the point mass on x: accept x_1
         w.p. min(1, p(x_1)/1) = p(x_1), else p <- normalize(p - p(x_1) e_{x_1}) and go on.
         It is also optimal for deterministic candidates: any exact scheme can only accept
         x_i when it outputs x_i, so P(accept) <= sum_i p(x_i), which this attains.
         Using the head's softmax q in min(1, p/q) with deterministic top-k candidates is
         biased (e.g. p(x)=0.3, q(x)=0.6 emits x with prob 0.5); the tests show that.

  draft="sampled". Children are drawn from q (the head's softmax with the same T / top-k /
         top-p filtering) without replacement: the i-th child (rank order; ranks then only
         mean draw order) of every node at depth d-1 carries the i-th draw of one Gumbel-top-k
         sequence of head d-1, drawn before any target randomness. Recursive rejection:
         child x_i is accepted w.p. min(1, p_i(x_i)/q_i(x_i)); on rejection
         p_{i+1} = normalize(max(0, p_i - q_i)) and q_{i+1} = q_i with x_i removed and
         renormalised (the law of the next draw given the earlier ones); if every child is
         rejected the bonus is drawn from the residual p. Exact by induction on the number of
         siblings: each stage is one step of standard speculative sampling with target p_i and
         proposal q_i, whose "reject" branch must produce a sample of p_{i+1}; the later stages
         do, since x_{i+1} ~ q_{i+1} independently of the uniform that rejected x_i. Drafts
         share draws across parents: the children of the one node accepted at a depth are still
         a fresh without-replacement sample of q, independent of the decisions that led there.
         Better than "topk" when the heads' q is close to p; worse when heads are under-confident.

``verify_sample`` is vectorised over a batch of independent trials so the exactness test can
run 10^5 samples; decoding calls it with B = 1.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..errors import UserError
from .static_tree import StaticTree
from .tree import RowTrees, TreeBuffers

MODES = ("greedy", "typical", "sample")
UNIFORMS = 32   # uniforms ``verify_sample`` draws a step (more for a deeper tree)
DRAFTS = ("topk", "sampled")


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. ``temperature``/``top_k``/``top_p`` define the target distribution. Frozen: its
    values are checked once, here (``dataclasses.replace`` makes a checked copy); a field set afterwards
    (``top_p = 0``) reached the sampler unchecked, a NaN distribution deep in torch."""

    mode: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0          # 0 = off
    top_p: float = 1.0      # 1.0 = off
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    draft: str = "topk"     # sample mode only: "topk" or "sampled" (see module docstring)

    def __post_init__(self):
        for name in ("temperature", "top_p", "typical_epsilon", "typical_delta"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise UserError(f"{name} must be a number, got {value!r}")
        if not isinstance(self.top_k, numbers.Integral) or isinstance(self.top_k, bool):
            raise UserError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.mode not in MODES:
            raise UserError(f"decoding mode must be one of {MODES}, got {self.mode!r}")
        if self.draft not in DRAFTS:
            raise UserError(f"draft scheme must be one of {DRAFTS}, got {self.draft!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise UserError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.mode == "sample" and self.temperature == 0:
            raise UserError("sample mode needs temperature > 0 (temperature 0 is greedy: use mode=greedy)")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 < self.typical_epsilon < math.inf and 0 < self.typical_delta < math.inf):
            raise UserError("typical_epsilon and typical_delta must be > 0")
        if self.typical_epsilon > 1:   # it caps a probability: above 1 nothing is accepted (1e300 crashed in torch)
            raise UserError(f"typical_epsilon caps a probability: it must be in (0, 1], got {self.typical_epsilon}")

    @property
    def is_greedy(self) -> bool:
        return self.mode == "greedy" or self.temperature == 0


@dataclass
class Verdict:
    """Outcome of one verification: accepted node indices (root first) and the bonus token."""

    path: list[int]
    bonus: int
    tokens: Optional[list[int]] = None   # the path's tokens, where verification read them with the path
    also: list[int] = field(default_factory=list)   # what the caller asked to read with them (``verify_greedy``)

    def accepted_tokens(self, tokens: torch.Tensor) -> list[int]:
        """The accepted drafted tokens (root excluded) of ``tokens`` [N]: from verification's own host read where
        it packed them (greedy), else read now (on a GPU each read waits for the device)."""
        return self.tokens[1:] if self.tokens is not None else tokens[self.path[1:]].tolist()


# -- distributions ------------------------------------------------------------------------
MIN_TEMPERATURE = 2.0 ** -126   # float32's smallest normal number: any temperature below it samples the argmax


def filter_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """softmax(logits / T), keep the top_k most likely, renormalise, keep the smallest top-p nucleus.

    Computed in float32 whatever the model dtype, so the same logits always give the same
    distribution (the target of exact sampling and of the plain sampling baseline). The logits are shifted by their
    maximum before the division (softmax is shift-invariant): a tiny temperature (1e-39) then gives the argmax
    distribution, where logits / T overflowed to inf and the softmax to NaN; one below float32's range (1e-46, 0
    in float32: 0 / 0 at the maximum) is taken as its smallest normal number, ``MIN_TEMPERATURE``.
    """
    z = logits.float()
    probs = torch.softmax((z - z.amax(-1, keepdim=True)) / max(temperature, MIN_TEMPERATURE), dim=-1)
    if top_k and top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)      # top-p then sees the kept mass (as HF)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p          # mass strictly above each token
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False                       # the first token is always kept (top_p 1e-46 is 0 in fp32)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def target_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    return filter_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)


def choose_token(logits: torch.Tensor, cfg: SamplingConfig, generator: Optional[torch.Generator]) -> torch.Tensor:
    """The backbone's own next token(s): argmax when greedy, else a sample of the target."""
    if cfg.is_greedy:
        return logits.argmax(-1)
    p = target_probs(logits, cfg)
    return torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=generator).reshape(p.shape[:-1])


def plain_token(logits: torch.Tensor, cfg: SamplingConfig, generator: Optional[torch.Generator]) -> torch.Tensor:
    """The next token of plain decoding from logits [V]: ``choose_token``, but in sample mode drawn as the verification
    of a one-node tree draws it (``verify_sample``: a step's uniforms, the bonus from the first), so plain decoding of
    one prompt and the plain batched loop with one row emit the same tokens from one seed. The same law."""
    if cfg.mode != "sample" or cfg.is_greedy:
        return choose_token(logits, cfg, generator)
    uniforms = torch.rand(1, UNIFORMS, generator=generator, device=logits.device)
    return draw(target_probs(logits[None], cfg).float(), uniforms[:, 0])[0]


# -- proposals ----------------------------------------------------------------------------
def propose(buf: TreeBuffers, head_logits: list[torch.Tensor], to_vocab, cfg: SamplingConfig,
            generator: Optional[torch.Generator], vocab_size: int):
    """Tokens for tree nodes 1..N-1 from each head's logits at the last accepted position.

    ``head_logits[k]`` is head k's [..., local_vocab] logits (leading dims = independent
    trials); ``to_vocab`` maps local ids to vocabulary ids (truncated heads). Returns
    (tokens [..., N-1], draft_probs [..., D, vocab] or None); draft_probs is each head's
    full-vocabulary q, returned only for draft="sampled" (the only rule that uses it).
    """
    d = buf.max_depth
    lead = head_logits[0].shape[:-1] if head_logits else ()
    if d == 0:
        return torch.empty(*lead, 0, dtype=torch.long, device=buf.node_head.device), None
    if cfg.mode == "sample" and cfg.draft == "sampled":
        q_local = torch.stack([filter_probs(head_logits[k], cfg.temperature, cfg.top_k, cfg.top_p)
                               for k in range(d)], dim=-2)                # [..., D, Vl]
        m = max(buf.slots_per_depth)
        # Gumbel-top-m: m draws without replacement, in draw order (ties have probability 0).
        u = torch.rand(q_local.shape, generator=generator, device=q_local.device).clamp_(min=1e-20)
        keys = q_local.log() - (-u.log()).log()
        draws = to_vocab(keys.topk(m, dim=-1).indices)                    # [..., D, m]
        local_ids = to_vocab(torch.arange(q_local.shape[-1], device=q_local.device))
        q = torch.zeros(*q_local.shape[:-1], vocab_size, device=q_local.device)
        q.scatter_(-1, local_ids.expand(q_local.shape), q_local)
        return draws[..., buf.node_head, buf.node_slot], q
    kmax = max(buf.topk_per_depth)
    top = torch.stack([head_logits[k].topk(kmax, dim=-1).indices for k in range(d)], dim=-2)  # [..., D, kmax]
    return to_vocab(top)[..., buf.node_head, buf.node_rank], None


# -- verification -------------------------------------------------------------------------
def _accepted_lengths(ri: torch.Tensor, match: torch.Tensor) -> torch.Tensor:
    """Nodes accepted along each leaf path (root included): its all-accepted prefix. ``ri`` [B, L, D+1] the rows'
    leaf paths, ``match`` [B, N]: node i is acceptable given its parent. Returns [B, L]."""
    ok = match.gather(1, ri.clamp(min=0).flatten(1)).view(ri.shape) & (ri >= 0)
    ok[:, :, 0] = True                                     # the root is always accepted
    return ok.int().cumprod(2).sum(2)


def verify_greedy(buf: TreeBuffers | StaticTree, tokens: torch.Tensor, logits: torch.Tensor,
                  also: Sequence[torch.Tensor] = ()) -> Verdict:
    """tokens [N], logits [N, V] (backbone next-token logits at every node). The first longest accepted leaf
    path, found on the device and read back once: on a GPU each read waits for the device. ``also``: long
    tensors (scalars, or a few values each) the caller needs on the host this step, read in that same read
    (``Verdict.also``: their values in order, flattened)."""
    v = greedy_rows(buf.parents, buf.retrieve_indices, tokens[None], logits[None], [x.reshape(1, -1) for x in also])
    return Verdict(v.paths[0], v.bonus[0], v.tokens[0], v.also[0])


@dataclass
class RowVerdicts:
    """Every row's verdict of a batched verification: accepted node paths (root first), bonus tokens, the paths'
    tokens (root first; None where verification did not read them) and what the caller asked to read with them."""

    paths: list[list[int]]
    bonus: list[int]
    tokens: list[Optional[list[int]]]
    also: list[list[int]]


def greedy_rows(parents: torch.Tensor, retrieve: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor,
                also: Sequence[torch.Tensor] = ()) -> RowVerdicts:
    """Greedy verification of B rows at once, in one host read: tokens [B, N], logits [B, N, V]; the tree's
    parents [N] and leaf paths ``retrieve`` [L, D+1] shared by the rows, or each row's own ([B, N], [B, L, D+1]).
    A node is accepted when its token is the backbone's choice at its parent and its parent is accepted; each
    row keeps its first longest accepted path (-1 tokens are never accepted). ``also``: [B] or [B, k] long tensors
    read in the same read (``RowVerdicts.also``)."""
    b, n = tokens.shape
    target = logits.argmax(-1)                                                # [B, N]
    ri = retrieve.expand(b, *retrieve.shape[-2:])                             # [B, L, D+1]
    match = tokens == target.gather(1, parents.expand(b, n).clamp(min=0))     # the root's own entry ignored
    lengths = _accepted_lengths(ri, match)                                    # [B, L]
    best = lengths.argmax(1)                                                  # the first of the longest
    count = lengths.gather(1, best[:, None])                                  # [B, 1]
    leaves = ri.gather(1, best[:, None, None].expand(b, 1, ri.shape[2]))[:, 0]   # [B, D+1]
    bonus = target.gather(1, leaves.gather(1, count - 1))
    return _read_rows(count, bonus, also, leaves, tokens)


def _read_rows(count: torch.Tensor, bonus: torch.Tensor, also: Sequence[torch.Tensor], paths: torch.Tensor,
               tokens: torch.Tensor) -> RowVerdicts:
    """Every row's verdict in one host read: count [B, 1] nodes on its accepted path (root included), bonus [B, 1],
    ``also`` ([B] or [B, k] long tensors), paths [B, D+1] node indices (-1 padded) and the nodes' tokens [B, N]."""
    b = paths.shape[0]
    extra = [x.reshape(b, -1).long() for x in also]
    packed = torch.cat([count, bonus, *extra, paths, tokens.gather(1, paths.clamp(min=0))], 1).tolist()
    at, width = 2 + sum(e.shape[1] for e in extra), paths.shape[1]   # (count, bonus, also, path, its tokens)
    return RowVerdicts([r[at:at + r[0]] for r in packed], [r[1] for r in packed],
                       [r[at + width:at + width + r[0]] for r in packed], [r[2:at] for r in packed])


def verify_typical(buf: TreeBuffers | StaticTree, tokens: torch.Tensor, logits: torch.Tensor, cfg: SamplingConfig,
                   generator: Optional[torch.Generator], also: Sequence[torch.Tensor] = ()) -> Verdict:
    """Typical acceptance of one tree (tokens [N], logits [N, V]); ``typical_rows`` with one row."""
    if cfg.is_greedy:
        return verify_greedy(buf, tokens, logits, also)
    v = typical_rows(buf.parents, buf.retrieve_indices, tokens[None], logits[None], cfg, generator,
                     [x.reshape(1, -1) for x in also])
    return Verdict(v.paths[0], v.bonus[0], v.tokens[0], v.also[0])


def typical_rows(parents: torch.Tensor, retrieve: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor,
                 cfg: SamplingConfig, generator: Optional[torch.Generator],
                 also: Sequence[torch.Tensor] = ()) -> RowVerdicts:
    """Typical acceptance of B rows in one host read (arguments as ``greedy_rows``'): a node is accepted when its
    token's probability at its parent passes the entropy threshold and its parent is accepted; among the longest
    accepted paths, the one of the highest summed log-probability; the bonus sampled at its last node. A token
    ``top_k`` / ``top_p`` leave out is never accepted: the plain loop could never sample it. The logits are
    shifted by their maximum first, as ``filter_probs`` does: a tiny temperature then gives the argmax, not NaN."""
    b, n = tokens.shape
    # in place on one float32 copy (the same values as out of place): at 32 rows x 65 nodes x 128,256 tokens each
    # full-vocabulary float32 tensor is ~1 GiB, and the out-of-place forms held four of them at once
    z = logits.to(torch.float32, copy=True)
    z.sub_(z.amax(-1, keepdim=True)).div_(max(cfg.temperature, MIN_TEMPERATURE))
    logp = torch.log_softmax(z, dim=-1)
    del z
    probs = logp.exp()
    entropy = torch.special.entr(probs, out=probs).sum(-1)                            # 0 log 0 = 0
    del probs
    if cfg.top_k or cfg.top_p < 1.0:
        logp = logp.masked_fill(target_probs(logits, cfg) == 0, -math.inf)
    threshold = torch.minimum(torch.full_like(entropy, cfg.typical_epsilon), cfg.typical_delta * torch.exp(-entropy))
    par = parents.expand(b, n).clamp(min=0)
    rows = torch.arange(b, device=tokens.device)
    cand_logp = logp[rows[:, None], par, tokens.clamp(min=0)].masked_fill(tokens < 0, -math.inf)   # -1: no draft
    match = cand_logp.exp() > threshold.gather(1, par)
    ri = retrieve.expand(b, *retrieve.shape[-2:])                                      # [B, L, D+1]
    lengths = _accepted_lengths(ri, match)                                             # [B, L]
    keep = torch.arange(ri.shape[2], device=ri.device) < lengths[..., None]
    on_path = cand_logp.gather(1, ri.clamp(min=0).flatten(1)).view(ri.shape)
    total = torch.where(keep, on_path, torch.zeros_like(on_path)).sum(2)
    total = total.masked_fill(lengths < lengths.max(1, keepdim=True).values, -math.inf)   # longest first, then score
    best = total.argmax(1)
    count = lengths.gather(1, best[:, None])                                           # [B, 1]
    leaves = ri.gather(1, best[:, None, None].expand(b, 1, ri.shape[2]))[:, 0]          # [B, D+1]
    last = leaves.gather(1, count - 1)                                                 # [B, 1]
    bonus = choose_token(logits[rows, last[:, 0]], cfg, generator)[:, None]
    return _read_rows(count, bonus, also, leaves, tokens)


def verify_sample(buf: TreeBuffers | RowTrees | StaticTree, tokens: torch.Tensor, probs,
                  draft_probs: Optional[torch.Tensor],
                  draft: str, generator: Optional[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact tree verification for B independent trials.

    tokens [B, N] (node 0 = root); probs: the target distribution at every node, either a
    [B, N, V] tensor or a function (nodes [B] -> [B, V]) so that decoding only filters the
    few nodes it visits; draft_probs [B, D, V] the heads' q (draft="sampled" only).
    Returns (paths [B, D+1] node indices, -1 padded; accepted [B] number of accepted
    non-root nodes; bonus [B]), on the device: nothing is read to the host (a caller reads them at once,
    ``sampled_rows``), so a step of sampled decoding waits on the device once.
    """
    if draft not in DRAFTS:
        raise UserError(f"draft scheme must be one of {DRAFTS}, got {draft!r}")
    B = tokens.shape[0]
    dev = tokens.device
    rows = torch.arange(B, device=dev)
    node_probs = (lambda nodes: probs[rows, nodes]) if isinstance(probs, torch.Tensor) else probs
    depth = buf.retrieve_indices.shape[-1] - 1      # a tree built on the device: its setting's bound
    # one fixed draw of uniforms u a step, whatever the tree's depth: Y at depth d is the inverse CDF of u[:, d-1], the
    # last bonus of u[:, accepted], so a tree and the same tree at a deeper fixed shape sample the same tokens
    uniforms = torch.rand(B, max(UNIFORMS, depth + 1), generator=generator, device=dev)
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    p = node_probs(cur).float().clone()
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    paths = torch.full((B, depth + 1), -1, dtype=torch.long, device=dev)
    paths[:, 0] = 0
    accepted = torch.zeros(B, dtype=torch.long, device=dev)
    bonus = torch.full((B,), -1, dtype=torch.long, device=dev)
    for d in range(1, depth + 1):
        kids = buf.children[cur] if buf.children.dim() == 2 else buf.children[rows, cur]   # [B, S]
        kid_tok = tokens.gather(1, kids.clamp(min=0))
        if draft == "topk":
            y = draw(p, uniforms[:, d - 1])
            hit = (kid_tok == y[:, None]) & (kids >= 0)
            found = hit.any(1) & alive
            nxt = kids.gather(1, hit.int().argmax(1, keepdim=True))[:, 0]
            stop = alive & ~found
            bonus = torch.where(stop, y, bonus)                      # Y ~ p matched no child
        else:
            q = draft_probs[:, d - 1].float().clone()
            nxt = torch.full((B,), -1, dtype=torch.long, device=dev)
            for s in range(kids.shape[1]):
                c = kids[:, s]
                x = kid_tok[:, s]
                px, qx = p[rows, x], q[rows, x]
                act = alive & (c >= 0) & (x >= 0) & (nxt < 0) & (qx > 0)   # q(x)=0: not a real draw
                u = torch.rand(B, generator=generator, device=dev)
                acc = act & (u * qx < px)                            # u < p(x)/q(x)
                nxt = torch.where(acc, c, nxt)
                rej = act & ~acc
                resid = (p - q).clamp_(min=0)
                rs = resid.sum(1, keepdim=True)
                p = torch.where(rej[:, None] & (rs > 0), resid / rs.clamp(min=1e-30), p)
                # a device-made zero: ``q2[rows, x] = 0`` makes the scalar a host tensor that index_put_ copies to
                # the device on CUDA, a blocking sync per sibling (the same values written)
                q2 = q.clone().index_put_((rows, x), q.new_zeros(()))
                q2 = q2 / q2.sum(1, keepdim=True).clamp(min=1e-30)
                q = torch.where(rej[:, None], q2, q)
            found = alive & (nxt >= 0)
        nxt = torch.where(found, nxt, cur)
        paths[:, d] = torch.where(found, nxt, paths[:, d])
        accepted += found.long()
        # fresh target at the new node; computed whether or not any row descended (asking would read the host)
        p = torch.where(found[:, None], node_probs(nxt).float(), p)
        cur = nxt
        alive = found
    # leaf reached (fresh p) or all children rejected (residual p); drawn for every row, used where no bonus yet:
    # the unused draws are independent of everything kept, so the output's law is unchanged, and nothing is read
    y = draw(p, uniforms.gather(1, accepted[:, None])[:, 0])
    return paths, accepted, torch.where(bonus < 0, y, bonus)


def draw(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of p [B, V] (non-negative, any total) from uniforms u [B] in [0, 1): the first token whose
    cumulative mass (in float64: no token of non-zero mass is skipped by rounding) exceeds u times the total. A token
    of zero mass is never drawn."""
    cdf = p.double().cumsum(-1)
    return torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=p.shape[-1] - 1)


def verify(buf: TreeBuffers | StaticTree, tokens: torch.Tensor, logits: torch.Tensor, cfg: SamplingConfig,
           draft_probs: Optional[torch.Tensor], generator: Optional[torch.Generator],
           also: Sequence[torch.Tensor] = ()) -> Verdict:
    """One step of batch-1 decoding: tokens [N], logits [N, V], in one host read (every mode); ``also``: long
    tensors read with the verdict (``verify_greedy``)."""
    if cfg.mode == "greedy" or cfg.is_greedy:
        return verify_greedy(buf, tokens, logits, also)
    if cfg.mode == "typical":
        return verify_typical(buf, tokens, logits, cfg, generator, also)
    v = sampled_rows(buf, tokens[None], lambda nodes: target_probs(logits[nodes], cfg),
                     None if draft_probs is None else draft_probs[None], cfg.draft, generator,
                     [x.reshape(1, -1) for x in also])
    return Verdict(v.paths[0], v.bonus[0], v.tokens[0], v.also[0])


def sampled_rows(buf: TreeBuffers | RowTrees | StaticTree, tokens: torch.Tensor, probs,
                 draft_probs: Optional[torch.Tensor],
                 draft: str, generator: Optional[torch.Generator], also: Sequence[torch.Tensor] = ()) -> RowVerdicts:
    """``verify_sample``'s verdicts (arguments as its): every row's path, its tokens, the bonus and ``also`` ([B] or
    [B, k] long tensors) read in one read."""
    paths, n, bonus = verify_sample(buf, tokens, probs, draft_probs, draft, generator)
    return _read_rows(n[:, None] + 1, bonus[:, None], also, paths, tokens)


def verify_rows(buf: TreeBuffers | RowTrees | StaticTree, tokens: torch.Tensor, logits: torch.Tensor,
                cfg: SamplingConfig, draft_probs: Optional[torch.Tensor], generator: Optional[torch.Generator],
                also: Sequence[torch.Tensor] = ()) -> RowVerdicts:
    """``verify`` for every row of a batch, each row its own tree instance: tokens [B, N], logits
    [B, N, V], draft_probs [B, D, V] or None. A token -1 marks a node that carries no draft in its row (a
    shorter proposal): never accepted. ``also`` ([B] or [B, k] long tensors) is read with the verdicts.

    Greedy is vectorised (``greedy_rows``, ``verify_greedy``'s tie rule: the first longest leaf path), one host
    read for the whole batch, so a row's verdict equals its batch-1 verdict on the same logits; a batch of trees
    built on the device (``StaticTree`` with a row axis) is verified so too. Exact sampling runs
    ``verify_sample`` over the rows as independent trials, typical acceptance ``typical_rows``: one read too.
    Per-row trees built on the host (``RowTrees``) are verified so through their stacked fields: each row's verdict
    is the one ``verify`` gives on its own tree alone (greedy: the same; sampling: the same law)."""
    if cfg.mode == "greedy" or cfg.is_greedy:
        return greedy_rows(buf.parents, buf.retrieve_indices, tokens, logits, also)
    if cfg.mode == "typical":
        return typical_rows(buf.parents, buf.retrieve_indices, tokens, logits, cfg, generator, also)
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    return sampled_rows(buf, tokens, lambda nodes: target_probs(logits[rows, nodes], cfg), draft_probs, cfg.draft,
                        generator, also)
