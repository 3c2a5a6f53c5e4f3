"""Offline feature cache: run the frozen backbone once, train the heads many times from disk.

In Medusa-1 the backbone never changes, so its last hidden states are the same every epoch
and for every head configuration. This module stores them once, with the batch they came
from, and hands the trainer batches that already carry them (the way EAGLE and SpecForge
train offline)::

    medusa-train medusa1_smollm2 features.mode=train              # build the cache if missing, then train from it
    medusa-train medusa1_smollm2 features.mode=build              # only build (e.g. on the GPU box), then exit
    medusa-train medusa1_smollm2 features.mode=train heads.num_layers=2 output_dir=runs/b \\
        features.cache_dir=runs/medusa1_smollm2/features          # reuse one cache for another head config

Config (``features.*``, defaults in recipes/base/run.yaml):

- ``mode``: ``off`` (default; the backbone runs on every micro-batch), ``build`` (build or
  complete the cache, then exit), ``train`` (train from the cache; whatever is missing is built
  first, so one command does both and a second run skips straight to training).
- ``cache_dir``: default ``<output_dir>/features``; point several runs at one cache.
- ``dtype``: ``bf16`` (default, half the disk) or ``fp32`` (bit-identical to the online path).
- ``shard_batches``: micro-batches per shard, the unit of resume.

What is cached: the first N micro-batches of the training stream exactly as the online
trainer would see them on one process (same seed, shuffle, packing), N = min(one epoch,
``trainer.max_steps`` x accumulation x world size), each with ``input_ids``, ``labels``,
``doc_ids``, ``position_ids``, ``hidden`` and ``greedy`` (int32: the backbone's argmax where
``heads.targets=backbone`` needs it, IGNORE elsewhere), both from ``backbone_inputs.FrozenFeatures``, the
very code the online batch source runs (greedy ids come from the backbone-dtype hidden states, not
the stored rounding), plus the held-out evaluation batches. Greedy ids are always stored, whatever
``heads.targets`` is, so one cache serves both settings (``heads.targets`` is not part of its
identity). Training reads them in that order in epoch 0, so with an fp32 cache the losses
equal the online run's; later epochs replay the same batches in a new seeded order (the
online stream would re-shuffle and re-pack the conversations instead).
With W processes, process r takes the batches at positions r, r+W, ... so one cache serves
any world size (the online path splits the conversation stream instead, so W > 1 runs differ
from online ones in which batch each rank sees, not in what is learned). Raising
``trainer.max_steps`` later extends the cache; a cache holding a whole epoch is simply cycled.

The backbone is still loaded (its lm_head initialises the heads; tokenizer and config are
needed) but never run on a cached batch. Building needs no trainer and no DeepSpeed engine: it
takes the frozen backbone, a way to open the training stream and a ``CachePlan`` (what to store,
shard size, dtype); the trainer reads the result through ``sources.CachedSource``.

Layout::

    features.json                 manifest: backbone fingerprint (config + weights), data settings and content, shards
    eval.safetensors              held-out batches ({j}.hidden, {j}.greedy, {j}.input_ids, ...)
    train-000000.safetensors      micro-batches 0..S-1 of the stream (metadata: first, count)

Safety: before writing, the disk needed (positions x hidden x bytes, plus the ids) is
printed and compared with ``shutil.disk_usage``; a cache that will not fit is refused. Each
shard is written under a temporary name and renamed when complete, so a full disk, a kill or
a crash mid-write never leaves a shard that looks complete (the error says how many are
kept; the same command continues; the temporary files of builds killed mid-write are removed by the next
build, ``FeatureCache.remove_dead_writers``). A cache built for another backbone (weights or
architecture), other data settings, seed or micro-batch size is refused, naming what differs; so is one
built from other content at the same local ``data.source`` (a file overwritten, a folder re-distilled:
``data_fingerprint``, sizes and a hash of each file's ends, no mtimes; caches that predate it get it recorded).

Aux layers: heads whose family declares them as inputs (``inference.heads.inputs``; EAGLE-3 reads three
backbone layers) need them cached too. A cache records the layers it stores (``aux_layers`` in its
manifest, chosen by the run that creates it) and keeps storing them in every shard it adds, so one cache
built for such a run serves every family (the others read ``hidden`` only); a cache built without them is
refused for such heads in one line rather than half-extended. They add 3 x hidden x bytes per position (shown in
the disk estimate).

Greedy ids everywhere (``heads.train_on=all``): by default the backbone's lm_head runs only where a
reply's label needs it; a train_on=all run that finds a cache with nothing stored yet (new, or a manifest
only) records ``greedy_everywhere`` in it, and the cache then computes them at every in-document position
in every shard it adds, whoever extends it (a superset: it serves the default too). Such a cache also keeps the
conversations with no reply token within ``max_length`` (``keeps_unlabelled``: their other positions train; a
default run reading it gets them too, with no label). A cache holding reply-only ids is refused for train_on=all
in one line.

Format 2 (the only one read): every shard stores ``greedy``. A format-1 cache (built before greedy
ids were stored) is refused in one line asking for a rebuild. The claim/compare/atomic-write of the
manifest is ``manifest.py``'s, shared with distillation.
"""

from __future__ import annotations

import fcntl
import math
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from safetensors import SafetensorError, safe_open
from inference.safetensors_file import save_file   # metadata in sorted order: runs write the same bytes
from tqdm.auto import tqdm

from inference.backbone import parse_dtype
from inference.cli_support import enum_value
from inference.errors import UserError
from inference.heads.native import pid_alive
from inference.runtime.memory import free_memory_bytes

from .backbone import RANDOM_BACKBONE_DIR, backbone_identity, load_backbone, template_identity, tokenizer_fingerprint
from .backbone_inputs import FrozenFeatures
from .checkpoint import keeps_trained_record
from .config import check_folder_writable, derived_batch, local_world_size, validate
from .data.readers import ReadStats, data_fingerprint
from .data.stream import ConversationStream, RankData, StreamStats, check_training_data, first_epoch
from .distributed import barrier, start_process, stop_on_signals
from .families import backbone_layers
from .manifest import check_recorded, claim, is_temp_name, read_manifest, write_json_atomic

FORMAT_VERSION = 2  # 2: shards also hold the backbone's greedy ids ({j}.greedy); 1 is refused
MANIFEST = "features.json"
MANIFEST_LOCK = ".features.lock"   # held while a build records itself (holding_manifest)
EVAL_FILE = "eval.safetensors"
KEYS = ("input_ids", "labels", "position_ids", "doc_ids")
_STARTED = time.time()  # leftovers older than this process cannot be from a writer of this run
_OTHER_HOSTS_MARGIN_S = 900


def enabled(cfg) -> bool:
    f = getattr(cfg, "features", None)
    return f is not None and enum_value(f.mode) != "off"


def cache_dir(cfg) -> Path:
    return Path(cfg.features.cache_dir) if cfg.features.cache_dir else Path(cfg.output_dir) / "features"


def cache_identity(cfg, backbone) -> dict:
    d, t = cfg.data, cfg.trainer
    return {
        "backbone": backbone_identity(backbone),
        "backbone_dtype": str(backbone.model.dtype),
        "data": {"source": d.source, "split": d.split, "max_length": d.max_length, "packing": d.packing,
                 "bucket_buffer": d.bucket_buffer, "shuffle_buffer": d.shuffle_buffer,
                 "max_conversations": d.max_conversations, "eval_conversations": d.eval_conversations,
                 "system_prompt": d.system_prompt, **template_identity(cfg.backbone)},
        "seed": t.seed,
        "micro_batch_size": t.micro_batch_size,
        "dtype": enum_value(cfg.features.dtype),
    }


# -- the cache on disk ---------------------------------------------------------------------------------------
RUN_SETUP = (".hydra", RANDOM_BACKBONE_DIR)  # what a run writes into output_dir before it claims a cache there


def _cache_own(name: str) -> bool:
    """Whether an entry of a cache folder is one the cache writes itself: its manifest, eval file and shards,
    and the temporary names they are written under (``.<name>.tmp-<pid>``)."""
    return (name in (MANIFEST, EVAL_FILE, MANIFEST_LOCK) or re.fullmatch(r"train-\d{6}\.safetensors", name) is not None
            or is_temp_name(name))


def foreign_cache(root: Path, run_dir: Optional[Path] = None) -> Optional[str]:
    """Why ``root``, which has no manifest, must not become a feature cache (None: it may): a file (or a path
    under one), shards without their manifest, or a folder holding anything a cache does not write itself (a
    finished training run, a data folder: a cache would be written into it). Entries a run writes before the
    claim (``RUN_SETUP``) pass where ``root`` is that run's own ``run_dir``. Reads names only, writes nothing."""
    root = Path(root)
    probe = root
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "is a file, not a folder" if probe == root else f"cannot be created: {probe} is a file"
        return f"features.cache_dir={root} {where}; use another features.cache_dir"
    if not root.is_dir():
        return None
    names = [e.name for e in root.iterdir()]
    if any(n.endswith(".safetensors") for n in names):
        return (f"{root} holds .safetensors files but no {MANIFEST}; not a features cache of this tool: "
                "use another features.cache_dir")
    same_run = run_dir is not None and Path(run_dir).resolve() == root.resolve()
    if any(not _cache_own(n) and not (same_run and n in RUN_SETUP) for n in names):
        return f"{root} holds files but no {MANIFEST}: not a feature cache; use another features.cache_dir"
    return None


def check_cache_dir(cfg) -> None:
    """Preflight of a run that uses the cache (``features.mode`` build or train): refuse a ``cache_dir`` that
    cannot become one (``foreign_cache``) before the backbone loads, as the claim would after it. A folder with a
    manifest is left to the claim: whether it was built for this backbone needs the backbone's weights. A
    ``cache_dir`` beside ``features.mode=off`` gets a note: the run reads no cache (a recipe's shared cache turned off
    on the command line, or a cache named without the mode that reads it)."""
    if enum_value(cfg.task) != "train":
        return
    if not enabled(cfg):
        if cfg.features.cache_dir:
            print(f"note: features.cache_dir={cfg.features.cache_dir} is not read with features.mode=off: the backbone "
                  "runs on every micro-batch (features.mode=train reads and builds the cache)", file=sys.stderr)
        return
    root = cache_dir(cfg)
    if (root / MANIFEST).is_file():
        return
    if cfg.features.cache_dir:   # a cache still to build (a complete one is only read: a read-only share serves)
        check_folder_writable("features.cache_dir", cfg.features.cache_dir)
    wrong = foreign_cache(root, Path(cfg.output_dir))
    if wrong:
        raise UserError(wrong)


class FeatureCache:
    def __init__(self, root: Path, run_dir: Optional[Path] = None):
        self.root = Path(root)
        self.run_dir = run_dir  # the run's output_dir: its setup's own entries may share a cache_dir naming it
        self._open: tuple[Optional[str], object, set] = (None, None, set())
        self.read_aux = False  # also hand out each batch's ``aux`` (heads that read aux layers)

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST

    def manifest(self) -> dict:
        return read_manifest(self.manifest_path, self.root)

    def claim(self, identity: dict, shard_batches: int, aux_layers=(), greedy_everywhere: bool = False,
              recorded: Optional[dict] = None) -> dict:
        """Create the manifest, or check the existing cache was built for this backbone and data (and what
        ``recorded`` gives: the data's content, the tokenizer, the compute dtype; ``_check_recorded``)."""
        root = self.root

        def ours(manifest: dict) -> Optional[str]:
            if manifest.get("format") == 1:
                return (f"features cache {root} is format 1 (built before the backbone's greedy tokens were "
                        f"stored), no longer read; rebuild it: delete {root} or use another features.cache_dir")
            if manifest.get("format") != FORMAT_VERSION:
                return f"{root} holds a features cache of another format; delete it to rebuild"
            return None

        def foreign() -> Optional[str]:
            return foreign_cache(root, self.run_dir)

        fresh = {"format": FORMAT_VERSION, "shard_batches": shard_batches, "batches": 0, "epoch_complete": False,
                 "shards": [], "eval": False, "aux_layers": list(aux_layers), "greedy_everywhere": greedy_everywhere,
                 "keeps_unlabelled": greedy_everywhere}
        manifest = claim(root, MANIFEST, identity, fresh, ours=ours, foreign=foreign,
                         mismatch=f"features cache {root} was built for another backbone or data ({{diff}}); "
                                  "use another features.cache_dir or delete it")
        manifest = self._check_recorded(manifest, identity, recorded or {})
        stored = list(manifest.get("aux_layers") or [])
        if aux_layers and stored != list(aux_layers):
            manifest = self._decide(manifest, {"aux_layers": list(aux_layers)}, (
                f"features cache {root} stores aux layers {stored}, these heads read {list(aux_layers)}; "
                f"use another features.cache_dir (or heads.aux_layers={stored})" if stored else
                f"features cache {root} was built without the aux layers these heads read; use another "
                "features.cache_dir or delete it"))
        if greedy_everywhere and not manifest.get("greedy_everywhere"):
            manifest = self._decide(manifest, {"greedy_everywhere": True, "keeps_unlabelled": True}, (
                f"features cache {root} stores the backbone's greedy tokens on the replies only; "
                "heads.train_on=all needs them at every position: use another features.cache_dir"))
        return manifest

    def _check_recorded(self, manifest: dict, identity: dict, recorded: dict) -> dict:
        """Refuse a cache of other data content, tokenizer or compute dtype than ``recorded`` says this run's are
        (kept beside the identity, not in it: caches built before one was recorded are taken and get it now)."""
        root = self.root

        def refusal(key: str, there, here) -> str:
            source = identity["data"]["source"] if key == "data_fingerprint" else None
            what = {"data_fingerprint": f"other content of data.source {source} ({there} there, {here} now: the "
                                        "data was rewritten)",
                    "tokenizer_fingerprint": f"another tokenizer or chat template ({there} there, {here} now): its "
                                             "input ids are not this tokenizer's",
                    "rounded_to": f"hidden states rounded to {there} before they were stored (trainer.precision), "
                                  f"this run's to {here}"}[key]
            return f"features cache {root} was built from {what}; use another features.cache_dir or delete it"

        return check_recorded(self.manifest_path, manifest, recorded, refusal)

    def _decide(self, manifest: dict, values: dict, refusal: str) -> dict:
        """Set what the cache stores (``values``) while nothing is stored yet, else refuse with ``refusal``. Shards
        and the eval file reach the disk before the manifest counts them (it is updated once the build
        completes), so a killed build leaves files the manifest does not show: look at the disk too."""
        written = any(self.root.glob("train-*.safetensors")) or (self.root / EVAL_FILE).is_file()
        if manifest["batches"] or manifest["eval"] or written:
            raise UserError(refusal)
        manifest = {**manifest, **values}
        write_json_atomic(self.manifest_path, manifest)
        return manifest

    def withdraw_claim(self, made: list[Path]) -> None:
        """Undo a claim that built nothing (refused for want of room, interrupted before a shard): the manifest it
        wrote and the folders it made (``made``, deepest first) go, so a refused run leaves no empty cache behind
        (nor, through it, a run folder that ``launch.remove_created_dirs`` must keep). A shard, the eval file or a
        writer's temporary file means something was built (by this run or another sharing the folder): kept."""
        if not self.root.is_dir() or any(e.name != MANIFEST for e in self.root.iterdir()):
            return
        self.manifest_path.unlink(missing_ok=True)
        for folder in made:
            try:
                folder.rmdir()
            except OSError:  # not empty (or gone): it and the folders above it stay
                return

    def remove_dead_writers(self) -> list[Path]:
        """Remove the temporary files (``.<name>.tmp-<pid>``) of writers killed mid-shard, which no rename will
        ever claim. The rule of ``inference.heads.native.recover_dir``: a file is a dead writer's when its process
        is gone from this host (or the id is this process's, reused, as nothing is being written yet); a file
        modified since this process started is kept whatever its id, as another host's writer of this very
        build may own it (a shared ``features.cache_dir``). Removed paths are returned."""
        removed = []
        for tmp in self.root.glob(".*.safetensors.tmp-*"):
            pid = tmp.name.rsplit(".tmp-", 1)[1]
            try:
                # a margin for another host's clock or a network file system's cached times: a writer of this
                # run elsewhere keeps its file, a killed build's stays until a later run (disk, never a shard)
                recent = tmp.stat().st_mtime >= _STARTED - _OTHER_HOSTS_MARGIN_S
            except FileNotFoundError:  # its writer finished (renamed it) or another rank removed it
                continue
            if recent or _pid_alive(int(pid) if pid.isdigit() else None):
                continue
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
        return removed

    def shard_path(self, k: int) -> Path:
        return self.root / f"train-{k:06d}.safetensors"

    def shard_count(self, path: Path) -> int:
        """Batches in a complete shard file (0 if absent or unreadable)."""
        if not path.is_file():
            return 0
        try:
            with safe_open(str(path), framework="pt") as f:
                return int((f.metadata() or {}).get("count", 0))
        except Exception:
            return 0

    def write(self, path: Path, batches: list[dict], first: int) -> None:
        """Temp file, fsync, rename: a shard either exists whole or not at all."""
        tensors = {f"{j}.{key}": b[key].contiguous() for j, b in enumerate(batches)
                   for key in (*KEYS, "hidden", "greedy", "aux") if key in b}
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            if self.shard_count(path) >= len(batches):   # another build sharing the cache wrote it, as long or longer
                return
            save_file(tensors, str(tmp), metadata={"first": str(first), "count": str(len(batches)),
                                                   "format": str(FORMAT_VERSION)})
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except (OSError, SafetensorError) as e:   # safetensors reports a full disk as its own error
            done = sum(1 for p in self.root.glob("train-*.safetensors"))
            why = getattr(e, "strerror", None) or str(e).strip().splitlines()[0]
            raise UserError(f"could not write features shard {path.name} ({why}); {done} complete "
                            f"shard(s) kept in {self.root}, none half-written; free space and run the same "
                            "command again to continue") from None
        finally:
            if tmp.exists():
                tmp.unlink()

    def read(self, path: Path, j: int, device, dtype) -> dict:
        key = str(path)
        if self._open[0] != key:
            f = safe_open(key, framework="pt")
            self._open = (key, f, set(f.keys()))
        _, f, _ = self._open
        batch = {k: f.get_tensor(f"{j}.{k}") for k in KEYS}
        batch["hidden"] = f.get_tensor(f"{j}.hidden").to(device=device, dtype=dtype)
        batch["greedy"] = f.get_tensor(f"{j}.greedy").long()
        if self.read_aux:
            batch["aux"] = f.get_tensor(f"{j}.aux").to(device=device, dtype=dtype)
        return batch

    def eval_batches(self, device, dtype) -> list[dict]:
        path = self.root / EVAL_FILE
        return [self.read(path, j, device, dtype) for j in range(self.shard_count(path))]


def _pid_alive(pid: Optional[int]) -> bool:
    """Whether process ``pid`` may still be writing: another live process on this host (this one writes nothing
    while leftovers are removed); a name without an id counts as dead, as in ``recover_dir``."""
    return pid != os.getpid() and pid_alive(pid)


# -- building -----------------------------------------------------------------------------------------------
@dataclass
class CachePlan:
    """What to store and how: the batches (micro-batch size, padding, bucketing, as training reads them),
    how many are needed, shard size, storage dtype, and which shards this process writes."""

    micro_batch_size: int
    pad_id: int
    bucket_buffer: int
    needed: int  # micro-batches training will read (max_steps x accumulation x world size)
    shard_batches: int
    dtype: str  # on disk: bf16 | fp32
    aux_layers: tuple = ()  # backbone layers the heads' family reads besides the last (stored beside ``hidden``)
    greedy_everywhere: bool = False  # greedy ids at every position, not only the replies' (heads.train_on=all)
    rank: int = 0
    world_size: int = 1
    progress_bar: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def epoch0(self, stream: ConversationStream) -> Iterator[dict]:
        return first_epoch(stream, self.micro_batch_size, self.pad_id, self.bucket_buffer)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def build(cache: FeatureCache, manifest: dict, plan: CachePlan, frozen: FrozenFeatures,
          open_stream: Callable[[], ConversationStream], eval_set: Callable[[], list[dict]]) -> dict:
    """Store the hidden states of the first ``plan.needed`` batches (or the whole epoch), as missing.

    ``open_stream`` gives a fresh training stream as one process reads it (every rank sees the same
    sequence); ``eval_set`` the held-out batches; ``frozen`` runs the backbone (once per batch)."""
    rank, world, main, needed = plan.rank, plan.world_size, plan.is_main, plan.needed
    S = manifest["shard_batches"]
    if main:  # before anything is written: what killed builds left, whether or not this one writes
        cache.remove_dead_writers()
    # a shard may hold more batches than a manifest counts (a longer build sharing the cache wrote it): its first
    # ones are the same batches, so it serves
    shards_ok = all(cache.shard_count(cache.shard_path(k)) >= c for k, c in enumerate(manifest["shards"]))
    if manifest["eval"] and shards_ok and (manifest["epoch_complete"] or manifest["batches"] >= needed):
        return manifest

    # plan: batch shapes without the backbone (tokenise + pack only), for the disk estimate
    stream = open_stream()
    shapes = []
    epoch_complete = True
    for batch in plan.epoch0(stream):
        if len(shapes) >= needed:
            epoch_complete = False
            break
        b, w = batch["input_ids"].shape
        shapes.append((b, w))
    target = len(shapes)
    counts = [min(S, target - k * S) for k in range(math.ceil(target / S))]
    todo = [k for k, c in enumerate(counts) if cache.shard_count(cache.shard_path(k)) < c]   # never shrink one
    hidden_size = frozen.model.config.hidden_size
    store = parse_dtype(plan.dtype)
    aux_layers = list(manifest.get("aux_layers") or [])  # kept in every shard once a cache has them
    everywhere = bool(manifest.get("greedy_everywhere"))  # likewise
    per_pos = (1 + len(aux_layers)) * hidden_size * store.itemsize + 8 * len(KEYS) + 4  # + int32 greedy id
    positions = sum(b * w for k in todo for (b, w) in shapes[k * S:k * S + counts[k]])
    eval_missing = not (cache.root / EVAL_FILE).is_file()
    if eval_missing:
        positions += sum(e["input_ids"].numel() for e in eval_set())
    need = positions * per_pos
    free = shutil.disk_usage(cache.root).free
    if main:
        scope = "the whole epoch" if epoch_complete else f"of {needed} needed"
        print(f"[features] cache {cache.root}: {target} micro-batches ({scope}), "
              f"{len(todo)} of {len(counts)} shard(s) to write: {positions:,} positions (incl. padding) x hidden "
              f"{hidden_size}{f' x {1 + len(aux_layers)} layers (last + aux {aux_layers})' if aux_layers else ''} x "
              f"{store.itemsize} bytes ({plan.dtype}) + ids = {_gb(need)}; {_gb(free)} free",
              flush=True)
    if need > free:
        smaller = ", use features.dtype=bf16" if store.itemsize > 2 else ""   # not when it is already 2 bytes
        close = _gb(need) == _gb(free)   # "needs ~0.5 MB but only 0.5 MB is free": the bytes say it
        raise UserError(f"features cache needs ~{f'{need:,} bytes' if close else _gb(need)} under {cache.root} but "
                        f"only {f'{free:,} bytes are' if close else f'{_gb(free)} is'} free; free space, set "
                        f"features.cache_dir to a larger disk{smaller}, or lower trainer.max_steps / "
                        "data.max_conversations")
    _refuse_shards_beyond_memory([sum(b * w for b, w in shapes[k * S:k * S + counts[k]]) * per_pos for k in todo])

    def stored(batch: dict) -> dict:
        """One batch as stored: its ids, the heads' hidden states and the backbone's greedy ids."""
        f = frozen.features(batch, aux_layers=aux_layers, greedy_everywhere=everywhere)  # one forward serves all
        out = {**{k: batch[k] for k in KEYS}, "hidden": f["hidden"].to("cpu", store),
               "greedy": f["greedy"].to("cpu", torch.int32)}
        if aux_layers:
            out["aux"] = f["aux"].to("cpu", store)
        return out

    if eval_missing and main:
        cache.write(cache.root / EVAL_FILE, [stored(e) for e in eval_set()], 0)
    _write_shards(cache, plan, open_stream, stored, [k for k in todo if k % world == rank], counts, S)
    barrier(world)
    # every rank checks (the cache_dir must be on a filesystem all processes see), so all stop together
    missing = [k for k, c in enumerate(counts) if cache.shard_count(cache.shard_path(k)) < c]
    if missing:
        raise UserError(f"features shards {missing[:5]} of {cache.root} were not written (is features.cache_dir "
                        "on a filesystem every process sees?); run the same command again")
    if main:
        _record_build(cache, target, epoch_complete, counts, shapes, hidden_size, per_pos, stream)
    barrier(world)
    return cache.manifest()


def _record_build(cache: FeatureCache, target: int, epoch_complete: bool, counts: list[int], shapes: list,
                  hidden_size: int, per_pos: int, stream: ConversationStream) -> None:
    """Write the manifest of a completed build (main process): its batches, shards and what tokenising them saw.
    A longer build sharing this cache that recorded more while this one ran keeps its record (it covers ours)."""
    with holding_manifest(cache.root):
        if cache.manifest().get("batches", 0) > target:
            return
        _write_build_record(cache, target, epoch_complete, counts, shapes, hidden_size, per_pos, stream)


@contextmanager
def holding_manifest(root: Path) -> Iterator[None]:
    """The cache's manifest held for a read-compare-write: two builds of different lengths sharing the cache could
    each read it before either wrote, and the shorter's record then replaced the longer's (a ``flock`` on a file
    of its own: the cache folder may be a run's ``output_dir``, which that run holds locked itself)."""
    with open(root / MANIFEST_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)   # released when the file closes, however the process ends
        yield


def _write_build_record(cache: FeatureCache, target: int, epoch_complete: bool, counts: list[int], shapes: list,
                        hidden_size: int, per_pos: int, stream: ConversationStream) -> None:
    manifest = {**cache.manifest(), "batches": target, "epoch_complete": epoch_complete, "shards": counts,
                "eval": True, "positions": sum(b * w for b, w in shapes), "hidden_size": hidden_size,
                "bytes_per_position": per_pos,
                "stream": {"conversations": stream.stats.conversations, "truncated": stream.stats.truncated,
                           "no_labels": stream.stats.no_labels, "unlabelled": stream.stats.unlabelled,
                           "unlocated_replies": stream.stats.unlocated_replies,
                           "recovered": stream.read_stats.recovered, "dropped": dict(stream.read_stats.dropped)}}
    write_json_atomic(cache.manifest_path, manifest)


def _refuse_shards_beyond_memory(shard_bytes: list[int]) -> None:
    """Refuse, before the first forward, shards this node's processes cannot hold in host memory: each process
    keeps the shard it builds whole until it writes it, and the write serialises it once more (an EAGLE-3 cache
    of Llama-3.1-8B's width: ~17 GB a shard of 64 micro-batches of 4 x 2,048 positions, 8 processes a node)."""
    largest = max(shard_bytes, default=0)
    processes = local_world_size()
    need, have = 2 * largest * processes, free_memory_bytes(torch.device("cpu"))
    if have is not None and need > have:
        each = f" each, x{processes} processes" if processes > 1 else ""
        raise UserError(f"a features shard holds ~{_gb(largest)} in host memory while it is built and ~as much again "
                        f"while it is written ({_gb(need)}{each}) but only {_gb(have)} is available; lower "
                        "features.shard_batches")


def _write_shards(cache: FeatureCache, plan: CachePlan, open_stream: Callable[[], ConversationStream],
                  stored: Callable[[dict], dict], mine: list[int], counts: list[int], S: int) -> None:
    """Write this process's shards ``mine`` (shard k holds batches k*S .. k*S + counts[k] - 1 of epoch 0):
    one pass over the stream, each batch through the backbone once, each shard written whole."""
    if not mine:
        return
    bar = None
    if plan.is_main and plan.progress_bar:
        bar = tqdm(total=sum(counts[k] for k in mine), desc="features", unit="batch", dynamic_ncols=True)
    last = max(mine) * S + counts[max(mine)]
    pending: list[dict] = []
    for i, batch in enumerate(plan.epoch0(open_stream())):
        if i >= last:
            break
        k = i // S
        if k not in mine:
            continue
        pending.append(stored(batch))
        if bar is not None:
            bar.update(1)
        if len(pending) == counts[k]:
            cache.write(cache.shard_path(k), pending, k * S)
            pending = []
    if bar is not None:
        bar.close()


# -- reading -------------------------------------------------------------------------------------------------
class CachedBatches:
    """Like ``MicroBatches`` (infinite, resumable at ``(epoch, index)``), but each batch carries ``hidden``."""

    def __init__(self, cache: FeatureCache, manifest: dict, rank: int, world: int, seed: int, device, dtype,
                 stats=None, epoch: int = 0, index: int = 0):
        self.cache, self.S = cache, manifest["shard_batches"]
        self.n = manifest["batches"]
        self.rank, self.world, self.seed = rank, world, seed
        self.device, self.dtype, self.stats = device, dtype, stats
        self.epoch, self.index = epoch, index
        if self.n < world:
            raise UserError(f"the features cache holds {self.n} micro-batches, fewer than the {world} processes")

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def order(self, epoch: int) -> list[int]:
        """Epoch 0 in stream order (= the online run); later epochs in a seeded permutation."""
        if epoch == 0:
            ids = list(range(self.n))
        else:
            # modulo 2**64: a seed near the top of its range stays within what torch takes
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**64)
            ids = torch.randperm(self.n, generator=g).tolist()
        return ids[self.rank::self.world]

    def batch(self, i: int) -> dict:
        k = i // self.S
        return self.cache.read(self.cache.shard_path(k), i - k * self.S, self.device, self.dtype)

    def __iter__(self) -> Iterator[dict]:
        while True:
            ids = self.order(self.epoch)
            for pos in range(self.index, len(ids)):
                self.index = pos + 1
                batch = self.batch(ids[pos])
                if self.stats is not None:  # the same counters MicroBatches keeps (padding fraction)
                    self.stats.count(batch)
                yield batch
            self.epoch, self.index = self.epoch + 1, 0


def stream_stats(manifest: dict) -> tuple[StreamStats, ReadStats]:
    """What tokenising the cached batches saw (for the run's summary line), as the online stream counts it."""
    counts = manifest.get("stream", {})
    stats = StreamStats(**{k: counts.get(k, 0) for k in ("conversations", "truncated", "no_labels", "unlabelled",
                                                         "unlocated_replies")})
    read = ReadStats(read=True)  # the build read them
    read.recovered = counts.get("recovered", 0)
    read.dropped.update(counts.get("dropped", {}))
    return stats, read


def rounding(compute: torch.dtype, store: torch.dtype) -> str:
    """What the stored hidden states were rounded to besides the stored dtype: the run's compute dtype
    (``trainer.precision``: the features are cast to it first) where it loses what the stored one keeps."""
    lossy = compute.itemsize < store.itemsize or (compute.itemsize == store.itemsize and compute != store)
    return str(compute).replace("torch.", "") if lossy else "the stored dtype"


def open_cache(cfg, backbone, frozen: FrozenFeatures, plan: CachePlan,
               eval_set: Callable[[], list[dict]]) -> tuple[FeatureCache, dict]:
    """Claim the cache for this backbone and data, build what is missing; (cache, its final manifest)."""
    cache = FeatureCache(cache_dir(cfg), Path(cfg.output_dir))
    made = [d for d in (cache.root, *cache.root.parents) if not d.exists()]   # what the claim creates, deepest first
    fresh = not cache.manifest_path.exists()
    recorded = {"data_fingerprint": data_fingerprint(cfg.data.source, cfg.data.split),
                "tokenizer_fingerprint": tokenizer_fingerprint(backbone.tokenizer),
                "rounded_to": rounding(frozen.compute_dtype, parse_dtype(plan.dtype))}
    manifest = cache.claim(cache_identity(cfg, backbone), plan.shard_batches, plan.aux_layers, plan.greedy_everywhere,
                           recorded)
    cache.read_aux = bool(plan.aux_layers)

    def open_stream() -> ConversationStream:
        # the cache's rule, whoever extends it: a cache begun before train_on=all kept them goes on dropping them
        return ConversationStream(cfg.data, backbone.tokenizer, seed=cfg.trainer.seed,
                                  keep_unlabelled=bool(manifest.get("keeps_unlabelled")))

    try:
        return cache, build(cache, manifest, plan, frozen, open_stream, eval_set)
    except (UserError, KeyboardInterrupt):
        if fresh and plan.is_main:
            cache.withdraw_claim(made)
        raise


def cache_plan(cfg, micro_batch_size: int, grad_accum: int, pad_id: int, rank: int, world_size: int) -> CachePlan:
    t, f = cfg.trainer, cfg.features
    return CachePlan(micro_batch_size=micro_batch_size, pad_id=pad_id, bucket_buffer=cfg.data.bucket_buffer,
                     needed=t.max_steps * grad_accum * world_size, shard_batches=f.shard_batches,
                     dtype=enum_value(f.dtype), greedy_everywhere=cfg.heads.train_on == "all", rank=rank,
                     world_size=world_size, progress_bar=t.progress_bar)


def kept_shards(root: Path) -> str:
    """What a stopped build leaves for the next one, as a clause of the line it stops with ("" when nothing)."""
    n = sum(1 for _ in Path(root).glob("train-*.safetensors")) if Path(root).is_dir() else 0
    return f"{n} complete shard{'s' if n != 1 else ''} of the feature cache kept in {root}" if n else ""


def run_build(cfg, record: Callable[[], None] | None = None) -> dict:
    """``features.mode=build``: build (or complete) the cache and exit, without heads, optimizer or engine.
    ``record`` writes the run's record once the data gave a training conversation (as the trainer's). A Ctrl-C or
    SIGTERM stops it at once in one line (``stop_on_signals``): complete shards are kept, none is half-written."""
    validate(cfg)

    def interrupted() -> str:
        kept = kept_shards(cache_dir(cfg)) or "no shard of the feature cache written yet"
        return f"interrupted while building the feature cache: {kept}; run the same command again to continue"

    with stop_on_signals(interrupted):
        return _build_only(cfg, record)


def _build_only(cfg, record: Callable[[], None] | None) -> dict:
    proc = start_process(cfg.trainer)
    batch = derived_batch(cfg.trainer, proc.world_size)

    def accept_data(tokenizer) -> None:
        check_training_data(cfg.data, tokenizer)
        if record is not None and not keeps_trained_record(cfg, ignoring=("features.",)):   # a run's own
            record()

    backbone = load_backbone(cfg.backbone, proc.device, seed=cfg.trainer.seed, before_write=accept_data)
    pad_id = backbone.tokenizer.pad_token_id
    frozen = FrozenFeatures(backbone.model, cfg.data.packing, parse_dtype(enum_value(cfg.trainer.precision)),
                            proc.device)
    data = RankData(cfg.data, backbone.tokenizer, cfg.trainer.seed, proc.rank, proc.world_size,
                    batch.micro_batch_size, pad_id)
    plan = cache_plan(cfg, batch.micro_batch_size, batch.grad_accum, pad_id, proc.rank, proc.world_size)
    plan.aux_layers = backbone_layers(cfg.heads, backbone.model.config)  # what the family declares it reads
    cache, manifest = open_cache(cfg, backbone, frozen, plan, data.eval_batches)
    if proc.is_main:
        print(f"[features] cache complete: {manifest['batches']} micro-batches in {cache.root}; train with "
              f"features.mode=train features.cache_dir={cache.root}", flush=True)
    return manifest
