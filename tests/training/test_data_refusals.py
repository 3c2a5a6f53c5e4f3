"""Data that gives no training batch is refused before anything is written into ``output_dir``: one
``medusa-train: error: ...`` line, exit 2, no ``.hydra`` record, no kept random backbone, no folder; and an
existing run named with ``trainer.resume=never`` is left as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY_DATA
from inference.errors import UserError
from test_train_refusals import assert_one_line_refusal, medusa_train, snapshot


def bad_sources(root: Path) -> dict[str, Path]:
    """An empty file, a malformed JSONL and a folder of JSON that is not chats, under ``root/data``."""
    data = root / "data"
    (data / "other").mkdir(parents=True)
    (data / "empty.jsonl").write_text("")
    (data / "bad.jsonl").write_text('{"messages": [\n{oops\n')
    (data / "other" / "a.json").write_text(json.dumps({"x": 1}))
    (data / "other" / "b.json").write_text(json.dumps([{"y": 2}]))
    return {"empty": data / "empty.jsonl", "malformed": data / "bad.jsonl", "not_chats": data / "other"}


REFUSED_DATA = [
    (["data.source={empty}"], "gave no training conversations (0 conversations usable"),
    (["data.source={malformed}"], "2 invalid JSON line"),
    (["data.source={not_chats}"], "2 no conversations/messages field"),
    (["data.eval_conversations=40"], "data.eval_conversations=40 holds out the first 40"),
    # Judged only with the backbone's tokenizer, by the trainer (and the cache build) before their first write.
    (["data.max_length=8"], "no training conversation with an assistant token within data.max_length=8"),
    (["features.mode=build", "data.max_length=8"], "within data.max_length=8"),
]


@pytest.mark.parametrize("args, phrase", REFUSED_DATA, ids=[" ".join(a) for a, _ in REFUSED_DATA])
def test_refused_data_writes_nothing(args, phrase, tmp_path):
    """Guards against: an empty file, a malformed JSONL, a folder of non-chat JSON (or data whose replies all
    lie past data.max_length) refused only once the trainer read its first batch, after
    ``<output_dir>/.hydra/`` and ``<output_dir>/backbone/`` were written."""
    sources = bad_sources(tmp_path)
    before = snapshot(tmp_path)
    proc = medusa_train(tmp_path, *[a.format(**sources) for a in args])
    assert_one_line_refusal(proc, phrase)
    assert snapshot(tmp_path) == before, "a refused command wrote files"


def test_refused_data_leaves_an_existing_run_as_it_was(tmp_path):
    """Guards against: ``trainer.resume=never`` with refused data (and another backbone width) overwriting an
    existing run's ``backbone/`` and ``.hydra/`` before the refusal, so its heads no longer load on its backbone
    and its record names settings that never trained."""
    sources = bad_sources(tmp_path)
    out = tmp_path / "out"
    proc = medusa_train(tmp_path, "trainer.max_steps=1", "logger.plot=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = snapshot(out)
    assert "backbone/model.safetensors" in before and ".hydra/config.yaml" in before
    other = ["trainer.resume=never", "backbone.random_init.hidden_size=32"]
    assert_one_line_refusal(medusa_train(tmp_path, *other, f"data.source={sources['empty']}"),
                            "gave no training conversations")
    assert snapshot(out) == before, "refused data changed the run's files"
    assert_one_line_refusal(medusa_train(tmp_path, *other, "data.max_length=8"), "within data.max_length=8")
    assert snapshot(out) == before, "refused data changed the run's files"


def test_training_data_check(compose_tiny, tmp_path):
    """Guards against: the data check accepting a source with nothing to train on (every usable conversation
    held out for evaluation, replies past data.max_length) or refusing usable data."""
    from medusa_train.backbone import byte_tokenizer
    from medusa_train.data.stream import check_training_data

    sources = bad_sources(tmp_path)
    tok = byte_tokenizer()
    check_training_data(compose_tiny().data, tok)  # the tiny data: 40 conversations, 8 held out
    check_training_data(compose_tiny("data.eval_conversations=38").data, tok)
    for source in sources.values():
        with pytest.raises(UserError, match="gave no training conversations"):
            check_training_data(compose_tiny(f"data.source={source}").data)
    with pytest.raises(UserError, match="holds out the first 40"):
        check_training_data(compose_tiny("data.eval_conversations=40").data)
    short = compose_tiny("data.max_length=8").data
    check_training_data(short)  # without a tokenizer, the length cannot be judged
    with pytest.raises(UserError, match="data.max_length=8"):
        check_training_data(short, tok)


def test_preflight_leaves_a_hub_dataset_to_the_trainer(compose_tiny, monkeypatch):
    """Guards against: the preflight data check streaming a hub dataset (network, before any check of the
    configuration is done) instead of leaving it to the trainer's check before its first write."""
    from medusa_train import preflight as P

    def no_reading(*a, **k):
        raise AssertionError("a hub dataset was read by preflight")

    monkeypatch.setattr(P, "check_training_data", no_reading)
    P.check_data_usable(compose_tiny("data.source=someone/some-chats"))
    with pytest.raises(AssertionError, match="hub dataset was read"):
        P.check_data_usable(compose_tiny(f"data.source={TINY_DATA}"))
