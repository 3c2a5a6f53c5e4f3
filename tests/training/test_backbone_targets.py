"""``heads.targets=backbone``: heads trained on the frozen backbone's own greedy tokens (what greedy
verification accepts) instead of the dataset's, online and from the features cache, on the tiny random
backbone."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inference.errors import UserError
from inference.methods import generate
from inference.loading import load_medusa
from inference.runtime.tree import MedusaTree
from medusa_train import backbone_inputs
from medusa_train import features
from medusa_train import trainer as T
from medusa_train.config import validate
from medusa_train.data.masks import block_causal_mask
from medusa_train.losses import backbone_labels, greedy_positions, head_targets
from medusa_train.tracking import read_metrics

from conftest import losses, train_without_backbone

I = -100  # IGNORE
RUN = ["trainer.max_steps=4", "trainer.log_every=1", "trainer.save_every=0", "logger.plot=false"]
BACKBONE = "heads.targets=backbone"


def make_trainer(cfg) -> T.MedusaTrainer:
    trainer = T.MedusaTrainer(cfg)
    trainer.setup()
    return trainer


def spy_labels(trainer) -> list:
    """The labels each later loss call hands the heads, appended to the returned list."""
    seen = []
    forward = trainer.module.forward

    def spy(hidden, lab, doc, ids=None):
        seen.append(lab.clone())
        return forward(hidden, lab, doc, ids)

    trainer.module.forward = spy
    return seen


def full_logits_argmax(trainer, batch) -> torch.Tensor:
    """The whole causal LM (body + lm_head over every position), independently of the trainer's chunks; loaded
    again where the trainer's run (from the feature cache) freed its body."""
    ids, pos, doc = batch["input_ids"], batch["position_ids"], batch["doc_ids"]
    model = trainer.backbone.model
    if trainer.backbone.released:
        from medusa_train.backbone import load_backbone

        model = load_backbone(trainer.cfg.backbone, seed=trainer.cfg.trainer.seed, run_dir=trainer.output_dir,
                              write=False).model
    mask = block_causal_mask(doc, model.dtype)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits.argmax(-1)


# -- the label transform ---------------------------------------------------------------------------------------
def test_backbone_labels_shift_mask_and_document_boundaries():
    """Guards against: the greedy token taken from the wrong position (j instead of j-1: a head would learn
    the token after the one it is asked for), backbone labels where the data has none (user turns, padding),
    a label crossing into the previous packed document (its last position predicts another conversation),
    and the first position of a row reading a wrapped-around greedy id."""
    # row 0: doc 1 = 0-5 (0-1 unlabelled), doc 2 = 6-8 (6 labelled: its j-1 is in doc 1), padding 9-10
    # with a stray label at 10; row 1: labelled from position 0 (nothing before it).
    labels = torch.tensor([[I, I, 12, 13, 14, 15, 16, 17, 18, I, 20],
                           [30, 31, I, 33, 34, I, I, I, I, I, I]])
    docs = torch.tensor([[1, 1, 1, 1, 1, 1, 2, 2, 2, 0, 0],
                         [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]])
    greedy = torch.arange(22).reshape(2, 11) + 100  # greedy[r, j] = 100 + 11 r + j: its origin is readable
    out = backbone_labels(labels, docs, greedy)
    assert out.tolist() == [[I, I, 101, 102, 103, 104, I, 106, 107, I, I],
                            [I, 111, I, 113, 114, I, I, I, I, I, I]]
    assert greedy_positions(labels, docs).tolist() == [
        [False, True, True, True, True, False, True, True, False, False, False],
        [True, False, True, True, False, False, False, False, False, False, False]]
    # only the needed positions are read: garbage elsewhere changes nothing
    junk = torch.where(greedy_positions(labels, docs), greedy, torch.full_like(greedy, 7))
    assert torch.equal(backbone_labels(labels, docs, junk), out)
    # drop-in for labels: head 1 at t is trained on greedy[t+1]
    assert head_targets(out, docs, 1)[0].tolist() == [101, 102, 103, 104, I, I, 107, I, I, I, I]


# -- online ------------------------------------------------------------------------------------------------------
def test_online_greedy_ids_are_the_full_backbone_argmax_and_reach_the_loss(compose_tiny, monkeypatch):
    """Guards against: greedy ids from something other than the backbone's full-vocabulary argmax (e.g. the
    heads' truncated vocabulary, a chunk boundary dropping or reordering rows, the hidden state rounded to
    the heads' precision), and the loss (train and eval) still receiving the dataset labels."""
    trainer = make_trainer(compose_tiny(*RUN, BACKBONE))
    batch = next(iter(trainer.batches))
    labels, docs = batch["labels"], batch["doc_ids"]
    expected = full_logits_argmax(trainer, batch)
    need = greedy_positions(labels, docs)
    assert int(need.sum()) > 20

    raw = trainer.source.frozen.backbone_hidden(batch)
    greedy = trainer.source.frozen.greedy_ids(raw, labels, docs)
    assert torch.equal(greedy[need], expected[need])
    assert (greedy[~need] == I).all()
    monkeypatch.setattr(backbone_inputs, "GREEDY_CHUNK", 7)  # many chunks, a ragged last one: the same ids
    assert torch.equal(trainer.source.frozen.greedy_ids(raw, labels, docs), greedy)

    seen = spy_labels(trainer)
    trainer.loss(batch)
    want = backbone_labels(labels, docs, expected)
    assert torch.equal(seen[0], want) and not torch.equal(want, labels)
    seen.clear()
    summary = trainer.evaluate()  # held-out accuracy against the same targets
    assert len(seen) == len(trainer.eval_set) and summary["targets"] == "backbone"
    for b, lab in zip(trainer.eval_set, seen):
        assert torch.equal(lab, backbone_labels(b["labels"], b["doc_ids"], full_logits_argmax(trainer, b)))
    trainer.cleanup(plot=False)


# -- features cache ----------------------------------------------------------------------------------------------
def test_cache_stores_the_online_greedy_ids_and_trains_to_the_online_losses(compose_tiny, tmp_path):
    """Guards against: cached greedy ids that differ from the online ones (other positions, the bf16-rounded
    cached hidden, another batch), a cache whose build depends on heads.targets (one built with the default
    must serve targets=backbone), and a cached targets=backbone run that differs from the online one or
    still runs the backbone."""
    online = tmp_path / "online"
    T.run(compose_tiny(*RUN, BACKBONE, out=online))

    cached = tmp_path / "cached"
    opts = ["features.mode=train", "features.dtype=fp32", "features.shard_batches=3"]
    features.run_build(compose_tiny(*RUN, *opts, out=cached))  # built with heads.targets=data (the default)
    manifest = json.loads((cached / "features" / features.MANIFEST).read_text())
    assert manifest["format"] == features.FORMAT_VERSION

    trainer = make_trainer(compose_tiny(*RUN, *opts, BACKBONE, out=cached))
    reference = make_trainer(compose_tiny(*RUN, BACKBONE, out=tmp_path / "ref"))  # online batches, same stream
    it = iter(reference.batches)
    for i in range(manifest["batches"]):
        stored, batch = trainer.batches.batch(i), next(it)
        assert torch.equal(stored["input_ids"], batch["input_ids"])
        frozen = reference.source.frozen
        want = frozen.greedy_ids(frozen.backbone_hidden(batch), batch["labels"], batch["doc_ids"])
        assert stored["greedy"].dtype == torch.long and torch.equal(stored["greedy"], want)
    for stored in trainer.eval_set:
        need = greedy_positions(stored["labels"], stored["doc_ids"])
        assert torch.equal(stored["greedy"][need], full_logits_argmax(trainer, stored)[need])
    reference.cleanup(plot=False)
    summary = train_without_backbone(trainer)
    assert losses(cached, "train") == losses(online, "train")  # fp32 cache: bit-identical
    assert summary["loss"] == losses(online, "eval")[-1]


def strip_greedy(root: Path) -> None:
    """Turn a cache into what the code before greedy ids wrote: format 1, no ``{j}.greedy`` tensors."""
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys() if not k.endswith(".greedy")}
        meta["format"] = "1"
        save_file(tensors, str(path), metadata=meta)
    manifest = json.loads((root / features.MANIFEST).read_text())
    manifest["format"] = 1
    (root / features.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("targets", [[], [BACKBONE]], ids=["data", "backbone"])
def test_format_one_cache_is_refused_asking_for_a_rebuild(targets, compose_tiny, tmp_path):
    """Guards against: a format-1 cache (built before greedy ids were stored) being read at all: for
    targets=backbone it would crash on a missing tensor or silently train on the dataset labels, for
    targets=data it would keep a second reading path alive. It is refused in one line naming the cache and
    asking for a rebuild, before anything is built or trained, and the cache is left untouched."""
    cache = tmp_path / "cache"
    opts = [*RUN, "features.mode=train", f"features.cache_dir={cache}"]
    T.run(compose_tiny(*opts, out=tmp_path / "new"))
    strip_greedy(cache)
    before = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}

    with pytest.raises(UserError) as err:
        T.run(compose_tiny(*opts, *targets, out=tmp_path / "refused"))
    msg = str(err.value)
    assert "format 1" in msg and "rebuild" in msg and str(cache) in msg and "\n" not in msg, msg
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == before  # nothing touched
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()


# -- config ------------------------------------------------------------------------------------------------------
def test_unknown_targets_and_lora_with_backbone_targets_are_refused(compose_tiny):
    """Guards against: a typo in heads.targets silently training on the data, and Medusa-2 (whose backbone
    moves while it trains) taking greedy targets from a backbone that is no longer the one verifying."""
    with pytest.raises(UserError) as err:
        validate(compose_tiny("heads.targets=greedy"))
    assert "heads.targets" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError) as err:
        T.MedusaTrainer(compose_tiny("lora.enabled=true", BACKBONE))
    assert "heads.targets=backbone" in str(err.value) and "lora" in str(err.value) and "\n" not in str(err.value)
    validate(compose_tiny(BACKBONE))
    validate(compose_tiny("lora.enabled=true"))


# -- end to end --------------------------------------------------------------------------------------------------
def test_hydra_trains_on_backbone_targets_and_exports(compose_tiny, out_dir, tiny_backbone):
    """Guards against: a dependent head family breaking under backbone targets (its teacher-forced input
    tokens must stay the true ones), an export that does not load, and logs that do not say which targets
    the reported accuracies are against."""
    summary = T.run(compose_tiny("heads.kind=hydra", BACKBONE, "trainer.max_steps=3", "trainer.save_every=0",
                                 "logger.plot=false"))
    assert summary["step"] == 3 and math.isfinite(summary["loss"]) and summary["targets"] == "backbone"
    m = load_medusa(out_dir / "heads", backbone=tiny_backbone.model)
    assert m.heads.spec.kind == "hydra" and m.heads.sequential
    ref = generate(m, [1, 2, 3, 4, 5], "autoregressive", max_new_tokens=16, eos_token_ids=()).tokens
    out = generate(m, [1, 2, 3, 4, 5], tree=MedusaTree([[0], [1], [0, 0]]), max_new_tokens=16,
                          eos_token_ids=())
    assert out.tokens == ref
    evals = [r for r in read_metrics(out_dir / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals and evals[-1]["targets"] == "backbone"
