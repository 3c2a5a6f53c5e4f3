"""Self-distillation data: regenerate every assistant turn of a chat dataset with the backbone.

Heads trained on someone else's replies (ShareGPT was written by another model) learn a
distribution the backbone does not follow. This task keeps the user turns of a conversation
dataset and replaces each assistant turn by the backbone's own reply, so the heads learn to
guess what the backbone will say::

    medusa-train distill_smollm2                                   # writes runs/distill_smollm2/
    medusa-train distill_smollm2 distill.temperature=0 distill.max_conversations=200
    deepspeed --num_gpus 8 --module medusa_train.cli distill_smollm2 trainer.device=cuda distill.batch_size=64
    medusa-train medusa1_smollm2_distilled                         # train heads on the result

Feature                                        config key
---------------------------------------------  -----------------------------------------------
source conversations (same readers as training)  data.source, data.split, data.system_prompt
sampling temperature (0 = greedy), nucleus       distill.temperature (default 0.3), distill.top_p
limits                                           distill.max_conversations, distill.max_new_tokens
                                                 (per turn), distill.max_turns, data.max_length
                                                 (a turn whose prompt already has that many tokens
                                                 ends the conversation: training would cut it off)
batched generation with a KV cache               distill.batch_size (prompts grouped by length)
generate / runtime / lookup                      distill.engine (auto: the fastest measured when greedy,
                                                 the runtime when sampling; distill_engines.py)
resume unit / output shard size                  distill.shard_size
device, seed, CPU threads, progress bar          trainer.device, trainer.seed, trainer.threads,
                                                 trainer.progress_bar

Multi-turn conversations are replayed turn by turn: the prompt of turn i holds the original
user turns and the *regenerated* replies 1..i-1, as in a real chat with the backbone.
Generation runs on batches (``distill_engines``: transformers' ``generate`` or the runtime's batched
decoding; greedy, whichever is measured faster on this machine); within a shard all conversations' turn-i
prompts are sorted by length before batching, so a batch wastes little on padding.
A conversation the chat template refuses (a system turn for Gemma's, roles that do not alternate) ends there,
its earlier turns kept, counted in ``distill.json``'s ``ended`` as "chat template refused it: <message>"; a run
whose template refuses every conversation is refused in one line before anything is written (``check_distillable``).
``data.max_length`` + ``distill.max_new_tokens`` must fit the backbone's positions (refused before loading).

Output (``output_dir``)::

    distill.json                 manifest: settings, backbone + weight fingerprint, source, counts, tokens/s
    data/shard-000000.jsonl      {"messages": [{role, content}...], "source_index": i, ...} per line; a reply cut
                                 at distill.max_new_tokens is marked "unfinished": true (training learns its
                                 words, not the end-of-turn marker the template puts after them)
    progress/shard-000000.json   per-shard counts, timing, distill.batch_size and the shard's bytes, written just
                                 before it (a shard without it, or of another size, is written again)
    engine-<digest>.json         the engine choice (distill.engine) of these settings, created once by the first
                                 process to choose

Train on it with ``data.source=<output_dir>/data`` (the manifest and progress files live
outside ``data/`` so the trainer's folder reader never mistakes them for conversations); a run reading the output
folder itself, an unfinished distillation, or one whose shards changed since it finished is refused (``unfinished``).

Resume and sharding: source conversation i belongs to shard i // shard_size, and process r of
a launcher's world W (RANK / WORLD_SIZE, as ``deepspeed`` or ``torchrun`` set them) does shards
k with k % W == r. A shard is written to a temporary name and renamed when complete, so a
SIGTERM, Ctrl-C or crash loses at most the shard in progress; the same command continues with
the shards that are missing (with any world size), never duplicating or losing a
conversation. Each shard's sampling is seeded by (seed, shard), so a resumed shard is the
shard the uninterrupted run would have written (at the same batch size). An output directory holding a different
run's data (other settings, backbone or source) is refused, naming what differs. The last
process to finish writes the final counts into ``distill.json``. ``distill.batch_size`` may change on
resume (a run out of memory continues with smaller batches); with sampling the replies depend on it,
so each shard records its own (``distill.json``'s ``batch_sizes``) and a resume that changes it says so
in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from inference.errors import UserError

from . import backbone as frozen   # frozen.load_backbone looked up when called (tests replace it)
from .config import validate
from .data.readers import ReadStats, data_fingerprint, iter_conversations
from .data.tokenize import UNFINISHED, TemplateRefused
from .distill_engines import ENGINES, CALIBRATION_TOKENS, Generator, choose_engine, make_engine
from .distributed import resolve_device, stop_on_signals
from .manifest import check_recorded, claim, claim_once, is_temp_name, read_manifest, read_once, write_json_atomic

FORMAT_VERSION = 2   # 2: replies cut at max_new_tokens marked unfinished (1 trained an end after them)
MANIFEST = "distill.json"
DATA_DIR = "data"
PROGRESS_DIR = "progress"
ENGINE_CLAIM = "engine-{digest}.json"   # the engine choice of one run identity, created once by the first to choose


# -- identity of a run: what must match for a directory to be continued ----------------------------
def run_identity(cfg) -> dict:
    """Settings that decide what the output holds; another value here means another dataset."""
    b, d, g = cfg.backbone, cfg.data, cfg.distill
    random_init = OmegaConf.to_container(b.random_init) if OmegaConf.is_config(b.random_init) else b.random_init
    return {
        "backbone": {"name_or_path": b.name_or_path, "gguf_file": b.gguf_file, "revision": b.revision,
                     "random_init": random_init, "dtype": b.dtype, **frozen.template_identity(b)},
        "data": {"source": d.source, "split": d.split, "system_prompt": d.system_prompt, "max_length": d.max_length},
        "distill": {"temperature": g.temperature, "top_p": g.top_p, "max_new_tokens": g.max_new_tokens,
                    "max_turns": g.max_turns, "max_conversations": g.max_conversations,
                    "shard_size": g.shard_size, "engine": g.engine},
        "trainer": {"seed": cfg.trainer.seed},
    }


def _source_manifest(source) -> Optional[dict]:
    """The manifest of the distillation whose ``data/`` folder ``source`` is (a symlink to it too); None when it is
    not one, or its manifest is not one this version reads (the readers then say what they make of the folder)."""
    folder = Path(os.path.expanduser(str(source))).resolve()
    if folder.name != DATA_DIR or not (folder.parent / MANIFEST).is_file():
        return None
    try:
        return read_manifest(folder.parent / MANIFEST, folder.parent)
    except UserError:
        return None


def distilled_by_another(source, identity: dict) -> Optional[str]:
    """A one-line note when ``source`` is a distillation's ``data/`` folder written by a backbone of other weights or
    architecture than ``identity`` (``backbone_identity`` of the run's backbone): its heads would learn that model's
    replies (a recipe's default data.source kept beside another backbone.name_or_path). None otherwise."""
    recorded = (_source_manifest(source) or {}).get("backbone_fingerprint") or {}
    differs = [k for k in ("config", "weights") if recorded.get(k) and recorded.get(k) != identity.get(k)]
    if not differs:
        return None
    return (f"note: data.source={source} holds replies self-distilled by {recorded.get('name')} (other "
            f"{' and '.join(differs)} than this run's backbone): the heads learn that model's replies, not its own")


def unfinished(source) -> Optional[str]:
    """Why ``source`` must not be read as data yet (None: it may): a distillation's output folder itself (its
    manifest and progress files would be read as conversations), or a distillation's ``data/`` folder whose manifest
    says it is not complete (a run killed, still running, or one of several processes not done) or whose shards are
    no longer the ones it finished with (one deleted or cut short): the reader would take what is there, silently,
    as if it were the dataset."""
    folder = Path(os.path.expanduser(str(source)))
    if (folder / MANIFEST).is_file() and (folder / DATA_DIR).is_dir():
        return (f"data.source={source} is a distillation's output folder (its {MANIFEST} and progress files would be "
                f"read as conversations): give its conversations, data.source={folder / DATA_DIR}")
    manifest = _source_manifest(source) or {}
    if manifest.get("task") != "distill":
        return None
    data = folder.resolve()
    if not manifest.get("complete", True):
        written = sum(1 for _ in data.glob("shard-*.jsonl"))
        return (f"data.source={source} is a distillation that has not finished ({written} shard(s) written, "
                f"{MANIFEST} not complete): run its distillation again to finish it (it continues), or train on a "
                f"copy of its {DATA_DIR}/ folder to use only what is there")
    sizes = manifest.get("shard_bytes") or [None] * len(manifest.get("shards") or [])
    for name, size in zip(manifest.get("shards") or [], sizes):
        path = data / name
        if not path.is_file() or (size is not None and path.stat().st_size != size):
            what = "is missing" if not path.is_file() else f"holds {path.stat().st_size} bytes, not the {size} written"
            return (f"data.source={source}: shard {name} of this finished distillation {what}: run its distillation "
                    "again to write it anew (it continues), or train on a copy of the folder to use what is there")
    return None


def claim_output(out: Path, identity: dict, fingerprint: Optional[dict] = None, create: bool = True,
                 recorded: Optional[dict] = None) -> dict:
    """Create the manifest, or check that ``out`` holds this very run's data; refuse otherwise. ``create=False``:
    only check, writing nothing (an ``out`` without a manifest is taken unless it holds other files). ``recorded``:
    the data source's content and the tokenizer (``manifest.check_recorded``): shards made from other ones are not
    continued."""
    data = out / DATA_DIR

    def ours(manifest: dict) -> Optional[str]:
        if manifest.get("task") == "distill" and manifest.get("format") == 1:
            return (f"{out} holds format-1 distillation data (from before replies cut at distill.max_new_tokens were "
                    "marked unfinished): it still trains as it is, but is not continued with format-2 shards; "
                    "distil into another output_dir")
        if manifest.get("task") != "distill" or manifest.get("format") != FORMAT_VERSION:
            return (f"{out} holds something other than distillation data of this version ({MANIFEST}); "
                    "use another output_dir")
        return None

    def foreign() -> Optional[str]:
        if data.is_dir() and any(data.iterdir()):
            return (f"{data} holds files but {out} has no {MANIFEST}: not a distillation run of this tool; "
                    "use another output_dir")
        # What a distillation writes itself, and the run's record (launch.RECORD_DIR), written before the claim;
        # ".<name>.tmp-<id>": a manifest or engine claim being (or killed while being) written. Anything else (a
        # finished training run's heads/, checkpoints/, ...) is another run's folder, which data would be added to.
        own = {DATA_DIR, PROGRESS_DIR, MANIFEST, "engine.json", ".hydra"}   # engine.json: the claim's earlier name
        other = sorted(e.name for e in out.iterdir() if e.name not in own and not is_temp_name(e.name)
                       and not re.fullmatch(ENGINE_CLAIM.format(digest="[0-9a-f]+"), e.name)) if out.is_dir() else []
        if other:
            return (f"{out} holds {', '.join(other[:3])}{', ...' if len(other) > 3 else ''} but no {MANIFEST}: "
                    "not a distillation run of this tool; use another output_dir")
        return None

    if not create and not (out / MANIFEST).is_file():
        wrong = foreign()
        if wrong:
            raise UserError(wrong)
        return {}
    manifest = claim(out, MANIFEST, identity, {"task": "distill", "format": FORMAT_VERSION,
                                               "backbone_fingerprint": fingerprint, "complete": False},
                     ours=ours, foreign=foreign,
                     mismatch=f"{out} already holds distillation data of another run ({{diff}}); "
                              "use another output_dir or delete it")
    old_fp = manifest.get("backbone_fingerprint")
    # the weights and architecture decide the replies; the name is how a setting spelled the same folder
    if fingerprint is not None and old_fp is not None and \
            any(old_fp.get(k) != fingerprint.get(k) for k in ("config", "weights")):
        raise UserError(f"{out} was generated by a backbone with other weights or architecture "
                        f"(fingerprint {old_fp} there, {fingerprint} here); use another output_dir")
    if fingerprint is not None and old_fp is None:
        manifest["backbone_fingerprint"] = fingerprint
        write_json_atomic(out / MANIFEST, manifest)

    def refusal(key: str, there, here) -> str:
        what = {"data_fingerprint": f"other content of data.source {identity['data']['source']} ({there} there, "
                                    f"{here} now: the data was rewritten)",
                "tokenizer_fingerprint": f"another tokenizer or chat template ({there} there, {here} now)"}[key]
        return f"{out} was distilled from {what}; its shards would mix with these: use another output_dir"

    return check_recorded(out / MANIFEST, manifest, recorded or {}, refusal)


# -- conversations and turns -------------------------------------------------------------------------------
@dataclass
class Replay:
    """One conversation being regenerated: source messages, what has been rebuilt so far."""

    index: int
    source: list[dict]
    cursor: int = 0  # next source message to consume
    messages: list[dict] = field(default_factory=list)  # rebuilt conversation (ends with an assistant turn)
    turns: int = 0
    tokens: int = 0
    truncated_turns: int = 0
    done: bool = False
    pending: list[dict] = field(default_factory=list)  # user/system turns before the reply being generated
    ended_by: str = ""  # why the replay stopped early (counted in the manifest)

    def next_prompt(self, max_turns: Optional[int]) -> Optional[list[dict]]:
        """Messages up to the next assistant turn (None when the conversation is finished)."""
        if self.done or (max_turns is not None and self.turns >= max_turns):
            self.done = True
            return None
        pending = []
        while True:
            while self.cursor < len(self.source) and self.source[self.cursor]["role"] != "assistant":
                pending.append(self.source[self.cursor])
                self.cursor += 1
            if self.cursor >= len(self.source):
                self.done = True
                return None
            self.cursor += 1  # the assistant turn we replace
            if any(m["role"] == "user" for m in self.messages + pending):
                break
            # A reply to no user turn (a greeting after the system prompt): nothing to regenerate it from, so it
            # is dropped, but the turns before it stay: the next reply must be generated under the system prompt
            # training will show it with (the reader re-inserts data.system_prompt where it is missing).
        self.pending = pending
        return self.messages + pending

    def accept(self, reply: str, n_tokens: int, hit_eos: bool) -> None:
        self.tokens += n_tokens
        if not hit_eos and reply.endswith("\ufffd"):   # cut inside a character: its first bytes decode to one
            reply = reply[:-1]                           # U+FFFD, not a word to train on
        if not reply.strip():  # an empty turn would merge the user turns around it; stop here
            self.done, self.ended_by = True, "empty reply"
            return
        turn = {"role": "assistant", "content": reply}
        if not hit_eos:   # cut at max_new_tokens: the backbone had not ended it, so training must not either
            turn[UNFINISHED] = True
        self.messages = self.messages + self.pending + [turn]
        self.turns += 1
        self.truncated_turns += int(not hit_eos)
        self.pending = []

    def record(self) -> dict:
        return {"messages": self.messages, "source_index": self.index, "regenerated_turns": self.turns,
                "generated_tokens": self.tokens}


def source_conversations(cfg, read_stats=None) -> Iterator[tuple[int, list[dict]]]:
    """(source index, messages) of the usable conversations, in source order, up to the limit."""
    d, limit = cfg.data, cfg.distill.max_conversations
    stats = read_stats if read_stats is not None else ReadStats()
    for i, messages in enumerate(iter_conversations(d.source, d.split, stats, d.system_prompt)):
        if limit is not None and i >= limit:
            return
        yield i, messages


def shards_of(conversations, shard_size: int) -> Iterator[tuple[int, list[tuple[int, list[dict]]]]]:
    """Group (index, messages) into (shard, members); shard k holds indices [k*S, (k+1)*S)."""
    shard, members = None, []
    for i, messages in conversations:
        k = i // shard_size
        if shard is not None and k != shard:
            yield shard, members
            members = []
        shard = k
        members.append((i, messages))
    if members:
        yield shard, members


@dataclass
class ShardResult:
    records: list[dict]
    stats: dict


def distill_shard(gen: Generator, members: list[tuple[int, list[dict]]], cfg, on_batch=None) -> ShardResult:
    """Regenerate one shard: round i generates turn i of every conversation still going."""
    g, max_prompt = cfg.distill, cfg.data.max_length
    replays = [Replay(i, messages) for i, messages in members]
    tokens, seconds = 0, 0.0
    stats = {"conversations": len(members), "written": 0, "turns": 0, "truncated_turns": 0,
             "ended": {}, "generated_tokens": 0, "generate_s": 0.0,
             "batch_size": g.batch_size}   # sampled replies depend on it (the draws per batch): recorded per shard
    while True:
        todo = []
        for rep in replays:
            prompt = rep.next_prompt(g.max_turns)
            if prompt is None:
                continue
            try:
                ids = gen.encode(prompt)
            except TemplateRefused as e:  # this conversation only: it ends here (its earlier turns are kept)
                rep.done, rep.ended_by = True, e.reason
                continue
            if len(ids) >= max_prompt:  # training would truncate before this reply: stop the replay here
                rep.done, rep.ended_by = True, "prompt reached data.max_length"
                continue
            todo.append((rep, ids))
        if not todo:
            break
        todo.sort(key=lambda x: len(x[1]), reverse=True)  # similar lengths together; the longest first
        for b in range(0, len(todo), g.batch_size):
            batch = todo[b:b + g.batch_size]
            t0 = time.perf_counter()
            outs = gen.generate([ids for _, ids in batch])
            dt = time.perf_counter() - t0
            n = 0
            for (rep, _), (new, hit_eos) in zip(batch, outs):
                k = len(new) + int(hit_eos)
                n += k
                rep.accept(gen.decode(new), k, hit_eos)
            tokens, seconds = tokens + n, seconds + dt
            if on_batch is not None:
                on_batch(n, dt)
    records = []
    for rep in replays:
        if rep.ended_by:
            stats["ended"][rep.ended_by] = stats["ended"].get(rep.ended_by, 0) + 1
        stats["turns"] += rep.turns
        stats["truncated_turns"] += rep.truncated_turns
        if rep.turns:
            records.append(rep.record())
    stats.update(written=len(records), generated_tokens=tokens, generate_s=round(seconds, 3))
    return ShardResult(records, stats)


# -- files ----------------------------------------------------------------------------------------------------
def shard_path(out: Path, k: int) -> Path:
    return out / DATA_DIR / f"shard-{k:06d}.jsonl"


def progress_path(out: Path, k: int) -> Path:
    return out / PROGRESS_DIR / f"shard-{k:06d}.json"


def write_shard(out: Path, k: int, result: ShardResult) -> Path:
    """Progress first (with the shard's size), then the shard by rename: a shard on disk is always whole and
    accounted for, and one changed since is found (``shard_done``)."""
    final = shard_path(out, k)
    final.parent.mkdir(parents=True, exist_ok=True)
    progress_path(out, k).parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in result.records).encode("utf-8")
    write_json_atomic(progress_path(out, k), {**result.stats, "bytes": len(text)})
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")  # not *.jsonl: readers never pick it up
    try:
        with open(tmp, "wb") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
    return final


def shard_done(out: Path, k: int) -> bool:
    """Shard ``k`` is on disk as it was written: with its progress file (its counts: without it the manifest summed
    zeros for it) and, where that recorded it, of the size written (a shard cut short kept fewer conversations)."""
    shard, progress = shard_path(out, k), progress_path(out, k)
    if not (shard.is_file() and progress.is_file()):
        return False
    try:
        size = json.loads(progress.read_text()).get("bytes")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return size is None or shard.stat().st_size == size


def _remove_leftovers(out: Path, k: int) -> None:
    for tmp in (out / DATA_DIR).glob(f"shard-{k:06d}.jsonl.tmp-*"):
        tmp.unlink(missing_ok=True)


def finalize(out: Path, n_shards: int, n_source: int, extra: dict) -> Optional[dict]:
    """Sum the per-shard counts into the manifest once every shard exists (any process may do it)."""
    if any(not shard_done(out, k) for k in range(n_shards)):
        return None
    sizes = []
    totals = {"source_conversations": n_source, "conversations": 0, "turns": 0, "truncated_turns": 0,
              "generated_tokens": 0, "generate_s": 0.0, "ended": {}}
    for k in range(n_shards):
        p = progress_path(out, k)
        st = json.loads(p.read_text())   # there: shard_done
        sizes.append(st.get("bytes"))
        totals["conversations"] += st.get("written", 0)
        for key in ("turns", "truncated_turns", "generated_tokens", "generate_s"):
            totals[key] += st.get(key, 0)
        for why, n in st.get("ended", {}).items():
            totals["ended"][why] = totals["ended"].get(why, 0) + n
    totals["generate_s"] = round(totals["generate_s"], 2)
    extra = {**extra, "batch_sizes": batch_size_segments(out, n_shards)}
    totals["tokens_per_s_per_process"] = round(totals["generated_tokens"] / max(totals["generate_s"], 1e-9), 1)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest.update(complete=True, shards=[shard_path(out, k).name for k in range(n_shards)], counts=totals, **extra)
    if all(size is not None for size in sizes):   # what a training run checks the shards against (``unfinished``)
        manifest["shard_bytes"] = sizes
    write_json_atomic(out / MANIFEST, manifest)
    for tmp in (out / DATA_DIR).glob("*.tmp-*"):
        tmp.unlink(missing_ok=True)  # leftovers of killed runs
    return manifest


def _reopen(out: Path) -> None:
    manifest = json.loads((out / MANIFEST).read_text())
    if manifest.get("complete"):
        manifest.update(complete=False)
        manifest.pop("shard_bytes", None)
        write_json_atomic(out / MANIFEST, manifest)


def shard_batch_size(out: Path, k: int) -> Optional[int]:
    """The distill.batch_size shard ``k`` was generated at (its progress file), None when not recorded."""
    p = progress_path(out, k)
    try:
        return json.loads(p.read_text()).get("batch_size")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def batch_size_segments(out: Path, n_shards: int) -> list[dict]:
    """``[{"from_shard": k, "batch_size": n}, ...]``: shards k up to the next entry's were generated at batch size n
    (None: not recorded, shards of an older version). With sampling, the replies depend on it: a resumed run at
    another batch size draws its shards otherwise than the first run would have."""
    segments: list[dict] = []
    for k in range(n_shards):
        size = shard_batch_size(out, k)
        if not segments or segments[-1]["batch_size"] != size:
            segments.append({"from_shard": k, "batch_size": size})
    return segments


def note_batch_size_change(cfg, out: Path) -> Optional[str]:
    """The line saying that a resumed sampling run draws at another batch size than its shards on disk were drawn
    at (None when it does not: the same batch size, nothing done yet, or greedy decoding, whose replies do not depend
    on the batch: ``test_greedy_replies_are_the_backbones_own_output_turn_by_turn``)."""
    g = cfg.distill
    if g.temperature <= 0 or not (out / DATA_DIR).is_dir():
        return None
    done = sorted(int(p.name[len("shard-"):-len(".jsonl")]) for p in (out / DATA_DIR).glob("shard-*.jsonl"))
    other = sorted({size for k in done if (size := shard_batch_size(out, k)) not in (None, g.batch_size)})
    if not other:
        return None
    return (f"[distill] shards on disk were sampled at distill.batch_size={'/'.join(map(str, other))}; replies from "
            f"here on are drawn at batch size {g.batch_size} ({MANIFEST} records the batch size of every shard)")


# -- the task -------------------------------------------------------------------------------------------------
def _launcher_rank() -> tuple[int, int, int]:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return rank, world, int(os.environ.get("LOCAL_RANK", 0))


def run(cfg, record: Callable[[], None] | None = None) -> dict:
    """The distillation task; returns the manifest when this process finished the last shard. ``record``
    writes the run's record (``launch.write_run_record``) once the backbone's chat template has accepted a
    conversation (``check_distillable``): a refused run writes nothing. A Ctrl-C or SIGTERM stops it in one line
    (``distributed.stop_on_signals``), losing at most the shard in progress."""
    validate(cfg)
    out = Path(cfg.output_dir)
    rank = _launcher_rank()[0]
    progress = {"phase": "loading the backbone", "written": 0}

    def interrupted() -> str:
        if progress["phase"]:
            return (f"interrupted during setup ({progress['phase']}): no shard written by this run; run the same "
                    "command again to continue")
        return (f"interrupted: {progress['written']} shard(s) written by this run under {out / DATA_DIR} "
                f"(rank {rank}); run the same command again to continue")

    with stop_on_signals(interrupted):
        return _distill(cfg, record, out, progress)


def _distill(cfg, record: Callable[[], None] | None, out: Path, progress: dict) -> dict:
    t, g = cfg.trainer, cfg.distill
    rank, world, local = _launcher_rank()
    identity = run_identity(cfg)
    claim_output(out, identity, create=False)  # refuse a foreign directory before loading anything
    backbone, device = _load_backbone(cfg, local)
    progress["phase"] = "checking the conversations"
    probe = Generator(backbone.model, backbone.tokenizer, cfg, device)
    check_distillable(cfg, probe)  # before the first write
    if record is not None:
        record()
    recorded = {"data_fingerprint": data_fingerprint(str(cfg.data.source), cfg.data.split),
                "tokenizer_fingerprint": frozen.tokenizer_fingerprint(backbone.tokenizer)}
    # its weights too: data is only valid for them (and for this data's content and tokenizer)
    claim_output(out, identity, frozen.backbone_identity(backbone), recorded=recorded)
    progress["phase"] = "choosing the engine"
    gen = pick_engine(cfg, out, backbone, device, probe)
    progress["phase"] = ""
    main = rank == 0
    note = note_batch_size_change(cfg, out) if main else None   # said before the first shard drawn here, if any

    bar = None
    if t.progress_bar and main:
        bar = tqdm(total=g.max_conversations, desc=f"distill (rank 0 of {world})", unit="conv", dynamic_ncols=True)
    rate = {"tokens": 0, "s": 0.0}

    def on_batch(n: int, dt: float) -> None:
        rate["tokens"] += n
        rate["s"] += dt
        if bar is not None:
            bar.set_postfix_str(f"{rate['tokens'] / max(rate['s'], 1e-9):.1f} tok/s")

    read_stats = ReadStats()
    n_source, n_shards, done_here, skipped = 0, 0, 0, 0
    started = time.perf_counter()
    try:
        for k, members in shards_of(source_conversations(cfg, read_stats), g.shard_size):
            n_source = members[-1][0] + 1
            n_shards = k + 1
            if k % world != rank:
                continue
            if shard_done(out, k):
                skipped += 1
                if bar is not None:
                    bar.update(len(members))
                continue
            _reopen(out)   # a finished distillation missing this shard: not complete until it is written again
            _remove_leftovers(out, k)
            # The shard's samples do not depend on what ran before; modulo 2**64, what torch takes.
            torch.manual_seed((t.seed * 1_000_003 + k) % 2**64)
            if note:
                print(note, flush=True)
                note = None
            result = distill_shard(gen, members, cfg, on_batch)
            write_shard(out, k, result)
            done_here += 1
            progress["written"] = done_here
            if bar is not None:
                bar.update(len(members))
    finally:
        if bar is not None:
            bar.close()
    if n_source == 0:
        raise UserError(f"data source {cfg.data.source!r} gave no conversations to distill ({read_stats.summary()})")
    wall = time.perf_counter() - started
    this_run = {"shards_written": done_here, "shards_found_done": skipped, "world_size": world,
                "batch_size": g.batch_size, "engine": gen.name, "device": str(device),
                "generated_tokens": rate["tokens"],
                "tokens_per_s": round(rate["tokens"] / max(rate["s"], 1e-9), 1), "wall_s": round(wall, 1)}
    print(f"[distill] rank {rank}: {done_here} shard(s) written ({skipped} already done), "
          f"{rate['tokens']} tokens at {this_run['tokens_per_s']} tok/s", flush=True)
    manifest = finalize(out, n_shards, n_source, {"last_run": this_run, "source_read": read_stats.summary(),
                                                  "backbone": backbone.name,
                                                  # the claimed choice, whatever another rank's write left there
                                                  "engine": _recorded_engine(out, engine_claim(out, identity))})
    if manifest is not None:
        say_complete(manifest["counts"], out)
    return manifest or {}


def say_complete(c: dict, out: Path) -> None:
    """The finished run's counts in one line; a run that kept no reply (each replay ended before its first: a
    backbone ending every turn at once) refused in one, as there is nothing a trainer can learn from."""
    if not c["conversations"]:
        ended = ", ".join(f"{why}: {n}" for why, n in sorted(c["ended"].items())) or "none recorded"
        raise UserError(f"distillation complete, but none of the {c['source_conversations']} conversations kept a "
                        f"reply (ended: {ended}); nothing to train on in {out / DATA_DIR}")
    print(f"[distill] complete: {c['conversations']} of {c['source_conversations']} conversations, "
          f"{c['turns']} turns, {c['generated_tokens']} tokens ({c['tokens_per_s_per_process']} tok/s per process) "
          f"in {out / DATA_DIR}; train on it with data.source={out / DATA_DIR}", flush=True)


def _load_backbone(cfg, local_rank: int):
    """(backbone, device): the run's backbone on this process's device (its launcher's GPU)."""
    t = cfg.trainer
    if t.threads:
        torch.set_num_threads(t.threads)
    device = resolve_device(t.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
    backbone = frozen.load_backbone(cfg.backbone, device, seed=t.seed)
    return backbone, device


def check_distillable(cfg, gen: Generator) -> None:
    """Refuse, before anything is written, a run with no conversation to distill: every one refused by the
    backbone's chat template (a system turn for Gemma's; each would end before its first reply, leaving empty
    shards to train on), or with a first prompt that already reaches ``data.max_length``. Reads up to the first
    conversation that has a reply to regenerate (normally the first: one rendered prompt); a run with some
    conversations refused goes on, each counted in ``distill.json``'s ``ended``."""
    stats = ReadStats()
    n, refused, too_long, first = 0, 0, 0, None
    for index, messages in source_conversations(cfg, stats):
        n += 1
        prompt = Replay(index, messages).next_prompt(cfg.distill.max_turns)
        if prompt is None:  # no user turn before any reply: the run writes nothing for it either
            continue
        try:
            ids = gen.encode(prompt)
        except TemplateRefused as e:
            refused, first = refused + 1, first or e
            continue
        if len(ids) < cfg.data.max_length:
            return
        too_long += 1
    source = cfg.data.source
    if n == 0:
        raise UserError(f"data source {source!r} gave no conversations to distill ({stats.summary()})")
    if refused == n:
        raise UserError(f"the backbone's chat template refused all {n} conversations of data source {source!r} to "
                        f"distill (the first: {first.line}); nothing was written: use data or a backbone whose "
                        "template takes them")
    parts, none = [], n - refused - too_long
    if refused:
        parts.append(f"{refused} refused by the chat template (the first: {first.line})")
    if too_long:
        parts.append(f"{too_long} with a first prompt of data.max_length={cfg.data.max_length} tokens or more")
    if none:
        parts.append(f"{none} with no reply to regenerate")
    raise UserError(f"data source {source!r} gave no conversations to distill: of {n}, {', '.join(parts)}; "
                    "nothing was written")


def pick_engine(cfg, out: Path, backbone, device, probe: Generator) -> Generator:
    """The engine of this output directory: the one recorded (a resumed run keeps it), else ``distill.engine``,
    else (``auto``) the fastest measured on the run's first prompts (``probe``, the plain ``generate`` engine, encodes
    its prompts). With several processes exactly one choice wins: the first to create the claim (``engine_claim``)
    (``claim_engine``: created once, atomically, on one machine or a shared filesystem); every process then writes
    with the engine that file names, and ``distill.json`` records it."""
    g = cfg.distill
    make = lambda name: make_engine(name, backbone.model, backbone.tokenizer, cfg, device)  # noqa: E731
    path = engine_claim(out, run_identity(cfg))
    recorded = _recorded_engine(out, path)
    if recorded.get("chosen"):
        gen, record = None, recorded
    elif g.engine != "auto":
        gen, record = make(g.engine), {"chosen": g.engine, "calibration": None}
    elif g.temperature > 0:
        gen, record = sampling_engine(make, probe)
    else:
        prompts = calibration_prompts(cfg, probe)
        if not prompts:
            gen, record = probe, {"chosen": "generate", "calibration": None}
        else:
            gen, record = choose_engine({name: (lambda n=name: make(n)) for name in ENGINES}, prompts,
                                        min(CALIBRATION_TOKENS, g.max_new_tokens))
        # a choice recorded while this process measured (a run from before engine claims) is the one to claim
        record = _recorded_engine(out, path) or record
    record = claim_engine(path, record)   # the winner's record: ours, or that of a process that claimed first
    if gen is None or gen.name != record["chosen"]:
        gen = make(record["chosen"])
    manifest = read_manifest(out / MANIFEST, out) or {}
    if manifest.get("engine") != record:
        manifest["engine"] = record
        write_json_atomic(out / MANIFEST, manifest)
    return gen


def sampling_engine(make: Callable[[str], Generator], probe: Generator) -> tuple[Generator, dict]:
    """``distill.engine=auto`` when sampling: the runtime's batched loop without timing anything. The engines draw
    their samples differently, so a choice by speed (within 5% of each other on a CPU) made two fresh runs of one
    recipe write different data; this one depends on nothing but the backbone. Greedy replies are the same from
    every engine, so there the fastest is measured and kept."""
    why = "sampling: auto does not time the engines, so the same command writes the same data"
    try:
        gen, chosen = make("runtime"), "runtime"
    except UserError:   # a backbone the runtime cannot decode: transformers' generate, the only engine left
        gen, chosen, why = probe, "generate", f"{why}; the runtime cannot decode this backbone"
    print(f"[distill] engine: {chosen} ({why}; distill.engine=generate|runtime|lookup chooses one)")
    return gen, {"chosen": chosen, "calibration": None, "why": why}


def engine_claim(out: Path, identity: dict) -> Path:
    """Where the engine choice of the run ``identity`` is claimed in ``out``. Named by the identity, so a claim left
    by a run whose manifest was deleted (other settings) is never read, and nothing is ever deleted: removing such a
    claim when a run found no manifest also removed, in a process that found none a moment before another wrote it,
    the claim that other process had just made, and the two wrote one dataset with two engines."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return out / ENGINE_CLAIM.format(digest=digest)


def _recorded_engine(out: Path, path: Path) -> dict:
    """The engine choice of ``out``: its claim (``path``), else ``distill.json`` (runs from before claims);
    {} when none is recorded yet."""
    claimed = read_once(path)
    if claimed:
        return claimed
    return (read_manifest(out / MANIFEST, out) or {}).get("engine") or {}


def claim_engine(path: Path, record: dict) -> dict:
    """Make ``record`` the engine choice of ``out`` unless one is already claimed; return the claimed one
    (``claim_once``: of processes claiming at the same instant exactly one wins; a read-then-write of ``distill.json``
    let two processes both see no choice and each keep its own engine: one dataset sampled by two engines)."""
    claimed = claim_once(path, record, valid=lambda r: bool(r.get("chosen")))
    if claimed is None:
        raise UserError(f"{path} holds no engine choice; delete it to choose again")
    return claimed


def calibration_prompts(cfg, gen: Generator) -> list[list[int]]:
    """The first replies' prompts of the run's first conversations (one batch), as the run will encode them."""
    prompts = []
    for index, messages in source_conversations(cfg):
        prompt = Replay(index, messages).next_prompt(cfg.distill.max_turns)
        if prompt is not None:
            try:
                ids = gen.encode(prompt)
            except TemplateRefused:  # the run drops this conversation (counted there): not a prompt to measure
                continue
            if len(ids) < cfg.data.max_length:
                prompts.append(ids)
        if len(prompts) >= cfg.distill.batch_size or index >= 4 * cfg.distill.batch_size:
            break
    return prompts

