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
``doc_ids``, ``position_ids``, ``hidden`` (what ``MedusaTrainer.hidden_states`` returns) and
``greedy`` (int32: the backbone's argmax where ``heads.targets=backbone`` needs it, IGNORE elsewhere;
``MedusaTrainer.greedy_ids``, computed from the backbone-dtype hidden states, not the stored
rounding), plus the held-out evaluation batches. Greedy ids are always stored, whatever
``heads.targets`` is, so one cache serves both settings (``heads.targets`` is not part of its
identity). Training reads them in that order in epoch 0, so with an fp32 cache the losses
equal the online run's; later epochs replay the same batches in a new seeded order (the
online stream would re-shuffle and re-pack the conversations instead).
With W processes, process r takes the batches at positions r, r+W, ... so one cache serves
any world size (the online path splits the conversation stream instead, so W > 1 runs differ
from online ones in which batch each rank sees, not in what is learned). Raising
``trainer.max_steps`` later extends the cache; a cache holding a whole epoch is simply cycled.

The backbone is still loaded (its lm_head initialises the heads; tokenizer and config are
needed) but never run on a cached batch.

Layout::

    features.json                 manifest: backbone fingerprint (config + weights), data settings, shards
    eval.safetensors              held-out batches ({j}.hidden, {j}.greedy, {j}.input_ids, ...)
    train-000000.safetensors      micro-batches 0..S-1 of the stream (metadata: first, count)

Safety: before writing, the disk needed (positions x hidden x bytes, plus the ids) is
printed and compared with ``shutil.disk_usage``; a cache that will not fit is refused. Each
shard is written under a temporary name and renamed when complete, so a full disk, a kill or
a crash mid-write never leaves a shard that looks complete (the error says how many are
kept; the same command continues). A cache built for another backbone (weights or
architecture), other data settings, seed or micro-batch size is refused, naming what differs.

Formats: 2 stores ``greedy``; 1 (built before) does not, and still trains ``heads.targets=data``
(``heads.targets=backbone`` asks for a rebuild). Extending a format-1 cache keeps it format 1.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inference.errors import UserError

FORMAT_VERSION = 2  # 2: shards also hold the backbone's greedy ids ({j}.greedy)
READABLE_FORMATS = (1, 2)  # 1: no greedy ids (heads.targets=data only)
GREEDY_FORMAT = 2
MANIFEST = "features.json"
EVAL_FILE = "eval.safetensors"
KEYS = ("input_ids", "labels", "position_ids", "doc_ids")
_BYTES = {"bf16": 2, "fp32": 4}
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _value(x):
    return getattr(x, "value", x)


def enabled(cfg) -> bool:
    f = getattr(cfg, "features", None)
    return f is not None and _value(f.mode) != "off"


# -- identities ----------------------------------------------------------------------------------------------
def weights_fingerprint(model) -> str:
    """A hash of every weight tensor's name, shape, dtype and leading values: other weights, other hash.

    Reading all bytes of an 8B model would take a minute; the first 64 values of each tensor
    change under any fine-tune or merged adapter, and cost nothing.
    """
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        head = p.detach().reshape(-1)[:64].float().cpu().contiguous()
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        h.update(head.numpy().tobytes())
    return h.hexdigest()[:16]


def backbone_identity(backbone) -> dict:
    """What generated data or cached features depend on: architecture and weights."""
    from inference.heads.spec import backbone_fingerprint

    model = backbone.model
    return {"name": backbone.name, "config": backbone_fingerprint(model.config),
            "weights": weights_fingerprint(model)}


def no_greedy_message(root) -> str:
    return (f"features cache {root} has no backbone targets (built before greedy ids were stored), so it cannot "
            f"train heads.targets=backbone; rebuild it: delete {root} or use another features.cache_dir")


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
                 "system_prompt": d.system_prompt},
        "seed": t.seed,
        "micro_batch_size": t.micro_batch_size,
        "dtype": _value(cfg.features.dtype),
    }


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}={a!r} there, {b!r} here")
    return out


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


# -- the cache on disk ---------------------------------------------------------------------------------------
class FeatureCache:
    def __init__(self, root: Path):
        self.root = Path(root)
        self._open: tuple[Optional[str], object, set] = (None, None, set())

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST

    def manifest(self) -> dict:
        return json.loads(self.manifest_path.read_text())

    def claim(self, identity: dict, shard_batches: int) -> dict:
        """Create the manifest, or check the existing cache was built for this backbone and data."""
        if self.manifest_path.is_file():
            try:
                manifest = self.manifest()
            except json.JSONDecodeError:
                raise UserError(f"{self.manifest_path} is not valid JSON; delete {self.root} to rebuild") from None
            if manifest.get("format") not in READABLE_FORMATS:
                raise UserError(f"{self.root} holds a features cache of another format; delete it to rebuild")
            diff = _differences(manifest.get("identity", {}), identity)
            if diff:
                raise UserError(f"features cache {self.root} was built for another backbone or data "
                                f"({'; '.join(diff[:3])}); use another features.cache_dir or delete it")
            return manifest
        if self.root.is_dir() and any(self.root.glob("*.safetensors")):
            raise UserError(f"{self.root} holds .safetensors files but no {MANIFEST}; not a features cache of "
                            "this tool: use another features.cache_dir")
        self.root.mkdir(parents=True, exist_ok=True)
        manifest = {"format": FORMAT_VERSION, "identity": identity, "shard_batches": shard_batches,
                    "batches": 0, "epoch_complete": False, "shards": [], "eval": False}
        _write_json_atomic(self.manifest_path, manifest)  # every rank may: same content, atomic rename
        return manifest

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
                   for key in (*KEYS, "hidden", "greedy") if key in b}
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            save_file(tensors, str(tmp), metadata={"first": str(first), "count": str(len(batches)),
                                                   "format": str(FORMAT_VERSION)})
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            done = sum(1 for p in self.root.glob("train-*.safetensors"))
            raise UserError(f"could not write features shard {path.name} ({e.strerror or e}); {done} complete "
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
        _, f, names = self._open
        batch = {k: f.get_tensor(f"{j}.{k}") for k in KEYS}
        batch["hidden"] = f.get_tensor(f"{j}.hidden").to(device=device, dtype=dtype)
        if f"{j}.greedy" in names:  # absent in format-1 caches
            batch["greedy"] = f.get_tensor(f"{j}.greedy").long()
        return batch

    def eval_batches(self, device, dtype) -> list[dict]:
        path = self.root / EVAL_FILE
        return [self.read(path, j, device, dtype) for j in range(self.shard_count(path))]


# -- building -----------------------------------------------------------------------------------------------
def _stream_batches(trainer, stream=None) -> Iterator[dict]:
    """Epoch 0 of the training stream as one process reads it (every rank sees the same sequence)."""
    from .data.stream import ConversationStream, MicroBatches

    cfg = trainer.cfg
    stream = stream or ConversationStream(cfg.data, trainer.backbone.tokenizer, seed=cfg.trainer.seed)
    batches = MicroBatches(stream, trainer.plan.micro_batch_size, trainer.pad_id, buffer=cfg.data.bucket_buffer)
    for batch in batches:
        if batches.epoch > 0:  # the first batch of the next epoch: epoch 0 is over
            return
        yield batch


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def build(trainer, cache: FeatureCache, manifest: dict, needed: int) -> dict:
    """Store the hidden states of the first ``needed`` batches (or the whole epoch), as missing."""
    rank, world, main = trainer.rank, trainer.world_size, trainer.is_main
    S = manifest["shard_batches"]
    shards_ok = all(cache.shard_count(cache.shard_path(k)) == c for k, c in enumerate(manifest["shards"]))
    if manifest["eval"] and shards_ok and (manifest["epoch_complete"] or manifest["batches"] >= needed):
        return manifest

    # plan: batch shapes without the backbone (tokenise + pack only), for the disk estimate
    from .data.stream import ConversationStream

    stream = ConversationStream(trainer.cfg.data, trainer.backbone.tokenizer, seed=trainer.cfg.trainer.seed)
    shapes = []
    epoch_complete = True
    for batch in _stream_batches(trainer, stream):
        if len(shapes) >= needed:
            epoch_complete = False
            break
        b, w = batch["input_ids"].shape
        shapes.append((b, w))
    target = len(shapes)
    counts = [min(S, target - k * S) for k in range(math.ceil(target / S))]
    todo = [k for k, c in enumerate(counts) if cache.shard_count(cache.shard_path(k)) != c]
    hidden_size = trainer.backbone.model.config.hidden_size
    dtype_name = _value(trainer.cfg.features.dtype)
    per_pos = hidden_size * _BYTES[dtype_name] + 8 * len(KEYS) + 4  # + int32 greedy id
    positions = sum(b * w for k in todo for (b, w) in shapes[k * S:k * S + counts[k]])
    eval_missing = not (cache.root / EVAL_FILE).is_file()
    if eval_missing:
        positions += sum(e["input_ids"].numel() for e in trainer.eval_set)
    need = positions * per_pos
    free = shutil.disk_usage(cache.root).free
    if main:
        scope = "the whole epoch" if epoch_complete else f"of {needed} needed"
        print(f"[features] cache {cache.root}: {target} micro-batches ({scope}), "
              f"{len(todo)} of {len(counts)} shard(s) to write: {positions:,} positions (incl. padding) x hidden "
              f"{hidden_size} x {_BYTES[dtype_name]} bytes ({dtype_name}) + ids = {_gb(need)}; {_gb(free)} free",
              flush=True)
    if need > free:
        raise UserError(f"features cache needs ~{_gb(need)} under {cache.root} but only {_gb(free)} is free; free "
                        "space, set features.cache_dir to a larger disk, use features.dtype=bf16, or lower "
                        "trainer.max_steps / data.max_conversations")

    store = _DTYPES[dtype_name]

    def features_of(batch: dict) -> dict:
        """The stored tensors of one batch: the heads' hidden states and the backbone's greedy ids."""
        raw = trainer.backbone_hidden(batch)  # one backbone forward serves both
        greedy = trainer.greedy_ids(raw, batch["labels"], batch["doc_ids"])
        return {"hidden": raw.to(trainer.compute_dtype).to("cpu", store), "greedy": greedy.to("cpu", torch.int32)}

    if eval_missing and main:
        evals = [{**{k: e[k] for k in KEYS}, **features_of(e)} for e in trainer.eval_set]
        cache.write(cache.root / EVAL_FILE, evals, 0)
    mine = [k for k in todo if k % world == rank]
    bar = None
    if mine and main and trainer.cfg.trainer.progress_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(counts[k] for k in mine), desc="features", unit="batch", dynamic_ncols=True)
    if mine:
        last = max(mine) * S + counts[max(mine)]
        pending: list[dict] = []
        for i, batch in enumerate(_stream_batches(trainer)):
            if i >= last:
                break
            k = i // S
            if k not in mine:
                continue
            pending.append({**batch, **features_of(batch)})
            if bar is not None:
                bar.update(1)
            if len(pending) == counts[k]:
                cache.write(cache.shard_path(k), pending, k * S)
                pending = []
    if bar is not None:
        bar.close()
    _barrier(world)
    # every rank checks (the cache_dir must be on a filesystem all processes see), so all stop together
    missing = [k for k, c in enumerate(counts) if cache.shard_count(cache.shard_path(k)) != c]
    if missing:
        raise UserError(f"features shards {missing[:5]} of {cache.root} were not written (is features.cache_dir "
                        "on a filesystem every process sees?); run the same command again")
    if main:
        manifest = {**cache.manifest(), "batches": target, "epoch_complete": epoch_complete, "shards": counts,
                    "eval": True, "positions": sum(b * w for b, w in shapes), "hidden_size": hidden_size,
                    "bytes_per_position": per_pos,
                    "stream": {"conversations": stream.stats.conversations, "truncated": stream.stats.truncated,
                               "recovered": stream.read_stats.recovered,
                               "dropped": dict(stream.read_stats.dropped)}}
        _write_json_atomic(cache.manifest_path, manifest)
    _barrier(world)
    return cache.manifest()


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
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            ids = torch.randperm(self.n, generator=g).tolist()
        return ids[self.rank::self.world]

    def batch(self, i: int) -> dict:
        k = i // self.S
        return self.cache.read(self.cache.shard_path(k), i - k * self.S, self.device, self.dtype)

    def __iter__(self) -> Iterator[dict]:
        from .data.tokenize import IGNORE

        while True:
            ids = self.order(self.epoch)
            for pos in range(self.index, len(ids)):
                self.index = pos + 1
                batch = self.batch(ids[pos])
                if self.stats is not None:  # the same counters MicroBatches keeps (padding fraction)
                    real = int((batch["doc_ids"] > 0).sum())
                    self.stats.tokens += real
                    self.stats.padding += batch["doc_ids"].numel() - real
                    self.stats.label_tokens += int((batch["labels"] != IGNORE).sum())
                yield batch
            self.epoch, self.index = self.epoch + 1, 0


def cached_batches(trainer, epoch: int = 0, index: int = 0) -> tuple[CachedBatches, list[dict]]:
    """Called from ``MedusaTrainer.setup``: build what is missing, return (train batches, eval batches)."""
    cfg = trainer.cfg
    cache = FeatureCache(cache_dir(cfg))
    manifest = cache.claim(cache_identity(cfg, trainer.backbone), cfg.features.shard_batches)
    if trainer.backbone_targets and manifest.get("format", 1) < GREEDY_FORMAT:
        raise UserError(no_greedy_message(cache.root))  # before building or training anything
    needed = cfg.trainer.max_steps * trainer.plan.grad_accum * trainer.world_size
    manifest = build(trainer, cache, manifest, needed)
    counts = manifest.get("stream", {})  # what tokenising the cached batches saw: for the run's summary line
    trainer.train_stream.stats.conversations = counts.get("conversations", 0)
    trainer.train_stream.stats.truncated = counts.get("truncated", 0)
    trainer.train_stream.read_stats.recovered = counts.get("recovered", 0)
    trainer.train_stream.read_stats.dropped.update(counts.get("dropped", {}))
    batches = CachedBatches(cache, manifest, trainer.rank, trainer.world_size, cfg.trainer.seed, trainer.device,
                            trainer.compute_dtype, trainer.train_stream.stats, epoch, index)
    return batches, cache.eval_batches(trainer.device, trainer.compute_dtype)


def run_build(cfg) -> dict:
    """``features.mode=build``: build (or complete) the cache and exit without training."""
    from omegaconf import open_dict

    from .trainer import MedusaTrainer

    with open_dict(cfg):
        cfg.logger.wandb = "disabled"  # nothing is trained: no run to track
        cfg.logger.plot = False
    trainer = MedusaTrainer(cfg)
    trainer.setup()  # builds the cache (cached_batches)
    trainer.cleanup(plot=False)
    manifest = FeatureCache(cache_dir(cfg)).manifest()
    if trainer.is_main:
        print(f"[features] cache complete: {manifest['batches']} micro-batches in {cache_dir(cfg)}; train with "
              f"features.mode=train features.cache_dir={cache_dir(cfg)}", flush=True)
    return manifest
