"""Self-distillation, reviewed: what the engines write is the backbone's reply, with tokenizers other than the tiny
byte-level one (byte fallback), and one engine per output directory when launch ranks measure at once."""

from __future__ import annotations

import json

import torch

from medusa_train import distill
from medusa_train.distill_engines import Generator

from test_distill import DISTILL, records, varied_backbone  # noqa: F401  (a fixture)


def byte_fallback_tokenizer():
    """A Llama-2 / Mistral / Gemma-like tokenizer: a few characters of its own, every other byte as a ``<0xNN>`` token
    (byte fallback), ChatML specials at the byte tokenizer's ids, so the tiny random backbone can run with it."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from medusa_train.backbone import CHATML_TEMPLATE

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {s: 256 + i for i, s in enumerate(specials)}
    for ch in "HSabehiy \n":
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


def test_a_reply_cut_inside_a_character_by_a_byte_fallback_tokenizer_keeps_no_replacement_character(
        compose_tiny, varied_backbone):  # noqa: F811
    """Guards against: a reply cut at max_new_tokens inside a character that a byte-fallback tokenizer (Llama 2,
    Mistral, Gemma) spells as ``<0xNN>`` tokens keeping U+FFFDs: that decoder turns each byte of a group of byte
    tokens holding an unfinished character into a U+FFFD (the complete characters before it in the group too), where
    byte-level BPE gives one, the only one ``Replay.accept`` drops; training then learns replacement characters."""
    tok = byte_fallback_tokenizer()
    cfg = compose_tiny(*DISTILL, "distill.temperature=0")
    gen = Generator(varied_backbone.model, tok, cfg, torch.device("cpu"))
    full = tok("Hi \u00e9\U0001F600", add_special_tokens=False)["input_ids"]
    assert tok.decode(full) == "Hi \u00e9\U0001F600" and tok.convert_ids_to_tokens(full[-4:])[0] == "<0xF0>"
    cut = {n: full[:-n] for n in (1, 2, 3)}   # 3, 2 and 1 of the emoji's 4 bytes generated
    source = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]
    for n, tokens in cut.items():
        gen.generate = lambda prompts, max_new_tokens=None, t=tokens: [(t, False) for _ in prompts]
        (row,) = distill.distill_shard(gen, [(0, source)], cfg).records
        assert row["messages"][-1] == {"role": "assistant", "content": "Hi \u00e9", "unfinished": True}, n
    # a finished reply is kept as decoded
    gen.generate = lambda prompts, max_new_tokens=None: [(full, True) for _ in prompts]
    (row,) = distill.distill_shard(gen, [(0, source)], cfg).records
    assert row["messages"][-1] == {"role": "assistant", "content": "Hi \u00e9\U0001F600"}


def test_a_process_writes_with_the_engine_another_process_recorded_while_it_measured(compose_tiny, out_dir,
                                                                                     monkeypatch):
    """Guards against: launch ranks that measure the engines at once (distill.engine=auto) each keeping its own
    fastest, though the first to finish recorded its choice in distill.json for all: the dataset mixes two engines'
    samples, the manifest names one engine for all of them, and a resumed shard is sampled by another engine than
    the one the uninterrupted run wrote it with."""
    cfg = compose_tiny(*[a for a in DISTILL if not a.startswith("distill.engine")], "distill.max_conversations=4",
                       "distill.temperature=0.7")

    def other_rank_recorded_first(engines, prompts, max_new_tokens, log=print):
        # while this process measured (and found lookup fastest), rank 0 finished and recorded runtime
        manifest = json.loads((out_dir / distill.MANIFEST).read_text())
        distill.write_json_atomic(out_dir / distill.MANIFEST, {**manifest, "engine": {"chosen": "runtime"}})
        return engines["lookup"](), {"chosen": "lookup", "calibration": None}

    monkeypatch.setattr(distill, "choose_engine", other_rank_recorded_first)
    manifest = distill.run(cfg)
    assert manifest["engine"]["chosen"] == "runtime" and manifest["last_run"]["engine"] == "runtime"
    assert len(records(out_dir)) == 4


MISTRAL_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] "
                    "+ ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")


def test_a_reply_keeps_the_space_its_first_token_starts_with(compose_tiny, varied_backbone):  # noqa: F811
    """Guards against: a SentencePiece tokenizer's decoder (Llama 2, Mistral: it strips one leading space of what it
    decodes) dropping the space that the reply's first token (``▁Hello``, a lone ``▁``) starts with, so a reply the
    backbone wrote after Mistral's ``[/INST]`` as `` Hello`` is written, trained on and put in the next turn's prompt
    as ``[/INST]Hello``: other tokens than the backbone generated. The reply must be the text its tokens add to the
    prompt."""
    from transformers import LlamaTokenizer

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"<unk>": 256, "<s>": 257, "</s>": 258}
    for piece in ["\u2581Hello", "\u2581there", "\u2581", *"[]/INSTayhi"]:
        vocab[piece] = len(vocab)
    tok = LlamaTokenizer(vocab=vocab, merges=[])
    tok.chat_template = MISTRAL_TEMPLATE
    cfg = compose_tiny(*DISTILL, "distill.temperature=0")
    gen = Generator(varied_backbone.model, tok, cfg, torch.device("cpu"))
    source = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]
    prompt = gen.encode(source[:1])
    emoji = list("\U0001F600".encode())
    for new, want in [([vocab["\u2581Hello"], vocab["\u2581there"]], " Hello there"),
                      ([vocab["\u2581"], *emoji], " \U0001F600"), ([*emoji, vocab["\u2581there"]], "\U0001F600 there")]:
        assert tok.decode(prompt + new)[len(tok.decode(prompt)):] == want   # the text the tokens add to the prompt
        gen.generate = lambda prompts, max_new_tokens=None, t=new: [(t, True) for _ in prompts]
        (row,) = distill.distill_shard(gen, [(0, source)], cfg).records
        assert row["messages"][-1] == {"role": "assistant", "content": want}, new


def test_two_processes_choosing_the_engine_at_the_same_instant_end_with_one_engine(compose_tiny, out_dir, monkeypatch,
                                                                                    varied_backbone):  # noqa: F811
    """Guards against: two launch ranks (distill.engine=auto, greedy: the engines are measured) that finish measuring
    together each reading "no engine recorded" in distill.json, then each recording and keeping its own fastest:
    one dataset written by two engines, and a manifest that names only one of them."""
    import threading

    cfg = compose_tiny(*[a for a in DISTILL if not a.startswith("distill.engine")], "distill.max_conversations=4",
                       "distill.temperature=0")
    distill.claim_output(out_dir, distill.run_identity(cfg))
    device = torch.device("cpu")
    probe = Generator(varied_backbone.model, varied_backbone.tokenizer, cfg, device)
    measured = threading.Barrier(2, timeout=60)
    fastest = {"rank0": "runtime", "rank1": "lookup"}   # each rank measures another engine fastest

    def measure(engines, prompts, max_new_tokens, log=print):
        measured.wait()   # both ranks are done measuring before either records its choice
        name = fastest[threading.current_thread().name]
        return engines[name](), {"chosen": name, "calibration": None}

    # Hold every write of distill.json until the other rank writes too (or 3 s pass: it may have nothing to write),
    # so both ranks have read the manifest before either record lands: the interleaving that lost the race.
    real_write, arrived, both = distill.write_json_atomic, [], threading.Event()

    def write_together(path, obj):
        arrived.append(threading.current_thread().name)
        if len(set(arrived)) == 2:
            both.set()
        both.wait(3)
        real_write(path, obj)

    monkeypatch.setattr(distill, "choose_engine", measure)
    monkeypatch.setattr(distill, "write_json_atomic", write_together)
    got, errors = {}, []

    def rank(name):
        try:
            got[name] = distill.pick_engine(cfg, out_dir, varied_backbone, device, probe).name
        except BaseException as e:  # noqa: BLE001  (reported by the assertion below)
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(n,), name=n) for n in fastest]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert got["rank0"] == got["rank1"], got
    manifest = json.loads((out_dir / distill.MANIFEST).read_text())
    assert manifest["engine"]["chosen"] == got["rank0"]
    # a later process (a resumed run, a late rank) takes the same engine without measuring
    monkeypatch.setattr(distill, "choose_engine", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured")))
    assert distill.pick_engine(cfg, out_dir, varied_backbone, device, probe).name == got["rank0"]


def test_an_engine_claim_is_created_once(tmp_path):
    """Guards against: a second claim replacing the first (the rank that claimed first already writes with it)."""
    path = tmp_path / distill.ENGINE_CLAIM.format(digest="0123abcd")
    first = distill.claim_engine(path, {"chosen": "runtime", "calibration": None})
    second = distill.claim_engine(path, {"chosen": "lookup", "calibration": None})
    assert first == second == {"chosen": "runtime", "calibration": None}
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]   # no temporary file left


def test_an_engine_claim_left_without_its_manifest_is_not_followed(compose_tiny, out_dir,
                                                                   varied_backbone):  # noqa: F811
    """Guards against a new run in a folder whose distill.json was deleted (its data/ empty, so the folder is taken)
    following the engine claim left there by a run of other settings: an explicit distill.engine=generate was
    silently replaced by the old run's measured engine."""
    old = compose_tiny(*[a for a in DISTILL if not a.startswith("distill.engine")], "distill.temperature=0")
    left = distill.engine_claim(out_dir, distill.run_identity(old))
    left.parent.mkdir(parents=True, exist_ok=True)
    left.write_text(json.dumps({"chosen": "lookup", "calibration": None}))
    cfg = compose_tiny(*[a for a in DISTILL if not a.startswith("distill.engine")], "distill.engine=generate")
    distill.claim_output(out_dir, distill.run_identity(cfg))
    device = torch.device("cpu")
    probe = Generator(varied_backbone.model, varied_backbone.tokenizer, cfg, device)
    assert distill.pick_engine(cfg, out_dir, varied_backbone, device, probe).name == "generate"
    claim = distill.engine_claim(out_dir, distill.run_identity(cfg))
    assert claim != left and json.loads(claim.read_text())["chosen"] == "generate"


def test_a_process_finding_no_manifest_never_removes_the_claim_another_just_made(compose_tiny, out_dir, monkeypatch,
                                                                                  varied_backbone):  # noqa: F811
    """Guards against: a fresh run's process that found no distill.json deleting the engine claim (left, it thought,
    by a deleted run) after another process of the same run had written the manifest and claimed its engine: the
    second process then measured and claimed its own, and the two wrote one dataset with two engines."""
    cfg = compose_tiny(*[a for a in DISTILL if not a.startswith("distill.engine")], "distill.max_conversations=4",
                       "distill.temperature=0")
    device = torch.device("cpu")
    probe = Generator(varied_backbone.model, varied_backbone.tokenizer, cfg, device)
    picks = iter(["lookup", "runtime"])   # the first process measures lookup fastest, the second runtime
    monkeypatch.setattr(distill, "choose_engine",
                        lambda engines, *a, **k: (lambda n: (engines[n](), {"chosen": n, "calibration": None}))(
                            next(picks)))
    real_claim, real_write, first, held = distill.claim, distill.write_json_atomic, {}, []

    def claim_while_the_other_process_runs(*a, **k):
        manifest = real_claim(*a, **k)
        if not first:   # between this process's look for a manifest and its return, the other one claims an engine
            first["engine"] = "..."
            distill.claim_output(out_dir, distill.run_identity(cfg))
            distill.write_json_atomic = lambda path, obj: held.append((path, obj))   # its distill.json write lags
            try:
                first["engine"] = distill.pick_engine(cfg, out_dir, varied_backbone, device, probe).name
            finally:
                distill.write_json_atomic = real_write
        return manifest

    monkeypatch.setattr(distill, "claim", claim_while_the_other_process_runs)
    distill.claim_output(out_dir, distill.run_identity(cfg))
    second = distill.pick_engine(cfg, out_dir, varied_backbone, device, probe).name
    for path, obj in held:
        real_write(path, obj)
    assert first["engine"] == second == "lookup"


def test_a_reply_is_kept_as_generated_by_a_tokenizer_that_cleans_up_spaces(compose_tiny, varied_backbone):  # noqa: F811
    """Guards against: a distilled reply decoded with transformers 4's clean_up_tokenization_spaces (Llama-3's
    tokenizer config sets it), "Hi . a 'b" written as "Hi. a'b": another token sequence than the backbone generated,
    which the heads then train on and the next turn replays as history."""
    tok = byte_fallback_tokenizer()
    plain = tok.decode

    def decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kw):
        text = plain(ids, skip_special_tokens=skip_special_tokens, **kw)
        return text if clean_up_tokenization_spaces is False else text.replace(" .", ".").replace(" '", "'")

    tok.decode = decode
    cfg = compose_tiny(*DISTILL, "distill.temperature=0")
    gen = Generator(varied_backbone.model, tok, cfg, torch.device("cpu"))
    reply = tok("Hi . a 'b", add_special_tokens=False)["input_ids"]
    gen.generate = lambda prompts, max_new_tokens=None: [(reply, True) for _ in prompts]
    source = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]
    (row,) = distill.distill_shard(gen, [(0, source)], cfg).records
    assert row["messages"][-1] == {"role": "assistant", "content": "Hi . a 'b"}
