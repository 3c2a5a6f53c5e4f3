"""Exact sampling: Medusa's output distribution equals the backbone's, checked by chi-square.

A tiny Llama with a 12-token vocabulary makes the exact law of the first three generated
tokens computable: one batched forward over every continuation of the prompt up to 4 tokens
gives the backbone's next-token distribution in every context decoding can reach, and the
hidden states the heads read. Two Medusa steps (enough for three tokens) are then simulated
for 2*10^5 independent trials at once with the runtime's own ``propose`` and
``verify_sample``. Deliberately broken rules must fail the same test, so it has the power to
see a bias. A smaller end-to-end run through ``generate(..., "medusa")`` checks the decoding loop.
"""

import pytest
import torch

from inference.methods import generate
from inference.heads.medusa import MedusaHeads
from inference.heads.spec import HeadsSpec
from inference.runtime.tree import MedusaTree
from inference.runtime.verify import SamplingConfig, filter_probs, propose, verify_sample

from runtime_support import one_thread, tiny_llama, wrap  # noqa: F401 (autouse fixture)

V = 12
PROMPT = [3, 7, 1, 5]
TREE = MedusaTree([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
N_TRIALS = 200_000


@pytest.fixture(scope="module")
def setup():
    model = tiny_llama(vocab=V, hidden=32, init=0.35, seed=5)
    # Fresh heads (identity blocks + the base lm_head, as Medusa initialises them): their guesses
    # are good enough that 0, 1 and 2 accepted nodes are all common (checked below).
    spec = HeadsSpec(num_heads=2, num_layers=1, hidden_size=32, vocab_size=V)
    m = wrap(model, MedusaHeads.from_lm_head(spec, model.lm_head.weight))
    seqs = torch.cartesian_prod(*[torch.arange(V)] * 4)                      # [V^4, 4]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], 1)
    with torch.inference_mode():
        hidden = model.model(input_ids=ids).last_hidden_state
        logits = model.lm_head(hidden)
    n0 = len(PROMPT) - 1
    # contexts with j generated tokens: rows whose trailing 4-j tokens are 0, at position n0 + j
    tables = {}
    for j in range(5):
        rows = torch.arange(V ** j) * V ** (4 - j)
        tables[j] = (logits[rows, n0 + j], hidden[rows, n0 + j])
    return m, tables


def _ctx_index(tokens: torch.Tensor) -> torch.Tensor:
    """Base-V number of each row of tokens [B, j] (the table row of that context)."""
    idx = torch.zeros(tokens.shape[0], dtype=torch.long)
    for col in tokens.unbind(1):
        idx = idx * V + col
    return idx


def _simulate(m, tables, cfg: SamplingConfig, n: int, seed: int, rule: str = "exact"):
    """First three tokens of n independent Medusa generations; rule selects what is verified."""
    g = torch.Generator().manual_seed(seed)
    buf = TREE.buffers()
    target = {j: filter_probs(tables[j][0], cfg.temperature, cfg.top_k, cfg.top_p) for j in tables}
    anc = [TREE.ancestors(i) for i in range(TREE.num_nodes)]

    def step(head_hidden, before, root):
        hl = [m.heads.head_logits(head_hidden, k) for k in range(2)]
        draft_cfg = cfg if rule == "exact" else SamplingConfig(mode="sample", temperature=cfg.temperature,
                                                              top_k=cfg.top_k, top_p=cfg.top_p, draft="topk")
        cand, q = propose(buf, hl, m.heads.to_vocab_ids, draft_cfg, g, V)
        tokens = torch.cat([root[:, None], cand], 1)
        probs = torch.stack([target[before.shape[1] + len(a)][_ctx_index(torch.cat([before, tokens[:, a]], 1))]
                             for a in anc], 1)
        if rule == "exact":
            paths, acc, bonus = verify_sample(buf, tokens, probs, q, cfg.draft, g)
        elif rule == "p_over_q_with_topk":     # SpecInfer's rule, but candidates were not drawn from q
            q = torch.stack([filter_probs(h, cfg.temperature, cfg.top_k, cfg.top_p) for h in hl], 1)
            paths, acc, bonus = verify_sample(buf, tokens, probs, q, "sampled", g)
        elif rule == "accept_first_child":     # no test at all: always take rank 0
            paths = torch.tensor([[0, 1, 4]]).expand(len(root), -1)
            acc = torch.full((len(root),), 2)
            bonus = torch.multinomial(probs[:, 4], 1, generator=g)[:, 0]
        return tokens, paths, acc, bonus

    y1 = torch.multinomial(target[0].expand(n, -1), 1, replacement=True, generator=g)[:, 0]
    tokens, paths, acc, bonus = step(tables[0][1].expand(n, -1), torch.empty(n, 0, dtype=torch.long), y1)
    along = tokens.gather(1, paths.clamp(min=0))
    y2 = torch.where(acc >= 1, along[:, 1], bonus)
    y3 = torch.where(acc >= 2, along[:, 2], bonus)
    again = acc == 0                           # only the bonus came out: a second step gives y3
    if again.any():
        t2, p2, a2, b2 = step(tables[1][1][y1[again]], y1[again][:, None], y2[again])
        y3[again] = torch.where(a2 >= 1, t2.gather(1, p2.clamp(min=0))[:, 1], b2)
    return y1, y2, y3, acc


def _exact_law(tables, cfg):
    t = {j: filter_probs(tables[j][0], cfg.temperature, cfg.top_k, cfg.top_p) for j in range(3)}
    return t[0][0][:, None, None] * t[1][:, :, None] * t[2].reshape(V, V, V)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells expected below 5 are pooled into one bin."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    assert (obs[~keep] == 0).all(), "a token with zero target probability was generated"
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(len(obs) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def _pvalue(setup, cfg, rule="exact", seed=0):
    m, tables = setup
    y1, y2, y3, _ = _simulate(m, tables, cfg, N_TRIALS, seed, rule)
    counts = torch.bincount((y1 * V + y2) * V + y3, minlength=V ** 3)
    return chi_square_pvalue(counts, _exact_law(tables, cfg).reshape(-1))


def test_the_tiny_backbone_is_not_trivial(setup):
    """Guards against a setup where the test has no power: a flat backbone, or trees that are
    (almost) never or always accepted, so that one branch of the sampler goes untested."""
    m, tables = setup
    p = torch.softmax(tables[1][0], -1)
    entropy = -(p * p.log()).sum(-1)
    assert entropy.mean() < 0.8 * torch.log(torch.tensor(float(V)))
    assert (p.max(-1).values > 0.3).float().mean() > 0.5
    for draft in ("topk", "sampled"):
        *_, acc = _simulate(m, tables, SamplingConfig(mode="sample", draft=draft), 20_000, seed=1)
        share = torch.bincount(acc, minlength=3).float() / len(acc)
        assert (share > 0.05).all(), (draft, share)   # 0, 1 and 2 accepted nodes all common


@pytest.mark.parametrize("cfg", [
    SamplingConfig(mode="sample", temperature=1.0, draft="topk"),
    SamplingConfig(mode="sample", temperature=0.8, top_k=7, top_p=0.9, draft="topk"),
    SamplingConfig(mode="sample", temperature=1.0, draft="sampled"),
    SamplingConfig(mode="sample", temperature=0.8, top_k=7, top_p=0.9, draft="sampled"),
], ids=["topk-T1", "topk-filtered", "sampled-T1", "sampled-filtered"])
def test_exact_sampling_matches_the_backbone_distribution(setup, cfg):
    """Guards against any bias of the tree sampler: the first three tokens must follow p exactly."""
    assert _pvalue(setup, cfg) > 1e-3


@pytest.mark.parametrize("rule", ["p_over_q_with_topk", "accept_first_child"])
def test_broken_acceptance_rules_fail_the_same_test(setup, rule):
    """Guards against a chi-square test too weak to notice a biased rule (the test must have power)."""
    assert _pvalue(setup, SamplingConfig(mode="sample", temperature=1.0), rule=rule) < 1e-6


def test_decoding_loop_samples_exactly_end_to_end(setup):
    """Guards against bugs in the real loop (positions, masks, bonus, cache compaction) biasing samples."""
    m, tables = setup
    cfg = SamplingConfig(mode="sample", temperature=1.0, draft="topk")
    law = _exact_law(tables, cfg).sum(0).reshape(-1)       # (y2, y3), y1 marginalised
    counts = torch.zeros(V * V, dtype=torch.long)
    for seed in range(2500):
        out = generate(m, PROMPT, tree=TREE, max_new_tokens=3, sampling=cfg, seed=seed, eos_token_ids=())
        counts[out.tokens[1] * V + out.tokens[2]] += 1
    assert chi_square_pvalue(counts, law) > 1e-3
