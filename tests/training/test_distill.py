"""Self-distillation (``task: distill``) on the tiny random backbone: the replies are the backbone's own,
multi-turn replay, resume after a kill, refusal of a foreign output directory, and that the trainer's
readers take the output as it is."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from inference.methods import generate
from inference.errors import UserError
from medusa_train import distill
from inference.backbone import eos_token_ids
from medusa_train.backbone import load_backbone
from medusa_train.data.readers import ReadStats, iter_conversations

# A larger init scale than debug_tiny's: the default random backbone repeats one token forever,
# which would make "the reply is the backbone's greedy output" true of almost any code.
VARIED = "+backbone.random_init.initializer_range=0.5"
DISTILL = ["task=distill", "distill.max_new_tokens=8", "distill.shard_size=4", "distill.batch_size=3",
           "distill.max_conversations=16", VARIED, "distill.engine=generate"]


def records(out: Path) -> list[dict]:
    rows = []
    for shard in sorted((out / distill.DATA_DIR).glob("shard-*.jsonl")):
        rows += [json.loads(line) for line in shard.read_text().splitlines()]
    return rows


@pytest.fixture(scope="module")
def varied_backbone():
    from medusa_train.launch import compose_recipe

    cfg = compose_recipe("debug_tiny", [VARIED])
    return load_backbone(cfg.backbone, "cpu", seed=cfg.trainer.seed)


def test_greedy_replies_are_the_backbones_own_output_turn_by_turn(compose_tiny, out_dir, tiny_data, varied_backbone):
    """Guards against: replies that are not what the backbone itself generates at temperature 0 (batching,
    left padding or KV cache changing the tokens, a prompt rendered differently from training), later turns
    prompted with the dataset's original replies instead of the regenerated ones, user turns altered, and
    conversations lost or duplicated."""
    manifest = distill.run(compose_tiny(*DISTILL, "distill.temperature=0"))
    assert manifest["complete"] and manifest["counts"]["source_conversations"] == 16
    rows = records(out_dir)
    assert [r["source_index"] for r in rows] == list(range(16))
    source = [m for _, m in zip(range(16), iter_conversations(str(tiny_data)))]

    model, tok = varied_backbone.model, varied_backbone.tokenizer
    eos = eos_token_ids(model, tok)
    multi_turn = 0
    for row in rows:
        msgs = row["messages"]
        src = source[row["source_index"]]
        assert [m for m in msgs if m["role"] != "assistant"] == [m for m in src if m["role"] != "assistant"]
        assistant_at = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        multi_turn += len(assistant_at) > 1
        for i in assistant_at:
            # the prompt holds the regenerated earlier replies, rendered and tokenised as training does
            text = tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            out = generate(model, prompt, "autoregressive", max_new_tokens=8, eos_token_ids=eos)
            tokens = [t for t in out.tokens if t not in eos]
            text = tok.decode(tokens, skip_special_tokens=True)
            if len(tokens) == len(out.tokens) and text.endswith("\ufffd"):
                text = text[:-1]   # a reply cut inside a character drops its first bytes' U+FFFD
            assert msgs[i]["content"] == text, (row["source_index"], i)
            assert msgs[i]["content"] != src[i]["content"]
            # a reply cut at max_new_tokens is marked, so training learns no end-of-turn after it
            assert msgs[i].get("unfinished", False) is (len(tokens) == len(out.tokens)), (row["source_index"], i)
    assert multi_turn >= 2  # the tiny chats have multi-turn conversations: they were replayed
    cut = sum(m.get("unfinished", False) for r in rows for m in r["messages"])
    assert cut > 0 and manifest["counts"]["truncated_turns"] == cut
    assert manifest["counts"]["turns"] == sum(len([m for m in r["messages"] if m["role"] == "assistant"])
                                              for r in rows)
    assert manifest["counts"]["tokens_per_s_per_process"] > 0 and manifest["last_run"]["tokens_per_s"] > 0


def test_generate_engine_ignores_the_checkpoints_generation_defaults(compose_tiny, varied_backbone):
    """Guards against: transformers filling what the engine's GenerationConfig leaves unset from the checkpoint's
    generation_config.json (a hub model's repetition_penalty, no_repeat_ngram_size, suppress_tokens), so the
    distilled "greedy" replies are not the backbone's greedy output, differ from the runtime engines' and depend
    on which engine was measured faster. The model's own generation config must come back untouched."""
    from medusa_train.distill_engines import Generator

    model, tok = varied_backbone.model, varied_backbone.tokenizer
    cfg = compose_tiny(*DISTILL, "distill.temperature=0", "distill.max_new_tokens=12")
    gen = Generator(model, tok, cfg, torch.device("cpu"))
    prompt = gen.encode([{"role": "user", "content": "hello there, how are you today?"}])
    eos = eos_token_ids(model, tok)
    want = [t for t in generate(model, prompt, "autoregressive", max_new_tokens=12, eos_token_ids=eos).tokens
            if t not in eos]
    assert len(set(want)) > 3  # a varied reply: a penalty on repeats would change it
    saved = model.generation_config
    hub = saved.__class__(**saved.to_dict())
    hub.update(repetition_penalty=3.0, no_repeat_ngram_size=2, suppress_tokens=[want[0]])
    model.generation_config = hub
    try:
        (got, _), = gen.generate([prompt])
        assert model.generation_config is hub and hub.repetition_penalty == 3.0
    finally:
        model.generation_config = saved
    assert got == want


def test_a_reply_ends_at_the_templates_end_of_turn_when_the_eos_is_another_token(compose_tiny, monkeypatch):
    """Guards against: distillation stopping at the checkpoint's eos ids only, so a ChatML model whose eos is
    <|endoftext|> wrote past <|im_end|> a made-up next turn into the reply ("Hello!\\nuser\\nI am the user"), its
    turn markers dropped by the decoding, and the reply marked unfinished (its end never trained)."""
    from medusa_train.distill_engines import Generator, RuntimeGenerator

    cfg = compose_tiny(*DISTILL, "distill.temperature=0", "distill.max_new_tokens=24")
    b = load_backbone(cfg.backbone, "cpu", seed=0)
    model, tok = b.model, b.tokenizer
    tok.eos_token = "<|endoftext|>"   # the checkpoint's eos is not the token its template closes turns with
    model.generation_config.eos_token_id = model.config.eos_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    end, start = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    words = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    script = words("Hello!") + [end] + words("\n") + [start] + words("user\nI am the user now")
    real = model.forward

    def scripted(*args, **kwargs):   # at each position past the prompt, the script's token there
        cache = kwargs.get("past_key_values", kwargs.get("cache"))   # transformers 4 / 5
        pos = kwargs.get("position_ids")
        past = cache.get_seq_length() if cache is not None else 0   # before the forward adds to it
        out = real(*args, **kwargs)
        pos = torch.arange(past, past + out.logits.shape[1])[None] if pos is None else pos
        for i in range(out.logits.shape[1]):
            step = min(max(int(pos[0, i]) + 1 - prompt_len, 0), len(script) - 1)
            out.logits[:, i] = -1e4
            out.logits[:, i, script[step]] = 1e4
        return out

    runtime = RuntimeGenerator(model, tok, cfg, torch.device("cpu"))   # the runtime engines stop at the same ids
    assert end in runtime.eos and end in runtime.m.eos_token_ids
    monkeypatch.setattr(model, "forward", scripted)
    gen = Generator(model, tok, cfg, torch.device("cpu"))
    prompt = gen.encode([{"role": "user", "content": "Say hello."}])
    prompt_len = len(prompt)
    (new, hit_end), = gen.generate([prompt])
    assert hit_end and gen.decode(new) == "Hello!", gen.decode(new)


def test_a_greeting_before_any_user_turn_keeps_the_system_prompt():
    """Guards against: a conversation whose first reply answers no user turn (system prompt, then an assistant
    greeting; ``data.system_prompt`` produces it from ShareGPT records opening with a "gpt" turn) losing its
    system prompt with the skipped greeting, so its replies are generated without the system prompt that
    training (which re-inserts data.system_prompt) shows them with."""
    source = [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "Hi! Ask me."},
              {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
              {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}]
    rep = distill.Replay(0, source)
    assert rep.next_prompt(None) == [source[0], source[2]]
    rep.accept("Four.", 2, True)
    assert rep.next_prompt(None) == [source[0], source[2], {"role": "assistant", "content": "Four."}, source[4]]
    rep.accept("Six.", 2, True)
    assert rep.next_prompt(None) is None
    assert [m for m in rep.record()["messages"] if m["role"] != "assistant"] == [source[0], source[2], source[4]]


def test_a_reply_cut_inside_a_character_keeps_no_replacement_character():
    """Guards against: a reply cut at max_new_tokens between the bytes of one character (an emoji, CJK) ending in
    the U+FFFD its first bytes decode to, which training then learns as the reply's last word; a finished reply's
    text is kept as generated."""
    rep = distill.Replay(0, [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}])
    rep.next_prompt(None)
    rep.accept("Hi there \U0001F600 and \ufffd\ufffd", 8, False)
    assert rep.messages[-1] == {"role": "assistant", "content": "Hi there \U0001F600 and \ufffd", "unfinished": True}
    rep = distill.Replay(0, [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}])
    rep.next_prompt(None)
    rep.accept("odd \ufffd", 3, True)
    assert rep.messages[-1] == {"role": "assistant", "content": "odd \ufffd"}


def test_output_is_read_by_the_trainers_readers(compose_tiny, out_dir):
    """Guards against: output the trainer cannot read as it is (wrong form, dropped records, the marks of
    replies cut at max_new_tokens lost), or the manifest and progress files being picked up as conversations by
    the folder reader."""
    distill.run(compose_tiny(*DISTILL, "distill.max_conversations=6", "distill.max_turns=1"))
    stats = ReadStats()
    convs = list(iter_conversations(str(out_dir / distill.DATA_DIR), stats=stats))
    assert len(convs) == 6 and stats.dropped_total == 0
    assert all(sum(m["role"] == "assistant" for m in c) == 1 for c in convs)  # max_turns=1
    cut = [m for r in records(out_dir) for m in r["messages"] if m.get("unfinished")]
    assert cut and [m for c in convs for m in c if m.get("unfinished")] == cut  # the marks reach training


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("how", ["crash", "ctrl-c"])
def test_resume_after_a_kill_loses_and_duplicates_nothing(how, compose_tiny, tmp_path, monkeypatch):
    """Guards against: a run killed mid-shard (crash or Ctrl-C/SIGTERM) leaving a half-written shard that
    looks complete, and a rerun that skips, repeats or re-samples conversations: with sampling on
    (temperature 0.7) the resumed output must equal an uninterrupted run's, record for record."""
    sampled = [*DISTILL, "distill.temperature=0.7"]
    distill.run(compose_tiny(*sampled, out=tmp_path / "whole"))

    real = distill.Generator.generate
    calls = {"n": 0}

    def dying(self, prompts):
        calls["n"] += 1
        if calls["n"] == 5:  # in the middle of the second shard (3 batches per shard here)
            raise KeyboardInterrupt if how == "ctrl-c" else Boom("injected")
        return real(self, prompts)

    monkeypatch.setattr(distill.Generator, "generate", dying)
    cut = tmp_path / "cut"
    with pytest.raises(UserError if how == "ctrl-c" else Boom) as err:
        distill.run(compose_tiny(*sampled, out=cut))
    if how == "ctrl-c":
        assert "run the same command again" in str(err.value)
    assert [p.name for p in (cut / distill.DATA_DIR).iterdir()] == ["shard-000000.jsonl"]  # nothing half-written
    assert not json.loads((cut / distill.MANIFEST).read_text())["complete"]

    monkeypatch.setattr(distill.Generator, "generate", real)
    manifest = distill.run(compose_tiny(*sampled, out=cut))
    assert manifest["last_run"]["shards_found_done"] == 1 and manifest["last_run"]["shards_written"] == 3
    assert records(cut) == records(tmp_path / "whole")
    assert [r["source_index"] for r in records(cut)] == list(range(16))
    assert not [p for p in (cut / distill.DATA_DIR).iterdir() if ".tmp" in p.name]


@pytest.mark.parametrize("temperature", [0.7, 0])
def test_a_resume_at_another_batch_size_is_recorded_and_said_when_sampling(temperature, compose_tiny, out_dir, capsys):
    """Guards against: a resume with another distill.batch_size (a run out of memory continues with smaller batches)
    taken silently: sampled replies depend on the batch size (the draws per batch), so a dataset whose manifest does
    not say which shards were drawn at which batch size cannot be regenerated from it. Greedy replies do not depend on
    it (the greedy test above batches them), so nothing is said then; the batch sizes are recorded either way."""
    args = [*DISTILL, f"distill.temperature={temperature}", "distill.max_conversations=8"]
    distill.run(compose_tiny(*args))   # 2 shards at batch size 3
    (out_dir / distill.DATA_DIR / "shard-000001.jsonl").unlink()   # as if killed before shard 1
    capsys.readouterr()
    manifest = distill.run(compose_tiny(*args, "distill.batch_size=2"))
    said = [line for line in capsys.readouterr().out.splitlines() if "batch size" in line]
    assert manifest["batch_sizes"] == [{"from_shard": 0, "batch_size": 3}, {"from_shard": 1, "batch_size": 2}]
    assert manifest["last_run"]["batch_size"] == 2
    if temperature:
        assert said == ["[distill] shards on disk were sampled at distill.batch_size=3; replies from here on are "
                        "drawn at batch size 2 (distill.json records the batch size of every shard)"]
    else:
        assert said == []
    distill.run(compose_tiny(*args))   # nothing left to draw: nothing to say (it was said at every rerun)
    assert [line for line in capsys.readouterr().out.splitlines() if "batch size" in line] == []


def test_processes_split_the_shards_and_together_cover_every_conversation(compose_tiny, out_dir, monkeypatch):
    """Guards against: launcher ranks generating the same conversations twice (or none), and the manifest
    being finalised before every rank's shards exist."""
    cfg = compose_tiny(*DISTILL, "distill.temperature=0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert distill.run(cfg) == {}  # rank 1 first: shards 1 and 3; shards 0 and 2 are still missing
    assert sorted(p.name for p in (out_dir / distill.DATA_DIR).iterdir()) == ["shard-000001.jsonl",
                                                                                "shard-000003.jsonl"]
    monkeypatch.setenv("RANK", "0")
    manifest = distill.run(cfg)
    assert manifest["complete"] and manifest["last_run"]["shards_written"] == 2
    assert [r["source_index"] for r in records(out_dir)] == list(range(16))


@pytest.mark.parametrize("change, words", [
    (["distill.temperature=0.9"], ["another run", "distill.temperature"]),
    (["++backbone.random_init.initializer_range=0.2"], ["another run", "random_init"]),
    (["data.source=tests/assets/other.jsonl"], ["another run", "data.source"]),
], ids=["settings", "backbone", "source"])
def test_output_dir_of_another_run_is_refused(change, words, compose_tiny, out_dir):
    """Guards against: appending to (or silently mixing with) a directory generated with other settings, by
    another backbone or from another source, which would leave a dataset no manifest describes."""
    distill.run(compose_tiny(*DISTILL, "distill.max_conversations=4"))
    before = sorted(p.name for p in (out_dir / distill.DATA_DIR).iterdir())
    with pytest.raises(UserError) as err:
        distill.run(compose_tiny(*DISTILL, "distill.max_conversations=4", *change))
    assert all(w in str(err.value) for w in words) and "\n" not in str(err.value)
    assert sorted(p.name for p in (out_dir / distill.DATA_DIR).iterdir()) == before


def test_rewritten_data_or_another_tokenizer_is_not_continued(compose_tiny, tiny_data, out_dir, tmp_path,
                                                               monkeypatch):
    """Guards against: a distillation keyed on data.source's path and the backbone's weights only, so a source
    file rewritten between two runs (or a chat template edited at the same backbone path) left shards of the old
    data beside shards of the new one in one dataset marked complete."""
    data = tmp_path / "chats.jsonl"
    original = tiny_data.read_text()
    data.write_text(original)
    args = [*DISTILL, "distill.max_conversations=8", f"data.source={data}"]
    distill.run(compose_tiny(*args))
    (out_dir / distill.DATA_DIR / "shard-000001.jsonl").unlink()   # a shard to write again
    data.write_text(original.replace("yak", "cat"))
    with pytest.raises(UserError, match="other content of data.source") as err:
        distill.run(compose_tiny(*args))
    assert "\n" not in str(err.value)
    assert not (out_dir / distill.DATA_DIR / "shard-000001.jsonl").exists()

    data.write_text(original)   # the same content again: continued
    real = distill.frozen.tokenizer_fingerprint
    monkeypatch.setattr(distill.frozen, "tokenizer_fingerprint", lambda tok: real(tok) + " (edited template)")
    with pytest.raises(UserError, match="another tokenizer or chat template"):
        distill.run(compose_tiny(*args))
    monkeypatch.setattr(distill.frozen, "tokenizer_fingerprint", real)
    assert distill.run(compose_tiny(*args))["complete"]


def test_training_on_an_unfinished_distillation_is_refused_before_loading(compose_tiny, out_dir, tmp_path,
                                                                          monkeypatch):
    """Guards against: training reading a distillation whose manifest says it is not complete (one of two processes
    done, a run killed or still running) as if its shards were the dataset, without a word."""
    from medusa_train.preflight import preflight

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    distill.run(compose_tiny(*DISTILL, "distill.max_conversations=8"))   # rank 1's shards only
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    train = compose_tiny(f"data.source={out_dir / distill.DATA_DIR}", "data.eval_conversations=2",
                         out=tmp_path / "train")
    with pytest.raises(UserError, match="is a distillation that has not finished") as err:
        preflight(train)
    assert "1 shard(s) written" in str(err.value) and not (tmp_path / "train").exists()
    assert distill.run(compose_tiny(*DISTILL, "distill.max_conversations=8"))["complete"]
    preflight(train)


def test_a_distillation_read_otherwise_than_as_finished_is_refused(compose_tiny, out_dir, tmp_path):
    """Guards against: a run reading a distillation as data without a word where (a) ``data.source`` is its output
    folder (the manifest and progress files read as conversations, the shards of an unfinished one taken), (b) a
    symlink to its data/ folder (the unfinished check looked for the name ``data``), (c) a shard was deleted or cut
    short after it finished (``complete`` stayed true), (d) the reader is another distillation (checked for training
    only); and a rerun that regenerates the shard leaving the manifest saying complete while it runs."""
    from medusa_train.preflight import preflight

    distill.run(compose_tiny(*DISTILL, "distill.max_conversations=8"))
    data = out_dir / distill.DATA_DIR

    def refusal(source, task=()):
        cfg = compose_tiny(f"data.source={source}", "data.eval_conversations=2", *task, out=tmp_path / "reader")
        with pytest.raises(UserError) as err:
            preflight(cfg)
        assert not (tmp_path / "reader").exists()
        return str(err.value)

    assert "is a distillation's output folder" in refusal(out_dir)
    link = tmp_path / "link"
    link.symlink_to(data)
    manifest = json.loads((out_dir / distill.MANIFEST).read_text())
    assert manifest["complete"] and len(manifest["shard_bytes"]) == 2
    shard = data / manifest["shards"][1]
    whole = shard.read_bytes()
    shard.write_bytes(whole[:len(whole) // 2])
    assert f"shard {shard.name} of this finished distillation holds" in refusal(link)
    assert f"shard {shard.name}" in refusal(data, ("task=distill", "distill.engine=generate"))   # (d)
    shard.unlink()
    assert "is missing" in refusal(data)
    progress = json.loads(distill.progress_path(out_dir, 0).read_text())
    distill.progress_path(out_dir, 0).unlink()   # its counts gone: the shard is written again, not summed as zeros

    seen = {}
    write = distill.write_shard

    def spy(out, k, result):
        seen.setdefault(k, json.loads((out / distill.MANIFEST).read_text())["complete"])
        return write(out, k, result)

    distill.write_shard = spy
    try:
        again = distill.run(compose_tiny(*DISTILL, "distill.max_conversations=8"))
    finally:
        distill.write_shard = write
    assert seen == {0: False, 1: False}
    assert again["complete"] and shard.read_bytes() == whole
    redone = json.loads(distill.progress_path(out_dir, 0).read_text())
    assert {**redone, "generate_s": 0} == {**progress, "generate_s": 0}   # the same counts (timing aside)
    assert again["counts"]["conversations"] == manifest["counts"]["conversations"]
    preflight(compose_tiny(f"data.source={link}", "data.eval_conversations=2", out=tmp_path / "reader"))


def test_same_config_other_weights_are_refused(compose_tiny, out_dir, monkeypatch):
    """Guards against: continuing a run with a backbone whose config matches but whose weights differ
    (a fine-tune saved under the same name), detected by the weight fingerprint."""
    import medusa_train.backbone as backbone_module

    distill.run(compose_tiny(*DISTILL, "distill.max_conversations=4"))

    original = backbone_module.load_backbone

    def perturbed(*a, **k):
        bb = original(*a, **k)
        with torch.no_grad():
            next(bb.model.parameters()).add_(1.0)
        return bb

    monkeypatch.setattr(backbone_module, "load_backbone", perturbed)
    with pytest.raises(UserError, match="other weights"):
        distill.run(compose_tiny(*DISTILL, "distill.max_conversations=4"))


def test_a_folder_of_other_files_is_refused(compose_tiny, out_dir):
    """Guards against: writing distillation shards into a folder that already holds unrelated data."""
    (out_dir / distill.DATA_DIR).mkdir(parents=True)
    (out_dir / distill.DATA_DIR / "mine.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match="no distill.json"):
        distill.run(compose_tiny(*DISTILL))


def test_a_finished_training_run_is_not_distilled_into(compose_tiny, out_dir, monkeypatch):
    """Guards against: distilling into an output_dir that is a finished training run (heads/, checkpoints/,
    metrics.jsonl, no data/): the claim looked at data/ only, so data/, progress/, distill.json and engine.json
    were added beside the run's files (exit 0). Refused before the backbone loads, writing nothing."""
    (out_dir / "heads").mkdir(parents=True)
    (out_dir / "heads" / "config.json").write_text("{}")
    (out_dir / "metrics.jsonl").write_text("{}\n")
    before = sorted(p.relative_to(out_dir) for p in out_dir.rglob("*"))
    # the refusal must come before the backbone loads: a load here fails the test
    monkeypatch.setattr(distill.frozen, "load_backbone", lambda *a, **k: pytest.fail("backbone loaded"))
    with pytest.raises(UserError, match=r"holds heads, metrics.jsonl but no distill.json: not a distillation run"):
        distill.run(compose_tiny(*DISTILL, "distill.max_conversations=4"))
    assert sorted(p.relative_to(out_dir) for p in out_dir.rglob("*")) == before
    with pytest.raises(UserError, match="no distill.json"):   # the claim that creates the manifest says the same
        distill.claim_output(out_dir, {"any": 1})
    assert not (out_dir / distill.MANIFEST).exists()


def test_an_empty_folder_or_the_runs_own_record_is_distilled_into(compose_tiny, out_dir):
    """Guards against: the refusal of a foreign output_dir taking an empty existing folder, or the run record
    (.hydra/) the CLI writes before the claim, or a half-done distillation's own files, for another run's."""
    cfg = compose_tiny(*DISTILL, "distill.max_conversations=4")
    (out_dir / ".hydra").mkdir(parents=True)
    (out_dir / ".hydra" / "config.yaml").write_text("x: 1\n")
    distill.claim_output(out_dir, distill.run_identity(cfg), create=False)
    distill.run(cfg)
    shard = distill.shard_path(out_dir, 0)
    shard.unlink()   # a half-done run (manifest kept): resumed, not refused
    distill.run(cfg)
    assert shard.is_file()


def test_format_1_data_is_not_continued_with_format_2_shards(compose_tiny, out_dir):
    """Guards against: a distillation folder written before replies cut at max_new_tokens were marked (format 1)
    continued with marked shards (one dataset, two labellings), or refused as "something other than distillation
    data", which read as if the data were unusable."""
    cfg = compose_tiny(*DISTILL, "distill.max_conversations=4")
    distill.run(cfg)
    manifest = json.loads((out_dir / distill.MANIFEST).read_text())
    (out_dir / distill.MANIFEST).write_text(json.dumps({**manifest, "format": 1}))
    with pytest.raises(UserError, match="format-1 distillation data .* it still trains as it is"):
        distill.run(cfg)


def test_recipe_dispatch():
    """Guards against: ``medusa-train distill_smollm2`` training heads instead of distilling (the task key
    ignored), or ``features.mode=build`` training."""
    from medusa_train import features, trainer
    from medusa_train.launch import compose_recipe, task_runner

    assert task_runner(compose_recipe("distill_smollm2")) is distill.run
    assert task_runner(compose_recipe("debug_tiny")) is trainer.run
    assert task_runner(compose_recipe("debug_tiny", ["features.mode=build"])) is features.run_build
    assert task_runner(compose_recipe("debug_tiny", ["features.mode=train"])) is trainer.run
    follow = compose_recipe("medusa1_smollm2_distilled")
    assert follow.data.source.rstrip("/").endswith(str(Path(compose_recipe("distill_smollm2").output_dir) / "data"))


def test_cli_distills_then_refuses_other_settings_in_one_line(subprocess_env, tmp_path):
    """Guards against: ``task=distill`` not reaching distill.run from the command line, and a refused output
    directory surfacing as a traceback instead of one line saying why."""
    from conftest import base_overrides
    from test_cli import assert_one_line_error, run_cli

    args = ["debug_tiny", *base_overrides(tmp_path / "d"), "task=distill", "distill.max_conversations=4",
            "distill.max_new_tokens=4", "distill.engine=generate"]
    proc = run_cli(args, subprocess_env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # one whose only reply (4 random bytes) was one cut character ends with no turn to write
    assert re.search(r"complete: [34] of 4 conversations", proc.stdout), proc.stdout
    assert sorted(p.name for p in (tmp_path / "d" / distill.DATA_DIR).iterdir()) == ["shard-000000.jsonl"]
    proc = run_cli([*args, "distill.temperature=0"], subprocess_env, tmp_path)
    assert_one_line_error(proc, "already holds distillation data of another run", "distill.temperature")


@pytest.mark.parametrize("engine", ["runtime", "lookup"])
def test_runtime_engines_write_the_same_greedy_data_as_generate(engine, compose_tiny, tmp_path):
    """Guards against: the runtime's batched decoding (plain loop or prompt lookup) giving other greedy
    replies than transformers' ``generate`` (padding, EOS cut, finished rows or the end-of-turn token
    handled differently), which would make the dataset depend on which engine was measured faster."""
    ref = compose_tiny(*DISTILL, "distill.temperature=0", "distill.max_conversations=8", out=tmp_path / "hf")
    distill.run(ref)
    cfg = compose_tiny(*DISTILL, "distill.temperature=0", "distill.max_conversations=8", f"distill.engine={engine}",
                       out=tmp_path / engine)
    manifest = distill.run(cfg)
    assert manifest["engine"]["chosen"] == engine and manifest["last_run"]["engine"] == engine
    assert records(tmp_path / engine) == records(tmp_path / "hf")


def test_auto_engine_is_measured_recorded_and_kept_on_resume(compose_tiny, tmp_path, monkeypatch):
    """Guards against: a greedy run's engine picked without measuring (no rates recorded), and a resumed run
    measuring again and switching engines half-way."""
    cfg = compose_tiny(*[a for a in DISTILL if not a.startswith("distill.engine")], "distill.max_conversations=8",
                       "distill.temperature=0", out=tmp_path / "auto")
    manifest = distill.run(cfg)
    record = manifest["engine"]
    assert record["chosen"] in ("generate", "runtime", "lookup")
    rates = {n: r["tokens_per_s"] for n, r in record["calibration"].items()}
    assert set(rates) == {"generate", "runtime", "lookup"} and all(v > 0 for v in rates.values())
    assert rates[record["chosen"]] == max(rates.values())
    (tmp_path / "auto" / distill.DATA_DIR / "shard-000001.jsonl").unlink()   # as if killed before shard 1

    def no_measuring(*a, **k):
        raise AssertionError("a resumed run measured the engines again")

    monkeypatch.setattr(distill, "choose_engine", no_measuring)
    again = distill.run(cfg)
    assert again["last_run"]["engine"] == record["chosen"] and again["last_run"]["shards_written"] == 1


def test_unknown_engine_is_refused_in_one_line(compose_tiny):
    """Guards against: a misspelt distill.engine falling back silently to some engine."""
    with pytest.raises(UserError) as err:
        distill.run(compose_tiny(*DISTILL, "distill.engine=vllm"))
    assert "distill.engine" in str(err.value) and "\n" not in str(err.value)


def test_sampled_auto_runs_write_the_same_data_whichever_engine_is_faster(compose_tiny, tmp_path, monkeypatch,
                                                                           capsys):
    """Guards against: ``distill.engine=auto`` with sampling (the recipe's default, temperature 0.3) choosing by
    speed. The engines draw their samples differently and measure within 5% of each other on a CPU, so two fresh
    runs of one command wrote different datasets depending on which engine a busy machine timed faster."""
    from medusa_train import distill_engines

    def timing(fastest):
        def time_engine(engine, prompts, max_new_tokens):
            return {"tokens": 1, "seconds": 1.0, "tokens_per_s": 100.0 if engine.name == fastest else 1.0}
        return time_engine

    runs = []
    for fastest in ("generate", "lookup"):
        monkeypatch.setattr(distill_engines, "time_engine", timing(fastest))
        cfg = compose_tiny(*[a for a in DISTILL if not a.startswith("distill.engine")], "distill.max_conversations=8",
                           "distill.temperature=0.7", out=tmp_path / fastest)
        manifest = distill.run(cfg)
        assert manifest["engine"]["chosen"] == "runtime" and manifest["engine"]["calibration"] is None
        runs.append(records(tmp_path / fastest))
    assert runs[0] == runs[1]
    assert "[distill] engine: runtime (sampling" in capsys.readouterr().out
    assert len(runs[0]) == 8 and all(any(m["role"] == "assistant" for m in r["messages"]) for r in runs[0])


def test_sampled_auto_takes_generate_when_the_runtime_cannot_decode_the_backbone(compose_tiny, tmp_path, monkeypatch):
    """Guards against: the sampling rule of ``distill.engine=auto`` failing a run whose backbone only transformers'
    generate can decode (the runtime refuses it) instead of writing with generate."""
    from medusa_train import distill_engines

    class Refused(distill_engines.Generator):
        def __init__(self, *a, **k):
            raise UserError("no runtime for this backbone")

    monkeypatch.setattr(distill_engines, "RuntimeGenerator", Refused)
    cfg = compose_tiny(*[a for a in DISTILL if not a.startswith("distill.engine")], "distill.max_conversations=4",
                       out=tmp_path / "g")
    manifest = distill.run(cfg)
    assert manifest["engine"]["chosen"] == "generate" and "cannot decode" in manifest["engine"]["why"]


def test_the_runtime_engines_refuse_requests_past_a_sliding_window(compose_tiny, tmp_path):
    """Guards against: a backbone with sliding-window layers (Gemma-3's 1,024-token window), which the runtime decodes
    only within its window, distilled by the runtime engines past it: each prompt longer than the window failed
    mid-run. The runtime engines refuse such a run when built, so ``distill.engine=auto`` writes with generate."""
    from medusa_train.distill_engines import RuntimeGenerator

    window = ["backbone.random_init.model_type=qwen2", "+backbone.random_init.use_sliding_window=true",
              "+backbone.random_init.max_window_layers=1", "+backbone.random_init.sliding_window=72",
              "data.max_length=64"]
    cfg = compose_tiny(*DISTILL, *window, "distill.max_new_tokens=9")
    b = load_backbone(cfg.backbone, "cpu", seed=0)
    with pytest.raises(UserError, match=r"^distill.engine=runtime cannot run this backbone: data.max_length \+ "
                                        r"distill.max_new_tokens \(73\) exceeds its 72-token sliding window .*; use "
                                        r"distill.engine=generate$"):
        RuntimeGenerator(b.model, b.tokenizer, cfg, torch.device("cpu"))
    fits = compose_tiny(*DISTILL, *window, "distill.max_new_tokens=8")
    assert RuntimeGenerator(b.model, b.tokenizer, fits, torch.device("cpu")).m is not None
    sampled = compose_tiny(*[a for a in DISTILL if not a.startswith("distill.engine")], *window,
                           "distill.max_new_tokens=9", "distill.max_conversations=4", out=tmp_path / "g")
    assert distill.run(sampled)["engine"]["chosen"] == "generate"


def test_training_on_data_distilled_by_another_backbone_is_said(compose_tiny, tmp_path, capsys):
    """Guards against: heads trained on self-distilled data written by another backbone in silence (a recipe's
    default data.source, runs/distill_smollm2/data, kept beside backbone.name_or_path=<your model>): the heads learn
    the other model's replies. The same backbone's data trains without a word."""
    import shutil

    from conftest import TINY_DATA
    from medusa_train import trainer as T
    from medusa_train.backbone import backbone_identity

    (tmp_path / "d" / distill.DATA_DIR).mkdir(parents=True)
    shutil.copy(TINY_DATA, tmp_path / "d" / distill.DATA_DIR / "shard-000000.jsonl")
    manifest = tmp_path / "d" / distill.MANIFEST
    for weights, said in (("0123456789abcdef", True), (None, False)):
        trainer = T.MedusaTrainer(compose_tiny(f"data.source={tmp_path / 'd' / distill.DATA_DIR}",
                                               "trainer.max_steps=1", out=tmp_path / f"run-{said}"))
        if weights is None:   # the data of this very backbone
            weights = backbone_identity(load_backbone(trainer.cfg.backbone, "cpu", seed=0))["weights"]
        manifest.write_text(json.dumps({"task": "distill",
                                        "backbone_fingerprint": {"name": "other", "weights": weights}}))
        trainer.setup()
        trainer.cleanup(plot=False)
        err = capsys.readouterr().err
        assert ("self-distilled by other (other weights than this run's backbone)" in err) == said, err


def test_a_distillation_that_keeps_no_reply_says_so_and_fails(compose_tiny, out_dir, monkeypatch):
    """Guards against: a run whose every reply came back empty (a backbone that ends each turn at once) printing
    "complete: 0 of N conversations ... train on it" and exiting 0, as if it had written a dataset."""
    from medusa_train import distill_engines

    monkeypatch.setattr(distill_engines.Generator, "generate",
                        lambda self, prompts, max_new_tokens=None: [([], True) for _ in prompts])
    with pytest.raises(UserError, match=r"none of the 4 conversations kept a reply \(ended: empty reply: 4\)"):
        distill.run(compose_tiny(*DISTILL, "distill.max_conversations=4"))


def test_a_local_backbone_keys_caches_and_data_by_its_setting_and_distillation_by_its_weights(tmp_path, monkeypatch,
                                                                                             varied_backbone):
    """Guards against: the absolute path the heads now record for ``backbone.name_or_path=models/x`` becoming the
    name distilled data and feature caches were keyed on, so a run started before could not continue its own data
    ("generated by a backbone with other weights or architecture", with the same weights) or cache."""
    from types import SimpleNamespace

    from medusa_train.backbone import _load_pretrained, backbone_identity

    folder = tmp_path / "models" / "x"
    varied_backbone.model.save_pretrained(folder)
    varied_backbone.tokenizer.save_pretrained(folder)
    monkeypatch.chdir(tmp_path)
    cfg = SimpleNamespace(name_or_path="models/x", dtype="float32", trust_remote_code=False, revision=None,
                          gguf_file=None, attn_implementation="sdpa")
    loaded = _load_pretrained(cfg)
    assert loaded.name == str(folder) and backbone_identity(loaded)["name"] == "models/x"
    out, identity = tmp_path / "d", {"settings": 1}
    fingerprint = backbone_identity(loaded)
    distill.claim_output(out, identity, fingerprint)
    distill.claim_output(out, identity, {**fingerprint, "name": str(folder)})   # the same folder, spelt otherwise
    with pytest.raises(UserError, match="other weights or architecture"):
        distill.claim_output(out, identity, {**fingerprint, "weights": "0" * 16})
