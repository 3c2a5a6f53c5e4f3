"""Data that gives no training batch is refused before anything is written into ``output_dir``: one
``medusa-train: error: ...`` line, exit 2, no ``.hydra`` record, no kept random backbone, no folder; and an
existing run named with ``trainer.resume=never`` is left as it was."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_DATA, clean_env, console_script
from inference.errors import UserError
from test_train_refusals import assert_one_line_refusal, snapshot


def medusa_train(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """``test_train_refusals.medusa_train``, its defaults left out where ``args`` set the same key (medusa-train
    refuses a key given twice)."""
    defaults = [f"output_dir={tmp / 'out'}", f"data.source={TINY_DATA}", "logger.wandb=disabled",
                "trainer.progress_bar=false", "trainer.threads=1"]
    given = {a.split("=", 1)[0] for a in args}
    argv = ["debug_tiny", *[d for d in defaults if d.split("=", 1)[0] not in given], *args]
    return subprocess.run([console_script("medusa-train"), *argv], capture_output=True, text=True, cwd=tmp,
                          env=clean_env(), timeout=240)


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
    (["data.source={not_chats}"], "1 file of JSON that is no conversation record, 1 no conversations/messages"),
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


# -- conversations the chat template refuses ----------------------------------------------------------------
REFUSED_SYSTEM = "System role not supported"
# ChatML that raises on a system turn, as Gemma's template does (and others on roles that do not alternate).
RAISING_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'system' %}{{ raise_exception('"
                    + REFUSED_SYSTEM + "') }}{% endif %}{% endfor %}")


def raising_tokenizer():
    from medusa_train.backbone import CHATML_TEMPLATE, byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = RAISING_TEMPLATE + CHATML_TEMPLATE
    return tok


def with_system_turns(path: Path, at: tuple[int, ...]) -> Path:
    """The tiny chats with a system turn added to the conversations at positions ``at`` (0-based)."""
    lines = TINY_DATA.read_text().splitlines()
    for i in at:
        record = json.loads(lines[i])
        turns = record.get("conversations") or record["messages"]
        key = ("from", "value") if "conversations" in record else ("role", "content")
        turns.insert(0, {key[0]: "system", key[1]: "Be brief."})
        lines[i] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_conversation_the_template_refuses_is_dropped_and_counted(compose_tiny, tmp_path):
    """Guards against: one conversation the chat template refuses (a system turn for a Gemma-like template)
    ending the whole run with jinja2's TemplateError traceback, in the training stream, the held-out stream,
    the truncated vocabulary's token count and the data check, instead of being dropped and counted."""
    from medusa_train.data.stream import (ConversationStream, RankData, check_training_data, first_epoch,
                                          token_frequencies)

    tok = raising_tokenizer()
    data = compose_tiny(f"data.source={with_system_turns(tmp_path / 'c.jsonl', (3, 20))}").data  # 8 held out
    why = f"chat template refused it: {REFUSED_SYSTEM}"
    rank = RankData(data, tok, seed=0, rank=0, world_size=1, micro_batch_size=2, pad_id=tok.pad_token_id)
    assert rank.eval_batches()  # the 7 other held-out conversations
    it = iter(rank.batches())
    next(it)
    assert rank.read_stats.dropped == {why: 2} and rank.read_stats.recovered == 38
    assert why in rank.read_stats.summary()
    assert rank.stats.conversations + rank.stats.no_labels == 31  # the training split less the refused one
    cache_stream = ConversationStream(data, tok)  # what a features build stores
    assert len(list(first_epoch(cache_stream, 2, tok.pad_token_id, data.bucket_buffer))) > 0
    assert cache_stream.read_stats.dropped == {why: 1}
    assert int(token_frequencies(ConversationStream(data, tok), 320, 100).sum()) > 0
    check_training_data(data, tok)


def test_every_conversation_refused_by_the_template_is_the_no_training_conversations_refusal(compose_tiny):
    """Guards against: a template that refuses every conversation (a system prompt for a Gemma-like template)
    surfacing as a traceback or as an unexplained 'produced no training batches' instead of the one-line
    'gave no training conversations' refusal naming the template's reason."""
    from medusa_train.data.stream import ConversationStream, MicroBatches, check_training_data

    tok = raising_tokenizer()
    data = compose_tiny("data.system_prompt=Be brief.").data
    with pytest.raises(UserError, match=f"gave no training conversations .*32 chat template refused it: "
                                        f"{REFUSED_SYSTEM}") as e:
        check_training_data(data, tok)
    assert "holds out" not in str(e.value)
    with pytest.raises(UserError, match=f"gave no training conversations .*chat template refused it"):
        next(iter(MicroBatches(ConversationStream(data, tok), 2, tok.pad_token_id)))


def test_a_refused_conversation_in_a_run_and_a_cache_build(compose_tiny, tmp_path, monkeypatch, capsys):
    """Guards against: the run (its truncated vocabulary scan, training and held-out streams) or a feature
    cache build stopping with a traceback on a conversation the template refuses, and the run's summary or
    the cache's counts not saying it was dropped."""
    from medusa_train import backbone as B
    from medusa_train import features
    from medusa_train import trainer as T

    monkeypatch.setattr(B, "CHATML_TEMPLATE", RAISING_TEMPLATE + B.CHATML_TEMPLATE)  # the random backbone's
    source = with_system_turns(tmp_path / "c.jsonl", (3, 20))
    run = ["trainer.max_steps=2", "trainer.save_every=0", "logger.plot=false", f"data.source={source}"]
    T.run(compose_tiny(*run, out=tmp_path / "online"))
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("data: "))
    assert f"2 chat template refused it: {REFUSED_SYSTEM}" in line, line
    manifest = features.run_build(compose_tiny(*run, "features.mode=build", out=tmp_path / "cached"))
    assert manifest["stream"]["dropped"] == {f"chat template refused it: {REFUSED_SYSTEM}": 1}


def test_distillation_ends_a_conversation_the_template_refuses(compose_tiny, tmp_path, monkeypatch):
    """Guards against: distillation stopping with a traceback (after shards were written) on a conversation
    the chat template refuses, instead of ending that conversation and counting why in distill.json."""
    from medusa_train import backbone as B
    from medusa_train import distill

    monkeypatch.setattr(B, "CHATML_TEMPLATE", RAISING_TEMPLATE + B.CHATML_TEMPLATE)
    source = with_system_turns(tmp_path / "c.jsonl", (1,))
    manifest = distill.run(compose_tiny("task=distill", f"data.source={source}", "distill.max_new_tokens=4",
                                        "distill.shard_size=4", "distill.max_conversations=6",
                                        "distill.engine=generate", out=tmp_path / "d"))
    assert manifest["complete"]
    ended = manifest["counts"]["ended"]   # beside it, random bytes may end one with a cut character alone
    assert ended[f"chat template refused it: {REFUSED_SYSTEM}"] == 1 and set(ended) <= {
        f"chat template refused it: {REFUSED_SYSTEM}", "empty reply"}
    assert manifest["counts"]["conversations"] == 5 - ended.get("empty reply", 0)


def test_distillation_the_template_refuses_entirely_is_refused_and_writes_nothing(compose_tiny, tmp_path,
                                                                                 monkeypatch):
    """Guards against: a distillation whose chat template refuses every conversation (each dropped and counted,
    as one refused conversation is) completing with empty shards and a 'complete' manifest, so the training on it
    then ran on nothing; it must refuse in one line naming how many were refused and why, write nothing, and leave
    an earlier run's data in that folder as it was. All but one refused still distills that one."""
    from medusa_train import backbone as B
    from medusa_train import distill

    run = ["task=distill", "distill.max_new_tokens=4", "distill.shard_size=4", "distill.max_conversations=6",
           "distill.engine=generate"]
    run.append(f"data.source={with_system_turns(tmp_path / 'all.jsonl', tuple(range(6)))}")
    earlier = tmp_path / "earlier"
    distill.run(compose_tiny(*run, out=earlier))  # the template of that run took them
    before = snapshot(earlier)
    monkeypatch.setattr(B, "CHATML_TEMPLATE", RAISING_TEMPLATE + B.CHATML_TEMPLATE)
    for out in (tmp_path / "new", earlier):
        with pytest.raises(UserError, match=f"chat template refused all 6 conversations .*{REFUSED_SYSTEM}") as e:
            distill.run(compose_tiny(*run, out=out))
        assert "\n" not in str(e.value) and "nothing was written" in str(e.value)
    assert not (tmp_path / "new").exists()
    assert snapshot(earlier) == before
    source = with_system_turns(tmp_path / "c.jsonl", (0, 1, 2, 4, 5))  # all but conversation 3
    manifest = distill.run(compose_tiny(*run[:-1], f"data.source={source}", out=tmp_path / "one"))
    assert manifest["complete"] and manifest["counts"]["conversations"] == 1
    assert manifest["counts"]["ended"] == {f"chat template refused it: {REFUSED_SYSTEM}": 5}


def test_cli_distillation_the_template_refuses_entirely_is_one_line(tmp_path):
    """Guards against: ``medusa-train <recipe> task=distill`` with a chat template that refuses every conversation
    exiting 0 after writing empty shards (or with a traceback) instead of one line, exit 2, and no folder, record
    or manifest left behind."""
    script = tmp_path / "refusing_template.py"
    script.write_text("import sys\nimport medusa_train.backbone as B\n"
                      f"B.CHATML_TEMPLATE = {RAISING_TEMPLATE!r} + B.CHATML_TEMPLATE\n"
                      "from medusa_train.cli import main\nmain(sys.argv[1:])\n")
    before = snapshot(tmp_path)
    proc = subprocess.run([sys.executable, str(script), "debug_tiny", f"output_dir={tmp_path / 'out'}",
                           f"data.source={TINY_DATA}", "logger.wandb=disabled", "trainer.progress_bar=false",
                           "trainer.threads=1", "task=distill", "distill.max_conversations=4",
                           "distill.engine=generate", "data.system_prompt=Be brief."],
                          capture_output=True, text=True, cwd=tmp_path, env=clean_env(), timeout=240)
    assert_one_line_refusal(proc, "chat template refused all 4 conversations")
    assert REFUSED_SYSTEM in proc.stderr
    assert snapshot(tmp_path) == before, "a refused distillation wrote files"


# -- unreadable parquet -----------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"", b"PAR1 not a parquet file at all"], ids=["empty", "corrupt"])
@pytest.mark.parametrize("task", ["train", "distill"])
def test_an_unreadable_parquet_file_is_one_line(content, task, tmp_path):
    """Guards against: a 0-byte or corrupt .parquet (alone or in a folder) giving pyarrow's ArrowInvalid traceback
    instead of one line naming the file, before anything is written."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "b.parquet").write_bytes(content)
    before = snapshot(tmp_path)
    for source in (folder / "b.parquet", folder):
        proc = medusa_train(tmp_path, f"data.source={source}", f"task={task}")
        assert_one_line_refusal(proc, f"{folder / 'b.parquet'} is not a readable parquet file")
        assert snapshot(tmp_path) == before, "a refused command wrote files"


def test_unreadable_parquet_reader(tmp_path):
    """Guards against: the parquet reader letting pyarrow's errors through (the trainer and distillation read
    the source beyond what preflight looked at)."""
    from medusa_train.data.readers import iter_conversations

    bad = tmp_path / "x.parquet"
    for content in (b"", b"\x00" * 64):
        bad.write_bytes(content)
        with pytest.raises(UserError, match="x.parquet is not a readable parquet file"):
            list(iter_conversations(str(bad)))


# -- distillation within the backbone's positions -----------------------------------------------------------
def test_distillation_past_the_backbones_positions_is_refused_before_loading(compose_tiny, tmp_path):
    """Guards against: data.max_length + distill.max_new_tokens beyond the backbone's positions accepted, the
    run then stopping mid-way ('prompt + max_new_tokens exceeds the backbone's positions') in a folder where the
    fix (a lower data.max_length) is refused because it is part of the data's identity."""
    from medusa_train.preflight import check_fits

    check_fits(compose_tiny("task=distill", "data.max_length=504", "distill.max_new_tokens=8"))  # 512 positions
    with pytest.raises(UserError, match=r"data.max_length=505 .*distill.max_new_tokens=8 exceeds the 512 positions"
                                        r".*data.max_length <= 504"):
        check_fits(compose_tiny("task=distill", "data.max_length=505", "distill.max_new_tokens=8"))
    before = snapshot(tmp_path)
    proc = medusa_train(tmp_path, "task=distill", "data.max_length=512", "distill.max_new_tokens=24")
    assert_one_line_refusal(proc, "exceeds the 512 positions of the backbone")
    assert snapshot(tmp_path) == before, "a refused command wrote files"


def test_a_run_refused_after_its_setup_wrote_takes_its_writes_back(tmp_path):
    """Guards against a new run refused once its setup had written into its new folder (a feature cache built for
    another run, found after the run's record and its random backbone were written) leaving ``.hydra/`` and
    ``backbone/`` behind: a refused command writes nothing. The cache named is left as it was."""
    cache = tmp_path / "cache"
    built = medusa_train(tmp_path, "features.mode=build", f"features.cache_dir={cache}", f"output_dir={tmp_path / 'a'}")
    assert built.returncode == 0, built.stderr[-2000:]
    before = snapshot(tmp_path)
    proc = medusa_train(tmp_path, "features.mode=train", f"features.cache_dir={cache}", "data.max_length=128",
                        f"output_dir={tmp_path / 'b'}")
    assert_one_line_refusal(proc, "data.max_length")
    assert snapshot(tmp_path) == before and not (tmp_path / "b").exists()


def test_the_runs_data_counts_add_up_every_ranks_share(compose_tiny, tmp_path, monkeypatch):
    """Guards against: with 2+ ranks, the run's summary line reporting rank 0's counts alone: each rank reads the
    whole source but meets the template's refusals (and tokenises conversations) in its own shard only, so a run
    that lost half its data to the template said a quarter, and 'tokenized' counted half the conversations."""
    import torch

    from medusa_train.data.stream import RankData

    tok = raising_tokenizer()
    data = compose_tiny(f"data.source={with_system_turns(tmp_path / 'c.jsonl', tuple(range(0, 40, 3)))}").data

    def epoch0(rank: int, world: int) -> RankData:
        d = RankData(data, tok, seed=0, rank=rank, world_size=world, micro_batch_size=2, pad_id=tok.pad_token_id)
        d.eval_batches()
        for _ in d.train_stream.encoded(0):
            pass
        return d

    alone, ranks = epoch0(0, 1), [epoch0(r, 2) for r in range(2)]
    shares = [(dict(r.train_stream.shard_refusals), r.stats.as_counts()) for r in ranks]
    assert shares[0][0] and shares[1][0]   # each rank met some of the refusals in its shard

    def gather(out, _mine):
        out[:] = shares

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)
    read, stats = ranks[0].run_counts()
    assert read.summary() == alone.read_stats.summary() and read.dropped_total == 14
    assert (stats.conversations, stats.no_labels) == (alone.stats.conversations, alone.stats.no_labels)
    assert ranks[0].read_stats.dropped_total < 14   # rank 0's own, as the line used to report them
