"""The EAGLE-3 training-time test, soft-target loss and logged accuracy against a port of SpecForge's trainer.

The port follows sgl-project/SpecForge at a6b6b023: ``specforge/algorithms/eagle3/model.py``
(``OnlineEagle3Model.forward`` with the sdpa backend, ``_compute_target_p``, ``_acc_and_loss``),
``specforge/modeling/draft/llama3_eagle.py`` (``LlamaAttention.forward``'s ``cache_hidden`` branch,
``LlamaDecoderLayer.forward``, ``compute_logits``), ``specforge/modeling/target/target_head.py`` (``preprocess``:
inputs and targets shifted left once) and ``specforge/utils.py`` (``padding``). SafeAILab/EAGLE's
``eagle/traineagle3/cnets.py`` (``Model.forward``, at cb7e0841) computes the same unroll. Run with our drafter's
weights, it must give our ``ttt_features`` logits at every step and position.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from inference.backbone import HiddenStateTap
from medusa_train.data.masks import block_causal_mask
from medusa_train.losses import future_tokens, heads_loss, vocab_to_local

from test_eagle3_training import random_drafter, tiny_llama


def _padding(x: torch.Tensor) -> torch.Tensor:
    """specforge/utils.py ``padding(tensor, left=False)``: shift left by one along dim 1, zero-fill the end."""
    return torch.cat((x[:, 1:], torch.zeros_like(x[:, -1:])), dim=1)


def _rope(x, positions, theta):
    """Llama rotate-half RoPE at ``positions`` (llama3_eagle.py ``apply_rotary_pos_emb``; plain rope here)."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions[..., None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


def specforge_ttt_logits(d, aux, input_ids, length):
    """OnlineEagle3Model.forward (sdpa) with ``d``'s weights: the per-step draft logits [B, T, V_draft]."""
    layer, attn = d.midlayer, d.midlayer.self_attn
    theta = d.spec.settings.draft_layer["rope_theta"]
    bsz, seq, _ = aux.shape
    hidden = d.fc(aux)                                                   # project_hidden_states
    position_ids = torch.arange(seq)[None].expand(bsz, seq)
    causal = torch.full((seq, seq), torch.finfo(hidden.dtype).min).triu(1)[None, None]  # _make_causal_mask
    ids = _padding(input_ids)                                            # target_head.preprocess
    cache_k, cache_v, out = [], [], []
    rep = attn.heads // attn.kv_heads
    for _ in range(length):
        emb = F.embedding(ids, d.embed_weight).to(hidden.dtype)          # embed_input_ids (frozen target table)
        residual = hidden                                                # LlamaDecoderLayer.forward
        x = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(hidden)), dim=-1)
        q = attn.q_proj(x).view(bsz, seq, attn.heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(bsz, seq, attn.kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(bsz, seq, attn.kv_heads, attn.head_dim).transpose(1, 2)
        lck = len(cache_k)
        q, k = _rope(q, position_ids + lck, theta), _rope(k, position_ids + lck, theta)
        cache_k.append(k.repeat_interleave(rep, dim=1))                  # repeat_kv
        cache_v.append(v.repeat_interleave(rep, dim=1))
        w = q @ cache_k[0].transpose(2, 3) / math.sqrt(attn.head_dim) + causal
        for i in range(1, len(cache_k)):                                 # each earlier step: its own position only
            w = torch.cat((w, ((q * cache_k[i]).sum(-1) / math.sqrt(attn.head_dim))[..., None]), dim=-1)
        w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        ctx = w[..., :seq] @ cache_v[0]
        for i in range(1, len(cache_k)):
            ctx = ctx + w[..., seq + i - 1][..., None] * cache_v[i]
        h = residual + attn.o_proj(ctx.transpose(1, 2).reshape(bsz, seq, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        hidden = h                                                       # the pre-norm state is fed back
        out.append(d.lm_head(d.norm(h)))                                 # compute_logits (norm_output default)
        ids = _padding(ids)                                              # step 5.7: inputs shift once more
    return out


def specforge_step_losses(logits, target_logits, t2d, loss_mask):
    """``_compute_target_p`` + ``LogSoftmaxLoss`` (sum over kept positions / (B * T)), targets and masks shifted per
    step as ``OnlineEagle3Model.forward`` shifts them."""
    target = _padding(target_logits).float()                             # target_head.preprocess
    position_mask = t2d[target.argmax(-1)][..., None].int() * loss_mask[..., None]
    target_p = torch.softmax(target[..., t2d], dim=2)
    padded = F.pad(target_p, (0, 0, 0, len(logits)), value=1 / target_p.shape[-1])
    seq = target.shape[1]
    losses = []
    for idx, lg in enumerate(logits):
        tp = padded[:, idx:idx + seq]
        losses.append(-(position_mask * tp * torch.log_softmax(lg.float(), -1)).sum(-1).mean())
        position_mask = _padding(position_mask)
    return losses


def _setup(truncated=0, steps=3, seq=14):
    model = tiny_llama()
    d = random_drafter(model, steps=steps, truncated=truncated)
    torch.manual_seed(3)
    ids = torch.randint(0, 90, (2, seq))
    pos = torch.arange(seq)[None].expand(2, seq)
    with HiddenStateTap(model, d.spec.settings.aux_layers) as tap, torch.no_grad():
        out = model(input_ids=ids, position_ids=pos, output_hidden_states=True)
    return model, d, ids, pos, tap.features(), out


def test_ttt_logits_equal_specforges_unroll_at_every_step_and_position():
    """Guards against: a training-time test that differs from SpecForge's / EAGLE's (the state of another step or
    position fed back, the token embedding shifted other than once per step, RoPE not advanced by one per step,
    step j seeing other step-0 entries than the causal prefix or other chain entries than its own position's,
    hidden_norm / input_layernorm swapped in the 2H input, the post-norm state fed back), i.e. a drafter
    trained on other math than the one SpecForge trains and vLLM / SGLang serve."""
    _, d, ids, pos, aux, _ = _setup(steps=4)
    with torch.no_grad():
        ours = d.ttt_features(aux, future_tokens(ids, 4), pos, block_causal_mask(torch.ones_like(ids), aux.dtype))
        ref = specforge_ttt_logits(d, aux, ids, 4)
    for j in range(4):
        assert torch.allclose(d.project(ours[j]), ref[j], atol=1e-4), j


def test_soft_target_loss_equals_specforges_kl_up_to_its_normalisation():
    """Guards against: the soft-target term (heads.teacher_weight=1, SpecForge's loss) scored against another
    target than SpecForge's for step j at t (the target model's softmax over the draft vocabulary at t+j+1, i.e.
    the distribution of x_{t+j+2}), or restricted / renormalised other than over the draft vocabulary. SpecForge
    averages over all B*T positions, we over the positions with a target: the test rescales for that, and masks
    SpecForge's positions by x_{s+2}'s label (its own loss_mask[s] marks x_s, two tokens before the target)."""
    model, d, ids, pos, aux, out = _setup(steps=3)
    hidden = out.hidden_states[-1]                                       # post-norm last state (lm_head's input)
    labels = ids.clone()
    labels[:, :4] = -100                                                 # a "user turn"
    doc = torch.ones_like(ids)
    seq = ids.shape[1]
    lm = torch.zeros_like(ids)
    lm[:, :seq - 2] = (labels[:, 2:] != -100).long()                     # position s trains x_{s+2}
    with torch.no_grad():
        ref = specforge_step_losses(specforge_ttt_logits(d, aux, ids, 3), out.logits,
                                    torch.ones(90, dtype=torch.bool), lm)
        for j in range(3):
            weights = [1.0 if k == j else 0.0 for k in range(3)]
            ours = heads_loss(d, hidden, labels, doc, weights, vocab_to_local(None, 90), input_ids=ids,
                              teacher_weight=1.0, lm_head_weight=model.lm_head.weight, aux=aux, position_ids=pos)
            kept = int(lm[:, j:].sum())                                 # step j's positions in SpecForge's mask
            assert torch.allclose(ours * kept / lm.numel(), ref[j], atol=1e-5), j


def test_soft_target_loss_with_a_draft_vocabulary_keeps_specforges_positions():
    """Guards against: the soft-target term scored at positions whose target lies outside the draft vocabulary
    (SpecForge and EAGLE mask them, ``t2d[target] * loss_mask``: such a target is never accepted), which pushed the
    drafter toward the target's distribution renormalised over tokens it can never be verified on."""
    from medusa_train.losses import backbone_labels

    model, d, ids, pos, aux, out = _setup(truncated=30, steps=3, seq=24)
    d.token_map.copy_(d.token_map.sort().values)   # SpecForge's draft vocabulary is in id order (t2d gathers so)
    hidden, doc = out.hidden_states[-1], torch.ones_like(ids)
    labels = backbone_labels(ids, doc, out.logits.argmax(-1))            # targets=backbone: out[s] = greedy[s-1]
    seq = ids.shape[1]
    lm = torch.zeros_like(ids)
    lm[:, :seq - 2] = (labels[:, 2:] != -100).long()
    t2d = torch.zeros(90, dtype=torch.bool)
    t2d[d.token_map] = True
    in_vocab = t2d[_padding(out.logits).argmax(-1)].long() * lm           # SpecForge's first position_mask
    assert 0 < int(in_vocab.sum()) < int(lm.sum())                        # some targets outside, some in
    inv = vocab_to_local(d.token_map, 90)
    with torch.no_grad():
        ref = specforge_step_losses(specforge_ttt_logits(d, aux, ids, 3), out.logits, t2d, lm)
        for j in range(3):
            weights = [1.0 if k == j else 0.0 for k in range(3)]
            ours = heads_loss(d, hidden, labels, doc, weights, inv, input_ids=ids, teacher_weight=1.0,
                              lm_head_weight=model.lm_head.weight, aux=aux, position_ids=pos)
            kept = int(in_vocab[:, j:].sum())
            assert torch.allclose(ours * kept / lm.numel(), ref[j], atol=1e-5), j


def specforge_step_accuracies(logits, target_logits, token_map, loss_mask):
    """``OnlineEagle3Model._acc_and_loss``'s acc: the draft argmax mapped to a target id equals the target's own
    argmax, over the step's (shifted) loss_mask; a target outside the draft vocabulary is a miss, not dropped."""
    target_ids = F.pad(_padding(target_logits).argmax(-1), (0, len(logits)))   # _compute_target_p_padded
    seq = target_logits.shape[1]
    accs = []
    for idx, lg in enumerate(logits):
        pred = token_map[lg.argmax(-1)]                                  # pred + d2t[pred]
        accs.append(float(((pred == target_ids[:, idx:idx + seq]) * loss_mask).sum() / loss_mask.sum()))
        loss_mask = _padding(loss_mask)
    return accs


def test_greedy_targets_and_top1_equal_specforges_targets_and_accuracy_with_a_draft_vocabulary():
    """Guards against: hard targets (heads.targets=backbone) other than SpecForge's target_token_ids for step j at
    t (the target's argmax at t+j+1), a target outside the draft vocabulary dropped from the logged accuracy
    instead of counted as a miss (SpecForge and EAGLE count it: their denominator is the loss mask), or the draft
    index mapped to the wrong vocabulary id (token_map, the d2t of the export)."""
    from medusa_train.losses import HeadMetrics, backbone_labels

    _, d, ids, pos, aux, out = _setup(truncated=30, steps=3, seq=24)
    with torch.no_grad():
        ref_logits = specforge_ttt_logits(d, aux, ids, 3)
    # The target's greedy ids: at every other position what step 0 guesses there (hits), elsewhere random ids,
    # most of them outside the 30-token draft vocabulary; the target's logits are peaked on them.
    greedy = torch.randint(0, 90, ids.shape, generator=torch.Generator().manual_seed(4))
    greedy[:, 1::2] = d.token_map[ref_logits[0].argmax(-1)][:, 0::2]   # step 0 at t guesses greedy[t+1]
    target_logits = 10.0 * F.one_hot(greedy, 90).float()
    doc = torch.ones_like(ids)
    labels = backbone_labels(ids, doc, greedy)                          # out[s] = greedy[s-1]
    seq = ids.shape[1]
    lm = torch.zeros_like(ids)
    lm[:, :seq - 2] = (labels[:, 2:] != -100).long()
    inv = vocab_to_local(d.token_map, 90)
    assert bool((inv[greedy[:, 1:seq - 1]] < 0).any())                  # some targets lie outside the draft vocabulary
    metrics = HeadMetrics(3)
    with torch.no_grad():
        heads_loss(d, out.hidden_states[-1], labels, doc, [1.0, 1.0, 1.0], inv, metrics=metrics, input_ids=ids,
                   aux=aux, position_ids=pos)
        ref = specforge_step_accuracies(ref_logits, target_logits, d.token_map, lm)
    assert 0.4 < ref[0] < 1                                             # hits and misses at step 0
    for j in range(3):
        assert metrics.count[j] == int(lm[:, j:].sum())
        assert math.isclose(metrics.hits[j][0] / metrics.count[j], ref[j], abs_tol=1e-6), j
