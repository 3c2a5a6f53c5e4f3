"""Dependent heads (Hydra, MLP speculator): wiring, tree drafting, decoding, format, training."""

import json
import math
import types

import pytest
import torch
import torch.nn.functional as F

from inference.methods import generate
from inference.methods.medusa_choice import measure_head_accuracy
from inference.errors import UserError
from inference.heads.drafting import PathDrafting, draft_dependent
from inference.heads.hydra import HydraHeads
from inference.heads.mlp_speculator import MLPSpeculatorHeads
from inference.heads.native import save_heads
from inference.heads.registry import init_heads
from inference.heads.spec import HeadsSpec
from inference.loading import load_heads, load_medusa
from inference.loading import attach_heads
from inference.runtime.tree import MedusaTree
from inference.runtime.verify import SamplingConfig

from runtime_support import one_thread, tiny_llama  # noqa: F401

V, H = 96, 64
PROMPT = [5, 17, 3, 88, 41, 9]
TREE = MedusaTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])   # 0 root, 1 [0], 2 [1], 3..6
KINDS = ["hydra", "mlp_speculator"]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=V, hidden=H, seed=0)


def dependent_heads(model, kind, projection="own", num_heads=3, seed=1, noise=0.3, **extra):
    """Heads initialised from the backbone, then perturbed so their guesses are arbitrary."""
    truncated = 40 if projection == "truncated" else None
    spec = HeadsSpec(num_heads=num_heads, num_layers=1, hidden_size=H, vocab_size=V, projection=projection,
                     truncated_vocab_size=truncated, kind=kind, base_model="random:llama", **extra)
    g = torch.Generator().manual_seed(seed)
    token_map = torch.randperm(V, generator=g)[:40] if truncated else None
    heads = init_heads(spec, model.lm_head.weight, model.get_input_embeddings().weight, token_map)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return heads


def assert_same_drafts(back, heads, seed: int) -> None:
    """``back`` drafts exactly what ``heads`` draft at every depth, teacher-forced on random states and tokens."""
    g = torch.Generator().manual_seed(seed)
    hidden, future = torch.randn(3, H, generator=g), torch.randint(0, V, (3, 3), generator=g)
    for k in range(3):
        torch.testing.assert_close(back.teacher_forced_logits(hidden, future, k),
                                   heads.teacher_forced_logits(hidden, future, k), atol=0, rtol=0)



@pytest.mark.parametrize("kind", KINDS)
def test_head_k_sees_tokens_up_to_t_plus_k_plus_1_and_never_later(model, kind):
    """Guards against leakage (a head trained on the token it must guess reaches 100% in
    training and is useless at decoding) and against a head blind to its own path."""
    heads = dependent_heads(model, kind)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, H, generator=g)
    future = torch.randint(0, V, (5, 3), generator=g)
    base = heads.teacher_forced_features(hidden, future)
    for k in range(3):
        for j in range(3):
            planted = future.clone()
            planted[:, j] = (planted[:, j] + 7) % V
            changed = not torch.allclose(heads.teacher_forced_features(hidden, planted)[k], base[k])
            assert changed == (j <= k), f"head {k} {'ignores' if j <= k else 'sees'} future token {j}"


@pytest.mark.parametrize("kind", KINDS)
def test_teacher_forcing_equals_the_decoding_recurrence(model, kind):
    """Guards against training one function and decoding another: the batched teacher-forced
    features must equal feeding the same tokens one ``step`` at a time."""
    heads = dependent_heads(model, kind)
    g = torch.Generator().manual_seed(1)
    hidden, future = torch.randn(4, H, generator=g), torch.randint(0, V, (4, 3), generator=g)
    batched = heads.teacher_forced_features(hidden, future)
    state = heads.init_state(hidden)
    for k in range(3):
        state, f = heads.step(k, state, future[:, k])
        torch.testing.assert_close(f, batched[k])


class TokenChainHeads(PathDrafting, torch.nn.Module):
    """Stub dependent heads whose guesses depend only on the fed token: head k ranks
    (token + 10 (k + 1) + r) % V at rank r, so the expected tree can be written by hand."""

    def __init__(self, num_heads=3):
        super().__init__()
        self.spec = types.SimpleNamespace(num_heads=num_heads, output_size=V)

    def init_state(self, hidden):
        return torch.zeros(hidden.shape[0], 1)

    def step(self, k, state, tokens):
        return state, tokens.float()[:, None] + 10 * (k + 1)

    def project(self, feats, k):
        base = feats[:, 0].long()
        logits = torch.full((feats.shape[0], V), -1e4)
        for r in range(4):
            logits[torch.arange(feats.shape[0]), (base + r) % V] = 10.0 - r
        return logits

    def to_vocab_ids(self, ids):
        return ids

    def teacher_forced_logits(self, hidden, future, k):
        state = self.init_state(hidden)
        for j in range(k + 1):
            state, feats = self.step(j, state, future[:, j])
        return self.project(feats, k)


def test_tree_drafting_feeds_each_node_its_parent_token():
    """Guards against drafting every depth from the root (Medusa-style) or from the wrong
    parent: node [r0, r1] must be rank r1 of head 1 fed node [r0]'s token."""
    root = 3
    got = draft_dependent(TREE.buffers(), TokenChainHeads(), torch.zeros(H), root).tolist()
    n1, n2 = root + 10, root + 11                  # [0], [1]: head 0 fed the root
    n00, n01 = n1 + 20, n1 + 21                    # [0,0], [0,1]: head 1 fed node [0]
    n10 = n2 + 20                                  # [1,0]: head 1 fed node [1]
    n000 = n00 + 30                                # [0,0,0]: head 2 fed node [0,0]
    assert got == [n1, n2, n00, n01, n10, n000]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("projection", ["own", "truncated", "shared"])
def test_greedy_decoding_is_token_identical(model, kind, projection):
    """Guards against lossy tree verification with dependent heads, in every projection mode."""
    m = attach_heads(model, dependent_heads(model, kind, projection))
    ref = generate(m, PROMPT, "autoregressive", max_new_tokens=40).tokens
    for tree in (TREE, MedusaTree([[0], [0, 0], [0, 0, 0]])):
        assert generate(m, PROMPT, tree=tree, max_new_tokens=40).tokens == ref


class SuccessorHeads(TokenChainHeads):
    """Stub dependent heads that guess the backbone's greedy successor of the token they are fed."""

    def __init__(self, successor: dict[int, int], num_heads=3):
        super().__init__(num_heads)
        self.successor = successor

    def step(self, k, state, tokens):
        return state, tokens.float()[:, None]

    def project(self, feats, k):
        logits = torch.zeros(feats.shape[0], V)
        for i, t in enumerate(feats[:, 0].long().tolist()):
            logits[i, self.successor.get(t, 0)] = 10.0
        return logits


def test_heads_that_follow_the_path_are_accepted(model):
    """Guards against drafting a depth from the wrong state: heads that know the greedy
    successor of the token they are fed must get whole chains accepted, which only happens
    when depth d is drafted from the node at depth d-1."""
    m = attach_heads(model, dependent_heads(model, "hydra"))
    ref = generate(m, PROMPT, "autoregressive", max_new_tokens=30).tokens
    seq = PROMPT[-1:] + ref
    successor = {}
    for a, b in zip(seq, seq[1:]):
        successor.setdefault(a, b)
    m.heads = SuccessorHeads(successor)
    out = generate(m, PROMPT, tree=MedusaTree([[0], [0, 0], [0, 0, 0]]), max_new_tokens=30)
    assert out.tokens == ref
    predictable = sum(successor[a] == b for a, b in zip(seq, seq[1:])) / (len(seq) - 1)
    if predictable == 1.0:
        assert out.tau > 3.0
    else:
        assert out.tau > 1.5


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_modes_run_and_sampled_drafts_are_refused(model, kind):
    """Guards against dependent heads breaking typical / exact sampling, and against silently
    using the per-depth draft distribution that sampled drafts assume (not defined here)."""
    m = attach_heads(model, dependent_heads(model, kind))
    for cfg in (SamplingConfig(mode="typical", temperature=0.7), SamplingConfig(mode="sample", temperature=0.8)):
        out = generate(m, PROMPT, tree=TREE, max_new_tokens=20, sampling=cfg, seed=0)
        again = generate(m, PROMPT, tree=TREE, max_new_tokens=20, sampling=cfg, seed=0)
        assert out.tokens == again.tokens and len(out.tokens) == 20
    with pytest.raises(UserError, match="draft=sampled"):
        generate(m, PROMPT, tree=TREE, max_new_tokens=5,
                        sampling=SamplingConfig(mode="sample", temperature=0.8, draft="sampled"))


def test_calibration_feeds_the_greedy_path(model):
    """Guards against calibrating dependent heads as if they were Medusa heads (blind to the
    path): head k at t is fed greedy tokens t+1..t+k+1, so successor heads score exactly the
    positions where the successor map predicts token t+k+2."""
    m = attach_heads(model, dependent_heads(model, "hydra"))
    ref = generate(m, PROMPT, "autoregressive", max_new_tokens=24).tokens
    seq = PROMPT + ref
    successor = {}
    for a, b in zip(seq[len(PROMPT) - 1:], seq[len(PROMPT):]):
        successor.setdefault(a, b)
    m.heads = SuccessorHeads(successor)
    acc = measure_head_accuracy(m, [PROMPT], max_new_tokens=24, topk=1)
    n0, n = len(PROMPT), len(seq)
    for k in range(3):
        positions = range(n0 - 1, n - k - 2)
        expected = sum(successor.get(seq[t + k + 1]) == seq[t + k + 2] for t in positions)
        assert int(acc.totals[k]) == len(positions)
        assert int(acc.hits[k, 0]) == expected


@pytest.mark.parametrize("kind,extra", [("hydra", {}), ("mlp_speculator", {}),
                                        ("mlp_speculator", {"tie_weights": True, "scale_input": True})])
def test_export_round_trip_gives_identical_logits(model, kind, extra, tmp_path):
    """Guards against an export that loads but computes something else (names, tying, ln0)."""
    heads = dependent_heads(model, kind, **extra)
    save_heads(heads, tmp_path / "heads")
    back = load_heads(tmp_path / "heads", model.config, model.lm_head.weight,
                      input_embeddings=model.get_input_embeddings().weight)
    assert type(back) is type(heads)
    assert_same_drafts(back, heads, seed=2)
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert config["kind"] == kind


def test_hydra_export_needs_the_backbone_embeddings(model, tmp_path):
    """Guards against Hydra heads loading without the embedding table they read (they would
    crash mid-decoding instead of failing at load time with a clear line)."""
    save_heads(dependent_heads(model, "hydra"), tmp_path / "heads")
    with pytest.raises(UserError, match="input embeddings"):
        load_heads(tmp_path / "heads", model.config, model.lm_head.weight)
    m = load_medusa(tmp_path / "heads", backbone=model)
    assert m.heads.sequential


def test_mlp_speculator_matches_vllm_arithmetic(model):
    """Guards against drifting from vLLM's mlp_speculator (vllm/model_executor/models/
    mlp_speculator.py, v0.8-v0.9.2: MLPSpeculator.generate_proposals, MLPSpeculatorLayerNorm):
    heads exported to vLLM must draft there what they draft here."""
    heads = dependent_heads(model, "mlp_speculator", scale_input=True)
    n = heads.spec.num_heads
    state_weight = 0.5 ** (0.5 / n)
    emb_weight = math.sqrt((1 - state_weight ** 2) * (H / 2))

    def ln(x, w=None, b=None, eps=1e-6):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return x if w is None else w * x + b

    sd = heads.state_dict()
    g = torch.Generator().manual_seed(3)
    hidden, future = torch.randn(2, H, generator=g), torch.randint(0, V, (2, n), generator=g)
    state = ln(hidden) / 2 ** 0.5
    for k in range(n):
        z = F.embedding(future[:, k], sd[f"emb.{k}.weight"])
        state = state @ sd[f"proj.{k}.weight"].T + (emb_weight / state_weight) * z
        state = F.gelu(ln(state, sd[f"ln.{k}.weight"], sd[f"ln.{k}.bias"]))
        ref = state @ sd[f"head.{k}.weight"].T
        torch.testing.assert_close(heads.teacher_forced_logits(hidden, future, k), ref, atol=1e-5, rtol=1e-5)


def test_tied_mlp_speculator_stores_vllm_tied_names(model):
    """Guards against a tied export vLLM cannot load: with tie_weights vLLM's named_parameters
    are emb.0, proj.0, proj.1, ln.0, head.0 only."""
    heads = dependent_heads(model, "mlp_speculator", num_heads=3, tie_weights=True)
    assert sorted(heads.state_dict()) == ["emb.0.weight", "head.0.weight", "ln.0.bias", "ln.0.weight",
                                          "proj.0.weight", "proj.1.weight"]


def test_bad_specs_are_one_line_errors():
    """Guards against silently building the wrong family from a typo or an impossible tying."""
    with pytest.raises(UserError, match="kind"):
        HeadsSpec(num_heads=2, num_layers=1, hidden_size=8, vocab_size=16, kind="hydra2")
    with pytest.raises(UserError, match="tie_weights"):
        HeadsSpec(num_heads=1, num_layers=1, hidden_size=8, vocab_size=16, kind="mlp_speculator", tie_weights=True)
    assert isinstance(HydraHeads(HeadsSpec(num_heads=2, num_layers=0, hidden_size=8, vocab_size=16, kind="hydra")),
                      HydraHeads)
    assert isinstance(MLPSpeculatorHeads(HeadsSpec(num_heads=2, num_layers=0, hidden_size=8, vocab_size=16,
                                                   kind="mlp_speculator", inner_dim=12)), MLPSpeculatorHeads)


# -- training ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,extra", [
    ("hydra", []),
    ("mlp_speculator", ["heads.tie_weights=true", "heads.scale_input=true"]),
    ("hydra", ["heads.teacher_weight=0.5", "heads.projection=own"]),
], ids=["hydra", "mlp-tied", "hydra-teacher"])
def test_dependent_heads_train_export_and_decode_losslessly(kind, extra, compose_tiny, out_dir, tiny_backbone):
    """Guards against a head family the trainer cannot train (input_ids not reaching the loss,
    a parameter left out of the optimizer, the teacher term breaking the graph) or whose export
    does not load and decode losslessly on its own backbone."""
    from medusa_train import trainer as T

    model = tiny_backbone.model
    backbone_before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    summary = T.run(compose_tiny(f"heads.kind={kind}", "trainer.max_steps=3", "trainer.save_every=0",
                                 "logger.plot=false", *extra))
    assert summary["step"] == 3 and math.isfinite(summary["loss"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, backbone_before[k]), f"backbone {k} changed"
    m = load_medusa(out_dir / "heads", backbone=model)
    assert m.heads.spec.kind == kind and m.heads.sequential
    fresh = init_heads(m.heads.spec, model.lm_head.weight if hasattr(model, "lm_head") else
                       model.get_output_embeddings().weight, model.get_input_embeddings().weight,
                       m.heads.token_map)
    moved = [n for n, p in m.heads.named_parameters() if not torch.equal(p, dict(fresh.named_parameters())[n])]
    assert moved, "no head parameter changed in training"
    ref = generate(m, [1, 2, 3, 4, 5], "autoregressive", max_new_tokens=24, eos_token_ids=()).tokens
    out = generate(m, [1, 2, 3, 4, 5], tree=MedusaTree([[0], [1], [0, 0]]), max_new_tokens=24,
                          eos_token_ids=())
    assert out.tokens == ref


def test_recipes_for_dependent_heads_compose():
    """Guards against shipped recipes that fail to compose or silently train Medusa heads."""
    from medusa_train.launch import compose_recipe

    for name, kind in (("hydra_smollm2", "hydra"), ("mlp_speculator_smollm2", "mlp_speculator")):
        cfg = compose_recipe(name, [])
        assert cfg.heads.kind == kind and cfg.output_dir == f"runs/{name}"
        assert cfg.trainer.max_steps == compose_recipe("medusa1_smollm2", []).trainer.max_steps


def test_heads_kind_typo_is_refused_at_compose():
    """Guards against a typo in heads.kind training the default family without a word (heads.kind chooses the
    family's config group: an unknown one is refused while composing, naming the kinds)."""
    from medusa_train.launch import compose_recipe
    from medusa_train.config import validate

    with pytest.raises(Exception, match="kind"):
        validate(compose_recipe("debug_tiny", ["heads.kind=hydar"]))


# -- export to serving formats ----------------------------------------------------------------
@pytest.mark.parametrize("extra", [{}, {"tie_weights": True, "scale_input": True}], ids=["untied", "tied"])
def test_mlp_speculator_exports_to_vllm_and_imports_bit_identically(model, extra, tmp_path):
    """Guards against an mlp_speculator export vLLM would load with uninitialised or misplaced
    tensors (it skips unknown names silently), and against an import that computes otherwise."""
    from engine_specs import check_vllm_mlp_speculator
    from inference.formats.export import export_heads
    from inference.formats.importers import detect_layout
    from inference.loading import import_heads

    heads = dependent_heads(model, "mlp_speculator", **extra)
    export_heads(heads, "vllm", tmp_path / "vllm")
    assert check_vllm_mlp_speculator(tmp_path / "vllm", H, V) == []
    assert detect_layout(tmp_path / "vllm") == "vllm_mlp_speculator"
    back = import_heads(tmp_path / "vllm", model.config)
    assert_same_drafts(back, heads, seed=4)
    m = load_medusa(tmp_path / "vllm", backbone=model)
    ref = generate(m, PROMPT, "autoregressive", max_new_tokens=16).tokens
    assert generate(m, PROMPT, tree=TREE, max_new_tokens=16).tokens == ref


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_an_mlp_speculator_dir_with_only_pytorch_model_bin_imports(model, tmp_path, zipfile):
    """Guards against: IBM fms mlp_speculator checkpoints (config.json + pytorch_model.bin, no safetensors) refused
    with the native loader's "missing model.safetensors"; the .bin is read with torch.load(weights_only=True)."""
    from safetensors.torch import load_file
    from inference.formats.export import export_heads
    from inference.formats.importers import detect_layout
    from inference.loading import import_heads

    heads = dependent_heads(model, "mlp_speculator")
    d = export_heads(heads, "vllm", tmp_path / "fms").path
    state = {f"speculator.{k}": v for k, v in load_file(str(d / "model.safetensors")).items()}
    (d / "model.safetensors").unlink()
    torch.save(state, d / "pytorch_model.bin", _use_new_zipfile_serialization=zipfile)
    assert detect_layout(d) == "vllm_mlp_speculator"
    back = import_heads(d, model.config)
    assert_same_drafts(back, heads, seed=5)


def test_a_tied_speculator_from_fms_extras_converter_imports(model, tmp_path):
    """Guards against: a tied speculator converted by fms-extras (its config says ``tie_wts``, not vLLM's
    ``tie_weights``) refused as lacking emb.1.weight, the weights it shares with step 0."""
    from inference.formats.export import export_heads
    from inference.loading import import_heads

    heads = dependent_heads(model, "mlp_speculator", tie_weights=True)
    d = export_heads(heads, "vllm", tmp_path / "fms").path
    config = json.loads((d / "config.json").read_text())
    config["tie_wts"] = config.pop("tie_weights")
    (d / "config.json").write_text(json.dumps(config))
    back = import_heads(d, model.config)
    assert_same_drafts(back, heads, seed=6)


def test_a_cut_or_odd_mlp_speculator_dir_is_refused_in_one_line(model, tmp_path):
    """Guards against: an mlp_speculator folder whose model.safetensors is cut short ending in safetensors'
    ``SafetensorError`` traceback (the other layouts check the header first), and a folder whose config.json
    holds a JSON list crashing layout detection with ``'list' object has no attribute 'get'``."""
    from inference.formats.export import export_heads
    from inference.formats.importers import detect_layout
    from inference.loading import import_heads

    d = export_heads(dependent_heads(model, "mlp_speculator"), "vllm", tmp_path / "cut").path
    weights = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    with pytest.raises(UserError, match="model.safetensors is corrupt or unreadable"):
        import_heads(d, model.config)
    (d / "model.safetensors").write_bytes(weights)
    (d / "config.json").write_text("[]")
    assert detect_layout(d) != "vllm_mlp_speculator"


def test_truncated_mlp_speculator_needs_materialize_and_hydra_has_no_vllm_layout(model, tmp_path):
    """Guards against writing a vLLM directory whose head.{k} vLLM cannot hold (truncated), and
    against exporting Hydra heads to a format that has no place for them."""
    from engine_specs import check_vllm_mlp_speculator
    from inference.formats.export import export_heads

    truncated = dependent_heads(model, "mlp_speculator", projection="truncated")
    with pytest.raises(UserError, match="materialize=true"):
        export_heads(truncated, "vllm", tmp_path / "a")
    from inference.formats.export import ExportOptions

    result = export_heads(truncated, "vllm", tmp_path / "b", options=ExportOptions(materialize=True))
    assert check_vllm_mlp_speculator(tmp_path / "b", H, V) == []
    assert any("materialised" in n for n in result.notes)
    with pytest.raises(UserError, match="kind 'hydra'"):
        export_heads(dependent_heads(model, "hydra"), "vllm", tmp_path / "c")


@pytest.mark.parametrize("extra", [{}, {"tie_weights": True}, {"scale_input": True}, {"tie_weights": True,
                                                                                    "scale_input": True}],
                         ids=["untied", "tied", "scaled", "tied-scaled"])
def test_mlp_speculator_exports_to_tgi_and_drafts_there_what_it_drafts_here(model, extra, tmp_path):
    """Guards against MLP speculators that no maintained engine serves (vLLM's V1 engine refuses them): the TGI
    export must load in TGI's loader (``speculator.``-prefixed names it reads with get_tensor, its architectures
    and inner_dim keys) and TGI's MLPSpeculatorModel must draft, head by head, the distribution this runtime drafts;
    the directory imports back bit-identically. Heads trained with scale_input (refused before, though TGI v2.3.0
    on applies it) draft the same there too."""
    from engine_specs import check_tgi_mlp_speculator, tgi_mlp_speculator_probs
    from inference.formats.export import ExportOptions, export_heads
    from inference.loading import import_heads

    heads = dependent_heads(model, "mlp_speculator", **extra)
    result = export_heads(heads, "tgi", tmp_path / "tgi", options=ExportOptions(base_model="org/backbone"))
    d, tied = result.path, bool(extra.get("tie_weights"))
    # the release that serves them: tied heads from v2.3.0 on, untied ones up to v2.2.0 (the export says so)
    release, other = ("current", "2.2") if tied else ("2.2", "current")
    assert check_tgi_mlp_speculator(d, H, V, release) == [] and check_tgi_mlp_speculator(d, H, V, other) != []
    assert any(("need TGI 2.3.0 or later" if tied else "TGI 2.2.0 or older") in n for n in result.notes)
    g = torch.Generator().manual_seed(6)
    hidden, greedy = torch.randn(4, H, generator=g), torch.randint(0, V, (4,), generator=g)
    tgi = tgi_mlp_speculator_probs(d, hidden, greedy, release)
    future = torch.cat([greedy[:, None], tgi.argmax(-1)[:, :-1]], dim=1)   # TGI's own top-1 chain
    ln0 = heads.ln0
    if not tied and extra.get("scale_input"):   # v2.2.0 ignores it: the drafts of unscaled heads, as said
        assert any("TGI 2.2.0 and older ignore" in n for n in result.notes)
        heads.ln0 = None
    for k in range(heads.spec.num_heads):
        ours = torch.softmax(heads.teacher_forced_logits(hidden, future, k), dim=-1)
        torch.testing.assert_close(ours, tgi[:, k], atol=1e-5, rtol=1e-4)
    heads.ln0 = ln0
    back = import_heads(d, model.config)
    for k in range(heads.spec.num_heads):
        torch.testing.assert_close(back.teacher_forced_logits(hidden, future, k),
                                   heads.teacher_forced_logits(hidden, future, k), atol=0, rtol=0)


def test_tgi_exports_of_scale_input_heads_say_which_tgi_applies_it(model, tmp_path):
    """Guards against a TGI export of heads trained with scale_input (vLLM's ln0 on the backbone state) written
    without a word: untied heads serve only on TGI 2.2.0 or older, which drafts from the unscaled state (fewer
    drafts accepted); tied ones need 2.3.0 or later, which applies it. Truncated heads need materialize=true, as
    for vLLM."""
    from engine_specs import check_tgi_mlp_speculator
    from inference.formats.export import ExportOptions, export_heads

    def notes(out, **extra):
        return export_heads(dependent_heads(model, "mlp_speculator", **extra), "tgi", tmp_path / out,
                            options=ExportOptions(base_model="org/backbone")).notes

    assert any("scale_input=true, which TGI 2.2.0 and older ignore" in n for n in notes("a", scale_input=True))
    assert not any("scale_input" in n for n in notes("c"))
    assert not any("scale_input" in n for n in notes("d", scale_input=True, tie_weights=True))
    truncated = dependent_heads(model, "mlp_speculator", projection="truncated")
    with pytest.raises(UserError, match="materialize=true"):
        export_heads(truncated, "tgi", tmp_path / "b")
    export_heads(truncated, "tgi", tmp_path / "b", options=ExportOptions(materialize=True, base_model="org/backbone"))
    assert check_tgi_mlp_speculator(tmp_path / "b", H, V, release="2.2") == []
