"""EAGLE-3 drafters in the trainer: the training-time test is what decoding computes, the drafter reads the
layers it names, online and cached training agree, and one feature cache serves every family."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from inference.backbone import HiddenStateTap
from inference.errors import UserError
from inference.heads.eagle3 import DraftKV, default_aux_layers, draft_layer_config
from inference.heads.registry import init_heads
from inference.heads.spec import HeadsSpec
from medusa_train import features
from medusa_train import trainer as T
from medusa_train.data.masks import block_causal_mask
from medusa_train.losses import future_tokens

from conftest import losses, train_without_backbone

# 4 layers: the fewest with three distinct servable aux layers (debug_tiny's 2 are refused for eagle3)
RUN = ["trainer.max_steps=3", "trainer.log_every=1", "trainer.save_every=0", "logger.plot=false",
       "heads.kind=eagle3", "backbone.random_init.num_hidden_layers=4"]


def tiny_llama(layers: int = 6, vocab: int = 90):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def random_drafter(model, steps: int = 3, truncated: int = 0):
    cfg = model.config
    spec = HeadsSpec(num_heads=steps, num_layers=1, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                     kind="eagle3", aux_layers=default_aux_layers(cfg.num_hidden_layers),
                     draft_layer=draft_layer_config(cfg), projection="truncated" if truncated else "own",
                     truncated_vocab_size=truncated or None)
    token_map = torch.randperm(cfg.vocab_size)[:truncated] if truncated else None
    d = init_heads(spec, model.lm_head.weight, model.get_input_embeddings().weight, token_map)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))  # every weight matters, nothing sits at its warm start
    return d.eval()


def test_training_time_test_equals_decoding_in_packed_rows():
    """Guards against: a TTT unrolling that trains the drafter on a context decoding never shows it (wrong
    step mask, wrong RoPE position for depth j, the state of another position fed back, or attention that
    crosses into the previous packed conversation), which makes training accuracy a lie about acceptance."""
    model = tiny_llama()
    d = random_drafter(model, steps=4)
    torch.manual_seed(1)
    doc = torch.tensor([[1] * 9 + [2] * 11])              # two packed conversations
    pos = torch.cat([torch.arange(9), torch.arange(11)])[None]
    ids = torch.randint(0, 90, doc.shape)
    with HiddenStateTap(model, d.spec.settings.aux_layers) as tap, torch.no_grad():
        model.model(input_ids=ids, position_ids=pos, attention_mask=block_causal_mask(doc, torch.float32))
    aux = tap.features()
    fut = future_tokens(ids, 4)
    with torch.no_grad():
        feats = d.ttt_features(aux, fut, pos, block_causal_mask(doc, torch.float32))
        for t in (0, 4, 9, 13):                            # 9 = first token of conversation 2
            start = 0 if t < 9 else 9
            rows = slice(start, t + 1)                     # the committed prefix: this conversation only
            g = d.combine(aux[:, rows])
            normed, pre, (k, v) = d.forward_step(fut[:, rows, 0], g, pos[:, rows])
            assert torch.allclose(normed[0, -1], feats[0][0, t], atol=1e-5)
            kv = DraftKV(64)
            kv.append(k, v)
            h = pre[:, -1:]
            for j in range(1, 4):
                n2, h, (k2, v2) = d.forward_step(fut[:, t:t + 1, j], h, pos[:, t:t + 1] + j, past=kv.view())
                kv.append(k2, v2)
                assert torch.allclose(n2[0, 0], feats[j][0, t], atol=1e-5), (t, j)


def test_tap_reads_the_named_hidden_states():
    """Guards against: aux features taken one layer off (layer i's output vs hidden_states[i]) or in the
    wrong order, which silently mismatches what vLLM and SGLang feed an exported drafter."""
    model = tiny_llama()
    ids = torch.randint(0, 90, (2, 7))
    with HiddenStateTap(model, [0, 3, 5]) as tap, torch.no_grad():
        out = model(ids, output_hidden_states=True)
    ref = torch.cat([out.hidden_states[i] for i in (0, 3, 5)], dim=-1)
    assert torch.equal(tap.features(), ref)
    with pytest.raises(UserError, match="out of range"):
        HiddenStateTap(model, [0, 6, 2])


def test_fresh_drafter_starts_from_the_high_layer_and_lm_head():
    """Guards against: a cold start (ANCHORS: ~10% of depth-1 accuracy at this data size) — the untrained
    drafter must equal lm_head(norm(the high aux layer)) so training starts from a sensible guess."""
    model = tiny_llama()
    cfg = model.config
    spec = HeadsSpec(num_heads=2, num_layers=1, hidden_size=64, vocab_size=90, kind="eagle3",
                     aux_layers=[1, 3, 4], draft_layer=draft_layer_config(cfg))
    d = init_heads(spec, model.lm_head.weight, model.get_input_embeddings().weight)
    aux = torch.randn(1, 5, 3 * 64)
    normed, pre, _ = d.forward_step(torch.randint(0, 90, (1, 5)), d.combine(aux), torch.arange(5)[None])
    assert torch.allclose(pre, aux[..., 128:], atol=1e-6)
    assert torch.allclose(d.project(normed), d.project(d.norm(aux[..., 128:])), atol=1e-5)


def test_online_and_cached_training_agree_and_one_cache_serves_every_family(compose_tiny, tmp_path):
    """Guards against: aux features cached other than the online path computes them (fp32 caches must give
    bit-identical losses), a cached eagle3 run that still runs the backbone, a cache without the aux
    layers silently extended or used for eagle3, and an eagle3 cache that Medusa heads cannot read."""
    online, cached = tmp_path / "online", tmp_path / "cached"
    T.run(compose_tiny(*RUN, out=online))
    cfg = compose_tiny(*RUN, "features.mode=train", "features.dtype=fp32", out=cached)
    features.run_build(cfg)
    manifest = json.loads((cached / "features" / features.MANIFEST).read_text())
    assert manifest["aux_layers"] == [1, 2, 3]  # three distinct layers on a 4-layer backbone ((2, 2, 1) is not)
    trainer = T.MedusaTrainer(cfg)
    trainer.setup()
    train_without_backbone(trainer)
    assert losses(cached, "train") == losses(online, "train")
    spec = trainer.spec
    assert spec.kind == "eagle3" and spec.settings.aux_layers == [1, 2, 3] and spec.num_heads == 3

    # the eagle3 cache serves Medusa heads as it is
    medusa = [a for a in RUN if a != "heads.kind=eagle3"]
    T.run(compose_tiny(*medusa, "features.mode=train", "features.dtype=fp32",
                       f"features.cache_dir={cached / 'features'}", out=tmp_path / "medusa"))
    assert (tmp_path / "medusa" / "heads" / "config.json").is_file()

    # a Medusa cache (no aux layers) is refused for eagle3 in one line, before anything is written to it
    T.run(compose_tiny(*medusa, "features.mode=train", "features.dtype=fp32", out=tmp_path / "plain"))
    before = sorted(p.name for p in (tmp_path / "plain" / "features").iterdir())
    with pytest.raises(UserError, match="built without the aux layers"):
        T.run(compose_tiny(*RUN, "features.mode=train", "features.dtype=fp32",
                           f"features.cache_dir={tmp_path / 'plain' / 'features'}", out=tmp_path / "e"))
    assert sorted(p.name for p in (tmp_path / "plain" / "features").iterdir()) == before


def test_ttt_steps_sets_the_trained_depth(compose_tiny, tmp_path):
    """Guards against: heads.ttt_steps ignored (the drafter unrolled num_heads steps instead) or a loss
    weight list sized for num_heads."""
    T.run(compose_tiny(*RUN, "heads.ttt_steps=2", "heads.draft_vocab_size=100", out=tmp_path / "r"))
    spec = json.loads((tmp_path / "r" / "heads" / "config.json").read_text())
    assert spec["num_heads"] == 2 and spec["truncated_vocab_size"] == 100 and spec["projection"] == "truncated"
    row = [json.loads(x) for x in (tmp_path / "r").glob("*.jsonl").__next__().read_text().splitlines()][-1]
    assert "head2/top1" in row and "head3/top1" not in row


def test_teacher_term_scores_every_ttt_step_against_the_backbone_distribution_it_guesses():
    """Guards against: the soft-target term (heads.teacher_weight, SpecForge's EAGLE-3 loss) aligned one token
    off for the unrolled steps (step j at t guesses x_{t+j+2}, so its teacher is lm_head(h_{t+j+1})), the
    teacher softmax taken over the whole vocabulary instead of the draft vocabulary (or at positions whose target
    lies outside it, which SpecForge masks), or the term dropped for
    eagle3 drafters (a drafter then trains on hard labels while the recipe says otherwise)."""
    from medusa_train.losses import heads_loss, vocab_to_local

    model = tiny_llama()
    d = random_drafter(model, steps=3, truncated=40)
    torch.manual_seed(2)
    ids = torch.randint(0, 90, (1, 16))
    doc = torch.ones_like(ids)
    pos = torch.arange(16)[None]
    labels = ids.clone()
    labels[:, :3] = -100                                   # a "user turn": no targets there
    with HiddenStateTap(model, d.spec.settings.aux_layers) as tap, torch.no_grad():
        hidden = model.model(input_ids=ids, position_ids=pos).last_hidden_state
    aux = tap.features()
    inv = vocab_to_local(d.token_map, 90)
    got = heads_loss(d, hidden, labels, doc, [1.0, 1.0, 1.0], inv, input_ids=ids, teacher_weight=1.0,
                     lm_head_weight=model.lm_head.weight, aux=aux, position_ids=pos)
    feats = d.ttt_features(aux, future_tokens(ids, 3), pos, block_causal_mask(doc, torch.float32))
    want = 0.0
    for j in range(3):
        ts = [t for t in range(16 - j - 2)   # x_{t+j+2} is an assistant token in the draft vocabulary
              if labels[0, t + j + 2] != -100 and inv[labels[0, t + j + 2]] >= 0]
        teacher = torch.softmax(model.lm_head(hidden[0, [t + j + 1 for t in ts]])[:, d.token_map], dim=-1)
        logp = torch.log_softmax(d.project(feats[j][0, ts]), dim=-1)
        want = want + -(teacher * logp).sum(-1).mean()
    assert torch.allclose(got, want, atol=1e-5)
    hard = heads_loss(d, hidden, labels, doc, [1.0, 1.0, 1.0], inv, input_ids=ids, teacher_weight=0.0,
                      aux=aux, position_ids=pos)
    assert not torch.allclose(got, hard)


def test_eagle3_trains_on_the_teacher_term(compose_tiny, tmp_path):
    """Guards against: heads.teacher_weight refused or ignored for eagle3 in the trainer (the frozen lm_head
    not reaching the loss), or a soft-target run whose loss is not finite."""
    T.run(compose_tiny(*RUN, "heads.teacher_weight=1.0", out=tmp_path / "soft"))
    T.run(compose_tiny(*RUN, out=tmp_path / "hard"))
    soft, hard = losses(tmp_path / "soft", "train"), losses(tmp_path / "hard", "train")
    assert len(soft) == 3 and all(map(math.isfinite, soft)) and soft != hard


def test_feature_noise_perturbs_each_aux_layer_at_its_own_scale_while_training():
    """Guards against: heads.feature_noise skipped for eagle3 drafters (their features come as ``aux``, not
    ``hidden``), scaled by the RMS of the three layers together (hidden_states[2] is far smaller than
    hidden_states[N-3] in a trained model, so it would drown), or applied to held-out batches."""
    from medusa_train.losses import heads_loss

    model = tiny_llama()
    d = random_drafter(model, steps=1)
    ids = torch.randint(0, 90, (2, 64))
    doc, pos = torch.ones_like(ids), torch.arange(64).expand(2, 64)
    with HiddenStateTap(model, d.spec.settings.aux_layers) as tap, torch.no_grad():
        hidden = model.model(input_ids=ids, position_ids=pos).last_hidden_state
    aux = tap.features()
    aux = aux * torch.tensor([0.01] * 64 + [1.0] * 64 + [50.0] * 64)   # layers of very different scales
    seen = []
    original = d.ttt_features
    d.ttt_features = lambda a, *rest, **kw: (seen.append(a), original(a, *rest, **kw))[1]
    heads_loss(d, hidden, ids, doc, [1.0], None, input_ids=ids, aux=aux, position_ids=pos, feature_noise=0.3)
    assert torch.equal(seen[-1], aux)                        # eval mode (held-out batches): clean
    d.train()
    heads_loss(d, hidden, ids, doc, [1.0], None, input_ids=ids, aux=aux, position_ids=pos, feature_noise=0.3)
    noise = (seen[-1] - aux).unflatten(-1, (3, 64))
    rms = aux.unflatten(-1, (3, 64)).pow(2).mean(-1, keepdim=True).sqrt()
    assert torch.allclose((noise / rms).std(dim=(0, 1, 3)), torch.full((3,), 0.3), rtol=0.05)


def test_eagle3_trains_with_feature_noise(compose_tiny, tmp_path):
    """Guards against: heads.feature_noise not reaching the trainer's loss (a recipe that sets it trains
    exactly as without it) or a noisy run whose loss is not finite."""
    T.run(compose_tiny(*RUN, "heads.feature_noise=0.2", out=tmp_path / "noisy"))
    T.run(compose_tiny(*RUN, out=tmp_path / "clean"))
    noisy, clean = losses(tmp_path / "noisy", "train"), losses(tmp_path / "clean", "train")
    assert len(noisy) == 3 and all(map(math.isfinite, noisy)) and noisy != clean
