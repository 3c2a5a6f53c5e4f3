"""Head targets, the weighted per-head loss and the accuracy metrics logged during training.

Offsets: the backbone at position t predicts t+1; head k (1-based) predicts token t+k+1, so
its target is ``labels[t + 1 + k]`` — only where that token is an assistant token of the
same packed conversation as position t.

Heads are evaluated only at positions that have a target (gathered first), so the vocabulary
projection — the dominant cost — is never spent on user turns or padding.

What the heads are fed is what their family declares (``inference.heads.inputs.BackboneInputs``):

- the last hidden state only (Medusa): head k's features from h_t, at the rows with a target;
- also the path tokens (Hydra / MLP speculator): the true tokens t+1..t+k+1 of the sequence (teacher
  forcing, ``future_tokens``); their cheap recurrent part runs at every position, the projection
  still only where a target exists;
- aux layers and positions (EAGLE-3): the drafter is unrolled instead (training-time test,
  ``ttt_features``): step j at t is fed its own step j-1 state and the true token x_{t+1+j}, attends
  causally within the packed document, and is scored exactly as head j+1 (target x_{t+j+2}).

Backbone targets (``heads.targets=backbone``): the labels are replaced by the backbone's own
greedy tokens (``backbone_labels``) before anything here sees them, so every head family,
projection and metric trains on / reports against what greedy verification will accept.

Optional teacher term (``teacher_weight`` w): head k's loss becomes
(1 - w) CE(label) + w CE(p_backbone), where p_backbone is the frozen backbone's own
distribution of the same token, lm_head(h_{t+k}) — restricted to the token map for
truncated heads, at the positions whose target is in the map (as SpecForge's and EAGLE's
``t2d[target] * loss_mask``: a target outside it is never accepted). Hydra++ found this best: the
heads learn what the backbone will verify.

Optional feature noise (``feature_noise`` s, training batches only, ``add_feature_noise``): the
features the heads read get Gaussian noise of std s x their per-position RMS (per layer for the
aux features), as EAGLE perturbs its drafter's inputs; the teacher term reads the clean states.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from inference.backbone import scale_logits
from inference.heads.registry import family

from .data.masks import block_causal_mask
from .data.tokenize import IGNORE

TOPK = 5


def head_targets(labels: torch.Tensor, doc_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Targets of head k (1-based) at every position; IGNORE where there is none."""
    shift = 1 + k
    tgt = torch.full_like(labels, IGNORE)
    if labels.shape[1] <= shift:
        return tgt
    later = labels[:, shift:].clone()
    same_doc = (doc_ids[:, :-shift] == doc_ids[:, shift:]) & (doc_ids[:, :-shift] > 0)
    later[~same_doc] = IGNORE
    tgt[:, :-shift] = later
    return tgt


def backbone_label_positions(labels: torch.Tensor, doc_ids: torch.Tensor, everywhere: bool = False) -> torch.Tensor:
    """[B, T] bool: positions j that get a backbone label (j is labelled, or any position with
    ``everywhere`` (``heads.train_on=all``); j-1 is in the same document)."""
    keep = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    if labels.shape[1] > 1:
        labelled = torch.ones_like(keep[:, 1:]) if everywhere else labels[:, 1:] != IGNORE
        keep[:, 1:] = labelled & (doc_ids[:, 1:] == doc_ids[:, :-1]) & (doc_ids[:, 1:] > 0)
    return keep


def greedy_positions(labels: torch.Tensor, doc_ids: torch.Tensor, everywhere: bool = False) -> torch.Tensor:
    """[B, T] bool: the positions j-1 whose backbone argmax ``backbone_labels`` reads (only these
    need the backbone's vocabulary projection)."""
    keep = backbone_label_positions(labels, doc_ids, everywhere)
    need = torch.zeros_like(keep)
    need[:, :-1] = keep[:, 1:]
    return need


def backbone_labels(labels: torch.Tensor, doc_ids: torch.Tensor, greedy: torch.Tensor,
                    everywhere: bool = False) -> torch.Tensor:
    """Labels of ``heads.targets=backbone``: ``out[j] = greedy[j-1]`` where ``labels[j]`` is set and
    j-1 is in the same packed document as j, IGNORE elsewhere.

    ``greedy[j]`` is the backbone's argmax at j (its next token given the true prefix up to j),
    needed only where ``greedy_positions`` is true. Why: greedy Medusa verification accepts a draft
    only when it equals the backbone's own greedy token, so that token — not the dataset's — is
    what a head should predict. Head k at t is then trained on greedy[t+k], the backbone's choice
    after the true tokens up to t+k; for Hydra head 1 (fed the true token t+1) this is exactly its
    conditional target. Drop-in for ``labels`` everywhere (``head_targets``, ``heads_loss``, metrics).
    ``everywhere`` (``heads.train_on=all``): every in-document position, the user's turns too; a greedy
    id missing there (a cache built for the replies only) is an error, not a silently dropped label.
    """
    keep = backbone_label_positions(labels, doc_ids, everywhere)
    out = torch.full_like(labels, IGNORE)
    if labels.shape[1] > 1:
        shifted = greedy[:, :-1].to(device=labels.device, dtype=labels.dtype)
        if everywhere and bool((keep[:, 1:] & (shifted == IGNORE)).any()):
            raise RuntimeError("heads.train_on=all read a batch without the backbone's greedy ids on every "
                               "position (a features cache built for the replies only?)")
        out[:, 1:] = torch.where(keep[:, 1:], shifted, out[:, 1:])
    return out


def future_tokens(input_ids: torch.Tensor, count: int) -> torch.Tensor:
    """[B, T, count]: ``out[:, t, j]`` = input_ids[:, t+1+j] (0 past the end of the row; such
    positions never have a target, see ``head_targets``)."""
    b, t = input_ids.shape
    out = input_ids.new_zeros(b, t, count)
    for j in range(count):
        s = 1 + j
        if t > s:
            out[:, :-s, j] = input_ids[:, s:]
    return out


def vocab_to_local(token_map: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """Inverse of a truncated head's token map: vocab id -> local index, -1 if absent."""
    if token_map is None:
        return None
    inv = torch.full((vocab_size,), -1, dtype=torch.long, device=token_map.device)
    inv[token_map] = torch.arange(token_map.numel(), device=token_map.device)
    return inv


@dataclass
class HeadMetrics:
    """Running sums for one logging window: per head loss (the one trained: with a teacher term, its mix with the
    label's CE), top-1..top-5 hits, target count."""

    num_heads: int
    loss_sum: list = field(default_factory=list)
    hits: list = field(default_factory=list)
    count: list = field(default_factory=list)
    batches: int = 0
    # chain_tau: positions where heads 1..k were all right (top-1), of the positions head 1 has a target
    chain: list = field(default_factory=list)
    roots: int = 0

    def __post_init__(self):
        self.reset()

    def reset(self):
        self.loss_sum = [0.0] * self.num_heads
        self.hits = [[0] * TOPK for _ in range(self.num_heads)]
        self.count = [0] * self.num_heads
        self.chain = [0] * self.num_heads
        self.batches = self.roots = 0

    def state(self) -> dict:
        """The window's sums, as JSON (a checkpoint keeps them: a run resumed mid-window logs what the
        uninterrupted run logs)."""
        return {"loss_sum": list(self.loss_sum), "hits": [list(h) for h in self.hits], "count": list(self.count),
                "batches": self.batches, "chain": list(self.chain), "roots": self.roots}

    def restore(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    def as_sums(self) -> list[float]:
        """Every sum of the window, flat and in a fixed order: what ranks add up (``from_sums``)."""
        return [*self.loss_sum, *(h for row in self.hits for h in row), *self.count, *self.chain, self.batches,
                self.roots]

    def from_sums(self, sums: list[float]) -> "HeadMetrics":
        """A window holding ``sums`` (``as_sums``'s order, e.g. added over ranks)."""
        k, it = self.num_heads, iter(sums)
        out = HeadMetrics(k)
        out.loss_sum = [float(next(it)) for _ in range(k)]
        out.hits = [[int(next(it)) for _ in range(TOPK)] for _ in range(k)]
        out.count = [int(next(it)) for _ in range(k)]
        out.chain = [int(next(it)) for _ in range(k)]
        out.batches, out.roots = int(next(it)), int(next(it))
        return out

    def add(self, k: int, loss: float, hits_topk: list[int], n: int):
        self.loss_sum[k] += loss
        self.count[k] += n
        for j in range(TOPK):
            self.hits[k][j] += hits_topk[j]

    def summary(self) -> dict:
        out = {}
        batches = max(self.batches, 1)
        top1 = []
        for k in range(self.num_heads):
            n = max(self.count[k], 1)
            out[f"head{k + 1}/loss"] = self.loss_sum[k] / batches
            for j in range(TOPK):
                out[f"head{k + 1}/top{j + 1}"] = self.hits[k][j] / n
            top1.append(self.hits[k][0] / n)
        out["sim_tau"] = simulated_tau(top1)
        if self.roots:
            out["chain_tau"] = 1 + sum(self.chain) / self.roots
        return out

    def add_chain(self, right: list[torch.Tensor], roots: int) -> None:
        """Per head (in order), a [B, T] mask of the positions where its top-1 was right (False where it had no
        target), and how many positions head 1 has a target at: adds the positions whose heads 1..k were all
        right, for ``chain_tau``."""
        alive = None
        self.roots += roots
        for k, r in enumerate(right):
            alive = r if alive is None else alive & r
            self.chain[k] += int(alive.sum())


def simulated_tau(top1: list[float]) -> float:
    """Expected accepted tokens per step of a top-1 chain: 1 + sum_k prod_{j<=k} acc_j.

    Assumes head k is right independently of heads < k (what SpecForge / ModelOpt log). ``chain_tau`` counts
    the heads right in a row at each position instead (what a top-1 chain accepts there, teacher-forced, as
    speculators logs its conditional accuracy): the heads' errors are correlated, so the two differ.
    """
    tau, p = 1.0, 1.0
    for a in top1:
        p *= a
        tau += p
    return tau


def add_feature_noise(x: torch.Tensor, scale: float, parts: int = 1) -> torch.Tensor:
    """x [..., parts * H] plus Gaussian noise of std ``scale`` x the RMS of each H-wide part at each
    position: relative, because a low layer's states are an order of magnitude smaller than a high
    one's, so one absolute amplitude would drown the first and not touch the last. Draws from the
    global torch RNG, which checkpoints save, so a resumed run draws the same noise."""
    if scale <= 0:
        return x
    split = x.unflatten(-1, (parts, x.shape[-1] // parts))
    rms = split.detach().float().pow(2).mean(-1, keepdim=True).sqrt().to(x.dtype)
    return (split + torch.randn_like(split) * (scale * rms)).flatten(-2)


def heads_loss(heads, hidden: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor,
               weights: list[float], inv_map: torch.Tensor | None,
               metrics: HeadMetrics | None = None, input_ids: torch.Tensor | None = None,
               teacher_weight: float = 0.0, lm_head_weight: torch.Tensor | None = None,
               aux: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
               feature_noise: float = 0.0, logit_scaling: tuple = (None, None)) -> torch.Tensor:
    """sum_k lambda_k * loss_k over positions with a target; fills ``metrics`` if given.

    For truncated heads, targets outside the head's vocabulary are excluded from the CE
    (they cannot be predicted) but counted as misses in the accuracy. ``input_ids`` is
    needed by heads fed the path tokens; ``lm_head_weight`` by the teacher term; ``aux`` and ``position_ids``
    by heads that read aux layers and positions (their family's declared inputs, module docstring);
    ``feature_noise`` perturbs what the heads read while they train; ``logit_scaling`` is the backbone's
    (logit_scale, final soft-cap) after its lm_head (``backbone_inputs.logit_scaling``), for the teacher term.
    """
    total = hidden.new_zeros(())
    noise = feature_noise if heads.training else 0.0  # held-out batches run in eval mode: clean
    inputs = family(heads.spec.kind).inputs
    # Noise on what the heads read; the teacher term keeps the clean ``hidden``.
    head_in = add_feature_noise(hidden, noise) if inputs.last_hidden else hidden
    if inputs.path_tokens and input_ids is None:
        raise ValueError(f"{heads.spec.kind} heads are fed the path tokens: they need the batch's input_ids")
    feats = None  # per-head features at every position, for heads that are not fed h_t alone
    if inputs.aux_layers:
        if aux is None or (inputs.positions and position_ids is None):
            raise ValueError(f"{heads.spec.kind} heads need the batch's aux features and position_ids")
        mask0 = block_causal_mask(doc_ids, aux.dtype)  # causal within a packed document (padding: itself)
        noisy = add_feature_noise(aux, noise, aux.shape[-1] // hidden.shape[-1])  # each aux layer its own scale
        positions = position_ids.to(aux.device) if inputs.positions else None
        feats = heads.ttt_features(noisy, future_tokens(input_ids, len(weights)), positions, mask0, steps=len(weights))
    elif inputs.path_tokens:
        feats = heads.teacher_forced_features(head_in, future_tokens(input_ids, len(weights)))
    token_map = getattr(heads, "token_map", None)
    right, roots = [], 0   # per head, where its top-1 was right: for the metrics' chain_tau
    for k in range(len(weights)):
        tgt = head_targets(labels, doc_ids, k + 1)
        mask = tgt != IGNORE
        n = int(mask.sum())
        # The head runs even with no targets: under ZeRO-3 every rank must take part in
        # gathering its weights, or the ranks deadlock.
        tgt = tgt[mask]
        local = inv_map[tgt] if inv_map is not None else tgt
        f = feats[k][mask] if feats is not None else heads.head_hidden(head_in[mask], k)
        logits = heads.project(f, k).float()
        valid = local >= 0
        if bool(valid.any()):
            ce = F.cross_entropy(logits[valid], local[valid])
            loss = ce
            if teacher_weight > 0:   # at the rows the CE keeps: a target outside the map is never accepted
                kept = mask.clone()
                kept[mask] = valid
                loss = (1 - teacher_weight) * ce + teacher_weight * _teacher_ce(
                    logits[valid], hidden, kept, k, lm_head_weight, token_map, logit_scaling)
            total = total + weights[k] * loss
        else:
            ce = loss = logits.sum() * 0.0  # nothing learnable here; keeps the graph connected
            total = total + ce
        if metrics is not None:
            hit = torch.zeros_like(mask)   # where this head's top-1 was right
            if n:
                with torch.no_grad():
                    top = logits.topk(min(TOPK, logits.shape[-1]), dim=-1).indices
                    eq = (top == local.unsqueeze(-1)) & valid.unsqueeze(-1)
                    cum = eq.cumsum(-1).clamp(max=1).sum(0).tolist()
                    cum += [cum[-1]] * (TOPK - len(cum))
                    metrics.add(k, float(loss), [int(c) for c in cum], n)
                    hit[mask] = eq[:, 0]
            right.append(hit)
            roots = roots if k else n
    if metrics is not None:
        metrics.add_chain(right, roots)
    return total


def _teacher_ce(logits: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor, k: int,
                lm_head_weight: torch.Tensor | None, token_map: torch.Tensor | None,
                logit_scaling: tuple = (None, None)) -> torch.Tensor:
    """CE of head k's logits (0-based k) against the backbone's distribution at t+k+1 (the position whose
    next token head k guesses from t). That distribution is the one the backbone samples from: its
    logit scale / soft-cap (Cohere, Gemma-2) applied after the lm_head, as ``backbone_logits`` does; the
    raw lm_head product would be a sharper (or flatter) teacher than the model verification runs."""
    if lm_head_weight is None:
        raise ValueError("the teacher loss needs the backbone's lm_head weight")
    rows, cols = mask.nonzero(as_tuple=True)
    with torch.no_grad():
        w = lm_head_weight if token_map is None else lm_head_weight[token_map]
        raw = F.linear(hidden[rows, cols + k + 1], w.to(hidden.dtype)).float()
        teacher = torch.softmax(scale_logits(raw, *logit_scaling), dim=-1)  # elementwise: a token map commutes
    return -(teacher * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
