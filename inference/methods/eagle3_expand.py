"""EAGLE-2's expansion of a draft tree, the one loop every EAGLE-3 draft path runs.

A step's tree (``Eagle3Decoder._draft`` at batch 1, ``Eagle3BatchDrafter._grow`` for a batch, and their fixed-shape
twins ``eagle3_static.draft_call`` / ``batch_draft_call``) grows the same way: depth 1 is the top-k of the root's
draft distribution scored by log-probability; each further depth runs the drafter once over the k best nodes of the
last depth, each seeing its ancestors' draft entries and its own, and gives each of them k children scored parent +
log q. What differs between the paths is only where the drafter's new keys and values go and what it attends over
(a cache grown per step, or a fixed-shape one under a mask over its whole capacity): ``attend``, handed in.

Everything here has a leading row axis (batch 1 is one row) and reads nothing from the host: no repeat count, no
data-dependent shape, so the fixed-shape paths can capture it.
"""

from __future__ import annotations

from typing import Callable

import torch

# attend(level, entries, rows, tokens [B, rows], states [B, rows, H], sees [B, rows, E]) -> (normed, pre) [B, rows, H]:
# one drafter forward over ``rows`` new nodes per row at depth ``level`` + 1, whose draft entries are the step's
# entries..entries+rows-1; ``sees`` marks, per node, which of the step's E draft entries it sees (its ancestors' and
# its own); the committed entries are seen by all.
Attend = Callable[[int, int, int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def expand(d, root_logits: torch.Tensor, root_state: torch.Tensor, depth: int, k: int,
           attend: Attend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's dynamic tree from its root's draft distribution ``root_logits`` [B, V'] and state [B, H]: token,
    score, parent (-1: the root) and depth of each drafted node [B, k + (depth-1) k^2], in drafting order (module
    docstring). ``d``: the drafter (``project``, ``to_vocab_ids``)."""
    b, dev = root_logits.shape[0], root_logits.device
    lanes = torch.arange(b, device=dev)[:, None]
    width = (depth - 1) * k                                   # the step's draft entries per row
    score, local = torch.log_softmax(root_logits.float(), -1).topk(k)                 # [B, k]
    tok = d.to_vocab_ids(local)
    parent = torch.full((b, k), -1, dtype=torch.long, device=dev)
    state = root_state[:, None].expand(b, k, -1)              # what each node of the last depth is fed
    vis = torch.zeros(b, k, width, dtype=torch.bool, device=dev)   # each node's ancestors' entries
    toks, scores, parents = [tok], [score], [parent]
    depths = [torch.ones(b, k, dtype=torch.long, device=dev)]
    first = entries = 0                                       # the last depth's first node; draft entries so far
    for level in range(1, depth):
        rows = min(k, score.shape[1])
        pick = score.topk(rows, dim=-1).indices                                      # [B, rows]
        sees = vis[lanes, pick]                                                      # [B, rows, width]
        # each node's own entry; a device tensor, not ``= True`` (a host scalar copied in at every replay)
        sees[:, :, entries:entries + rows] |= torch.eye(rows, dtype=torch.bool, device=dev)
        normed, pre = attend(level, entries, rows, tok[lanes, pick], state[lanes, pick], sees)
        logq = torch.log_softmax(d.project(normed).float(), -1).clamp(max=0)
        child_score, child_local = logq.topk(k, dim=-1)                              # [B, rows, k]
        score = (score[lanes, pick][..., None] + child_score).reshape(b, -1)
        tok = d.to_vocab_ids(child_local).reshape(b, -1)
        # expand + reshape, not repeat_interleave: the same values, and no host read of a repeat count
        parent = (first + pick)[..., None].expand(b, rows, k).reshape(b, -1)
        state = pre[:, :, None].expand(b, rows, k, -1).reshape(b, rows * k, -1)
        vis = sees[:, :, None].expand(b, rows, k, width).reshape(b, rows * k, width)
        first += toks[-1].shape[1]
        entries += rows
        toks.append(tok)
        scores.append(score)
        parents.append(parent)
        depths.append(torch.full((b, score.shape[1]), level + 1, dtype=torch.long, device=dev))
    return torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(parents, 1), torch.cat(depths, 1)
