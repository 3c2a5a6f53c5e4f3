"""``heads.train_on=all``: heads trained on the backbone's greedy token at every position of a conversation
(the user's turns too), not only the replies; held-out accuracy stays on the replies. The positions a
feature cache stores greedy ids for must follow, and a cache that lacks them must be refused."""

from __future__ import annotations

import json

import pytest
import torch

from inference.errors import UserError
from medusa_train import features
from medusa_train import trainer as T
from medusa_train.config import validate
from medusa_train.losses import backbone_labels, greedy_positions

from conftest import TINY_DATA, losses, train_without_backbone
from test_backbone_targets import BACKBONE, RUN, full_logits_argmax, make_trainer, spy_labels

I = -100
ALL = "heads.train_on=all"


def test_labels_cover_every_in_document_position_but_never_cross_a_document():
    """Guards against: train_on=all still training only on the replies (no gain, silently), labelling
    padding, a position whose j-1 is in the previous packed document, or a position whose greedy id was
    never computed (IGNORE in the cache) silently dropped or trained on as a label."""
    labels = torch.tensor([[I, I, 12, 13, 14, 15, 16, 17, 18, I, 20],
                           [30, 31, I, 33, 34, I, I, I, I, I, I]])
    docs = torch.tensor([[1, 1, 1, 1, 1, 1, 2, 2, 2, 0, 0],
                         [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]])
    greedy = torch.arange(22).reshape(2, 11) + 100
    assert backbone_labels(labels, docs, greedy, everywhere=True).tolist() == [
        [I, 100, 101, 102, 103, 104, I, 106, 107, I, I],
        [I, 111, 112, 113, 114, I, I, I, I, I, I]]
    assert greedy_positions(labels, docs, everywhere=True).tolist() == [
        [True, True, True, True, True, False, True, True, False, False, False],
        [True, True, True, True, False, False, False, False, False, False, False]]
    missing = greedy.clone()
    missing[0, 0] = I  # not computed (a cache built for the replies only): an error, not a dropped label
    with pytest.raises(RuntimeError, match="greedy ids"):
        backbone_labels(labels, docs, missing, everywhere=True)
    assert backbone_labels(labels, docs, greedy).tolist() == [  # the default is unchanged
        [I, I, 101, 102, 103, 104, I, 106, 107, I, I], [I, 111, I, 113, 114, I, I, I, I, I, I]]


def test_training_reads_the_user_turns_and_evaluation_the_replies(compose_tiny):
    """Guards against: the held-out accuracy of a train_on=all run measured on other positions than a default
    run's (the two could not be compared), or the training loss still receiving reply-only labels."""
    trainer = make_trainer(compose_tiny(*RUN, BACKBONE, ALL))
    batch = next(iter(trainer.batches))
    full = full_logits_argmax(trainer, batch)
    seen = spy_labels(trainer)
    trainer.loss(batch)
    want = backbone_labels(batch["labels"], batch["doc_ids"], full, everywhere=True)
    assert torch.equal(seen[0], want)
    assert (want != I).sum() > (backbone_labels(batch["labels"], batch["doc_ids"], full) != I).sum()
    seen.clear()
    trainer.evaluate()
    for b, lab in zip(trainer.eval_set, seen):
        assert torch.equal(lab, backbone_labels(b["labels"], b["doc_ids"], full_logits_argmax(trainer, b)))
    trainer.cleanup(plot=False)


def test_a_cache_for_all_positions_trains_to_the_online_losses_and_serves_the_default(compose_tiny, tmp_path):
    """Guards against: a cache built for train_on=all storing greedy ids on the replies only (its run would
    train on less than the online one), and such a cache not serving a default run exactly as a reply-only
    cache does (it stores a superset)."""
    opts = ["features.mode=train", "features.dtype=fp32", "features.shard_batches=3"]
    online = tmp_path / "online"
    T.run(compose_tiny(*RUN, BACKBONE, ALL, out=online))
    cached = tmp_path / "cached"
    features.run_build(compose_tiny(*RUN, *opts, BACKBONE, ALL, out=cached))
    manifest = json.loads((cached / "features" / features.MANIFEST).read_text())
    assert manifest["greedy_everywhere"] is True
    trainer = make_trainer(compose_tiny(*RUN, *opts, BACKBONE, ALL, out=cached))
    stored = trainer.batches.batch(0)
    need = greedy_positions(stored["labels"], stored["doc_ids"], everywhere=True)
    assert torch.equal(stored["greedy"][need], full_logits_argmax(trainer, stored)[need])
    train_without_backbone(trainer)
    assert losses(cached, "train") == losses(online, "train")

    default = tmp_path / "default"
    T.run(compose_tiny(*RUN, BACKBONE, out=default))  # online, replies only
    served = tmp_path / "served"
    T.run(compose_tiny(*RUN, *opts, BACKBONE, f"features.cache_dir={cached / 'features'}", out=served))
    assert losses(served, "train") == losses(default, "train")


def test_a_reply_only_cache_is_refused_for_all_positions(compose_tiny, tmp_path):
    """Guards against: train_on=all reading a cache whose greedy ids exist on the replies only (it would
    train exactly as the default while claiming otherwise), or that cache being rewritten; one line, the
    files untouched, nothing trained."""
    cache = tmp_path / "cache"
    opts = [*RUN, BACKBONE, "features.mode=train", f"features.cache_dir={cache}"]
    T.run(compose_tiny(*opts, out=tmp_path / "first"))
    before = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    with pytest.raises(UserError) as err:
        T.run(compose_tiny(*opts, ALL, out=tmp_path / "refused"))
    msg = str(err.value)
    assert "heads.train_on=all" in msg and str(cache) in msg and "\n" not in msg, msg
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == before
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()


def _with_a_long_prompt(path):
    """The tiny chats with, first of the training split (after 8 held out), a conversation whose user turn
    fills ``max_length`` (256) before the reply starts."""
    lines = TINY_DATA.read_text().splitlines()
    long = {"messages": [{"role": "user", "content": "tell me more " * 200},
                         {"role": "assistant", "content": "Sure."}]}
    path.write_text("\n".join(lines[:8] + [json.dumps(long)] + lines[8:]) + "\n")
    return path


def test_a_conversation_whose_reply_is_out_of_reach_trains_its_other_positions(compose_tiny, tmp_path, capsys):
    """Guards against: train_on=all dropping a conversation whose prompt fills max_length (no reply token in
    reach) though every position of it has a target there, so long pasted prompts never trained; the default
    still drops it (nothing to learn), and the summary says what was kept."""
    from medusa_train.data.stream import ConversationStream

    data = compose_tiny(f"data.source={_with_a_long_prompt(tmp_path / 'c.jsonl')}").data
    tok = T.load_backbone(compose_tiny().backbone, "cpu", seed=0).tokenizer
    dropped, kept = ConversationStream(data, tok), ConversationStream(data, tok, keep_unlabelled=True)
    unlabelled = [e for e in kept.encoded() if all(label == I for label in e.labels)]
    assert [len(e.input_ids) for e in unlabelled] == [data.max_length]
    kept = ConversationStream(data, tok, keep_unlabelled=True)
    assert len(list(kept.encoded())) == len(list(dropped.encoded())) + 1
    assert (dropped.stats.no_labels, dropped.stats.unlabelled) == (1, 0)
    assert (kept.stats.no_labels, kept.stats.unlabelled) == (0, 1)

    T.run(compose_tiny(*RUN, BACKBONE, ALL, f"data.source={data.source}", out=tmp_path / "all"))
    assert "1 kept with no reply token within 256 tokens" in capsys.readouterr().out
    T.run(compose_tiny(*RUN, BACKBONE, f"data.source={data.source}", out=tmp_path / "default"))
    assert "1 more dropped with no reply token" in capsys.readouterr().out
    cached = tmp_path / "cached"
    features.run_build(compose_tiny(*RUN, "features.mode=train", BACKBONE, ALL, f"data.source={data.source}",
                                    out=cached))
    manifest = json.loads((cached / "features" / features.MANIFEST).read_text())
    assert manifest["keeps_unlabelled"] is True and manifest["stream"]["unlabelled"] == 1
    capsys.readouterr()
    T.run(compose_tiny(*RUN, "features.mode=train", BACKBONE, f"data.source={data.source}",
                       f"features.cache_dir={cached / 'features'}", out=tmp_path / "default-cached"))
    assert "1 kept with no reply token within 256 tokens (no label in this run" in capsys.readouterr().out


def test_a_run_begun_under_the_dropping_rule_resumes_with_it(compose_tiny, tmp_path):
    """Guards against: a train_on=all run checkpointed before such conversations were kept resuming into the
    keeping stream: its saved position counts the other stream's micro-batches (some conversations trained
    twice, some never). A run begun keeping them records it and resumes keeping them."""
    source = f"data.source={_with_a_long_prompt(tmp_path / 'c.jsonl')}"
    opts = ["trainer.max_steps=2", "trainer.save_every=1", "logger.plot=false", BACKBONE, ALL, source]
    out = tmp_path / "run"
    T.run(compose_tiny(*opts, out=out))
    state_file = sorted((out / "checkpoints").glob("step-*"))[-1] / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["data"]["keeps_unlabelled"] is True
    resumed = make_trainer(compose_tiny(*opts[1:], "trainer.max_steps=3", out=out))
    assert resumed.source.data.train_stream.keep_unlabelled
    resumed.cleanup(plot=False)
    for key in ("data", *(["data_per_rank"] if "data_per_rank" in state else [])):
        for position in ([state[key]] if key == "data" else state[key]):
            position.pop("keeps_unlabelled")
    state_file.write_text(json.dumps(state))
    older = make_trainer(compose_tiny(*opts[1:], "trainer.max_steps=3", out=out))
    assert not older.source.data.train_stream.keep_unlabelled
    assert "keeps_unlabelled" not in older.batches.state()
    older.cleanup(plot=False)


@pytest.mark.parametrize("bad, words", [(["heads.train_on=everything"], "heads.train_on must be one of"),
                                        ([ALL], "needs heads.targets=backbone")])
def test_bad_train_on_is_one_line(bad, words, compose_tiny):
    """Guards against: a typo in heads.train_on silently training on the replies, and train_on=all with the
    dataset's labels (there are none on the user's turns) running at all."""
    with pytest.raises(UserError) as err:
        validate(compose_tiny(*bad))
    assert words in str(err.value) and "\n" not in str(err.value)
