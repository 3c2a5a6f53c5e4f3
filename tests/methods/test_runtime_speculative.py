"""Draft-model speculative sampling (inference/methods/draft.py): forced acceptance with scripted
models, greedy identity and cache roll-back on tiny random Llamas, the self-draft, bad input,
and exactness of the sampler by chi-square (with broken rules that must fail the same test)."""

from typing import Optional

import pytest
import torch

from inference.errors import UserError
from inference.methods import generate, stream
from inference.methods.draft import (DraftDecoder, DraftSettings, check_draft_compatible, load_draft,
                                     self_draft)
from inference.methods.registry import extra_parameters
from inference.runtime.model import MedusaModel
from inference.runtime.verify import SamplingConfig, filter_probs

from runtime_support import one_thread, sequential_kv, tiny_llama  # noqa: F401 (autouse fixture)
from scripted_lm import ScriptedLM, cached_tokens

PROMPT = [5, 17, 3, 88, 41, 9]
V = 96


def bare(model) -> MedusaModel:
    return MedusaModel(model=model, tokenizer=None, heads=None)


@pytest.fixture(scope="module")
def m():
    return bare(tiny_llama(vocab=V, seed=0))


@pytest.fixture(scope="module")
def greedy(m):
    return generate(m, PROMPT, "autoregressive", max_new_tokens=48).tokens


# -- forced acceptance (scripted models) ---------------------------------------------------------
P = [1, 2, 3, 4, 5]
T = list(range(10, 30))             # the target's continuation: T[0] is chosen at prefill
K = 4


@pytest.mark.parametrize("case, wrong_from, accepted", [("full", None, 4), ("zero", 6, 0), ("partial", 8, 2)])
def test_forced_acceptance_counts_and_cache_rollback(case, wrong_from, accepted):
    """Guards against wrong acceptance counts and against caches that keep rejected draft tokens
    (or lose accepted ones) after the roll-back, in the target and in the draft."""
    script = P + T
    draft_script = [t if wrong_from is None or i < wrong_from else 31 for i, t in enumerate(script)]
    target, draft = ScriptedLM(script, 32), ScriptedLM(draft_script, 32)
    dec = DraftDecoder(target, draft, DraftSettings(k=K))
    assert dec.prefill(torch.tensor([P]), max_new_tokens=16) == T[0]
    new, proposed = dec.step()
    assert proposed == K
    assert new == T[1:accepted + 2]                          # accepted drafts + the target's own token
    assert target.calls == [len(P), K + 1]                   # ONE verification forward over root + K drafts
    assert dec.cache.length == len(P) + 1 + accepted and cached_tokens(dec.cache) == P + T[:accepted + 1]
    kept = min(accepted, K - 1)                              # the draft never ran x_K
    assert dec.dcache.length == len(P) + 1 + kept and cached_tokens(dec.dcache) == P + T[:kept + 1]
    new2, _ = dec.step()                                     # the draft catches up and continues
    assert cached_tokens(dec.dcache)[:len(P) + accepted + 2] == P + T[:accepted + 2]
    assert new2[0] == T[accepted + 2]


def test_adaptive_k_grows_after_full_and_shrinks_after_partial_acceptance():
    """Guards against the adaptive schedule ignoring acceptance or leaving 1..2K."""
    script = P + list(range(10, 60))
    target = ScriptedLM(script, 64)
    dec = DraftDecoder(target, ScriptedLM(script, 64), DraftSettings(k=2, adaptive=True))
    dec.prefill(torch.tensor([P]), max_new_tokens=40)
    ks = [dec.step()[1] for _ in range(4)]
    assert ks == [2, 4, 4, 4]                                # +2 after full acceptance, capped at 2K
    dec2 = DraftDecoder(target, ScriptedLM(P + [63] * 50, 64), DraftSettings(k=3, adaptive=True))
    dec2.prefill(torch.tensor([P]), max_new_tokens=40)
    assert [dec2.step()[1] for _ in range(4)] == [3, 2, 1, 1]   # -1 after a rejection, floor 1


# -- real tiny models ----------------------------------------------------------------------------
@pytest.mark.parametrize("draft_spec, settings", [
    ("self:1", DraftSettings(k=4)),
    ("self:2", DraftSettings(k=3)),
    ("other", DraftSettings(k=5)),
    ("other", DraftSettings(k=2, adaptive=True)),
], ids=["self1", "self-full", "other-model", "other-adaptive"])
def test_greedy_speculative_is_token_identical(m, greedy, draft_spec, settings):
    """Guards against greedy speculative decoding changing the output, whatever the draft."""
    draft = bare(tiny_llama(vocab=V, seed=3)) if draft_spec == "other" else draft_spec
    out = generate(m, PROMPT, "draft", options=settings, max_new_tokens=48, draft=draft)
    assert out.tokens == greedy and out.finish_reason == "length"
    if draft_spec == "self:2":                               # the whole model as its own draft
        assert out.accept_lengths[:-1] == [settings.k + 1] * (len(out.accept_lengths) - 1)   # the last: cut at 48
        assert sum(out.accept_lengths) == 47 and out.acceptance_rate == 1.0


def test_caches_after_rollback_equal_sequential_caches(m):
    """Guards against stale or misplaced KV rows after rejections: after every step the target
    cache must equal feeding prompt + accepted tokens one by one, and the draft's likewise."""
    draft = load_draft("self:1", m)                          # agrees with the target now and then
    dec = DraftDecoder(m, draft, DraftSettings(k=3))
    dec.prefill(torch.tensor([PROMPT]), max_new_tokens=40)
    lengths = []
    for _ in range(12):
        new, _ = dec.step()
        lengths.append(len(new))
        assert dec.cache.length == len(dec.seq) - 1
        for cache, model in ((dec.cache, m), (dec.dcache, draft)):
            ref = sequential_kv(model, dec.seq[:cache.length])
            for layer, (k_ref, v_ref) in zip(cache.layers, ref):
                torch.testing.assert_close(layer.keys, k_ref, atol=1e-5, rtol=0)
                torch.testing.assert_close(layer.values, v_ref, atol=1e-5, rtol=0)
    assert min(lengths) == 1 and max(lengths) > 1            # both rejections and acceptances happened


def test_self_draft_shares_weights_and_leaves_the_target_intact(m):
    """Guards against a self-draft that copies weights (memory) or truncates the target's own stack."""
    layers = len(m.model.model.layers)
    full = self_draft(m, layers)
    short = load_draft("self:1", m)
    assert extra_parameters(short.model, m.model) == (0, 0) and extra_parameters(full.model, m.model) == (0, 0)
    assert short.config.num_hidden_layers == 1 and len(short.model.model.layers) == 1
    assert m.config.num_hidden_layers == layers and len(m.model.model.layers) == layers
    assert short.model.lm_head is m.model.lm_head and short.model.model.norm is m.model.model.norm
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        ref = m.model(input_ids=ids).logits[0, -1]
        got = full.logits(full.hidden(ids, torch.arange(len(PROMPT))[None], full.new_cache(8))[0, -1])
        first = short.logits(short.hidden(ids, torch.arange(len(PROMPT))[None], short.new_cache(8))[0, -1])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert not torch.allclose(first, ref)


class _Tok:
    def __init__(self, vocab, eos=0):
        self._vocab, self.eos_token_id = vocab, eos
        self.bos_token_id = self.pad_token_id = self.unk_token_id = None
        self.all_special_ids = [eos]

    def get_vocab(self):
        return dict(self._vocab)


@pytest.mark.parametrize("spec, words", [("self:0", "N >= 1"), ("self:3", "1..2"), ("self:x", "self:N"),
                                         ("small-vocab", "vocabulary"), ("other-tokenizer", "tokenizer"),
                                         ("other-eos", "eos_token_id")])
def test_bad_drafts_are_refused_with_one_line(m, spec, words):
    """Guards against a draft with other tokens (vocabulary size, token ids, special tokens) or an
    impossible self-draft depth silently producing garbage instead of one clear error."""
    vocab = {f"t{i}": i for i in range(V)}
    with pytest.raises(UserError, match=words) as e:
        if spec.startswith("self"):
            load_draft(spec, m)
        elif spec == "small-vocab":
            load_draft(tiny_llama(vocab=80, seed=1), m)
        else:
            target = MedusaModel(model=m.model, tokenizer=_Tok(vocab), heads=None)
            other = dict(vocab) if spec == "other-eos" else {**vocab, "t1": 2, "t2": 1}
            tok = _Tok(other, eos=1 if spec == "other-eos" else 0)
            draft = MedusaModel(model=tiny_llama(vocab=V, seed=2), tokenizer=tok, heads=None)
            check_draft_compatible(target, draft)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("k", [0, -1, 1.5])
def test_k_must_be_positive(k):
    """Guards against K <= 0 (or a fractional K) reaching the decoding loop."""
    with pytest.raises(UserError, match="draft_k"):
        DraftSettings(k=k)


def test_sample_mode_is_reproducible_and_streams(m):
    """Guards against seeds being ignored and streams that lose or duplicate tokens in sample mode."""
    cfg = SamplingConfig(mode="sample", temperature=0.9, top_p=0.95)
    a = generate(m, PROMPT, "draft", max_new_tokens=24, sampling=cfg, seed=7, draft="self:1")
    b = stream(m, PROMPT, "draft", max_new_tokens=24, sampling=cfg, seed=7, draft="self:1")
    assert [t for c in b for t in c] == a.tokens == b.result.tokens and len(a.tokens) == 24


# -- exactness of the sampler (chi-square) -------------------------------------------------------
SV = 12
SPROMPT = [3, 7, 1, 5]
N_TRIALS = 200_000


@pytest.fixture(scope="module")
def tables():
    """Target and draft next-token logits in every context of SPROMPT + up to 4 generated tokens."""
    target = tiny_llama(vocab=SV, hidden=32, init=0.35, seed=5)
    draft = tiny_llama(vocab=SV, hidden=32, init=0.35, seed=9)   # another random model: q far from p
    seqs = torch.cartesian_prod(*[torch.arange(SV)] * 4)
    ids = torch.cat([torch.tensor(SPROMPT).expand(len(seqs), -1), seqs], 1)
    with torch.inference_mode():
        lt, ld = target(input_ids=ids).logits, draft(input_ids=ids).logits
    n0 = len(SPROMPT) - 1
    out = {"p": {}, "q": {}, "models": (target, draft)}
    for j in range(5):  # contexts with j generated tokens: rows whose trailing 4-j tokens are 0
        rows = torch.arange(SV ** j) * SV ** (4 - j)
        out["p"][j], out["q"][j] = lt[rows, n0 + j], ld[rows, n0 + j]
    return out


def _ctx(tokens: torch.Tensor) -> torch.Tensor:
    idx = torch.zeros(tokens.shape[0], dtype=torch.long)
    for col in tokens.unbind(1):
        idx = idx * SV + col
    return idx


def exact_rule(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                  gen: Optional[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's accept/resample rule for B independent trials, vectorised: the reference the chi-square
    harness must accept while it rejects the broken rules (``_broken``); decoding's own rule is tested end to end.

    drafts [B, K] with x_i ~ q[:, i]; p [B, K+1, V] the target at root, x_1, .., x_K; q [B, K, V].
    Returns (accepted [B], next token [B]): x_i is kept with probability min(1, p_i/q_i) until
    the first rejection, whose replacement is drawn from normalize(max(0, p_n - q_n)); when all
    K are kept the next token is a bonus draw from p_{K+1}. Exact: P(emit y) = min(p, q)(y) +
    (1 - sum min(p, q)) * (p - q)+(y) / sum (p - q)+ = p(y), one position at a time.
    """
    B, K = drafts.shape
    rows = torch.arange(B, device=drafts.device)
    px = p[:, :K].gather(-1, drafts[..., None])[..., 0]
    qx = q.gather(-1, drafts[..., None])[..., 0]
    u = torch.rand(B, K, generator=gen, device=drafts.device)
    keep = u * qx < px                                    # u < p/q, without dividing by q
    n = keep.int().cumprod(1).sum(1)                      # accepted before the first rejection
    p_n = p[rows, n].float()
    q_n = torch.where((n < K)[:, None], q[rows, n.clamp(max=K - 1)].float(), torch.zeros_like(p_n))
    resid = (p_n - q_n).clamp(min=0)
    mass = resid.sum(-1, keepdim=True)
    # mass == 0 only when p_n == q_n, where a rejection has probability 0: p_n is then correct
    dist = torch.where(mass > 0, resid / mass.clamp(min=1e-30), p_n)
    nxt = torch.multinomial(dist, 1, generator=gen)[:, 0]
    return n, nxt


def _broken(rule):
    def resample_from_p(drafts, p, q, gen):     # the classic bug: on rejection, draw from p, not (p - q)+
        B, k = drafts.shape
        px = p[:, :k].gather(-1, drafts[..., None])[..., 0]
        qx = q.gather(-1, drafts[..., None])[..., 0]
        n = (torch.rand(B, k, generator=gen) * qx < px).int().cumprod(1).sum(1)
        return n, torch.multinomial(p[torch.arange(B), n], 1, generator=gen)[:, 0]

    def accept_all(drafts, p, q, gen):          # no test at all: the draft's distribution comes out
        B, k = drafts.shape
        n = torch.full((B,), k)
        return n, torch.multinomial(p[:, k], 1, generator=gen)[:, 0]

    return {"exact": exact_rule, "resample_from_p": resample_from_p, "accept_all": accept_all}[rule]


def _simulate(tables, cfg, n, seed, rule="exact", k=2):
    """First three tokens of n independent generations with k=2 drafts per step."""
    g = torch.Generator().manual_seed(seed)
    accept = _broken(rule)
    p = {j: filter_probs(tables["p"][j], cfg.temperature, cfg.top_k, cfg.top_p) for j in tables["p"]}
    q = {j: filter_probs(tables["q"][j], cfg.temperature, cfg.top_k, cfg.top_p) for j in tables["q"]}

    def step(before):                            # before: [B, j] generated tokens, the last is the root
        drafts, qs = [], []
        ctx = before
        for _ in range(k):
            qi = q[ctx.shape[1]][_ctx(ctx)]
            x = torch.multinomial(qi, 1, generator=g)[:, 0]
            drafts.append(x), qs.append(qi)
            ctx = torch.cat([ctx, x[:, None]], 1)
        d = torch.stack(drafts, 1)
        ps = torch.stack([p[before.shape[1] + i][_ctx(torch.cat([before, d[:, :i]], 1))] for i in range(k + 1)], 1)
        acc, nxt = accept(d, ps, torch.stack(qs, 1), g)
        return d, acc, nxt

    y1 = torch.multinomial(p[0].expand(n, -1), 1, replacement=True, generator=g)[:, 0]
    d, acc, nxt = step(y1[:, None])
    y2 = torch.where(acc >= 1, d[:, 0], nxt)
    y3 = torch.where(acc >= 2, d[:, 1], nxt)
    again = acc == 0
    d2, acc2, nxt2 = step(torch.stack([y1[again], y2[again]], 1))
    y3[again] = torch.where(acc2 >= 1, d2[:, 0], nxt2)
    return y1, y2, y3, acc


def _law(tables, cfg):
    t = {j: filter_probs(tables["p"][j], cfg.temperature, cfg.top_k, cfg.top_p) for j in range(3)}
    return (t[0][0][:, None, None] * t[1][:, :, None] * t[2].reshape(SV, SV, SV)).reshape(-1)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit (as in test_runtime_sampling); cells expected below 5 pooled."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    assert (obs[~keep] == 0).all(), "a token with zero target probability was generated"
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(len(obs) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def _pvalue(tables, cfg, rule="exact"):
    y1, y2, y3, _ = _simulate(tables, cfg, N_TRIALS, seed=0, rule=rule)
    return chi_square_pvalue(torch.bincount((y1 * SV + y2) * SV + y3, minlength=SV ** 3), _law(tables, cfg))


def test_the_draft_and_target_disagree_enough(tables):
    """Guards against a test without power: 0, 1 and 2 accepted drafts must all be common."""
    *_, acc = _simulate(tables, SamplingConfig(mode="sample"), 20_000, seed=1)
    share = torch.bincount(acc, minlength=3).float() / len(acc)
    assert (share > 0.05).all(), share


@pytest.mark.parametrize("cfg", [SamplingConfig(mode="sample", temperature=1.0),
                                 SamplingConfig(mode="sample", temperature=0.8, top_k=7, top_p=0.9)],
                         ids=["T1", "filtered"])
def test_speculative_sampling_matches_the_target_distribution(tables, cfg):
    """Guards against any bias of the accept / resample / bonus rule: three tokens must follow p."""
    assert _pvalue(tables, cfg) > 1e-3


@pytest.mark.parametrize("rule", ["resample_from_p", "accept_all"])
def test_broken_rules_fail_the_same_test(tables, rule):
    """Guards against a chi-square test too weak to notice a biased rule."""
    assert _pvalue(tables, SamplingConfig(mode="sample", temperature=1.0), rule=rule) < 1e-6


@pytest.mark.parametrize("cfg", [SamplingConfig(mode="sample", temperature=1.0),
                                 SamplingConfig(mode="sample", temperature=0.8, top_k=7, top_p=0.9)],
                         ids=["T1", "filtered"])
def test_decoding_loop_samples_exactly_end_to_end(tables, cfg):
    """Guards against bugs in the real loop (draft cache catch-up, positions, q rows, roll-back) or in the
    verification it runs (``verify``'s sampled rule on the chain: accept, resample, bonus; with temperature, top-k
    and top-p filters) biasing samples: (y2, y3) from the draft method must follow the target's law."""
    target, draft = tables["models"]
    law = _law(tables, cfg).reshape(SV, SV, SV).sum(0).reshape(-1)
    counts = torch.zeros(SV * SV, dtype=torch.long)
    tm, dm = bare(target), bare(draft)
    for seed in range(2500):
        out = generate(tm, SPROMPT, "draft", options=DraftSettings(k=2), max_new_tokens=3, sampling=cfg,
                                   seed=seed, eos_token_ids=(), draft=dm)
        counts[out.tokens[1] * SV + out.tokens[2]] += 1
    assert chi_square_pvalue(counts, law) > 1e-3
