"""Head targets (offsets, document boundaries), the weighted head loss and its metrics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.heads.medusa import MedusaHeads
from inference.heads.spec import HeadsSpec
from medusa_train import losses as L
from medusa_train.losses import (HeadMetrics, add_feature_noise, head_targets, heads_loss, simulated_tau,
                                   vocab_to_local)

I = -100  # IGNORE

# One packed row: doc 1 = positions 0-5 (0-1 user/header: no label), doc 2 = positions 6-8,
# then padding (doc 0) at 9-10.
LABELS = torch.tensor([[I, I, 12, 13, 14, 15, I, 17, 18, I, I]])
DOCS = torch.tensor([[1, 1, 1, 1, 1, 1, 2, 2, 2, 0, 0]])


@pytest.mark.parametrize("k, expected", [
    # head 1 at t predicts t+2: labels[t+2] within the same document, else IGNORE
    (1, [12, 13, 14, 15, I, I, 18, I, I, I, I]),
    # head 2 at t predicts t+3
    (2, [13, 14, 15, I, I, I, I, I, I, I, I]),
    # head 3 at t predicts t+4
    (3, [14, 15, I, I, I, I, I, I, I, I, I]),
])
def test_head_targets_exact_offsets(k, expected):
    """Guards against: head k trained on the wrong offset (t+k instead of t+k+1: head 1 would just
    duplicate the backbone), targets crossing a packed-document boundary, targets at padding, or
    wrap-around past the end of the row."""
    assert head_targets(LABELS, DOCS, k).tolist() == [expected]


def test_head_targets_padding_and_short_rows():
    """Guards against: a label-carrying padding position (doc 0) producing a target, or an index error
    when the row is shorter than the shift."""
    labels = torch.tensor([[5, 6, 7, 8]])
    assert head_targets(labels, torch.tensor([[0, 0, 0, 0]]), 1).tolist() == [[I] * 4]
    assert head_targets(torch.tensor([[5, 6]]), torch.tensor([[1, 1]]), 1).tolist() == [[I, I]]
    assert head_targets(torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1, 1]]), 1).tolist() == [[7, I, I]]


def test_heads_loss_without_any_target_still_runs_every_head():
    """Guards against: heads skipped on a rank whose batch has no target (under ZeRO-3 every rank must
    join each head's parameter gather, or the ranks deadlock); the loss must still backpropagate."""
    heads = _heads(n=3)
    calls = []
    original = heads.project
    heads.project = lambda h, k: (calls.append(k), original(h, k))[1]
    labels = torch.full((1, 6), I)
    loss = heads_loss(heads, torch.randn(1, 6, 8), labels, torch.ones_like(labels), [1.0, 1.0, 1.0], None,
                      HeadMetrics(3))
    assert calls == [0, 1, 2]
    loss.backward()
    assert float(loss.detach()) == 0.0


def test_head_targets_batch_rows_are_independent():
    """Guards against: shifting across rows of a batch (row 0's end taking row 1's start)."""
    labels = torch.tensor([[1, 2, 3], [4, 5, 6]])
    docs = torch.ones_like(labels)
    assert head_targets(labels, docs, 1).tolist() == [[3, I, I], [6, I, I]]


def _heads(projection="own", vocab=10, hidden=8, n=2, trunc=None, seed=0):
    torch.manual_seed(seed)
    spec = HeadsSpec(num_heads=n, num_layers=1, hidden_size=hidden, vocab_size=vocab, projection=projection,
                     truncated_vocab_size=trunc)
    w = torch.randn(vocab, hidden)
    tm = torch.tensor([3, 5, 7, 9]) if projection == "truncated" else None
    heads = MedusaHeads.from_lm_head(spec, w, tm)
    for p in heads.parameters():
        p.data.normal_()
    return heads


def test_heads_loss_is_weighted_sum_of_per_head_ce():
    """Guards against: loss weights applied to the wrong head, CE over positions without a target,
    or the loss not matching sum_k lambda_k * CE_k."""
    heads = _heads()
    hidden = torch.randn(1, 11, 8)
    labels = torch.tensor([[I, I, 2, 3, 4, 5, I, 7, 8, I, I]])
    weights = [0.8, 0.64]
    total = heads_loss(heads, hidden, labels, DOCS, weights, None)
    expected = 0.0
    for k in range(2):
        tgt = head_targets(labels, DOCS, k + 1)
        mask = tgt != I
        expected += weights[k] * F.cross_entropy(heads.head_logits(hidden[mask], k), tgt[mask])
    assert torch.allclose(total, expected)
    total.backward()
    assert all(p.grad is not None for p in heads.parameters())


def test_truncated_targets_outside_vocab_excluded_from_ce_but_counted_as_misses():
    """Guards against: out-of-vocabulary targets of truncated heads being mapped to a wrong local id
    (training toward the wrong token) or being left out of the accuracy denominator (inflated accuracy)."""
    heads = _heads("truncated", trunc=4, n=1)
    inv = vocab_to_local(heads.token_map, 10)
    assert inv.tolist() == [-1, -1, -1, 0, -1, 1, -1, 2, -1, 3]
    hidden = torch.randn(1, 6, 8)
    labels = torch.tensor([[I, I, 5, 4, 9, 4]])  # 4 is not in the truncated vocabulary
    docs = torch.ones_like(labels)
    metrics = HeadMetrics(1)
    metrics.batches = 1
    loss = heads_loss(heads, hidden, labels, docs, [1.0], inv, metrics)
    tgt = head_targets(labels, docs, 1)  # [5, 4, 9, 4, I, I]
    h = hidden[0, :4]
    logits = heads.head_logits(h, 0)
    valid = torch.tensor([True, False, True, False])
    local = torch.tensor([1, -1, 3, -1])
    assert torch.allclose(loss, F.cross_entropy(logits[valid], local[valid]))
    assert metrics.count == [4]  # all four targets count in the denominator
    top1 = int((logits.argmax(-1) == local).logical_and(valid).sum())
    assert metrics.hits[0][0] == top1
    assert metrics.hits[0][-1] == 2  # top-5 of a 4-way head contains every valid target, never an OOV one
    s = metrics.summary()
    assert s["head1/top5"] == pytest.approx(0.5)
    assert tgt[0, :4].tolist() == [5, 4, 9, 4]


def test_all_targets_out_of_vocab_loss_still_backpropagates():
    """Guards against: a batch whose targets all fall outside a truncated vocabulary returning a loss
    with no graph, so engine.backward raises (and a ZeRO rank skips the gradient reduction)."""
    heads = _heads("truncated", trunc=4, n=1)
    inv = vocab_to_local(heads.token_map, 10)
    labels = torch.tensor([[I, 0, 0, 0, 0]])  # token 0 is not in the truncated vocabulary
    loss = heads_loss(heads, torch.randn(1, 5, 8), labels, torch.ones_like(labels), [1.0], inv, HeadMetrics(1))
    assert float(loss.detach()) == 0.0
    loss.backward()  # what engine.backward does; must not raise
    assert all(p.grad is not None and not p.grad.any() for p in heads.parameters())


def test_metrics_summary_and_simulated_tau():
    """Guards against: top-k accuracies not cumulative (top2 < top1) or a wrong tau formula."""
    m = HeadMetrics(2)
    m.batches = 2
    m.add(0, 2.0, [3, 4, 4, 5, 5], 10)
    m.add(1, 4.0, [1, 1, 2, 2, 2], 10)
    s = m.summary()
    assert s["head1/loss"] == 1.0 and s["head2/loss"] == 2.0
    assert s["head1/top1"] == 0.3 and s["head1/top5"] == 0.5
    assert s["sim_tau"] == pytest.approx(1 + 0.3 + 0.3 * 0.1)
    assert simulated_tau([0.5, 0.5]) == pytest.approx(1.75)
    assert simulated_tau([]) == 1.0


def test_metrics_sums_added_over_ranks_give_the_runs_window():
    """Guards against: the sums ranks add up at log time read back in another order (a head's hits as another
    head's, counts as losses), or a window of two ranks that is not the window of their micro-batches together."""
    a, b, both = HeadMetrics(2), HeadMetrics(2), HeadMetrics(2)
    a.batches, b.batches, both.batches = 1, 3, 4
    for m, (l0, h0, n0, l1, h1, n1) in ((a, (2.0, [3, 4, 4, 5, 5], 10, 1.0, [1, 1, 2, 2, 2], 10)),
                                         (b, (6.0, [1, 1, 1, 2, 9], 30, 3.0, [0, 0, 1, 1, 1], 30))):
        m.add(0, l0, h0, n0)
        m.add(1, l1, h1, n1)
        both.add(0, l0, h0, n0)
        both.add(1, l1, h1, n1)
        m.add_chain([torch.tensor([True, False]), torch.tensor([True, True])], 2)
        both.add_chain([torch.tensor([True, False]), torch.tensor([True, True])], 2)
    assert a.from_sums(a.as_sums()).state() == a.state()
    added = [x + y for x, y in zip(a.as_sums(), b.as_sums())]
    assert a.from_sums(added).summary() == both.summary()
    assert both.summary() != a.summary()


def test_feature_noise_follows_each_layers_own_scale():
    """Guards against: one absolute noise amplitude for every layer (a low layer's small states drowned, a
    high layer's large ones untouched), noise scaled by the whole vector's RMS across layers, or a scale of 0
    still perturbing (or copying) the features."""
    torch.manual_seed(0)
    x = torch.cat([torch.randn(4, 256, 16) * 0.01, torch.randn(4, 256, 16) * 100.0], dim=-1)
    assert add_feature_noise(x, 0.0, 2) is x
    noise = (add_feature_noise(x, 0.2, 2) - x).unflatten(-1, (2, 16))
    rms = x.unflatten(-1, (2, 16)).pow(2).mean(-1, keepdim=True).sqrt()
    ratio = (noise / rms).std(dim=(0, 1, 3))                 # per part: noise std / that part's RMS
    assert torch.allclose(ratio, torch.tensor([0.2, 0.2]), rtol=0.05)


def test_feature_noise_only_while_training_and_never_on_the_teacher(monkeypatch):
    """Guards against: noise on held-out batches (the engine's eval mode: held-out accuracy would measure a
    perturbed drafter), heads.feature_noise ignored by the loss, or the teacher term (the backbone's own
    distribution) computed from the noisy states instead of the clean ones."""
    heads = _heads()
    hidden = torch.randn(1, 11, 8)
    labels = torch.tensor([[I, I, 2, 3, 4, 5, I, 7, 8, I, I]])
    clean = heads_loss(heads, hidden, labels, DOCS, [0.8, 0.64], None)
    heads.eval()
    assert torch.equal(heads_loss(heads, hidden, labels, DOCS, [0.8, 0.64], None, feature_noise=0.5), clean)
    heads.train()
    assert not torch.allclose(heads_loss(heads, hidden, labels, DOCS, [0.8, 0.64], None, feature_noise=0.5),
                              clean)
    seen = []
    monkeypatch.setattr(L, "_teacher_ce", lambda logits, h, *a: (seen.append(h), logits.sum() * 0)[1])
    heads_loss(heads, hidden, labels, DOCS, [0.8, 0.64], None, teacher_weight=0.5,
               lm_head_weight=torch.randn(10, 8), feature_noise=0.5)
    assert seen and all(h is hidden for h in seen)


def test_the_logged_head_loss_is_the_one_trained():
    """Guards against ``head{k}/loss`` logging the label's CE while a teacher term (``heads.teacher_weight``) is
    what trains the heads: with teacher_weight=1 the curve showed a loss nothing minimised, and its fall or rise
    said nothing of training."""
    heads = _heads()
    hidden = torch.randn(1, 11, 8)
    labels = torch.tensor([[I, I, 2, 3, 4, 5, I, 7, 8, I, I]])
    lm_head = torch.randn(10, 8)
    logged = {}
    for w in (0.0, 1.0):
        metrics = HeadMetrics(2)
        total = heads_loss(heads, hidden, labels, DOCS, [1.0, 0.0], None, metrics, teacher_weight=w,
                           lm_head_weight=lm_head)
        logged[w] = metrics.summary()["head1/loss"]
        assert logged[w] == pytest.approx(float(total), rel=1e-6)   # head 2 weighs 0: the total is head 1's
    assert logged[0.0] != pytest.approx(logged[1.0])


def test_chain_tau_counts_the_heads_right_in_a_row_at_each_position():
    """Guards against the only tau the trainer logged assuming every head is right independently of the ones
    before it (``sim_tau``): heads whose errors fall on the same positions accept less than that product says, and
    heads right on disjoint positions accept only the first. ``chain_tau`` counts, at each position, how many heads
    were right in a row from head 1, which is what a top-1 chain accepts there."""
    heads = _heads()
    labels = torch.tensor([[I, 1, 2, 3, 4, 5, 6, 7, 8, 9, I]])
    hidden = torch.randn(1, 11, 8)
    metrics = HeadMetrics(2)
    heads_loss(heads, hidden, labels, torch.ones(1, 11, dtype=torch.long), [0.8, 0.64], None, metrics)   # one doc
    metrics.batches = 1
    s = metrics.summary()
    with torch.no_grad():   # the same by hand: head k (0-based) at t is right when its top-1 is labels[t + k + 2]
        rows = [heads.head_logits(hidden[0], k).argmax(-1) for k in range(2)]
    right = [[bool(rows[k][t] == labels[0, t + k + 2]) and labels[0, t + k + 2] != I for t in range(11 - k - 2)]
             for k in range(2)]
    roots = sum(labels[0, t + 2] != I for t in range(9))
    chain = sum(right[0]) + sum(right[0][t] and right[1][t] for t in range(len(right[1])))
    assert s["chain_tau"] == pytest.approx(1 + chain / roots)
    m = HeadMetrics(2)   # head 1 right at 1 of 2 positions, head 2 at the other one: no chain of two
    m.add_chain([torch.tensor([True, False]), torch.tensor([False, True])], 2)
    m.add(0, 0.0, [1] * 5, 2)
    m.add(1, 0.0, [1] * 5, 2)
    assert m.summary()["chain_tau"] == pytest.approx(1.5) and m.summary()["sim_tau"] == pytest.approx(1.75)
