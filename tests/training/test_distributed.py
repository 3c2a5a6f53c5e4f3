"""Two CPU ranks through the ``deepspeed`` launcher (gloo): ZeRO-2 and ZeRO-3 runs, their checkpoints,
their exports, and resuming a 2-rank run.

Each launch costs ~15-30 s on 2 cores, so every launch is a module-scoped fixture shared by the
tests that inspect it. The launcher runs the installed ``medusa-train`` script (``deepspeed
--module medusa_train.cli`` is the documented form; see test_cli.test_module_entry_point_runs).
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import TINY_DATA, clean_env, console_script
from inference.loading import load_heads
from medusa_train.checkpoint import read_state
from medusa_train.tracking import read_metrics

CKPT_FILES = ["heads.safetensors", "optimizer.safetensors", "rng-rank0.safetensors", "rng-rank1.safetensors",
              "trainer_state.json"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, data: Path, *overrides: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = clean_env()
    cmd = [console_script("deepspeed"), "--num_gpus", "2", "--master_port", str(_free_port()),
           console_script("medusa-train"), "debug_tiny", f"output_dir={out}", f"data.source={data}",
           "logger.wandb=disabled", "trainer.progress_bar=false", "logger.plot=false", "trainer.log_every=1",
           "trainer.threads=1",
           *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out.parent, timeout=timeout)


def uneven_data(path: Path) -> Path:
    """2 held-out + 24 training conversations alternating short / long, so that without shuffling
    rank 0 gets only short ones (few packed rows per epoch) and rank 1 only long ones (many rows):
    the ranks' epochs end at different micro-batches."""
    lines = []
    for i in range(26):
        if i % 2 == 0:
            rec = {"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"short {i}."}]}
        else:
            rec = {"conversations": [{"from": "human", "value": f"Tell story {i}."},
                                     {"from": "gpt", "value": "Once upon a time, " * 9 + f"the end {i}."}]}
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path


def train_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"}


def assert_clean_exit(proc):
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stdout + proc.stderr


UNEVEN = ["data.eval_conversations=2", "data.shuffle_buffer=1", "trainer.zero_stage=2", "trainer.max_steps=6",
          "trainer.save_every=3", "trainer.keep_last=5"]


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero2")
    data = uneven_data(root / "uneven.jsonl")
    out = root / "a"
    return out, data, launch(out, data, *UNEVEN)


@pytest.fixture(scope="module")
def zero2_resumed(zero2_run):
    a, data, proc = zero2_run
    assert_clean_exit(proc)
    out = a.parent / "b"
    return out, launch(out, data, *UNEVEN, f"trainer.resume={a / 'checkpoints' / 'step-000003'}")


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3") / "run"
    return out, launch(out, TINY_DATA, "trainer.zero_stage=3", "trainer.max_steps=4", "trainer.save_every=2",
                       "trainer.keep_last=5")


@pytest.fixture(scope="module")
def zero3_medusa2_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3_medusa2") / "run"
    # A hang (ranks waiting on each other's collectives) fails in 200 s rather than the default 400.
    return out, launch(out, TINY_DATA, "trainer.zero_stage=3", "trainer.max_steps=2", "trainer.save_every=0",
                       "lora.enabled=true", "lora.merge=true", timeout=200)


def _check_run(out: Path, proc, steps: list[int], tiny_backbone):
    assert_clean_exit(proc)
    assert "world 2" in proc.stdout  # really two ranks
    assert sorted(p.name for p in (out / "heads").iterdir()) == ["config.json", "model.safetensors"]
    heads = load_heads(out / "heads", backbone_config=tiny_backbone.model.config)  # full-size, strict shapes
    root = out / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == [f"step-{s:06d}" for s in steps]
    for s in steps:
        assert sorted(p.name for p in (root / f"step-{s:06d}").iterdir()) == CKPT_FILES
    assert (root / "latest").read_text().strip() == f"step-{steps[-1]:06d}"
    pickles = [p for p in out.rglob("*") if p.suffix in (".pt", ".pth", ".bin", ".pkl", ".pickle")]
    assert not pickles, pickles
    state = read_state(root / f"step-{steps[-1]:06d}")
    assert state["world_size"] == 2 and state["step"] == steps[-1]
    # the export holds the gathered final weights, not one rank's partition
    from safetensors.torch import load_file

    final = load_file(str(root / f"step-{steps[-1]:06d}" / "heads.safetensors"))
    for name, tensor in heads.state_dict().items():
        assert torch.equal(tensor, final[f"heads.{name}"]), name
    assert list(train_losses(out)) == list(range(1, steps[-1] + 1))


def test_zero2_two_ranks_train_export_and_checkpoint(zero2_run, tiny_backbone):
    """Guards against: a 2-rank ZeRO-2 run failing on CPU/gloo, exporting one rank's shard instead of
    the full heads, writing DeepSpeed's pickled checkpoints, or missing a rank's RNG state."""
    out, _, proc = zero2_run
    _check_run(out, proc, [3, 6], tiny_backbone)


def test_zero3_two_ranks_train_export_and_checkpoint(zero3_run, tiny_backbone):
    """Guards against: ZeRO-3 (partitioned parameters) deadlocking, or exporting / checkpointing the
    empty local partitions instead of gathered full tensors."""
    out, proc = zero3_run
    _check_run(out, proc, [2, 4], tiny_backbone)


def test_two_rank_resume_restores_weights_and_optimizer(zero2_resumed):
    """Guards against: a 2-rank resume that loads weights / AdamW state into the wrong partitions: the
    first step after resuming (rank 0's loss on its own next batch) must equal the uninterrupted run's."""
    b, proc = zero2_resumed
    assert_clean_exit(proc)
    a = b.parent / "a"
    assert "resumed from" in proc.stdout
    assert train_losses(b)[4] == train_losses(a)[4]


def test_two_rank_resume_continues_every_ranks_data(zero2_resumed):
    """Guards against: ranks resuming at another rank's data position (uneven shards), so a resumed
    multi-rank run trains on other batches than the uninterrupted run."""
    b, proc = zero2_resumed
    assert_clean_exit(proc)
    a, resumed = train_losses(b.parent / "a"), train_losses(b)
    assert [resumed[s] for s in (4, 5, 6)] == [a[s] for s in (4, 5, 6)]


def test_two_rank_log_counts_every_ranks_batches(zero2_run):
    """Guards against: a 2-rank run logging rank 0's window only (its loss and accuracies over its shard, its
    tokens x 2 as the run's, its padding): with the uneven shards here rank 0 reads the short conversations, so
    the logged tokens and padding were not the run's."""
    out, _, proc = zero2_run
    assert_clean_exit(proc)
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    counts = read_state(out / "checkpoints" / "step-000006")["batch_counts_per_rank"]
    assert counts[0]["tokens"] != counts[1]["tokens"]   # the shards differ, so rank 0 x 2 is not the total
    assert sum(r["tokens"] for r in records) == sum(c["tokens"] for c in counts)
    real, padding = sum(c["tokens"] for c in counts), sum(c["padding"] for c in counts)
    assert records[-1]["padding_fraction"] == pytest.approx(padding / (real + padding))


def test_zero3_two_ranks_medusa2_merges_the_gathered_backbone(zero3_medusa2_run, tiny_backbone):
    """Guards against: Medusa-2 under 2-rank ZeRO-3 hanging at export (the drift report's forward passes and the
    merge gather partitioned parameters, collectives that ran on the main rank alone), writing ``merged/`` from
    the empty local shards (zero-size tensors: from_pretrained failed with a size mismatch), and the drift report
    or merged model written by more than one rank."""
    import copy

    from transformers import AutoModelForCausalLM

    from inference.runtime.adapter import merge_lora

    out, proc = zero3_medusa2_run
    assert_clean_exit(proc)
    assert "world 2" in proc.stdout
    assert proc.stdout.count("backbone drift on") == 1 and proc.stdout.count("merged backbone:") == 1
    drift = json.loads((out / "drift.json").read_text())
    assert drift["heldout_tokens"] > 0
    expected = copy.deepcopy(tiny_backbone.model)
    assert merge_lora(expected, out / "heads" / "adapter") > 0
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", attn_implementation="sdpa")  # strict shapes
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, expected(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(expected(input_ids=ids).logits, tiny_backbone.model(input_ids=ids).logits)


def test_a_killed_rank_ends_the_others_in_one_line(tmp_path):
    """Guards against: a rank whose peer was killed (-9, out of memory, a lost node) ending in Hydra's "Error
    executing job" and gloo's traceback ("Connection reset by peer ... GLHF"), or aborting at exit ("terminate
    called without an active exception"), instead of one line saying what happened and that the run resumes."""
    import os
    import signal
    import time

    import psutil

    out = tmp_path / "run"
    cmd = [console_script("deepspeed"), "--num_gpus", "2", "--master_port", str(_free_port()),
           console_script("medusa-train"), "debug_tiny", f"output_dir={out}", f"data.source={TINY_DATA}",
           "logger.wandb=disabled", "trainer.progress_bar=false", "logger.plot=false", "trainer.threads=1",
           "trainer.max_steps=100000", "trainer.save_every=5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(),
                            cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoints" / "latest").exists():   # training: both ranks in the step loop
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.5)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "--local_rank=1" in p.cmdline()]
        assert len(ranks) == 1
        ranks[0].send_signal(signal.SIGKILL)
        text, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    survivor = [l for l in text.splitlines() if "medusa-train: error:" in l]
    assert len(survivor) == 1 and "lost another process of this launch" in survivor[0], text[-3000:]
    assert "run the same command again to resume" in survivor[0]
    assert "Traceback" not in text and "Error executing job" not in text and "terminate called" not in text


def test_only_a_gone_peers_errors_read_as_a_lost_process(monkeypatch):
    """Guards against: any collective error (an NCCL misuse, a shape mismatch: a defect here) reported as "lost
    another process ... run the same command again to resume", which a rerun would only repeat; or a lost peer's
    gloo / NCCL error not recognised (a traceback); or a single process saying it lost a peer it never had."""
    import torch.distributed as dist

    from medusa_train.distributed import lost_peer

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:59592: Connection reset by peer.")
    nccl = dist.DistBackendError("NCCL error: remote process exited or there was a network error, ncclRemoteError")
    misuse = dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage, ncclInvalidUsage")
    shapes = RuntimeError("Tensors must be CUDA and dense")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert lost_peer(gloo) and lost_peer(nccl) and lost_peer(dist.DistStoreError("wait timeout"))
    late = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation")
    assert not lost_peer(misuse) and not lost_peer(shapes) and not lost_peer(ValueError("Connection reset by peer"))
    assert not lost_peer(late)   # a peer alive but late: a hang's traceback, not "rerun to resume"
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert not lost_peer(gloo)


def _scripted_trainer(rank: int, world_size: int, n_batches: int):
    """A trainer whose loss is a script: batch i gives loss i and head 1 right on i of its 10 positions (the
    sums ``evaluate`` adds up), and counts its forwards (what ZeRO-3's collective gathers need equal)."""
    from types import SimpleNamespace

    from medusa_train.losses import HeadMetrics

    module = SimpleNamespace(metrics=HeadMetrics(2))
    forwards = []

    def loss(batch):
        forwards.append(batch["i"])
        m = module.metrics
        m.count[0] += 10
        m.hits[0][0] += batch["i"]
        return torch.tensor(float(batch["i"]))

    engine = SimpleNamespace(eval=lambda: None, train=lambda: None)
    cfg = SimpleNamespace(heads=SimpleNamespace(targets="data"), data=None)
    return SimpleNamespace(spec=SimpleNamespace(num_heads=2), module=module, eval_set=[{"i": i} for i in
                           range(n_batches)], rank=rank, world_size=world_size, engine=engine, loss=loss,
                           device=torch.device("cpu"), tracker=None, cfg=cfg, step=0, forwards=forwards)


def _sharded_eval_rank(rank: int, port: int, n_batches: int, out: str):
    import torch.distributed as dist

    from medusa_train.trainer import MedusaTrainer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        fake = _scripted_trainer(rank, 2, n_batches)
        summary = MedusaTrainer.evaluate(fake)
        Path(f"{out}.{rank}").write_text(json.dumps({"summary": summary, "forwards": fake.forwards}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("n_batches", [3, 4])
def test_held_out_evaluation_is_shared_by_the_ranks(n_batches, tmp_path):
    """Guards against: every rank evaluating every held-out batch (N ranks took as long as one, the final
    evaluation included); a sharded evaluation logging one rank's share instead of the whole set's loss and
    accuracies; ranks running unequal numbers of forwards (a hang under ZeRO-3, which gathers parameters in each)."""
    import torch.multiprocessing as mp

    from medusa_train.trainer import MedusaTrainer

    alone = _scripted_trainer(0, 1, n_batches)
    expected = MedusaTrainer.evaluate(alone)
    assert alone.forwards == list(range(n_batches))
    mp.spawn(_sharded_eval_rank, args=(_free_port(), n_batches, str(tmp_path / "r")), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"r.{r}").read_text()) for r in range(2)]
    for r in ranks:
        assert r["summary"] == pytest.approx(expected)
        assert len(r["forwards"]) == (n_batches + 1) // 2
    assert sorted(ranks[0]["forwards"] + ranks[1]["forwards"][: n_batches // 2]) == list(range(n_batches))
