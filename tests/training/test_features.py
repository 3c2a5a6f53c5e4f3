"""Offline feature cache (``features.mode``) on the tiny random backbone: same losses as the online path,
no backbone forward when training from it, refusal of a cache for another backbone or data, the disk
check, and no half-written shard after a failure mid-write."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch

from inference.errors import UserError
from medusa_train import features, launch
from medusa_train import trainer as T

from conftest import losses, train_without_backbone

RUN = ["trainer.max_steps=4", "trainer.log_every=1", "trainer.save_every=0", "logger.plot=false"]


def shard_files(root: Path) -> list[str]:
    return sorted(p.name for p in Path(root).iterdir() if p.suffix == ".safetensors" or ".tmp" in p.name)


def test_cached_training_gives_the_online_losses_without_running_the_backbone(compose_tiny, tmp_path):
    """Guards against: cached batches that differ from the online stream (other order, packing, labels or
    positions), hidden states stored other than the trainer computes them, cached eval batches that differ,
    and a cached run that still forwards the backbone (it must not: that is the point of the cache)."""
    online = tmp_path / "online"
    T.run(compose_tiny(*RUN, out=online))

    cached = tmp_path / "cached"
    cfg = compose_tiny(*RUN, "features.mode=train", "features.dtype=fp32", "features.shard_batches=3", out=cached)
    features.run_build(cfg)  # build first, so the training run below never needs the backbone
    manifest = json.loads((cached / "features" / features.MANIFEST).read_text())
    assert manifest["batches"] >= 4 and manifest["shards"][0] == 3  # two shards: reading crosses a boundary

    trainer = T.MedusaTrainer(compose_tiny(*RUN, "features.mode=train", "features.dtype=fp32",
                                           "features.shard_batches=3", out=cached))
    trainer.setup()
    summary = train_without_backbone(trainer)
    assert losses(cached, "train") == losses(online, "train")  # fp32 cache: bit-identical
    assert summary["loss"] == losses(online, "eval")[-1]
    assert json.loads((cached / "features" / features.MANIFEST).read_text())["identity"]["dtype"] == "fp32"


def test_cached_training_frees_the_backbone_body(compose_tiny, tmp_path, capsys):
    """Guards against: a run trained from the feature cache keeping the whole frozen backbone in memory for
    nothing (~13 GiB of Llama-3.1-8B in bf16 on every GPU), or freeing what the heads still read (embeddings,
    lm_head), or the start-up line then counting only what is left."""
    cfg = compose_tiny(*RUN, "features.mode=train", "features.dtype=fp32", out=tmp_path / "run")
    trainer = T.MedusaTrainer(cfg)
    trainer.setup()
    model = trainer.backbone.model
    kept = {id(model.get_input_embeddings().weight): model.get_input_embeddings().weight,
            id(model.get_output_embeddings().weight): model.get_output_embeddings().weight}
    body = [p for p in model.parameters() if id(p) not in kept]
    assert body and all(p.numel() == 0 for p in body)
    assert all(p.numel() > 0 for p in kept.values())
    loaded = trainer.backbone.parameter_count()
    assert trainer.backbone.released == (loaded - sum(p.numel() for p in kept.values())) * 4  # fp32 weights
    assert f"({loaded / 1e6:.1f}M params, frozen; its body's" in capsys.readouterr().out
    trainer.train()   # the heads train with the body gone


def test_bf16_cache_is_the_default_and_close(compose_tiny, tmp_path):
    """Guards against: the default cache storing fp32 (twice the disk) or bf16 storage shifting the losses
    by more than rounding explains."""
    online, cached = tmp_path / "online", tmp_path / "cached"
    T.run(compose_tiny(*RUN, out=online))
    T.run(compose_tiny(*RUN, "features.mode=train", out=cached))  # builds the missing cache, then trains
    from safetensors import safe_open

    with safe_open(str(cached / "features" / "train-000000.safetensors"), framework="pt") as f:
        assert f.get_tensor("0.hidden").dtype == torch.bfloat16
    for a, b in zip(losses(cached, "train"), losses(online, "train")):
        assert a == pytest.approx(b, rel=1e-3)


@pytest.mark.parametrize("change, words", [
    (["++backbone.random_init.initializer_range=0.5"], ["another backbone", "weights"]),
    (["data.max_length=128"], ["data.max_length"]),
    (["trainer.seed=1"], ["seed"]),
], ids=["weights", "data", "seed"])
def test_cache_for_another_backbone_or_data_is_refused(change, words, compose_tiny, tmp_path):
    """Guards against: training on hidden states of another backbone (same architecture, other weights) or of
    other data settings, which would train heads for a model or stream they will never see."""
    cache = tmp_path / "shared_cache"
    features.run_build(compose_tiny(*RUN, "features.mode=build", f"features.cache_dir={cache}", out=tmp_path / "a"))
    before = shard_files(cache)
    with pytest.raises(UserError) as err:
        T.run(compose_tiny(*RUN, "features.mode=train", f"features.cache_dir={cache}", *change, out=tmp_path / "b"))
    assert all(w in str(err.value) for w in words) and "\n" not in str(err.value), str(err.value)
    assert shard_files(cache) == before


def test_disk_without_room_is_refused_before_writing(compose_tiny, out_dir, monkeypatch, capsys):
    """Guards against: starting a cache the disk cannot hold (and filling it) instead of saying so up front,
    with the estimate printed first; the refusal advising features.dtype=bf16 to a cache already stored in it; and
    the refused run leaving an empty cache (its manifest alone) that kept the new run's folder behind."""
    real = features.shutil.disk_usage

    def tiny_disk(path):
        return real(path)._replace(free=10_000)

    monkeypatch.setattr(features.shutil, "disk_usage", tiny_disk)
    cfg = compose_tiny(*RUN, "features.mode=build")
    launch.create_output_dir(out_dir)   # what the command does around its task: the run's folder and record

    def record():   # as launch.write_run_record (which needs Hydra's own run)
        (out_dir / launch.RECORD_DIR).mkdir()
        (out_dir / launch.RECORD_DIR / "config.yaml").write_text("task: train\n")

    with pytest.raises(UserError, match="features cache needs ~.* free") as err:
        features.run_build(cfg, record=record)
    launch.remove_created_dirs()
    assert "features.dtype=bf16" not in str(err.value)
    printed = capsys.readouterr().out
    assert "x hidden 64 x 2 bytes (bf16)" in printed
    assert not out_dir.exists()


def test_failure_mid_write_leaves_no_half_written_shard(compose_tiny, out_dir, monkeypatch):
    """Guards against: a full disk (or a kill) during a shard write leaving a truncated file under the final
    name that a later run would read as complete; the rerun must finish the cache and train."""
    real = features.save_file
    calls = {"n": 0}

    def disk_full_on_third(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] == 3:  # eval, first train shard, then this one
            with open(filename, "wb") as f:
                f.write(b"\0" * 100)  # part of the file made it to disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(features, "save_file", disk_full_on_third)
    cfg = [*RUN, "features.mode=train", "features.shard_batches=1"]
    with pytest.raises(UserError, match="No space left on device.*1 complete shard.*none half-written"):
        T.run(compose_tiny(*cfg))
    root = out_dir / "features"
    assert shard_files(root) == ["eval.safetensors", "train-000000.safetensors"]
    assert json.loads((root / features.MANIFEST).read_text())["shards"] == []  # not listed as built

    monkeypatch.setattr(features, "save_file", real)
    T.run(compose_tiny(*cfg))
    assert shard_files(root) == ["eval.safetensors"] + [f"train-{k:06d}.safetensors" for k in range(4)]
    assert len(losses(out_dir, "train")) == 4


def test_cached_batches_order_ranks_and_resume(tmp_path):
    """Guards against: epoch 0 not in stream order (breaks equivalence with the online path), later epochs
    not covering every batch, ranks sharing batches, and a resumed position not continuing exactly."""
    manifest = {"shard_batches": 4, "batches": 10}

    class Fake(features.CachedBatches):
        def batch(self, i):
            return {"i": i, "doc_ids": torch.ones(1, 1, dtype=torch.long), "labels": torch.ones(1, 1, dtype=torch.long)}

    one = Fake(None, manifest, 0, 1, 0, "cpu", torch.float32)
    assert one.order(0) == list(range(10))
    assert sorted(one.order(1)) == list(range(10)) and one.order(1) != one.order(2)
    r0, r1 = (Fake(None, manifest, r, 2, 0, "cpu", torch.float32) for r in (0, 1))
    for epoch in (0, 1):
        assert sorted(r0.order(epoch) + r1.order(epoch)) == list(range(10))
    it = iter(one)
    first = [next(it)["i"] for _ in range(13)]
    state = one.state()
    assert state == {"epoch": 1, "index": 3}
    resumed = iter(Fake(None, manifest, 0, 1, 0, "cpu", torch.float32, **state))
    assert [next(resumed)["i"] for _ in range(5)] == [next(it)["i"] for _ in range(5)]
    assert first[:10] == list(range(10))


def test_cache_grows_when_more_steps_are_asked(compose_tiny, out_dir):
    """Guards against: a cache built for a short run silently cycling its few batches in a longer run
    (instead of extending), and rebuilding shards that are already complete."""
    features.run_build(compose_tiny("trainer.max_steps=2", "features.mode=build", "features.shard_batches=2"))
    root = out_dir / "features"
    first = root / "train-000000.safetensors"
    stamp = first.stat().st_mtime_ns
    assert json.loads((root / features.MANIFEST).read_text())["batches"] == 2
    features.run_build(compose_tiny("trainer.max_steps=4", "features.mode=build", "features.shard_batches=2"))
    assert json.loads((root / features.MANIFEST).read_text())["batches"] == 4
    assert first.stat().st_mtime_ns == stamp


def test_a_shorter_build_sharing_the_cache_never_shrinks_a_longer_ones_shards(compose_tiny, tmp_path, monkeypatch):
    """Guards against: two runs sharing one features.cache_dir with different trainer.max_steps, the shorter one
    started while the longer one was building (it read the manifest before the longer build recorded its shards):
    it rewrote the longer build's fuller shard down to its own count and overwrote the manifest, so the longer
    run's training died on a missing tensor (or silently cycled fewer batches)."""
    cache = tmp_path / "cache"
    common = ["features.mode=build", "features.shard_batches=2", f"features.cache_dir={cache}"]
    seen = {}
    real_claim = features.FeatureCache.claim

    def claim_and_keep(self, *args, **kwargs):   # what the shorter run would have read at its start
        seen.setdefault("fresh", real_claim(self, *args, **kwargs))
        return seen["fresh"]

    monkeypatch.setattr(features.FeatureCache, "claim", claim_and_keep)
    features.run_build(compose_tiny("trainer.max_steps=6", *common, out=tmp_path / "long"))
    longer = json.loads((cache / features.MANIFEST).read_text())
    shard = features.FeatureCache(cache).shard_path(1)
    stamp = shard.stat().st_mtime_ns
    features.run_build(compose_tiny("trainer.max_steps=3", *common, out=tmp_path / "short"))   # from the fresh one
    assert features.FeatureCache(cache).shard_count(shard) == 2 and shard.stat().st_mtime_ns == stamp
    assert json.loads((cache / features.MANIFEST).read_text()) == longer
    monkeypatch.setattr(features.FeatureCache, "claim", real_claim)
    T.run(compose_tiny(*RUN[1:], "trainer.max_steps=6", "features.mode=train", "features.shard_batches=2",
                       f"features.cache_dir={cache}", out=tmp_path / "train"))


def test_a_longer_build_recording_beside_a_shorter_one_keeps_its_record(tmp_path, monkeypatch):
    """Guards against: the manifest's final read-compare-write racing between two builds sharing a cache: the
    shorter build read the manifest, the longer one then recorded its 10 batches, and the shorter's record (6)
    replaced it. The longer build's record, made while the shorter one holds the manifest, must wait for it."""
    import multiprocessing
    from types import SimpleNamespace

    root = tmp_path / "cache"
    root.mkdir()
    (root / features.MANIFEST).write_text(json.dumps({"format": features.FORMAT_VERSION, "batches": 2}))
    cache = features.FeatureCache(root)
    stream = SimpleNamespace(stats=SimpleNamespace(conversations=1, truncated=0, no_labels=0, unlabelled=0,
                                                    unlocated_replies=0),
                             read_stats=SimpleNamespace(recovered=1, dropped={}))
    def record(target: int) -> None:
        features._record_build(cache, target, False, [target], [(target, 4)], 8, 16, stream)

    real_write = features._write_build_record
    context = multiprocessing.get_context("fork")   # started before the lock is taken: it must not inherit it
    go = context.Event()
    longer = context.Process(target=lambda: go.wait(60) and record(10))
    longer.start()

    def write_after_the_longer_one_tried(*args):   # the shorter build, between its read and its write
        go.set()
        longer.join(timeout=2)
        real_write(*args)

    monkeypatch.setattr(features, "_write_build_record", write_after_the_longer_one_tried)
    record(6)
    longer.join(timeout=60)
    assert longer.exitcode == 0
    assert json.loads((root / features.MANIFEST).read_text())["batches"] == 10


def test_a_cache_dir_that_is_a_file_or_another_folder_is_refused_before_the_backbone_loads(compose_tiny, tmp_path):
    """Guards against: features.cache_dir naming a file ending in a 27-line FileExistsError traceback after the
    backbone was built (output_dir/.hydra and backbone/ left behind), and naming a folder of something else (a
    finished training run) being taken as a cache and written into, as the claim looked for *.safetensors only.
    Both are refused in preflight (before anything loads) and by the claim itself, in one line."""
    from medusa_train.preflight import preflight

    afile = tmp_path / "afile"
    afile.write_text("x")
    run = tmp_path / "finished"
    (run / "heads").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    refused = [(afile, "is a file, not a folder"), (afile / "sub", f"cannot be created: {afile} is a file"),
               (run, "holds files but no features.json: not a feature cache; use another features.cache_dir")]
    for root, words in refused:
        for mode in ("train", "build"):
            with pytest.raises(UserError, match=re.escape(words)):
                preflight(compose_tiny(f"features.mode={mode}", f"features.cache_dir={root}"), resume=False)
        with pytest.raises(UserError, match=re.escape(words)):
            features.FeatureCache(root).claim({"backbone": "tiny"}, 1)
    assert afile.read_text() == "x" and sorted(p.name for p in run.iterdir()) == ["heads", "metrics.jsonl"]
    # features.mode=off never touches the cache: nothing to refuse
    preflight(compose_tiny(f"features.cache_dir={run}"), resume=False)


def test_a_cache_dir_that_is_empty_or_the_runs_own_folder_is_taken(compose_tiny, tmp_path, out_dir):
    """Guards against: the foreign-folder refusal taking an empty folder, a cache's own leftovers, or the entries
    a run writes before it claims a cache in its own output_dir (.hydra/, backbone/) for another folder."""
    empty = tmp_path / "empty"
    empty.mkdir()
    assert features.foreign_cache(empty) is None and features.foreign_cache(tmp_path / "new") is None
    (empty / ".features.json.tmp-123").write_text("")   # a killed writer's temporary file
    assert features.foreign_cache(empty) is None
    run = out_dir   # the run's own output_dir, as the cache_dir too
    for entry in features.RUN_SETUP:
        (run / entry).mkdir(parents=True)
    assert features.foreign_cache(run, run) is None
    assert "not a feature cache" in features.foreign_cache(run)   # another run's setup is not this one's
    features.check_cache_dir(compose_tiny("features.mode=train", f"features.cache_dir={run}"))
    assert features.FeatureCache(run, run).claim({"backbone": "tiny"}, 1)["batches"] == 0


@pytest.mark.parametrize("first_aux", [(2, 4, 6), ()])
def test_a_killed_build_keeps_its_aux_layers(tmp_path, first_aux):
    """Guards against: a build killed after writing shards (the manifest counts them only once the build
    completes) rerun for other aux layers, or for an eagle3 drafter over a killed Medusa build: the manifest
    was rewritten for the new layers and the old shards kept, so training read features of the wrong layers
    or died on a missing tensor. The second claim must refuse in one line and leave the files as they were."""
    cache = features.FeatureCache(tmp_path)
    identity = {"backbone": "tiny", "data": 1}
    cache.claim(identity, 1, aux_layers=first_aux)
    batch = {k: torch.zeros(1, 4, dtype=torch.long) for k in features.KEYS}
    batch.update(hidden=torch.zeros(1, 4, 8), greedy=torch.zeros(1, 4, dtype=torch.int32))
    if first_aux:
        batch["aux"] = torch.zeros(1, 4, 24)
    cache.write(cache.shard_path(0), [batch], 0)  # the kill comes before the manifest update
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(UserError) as e:
        cache.claim(identity, 1, aux_layers=(1, 3, 5))
    assert "\n" not in str(e.value) and "features.cache_dir" in str(e.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert cache.claim(identity, 1, aux_layers=first_aux or ())["aux_layers"] == list(first_aux)  # its own: fine


def _dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_rerun_removes_what_killed_builds_left(compose_tiny, out_dir):
    """Guards against: the temporary shard files of builds killed mid-write (``.train-*.safetensors.tmp-<pid>``)
    staying in the cache forever, as the shard is rewritten under a new process id; and the clean-up removing a
    live writer's file (another process, or one written since this process started: another host's)."""
    import subprocess
    import sys
    import time

    root = out_dir / "features"
    root.mkdir(parents=True)
    old = time.time() - 3600
    dead = [root / f".train-000002.safetensors.tmp-{_dead_pid()}", root / f".eval.safetensors.tmp-{_dead_pid()}"]
    live_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        live = root / f".train-000003.safetensors.tmp-{live_proc.pid}"
        for p in (*dead, live):
            p.write_bytes(b"\0" * 100)
            os.utime(p, (old, old))
        recent = root / f".train-000004.safetensors.tmp-{_dead_pid()}"  # written after this process started
        recent.write_bytes(b"\0" * 100)
        features.run_build(compose_tiny(*RUN, "features.mode=build", "features.shard_batches=1"))
        left = sorted(p.name for p in root.iterdir() if ".tmp-" in p.name)
        assert left == sorted([live.name, recent.name])
    finally:
        live_proc.kill()
        live_proc.wait()
    assert features.FeatureCache(root).remove_dead_writers() == [live]  # its writer is gone now


def test_cache_of_overwritten_data_is_refused(compose_tiny, tiny_data, tmp_path):
    """Guards against: a cache keyed on the data.source path only, so overwriting the data file (or re-distilling
    into the same folder) trains on the hidden states of the OLD data without a word; the run must be refused in
    one line naming the source, and the same content again accepted."""
    data, cache = tmp_path / "chats.jsonl", tmp_path / "cache"
    original = tiny_data.read_text()
    data.write_text(original)
    common = [*RUN, f"data.source={data}", f"features.cache_dir={cache}"]
    features.run_build(compose_tiny(*common, "features.mode=build", out=tmp_path / "a"))
    before = shard_files(cache)

    data.write_text(original.replace("yak", "cat"))  # other conversations, the same size
    with pytest.raises(UserError) as err:
        T.run(compose_tiny(*common, "features.mode=train", out=tmp_path / "b"))
    msg = str(err.value)
    assert str(data) in msg and str(cache) in msg and "\n" not in msg, msg
    assert shard_files(cache) == before

    data.write_text(original)  # rewritten with the same content (a new mtime): still its cache
    T.run(compose_tiny(*common, "features.mode=train", out=tmp_path / "c"))
    assert len(losses(tmp_path / "c", "train")) == 4


def test_cache_built_before_data_fingerprints_is_accepted_and_gets_one(compose_tiny, tiny_data, tmp_path):
    """Guards against: every cache built before data fingerprints were recorded being refused (their manifests have
    none): such a cache is taken as it is, and its fingerprint recorded so a later change of the data is seen."""
    data, cache = tmp_path / "chats.jsonl", tmp_path / "cache"
    data.write_text(tiny_data.read_text())
    common = [*RUN, f"data.source={data}", f"features.cache_dir={cache}"]
    features.run_build(compose_tiny(*common, "features.mode=build", out=tmp_path / "a"))
    path = cache / features.MANIFEST
    manifest = json.loads(path.read_text())
    recorded = manifest.pop("data_fingerprint", None)
    assert recorded, "the build records the data's fingerprint"
    path.write_text(json.dumps(manifest))  # as an older version wrote it

    T.run(compose_tiny(*common, "features.mode=train", out=tmp_path / "b"))
    assert len(losses(tmp_path / "b", "train")) == 4
    assert json.loads(path.read_text())["data_fingerprint"] == recorded


def test_a_cache_dir_with_the_cache_off_is_said_once(compose_tiny, tmp_path, capsys):
    """Guards against: ``features.cache_dir=`` given without ``features.mode=train`` (or a recipe's shared cache
    turned off on the command line) training online in silence, the named cache neither read nor built."""
    features.check_cache_dir(compose_tiny(f"features.cache_dir={tmp_path / 'shared'}"))
    err = capsys.readouterr().err
    assert "features.cache_dir=" in err and "features.mode=off" in err and len(err.strip().splitlines()) == 1
    features.check_cache_dir(compose_tiny())
    assert capsys.readouterr().err == ""
    assert not (tmp_path / "shared").exists()


def test_cache_of_another_tokenizer_or_rounding_is_refused(compose_tiny, tiny_data, tmp_path, monkeypatch):
    """Guards against: a cache keyed on the backbone's weights and config only, so a chat template or tokenizer
    changed at the same path (a hub revision, an edited chat_template.jinja) trained on ids of the old one, and a
    cache built under trainer.precision=bf16 into fp32 shards was read by an fp32 run as if computed in fp32."""
    data, cache = tmp_path / "chats.jsonl", tmp_path / "cache"
    data.write_text(tiny_data.read_text())
    common = [*RUN, f"data.source={data}", f"features.cache_dir={cache}", "features.dtype=fp32"]
    features.run_build(compose_tiny(*common, "features.mode=build", out=tmp_path / "a"))
    manifest = json.loads((cache / features.MANIFEST).read_text())
    assert manifest["tokenizer_fingerprint"] and manifest["rounded_to"] == "the stored dtype"
    before = shard_files(cache)

    real = features.tokenizer_fingerprint
    monkeypatch.setattr(features, "tokenizer_fingerprint", lambda tok: real(tok) + " (edited template)")
    with pytest.raises(UserError, match="another tokenizer or chat template") as err:
        T.run(compose_tiny(*common, "features.mode=train", out=tmp_path / "b"))
    assert str(cache) in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setattr(features, "tokenizer_fingerprint", real)
    assert shard_files(cache) == before

    assert features.rounding(torch.bfloat16, torch.float32) == "bfloat16"
    assert features.rounding(torch.float32, torch.bfloat16) == "the stored dtype"
    assert features.rounding(torch.float16, torch.bfloat16) == "float16"
    monkeypatch.setattr(features, "rounding", lambda compute, store: "bfloat16")   # as precision=bf16 builds it
    with pytest.raises(UserError, match="rounded to the stored dtype before they were stored .* to bfloat16"):
        T.run(compose_tiny(*common, "features.mode=train", out=tmp_path / "c"))


def test_tokenizer_fingerprint_follows_the_chat_template_not_the_load(tiny_backbone, tmp_path):
    """Guards against: a fingerprint that differs between two loads of the same tokenizer, or after a padded call
    (its truncation / padding state is in the tokenizer's JSON: every cache refused as "another tokenizer"), or
    that misses an edited chat template (a stale cache taken)."""
    from transformers import AutoTokenizer

    from medusa_train.backbone import tokenizer_fingerprint

    tiny_backbone.tokenizer.save_pretrained(tmp_path)
    first, again = AutoTokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    loaded = tokenizer_fingerprint(tiny_backbone.tokenizer)
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(again) == loaded
    first(["a b c", "a"], padding=True, truncation=True, max_length=2)   # leaves its call-time state behind
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(again)
    again.chat_template = "{{ 'system: be brief' }}" + again.chat_template
    assert tokenizer_fingerprint(again) != tokenizer_fingerprint(first)


def test_a_cache_dir_that_cannot_be_written_is_refused_before_the_backbone_loads(compose_tiny, tmp_path, monkeypatch):
    """Guards against: a features.cache_dir on a read-only filesystem (or under a file) found only once the backbone
    had loaded, as an OSError traceback from the manifest's claim, with the new run's folder left behind: one line in
    preflight. A complete cache there is still only read (a read-only share serves)."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match=rf"^features.cache_dir={blocker}/cache cannot be created: {blocker} is a "
                                        "file$"):
        features.check_cache_dir(compose_tiny("features.mode=train", f"features.cache_dir={blocker}/cache"))
    shared = tmp_path / "ro"
    shared.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == shared else real(p, mode))
    with pytest.raises(UserError, match=rf"^features.cache_dir={shared}/cache cannot be written: no write "
                                        rf"permission on {shared}$"):
        features.check_cache_dir(compose_tiny("features.mode=train", f"features.cache_dir={shared}/cache"))
    (shared / features.MANIFEST).write_text("{}")   # a cache built there before: read, not written
    features.check_cache_dir(compose_tiny("features.mode=train", f"features.cache_dir={shared}"))


def test_held_out_batches_wait_in_host_memory(compose_tiny):
    """Guards against the cached held-out batches sitting on the GPU for the whole run (~1-4 GiB of hidden states at
    Llama-3.1-8B's width, more with EAGLE-3's layers, uncounted by the memory check): they are read to host memory
    and each moves to the training device when it is evaluated (a stand-in device here: "meta")."""
    trainer = T.MedusaTrainer(compose_tiny("features.mode=train", "trainer.max_steps=1", "logger.plot=false"))
    trainer.setup()
    source = trainer.source
    source.device = torch.device("meta")   # where the training runs, as far as the source knows
    held = source.eval_batches()
    assert held and all(b["hidden"].device.type == "cpu" for b in held)
    assert source.features(held[0])["hidden"].device.type == "meta"
    trainer.cleanup(plot=False)


def test_shards_beyond_host_memory_are_refused_before_the_first_forward(compose_tiny, tmp_path, monkeypatch):
    """Guards against a feature-cache build killed by the kernel's OOM killer: each process holds the shard it
    builds whole until it writes it (~17 GB a shard of an EAGLE-3 cache at Llama-3.1-8B's width, 8 processes a
    node); one line naming features.shard_batches instead, nothing written, the claim withdrawn."""
    monkeypatch.setattr(features, "free_memory_bytes", lambda device: 1000)
    forwards = []
    monkeypatch.setattr(features.FrozenFeatures, "features", lambda self, *a, **k: forwards.append(1))
    out = tmp_path / "run"
    with pytest.raises(UserError) as err:
        features.run_build(compose_tiny("features.mode=build", out=out))
    msg = str(err.value)
    assert "lower features.shard_batches" in msg and "host memory" in msg and "\n" not in msg, msg
    assert forwards == [] and not (out / "features").exists()
