"""medusa-train refusals that must come before anything is written (issue 43, items 6, 8, 9): one
``medusa-train: error: ...`` line, exit 2, and no ``<output_dir>/.hydra`` record, backbone or folder left
behind; and a TTT unroll the memory estimate counts and the configuration bounds."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import TINY_DATA, clean_env, console_script
from inference.errors import UserError

REFUSED = [
    (["heads.truncated_vocab_size=0"], "heads.truncated_vocab_size must be >= 1"),
    (["heads.truncated_vocab_size=100000"], "heads.truncated_vocab_size=100000 exceeds the backbone vocabulary (320)"),
    (["trainer.micro_batch_size=0"], "trainer.micro_batch_size must be >= 1"),
    (["trainer.global_batch_size=3"], "trainer.global_batch_size=3 is not a multiple"),
    (["trainer.resume={tmp}/missing"], "is not a checkpoint directory"),
    (["heads.kind=eagle3", "backbone.random_init.num_hidden_layers=8", "heads.ttt_steps=100000"],
     "heads.ttt_steps must be in 1..32"),
    (["heads.kind=eagle3", "backbone.random_init.num_hidden_layers=8", "heads.num_heads=100000"], "heads.num_heads"),
    # stage 2 from heads that are not there: refused in preflight, no longer after the backbone loaded
    (["lora.enabled=true", "lora.init_heads={tmp}/nonexist"], "/nonexist: heads directory not found"),
    (["features.mode=train", "features.cache_dir={tmp}/.."], "holds files but no features.json: not a feature cache"),
    (["data.split=test"], "data.split='test', but data.source="),
    # a traceback (transformers' KeyError) and an empty output_dir left behind
    (["+backbone.random_init.hidden_act=nosuch"], "backbone.random_init does not build a model: KeyError: 'nosuch'"),
    # trained to the end unlogged, with a note only: wandb.init refuses such a project
    (["logger.wandb=offline", "logger.project=team/heads"], "logger.project='team/heads': a wandb project name"),
    # Hydra's + adds a key even to a typed section: recorded, never read (the run trained its own 10 steps)
    (["+trainer.max_step=3"], "trainer.max_step is not a setting; did you mean trainer.max_steps?"),
    (["+foo=1"], "foo is not a setting; the keys of a recipe: recipe, output_dir, backbone"),
    # distilled every conversation: only distill.max_conversations bounds a distillation
    (["task=distill", "data.max_conversations=5"], "data.max_conversations is not read by task=distill: use distill."),
]


def snapshot(root: Path) -> dict:
    """Every path under ``root`` with its bytes (folders as None): to prove a refusal wrote nothing."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def medusa_train(tmp: Path, *args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    given = {a.split("=", 1)[0] for a in args}   # a key given twice is refused: the test's own value wins
    defaults = [f"output_dir={out or tmp / 'out'}", f"data.source={TINY_DATA}", "logger.wandb=disabled",
                "trainer.progress_bar=false", "trainer.threads=1"]
    argv = ["debug_tiny", *[d for d in defaults if d.split("=", 1)[0] not in given], *args]
    return subprocess.run([console_script("medusa-train"), *argv], capture_output=True, text=True, cwd=tmp,
                          env=clean_env(), timeout=240)


def assert_one_line_refusal(proc: subprocess.CompletedProcess, phrase: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[transformers]")]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("medusa-train: error: "), proc.stderr[-3000:]
    assert phrase in lines[0], (phrase, lines[0])


@pytest.mark.parametrize("args, phrase", REFUSED, ids=[a[-1] for a, _ in REFUSED])
def test_refused_configuration_writes_nothing(args, phrase, tmp_path):
    """Guards against: a configuration refused only once Hydra ran (or after the backbone loaded) leaving
    ``<output_dir>/.hydra/{config,hydra,overrides}.yaml`` (and a saved random backbone) behind, and an
    eagle3 TTT unroll of 100,000 steps running until the kernel kills it (exit -9, no message)."""
    before = snapshot(tmp_path)
    proc = medusa_train(tmp_path, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert_one_line_refusal(proc, phrase)
    assert snapshot(tmp_path) == before, "a refused command wrote files"


def test_output_dir_that_cannot_be_created_is_one_line(tmp_path):
    """Guards against: ``output_dir=/proc/x`` (a folder the kernel will not let anyone create) ending in
    Hydra's FileNotFoundError traceback instead of one line."""
    proc = medusa_train(tmp_path, out=Path("/proc/medusa-train-x/run"))
    assert_one_line_refusal(proc, "output_dir=/proc/medusa-train-x/run cannot be created")
    assert not Path("/proc/medusa-train-x").exists()


def test_refused_resume_keeps_the_runs_record(tmp_path):
    """Guards against: a resume refused for changed keys overwriting the run's own ``.hydra/config.yaml`` and
    ``overrides.yaml`` with the refused settings (the record then no longer says how the run was trained);
    and an idle rerun of a finished run rewriting it. An accepted resume updates the record."""
    out = tmp_path / "out"
    run = ["trainer.max_steps=2", "trainer.save_every=1", "logger.plot=false"]
    proc = medusa_train(tmp_path, *run, "heads.num_heads=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = out / ".hydra"
    assert "heads.num_heads=2" in (record / "overrides.yaml").read_text()
    assert "num_heads: 2" in (record / "config.yaml").read_text() and (record / "hydra.yaml").is_file()
    before = snapshot(out)

    assert_one_line_refusal(medusa_train(tmp_path, *run, "heads.num_heads=3"), "heads.num_heads (2 -> 3)")
    assert snapshot(out) == before, "a refused resume changed the run's files"
    assert medusa_train(tmp_path, *run, "heads.num_heads=2").returncode == 0  # already trained: nothing to do
    assert snapshot(out) == before, "an idle rerun changed the run's files"

    proc = medusa_train(tmp_path, "trainer.max_steps=3", "trainer.save_every=1", "logger.plot=false",
                        "heads.num_heads=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainer.max_steps=3" in (record / "overrides.yaml").read_text()
    assert "max_steps: 3" in (record / "config.yaml").read_text()


def test_a_task_that_trains_nothing_keeps_the_trained_runs_record(tmp_path):
    """Guards against a finished run's record being rewritten by commands that trained nothing there: an idle
    rerun under another precision (bf16 / ZeRO-2 recorded for fp32 heads) and a feature-cache build into the
    folder (``features.mode=build`` recorded); once its checkpoints were deleted, the original command was then
    refused there as "a finished run trained with another configuration"."""
    import shutil

    out = tmp_path / "out"
    run = ["trainer.max_steps=2", "trainer.save_every=1", "logger.plot=false"]
    assert medusa_train(tmp_path, *run).returncode == 0
    record = snapshot(out / ".hydra")
    proc = medusa_train(tmp_path, *run, "trainer.precision=bf16", "trainer.zero_stage=2")
    assert proc.returncode == 0 and "nothing to do" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert snapshot(out / ".hydra") == record
    proc = medusa_train(tmp_path, *run, "features.mode=build", f"features.cache_dir={tmp_path / 'cache'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert snapshot(out / ".hydra") == record
    shutil.rmtree(out / "checkpoints")
    proc = medusa_train(tmp_path, *run)
    assert proc.returncode == 0, proc.stderr[-3000:]


# -- item 6: the TTT unroll in the memory estimate, bounded ------------------------------------------------
def test_ttt_unroll_is_counted_in_the_memory_estimate(compose_tiny, monkeypatch):
    """Guards against: the memory estimate counting one frozen forward only, so an eagle3 drafter unrolled over
    many TTT steps (each step's activations and its growing attention mask kept for backward) passes the
    check and then grows until the kernel kills the run without a word."""
    from medusa_train import preflight as P
    from medusa_train.backbone import backbone_config
    from medusa_train.config import validate
    from medusa_train.families import training_family
    from medusa_train.families.eagle3 import MAX_TTT_STEPS

    monkeypatch.setattr(P, "available_memory", lambda device: (64 * 2**20, "RAM available"))
    short = compose_tiny("heads.kind=eagle3", "heads.ttt_steps=1", "backbone.random_init.num_hidden_layers=8")
    P.check_fits(short)  # one step fits in 64 MB
    deep = compose_tiny("heads.kind=eagle3", f"heads.ttt_steps={MAX_TTT_STEPS}",
                        "backbone.random_init.num_hidden_layers=8")
    validate(deep)
    with pytest.raises(UserError, match=rf"heads.ttt_steps={MAX_TTT_STEPS}.*or heads.ttt_steps"):
        P.check_fits(deep)
    hf_config = backbone_config(deep.backbone)
    unroll = [training_family("eagle3").unroll_bytes(cfg.heads, hf_config, 256, 2, 4) for cfg in (short, deep)]
    assert unroll[1] > 8 * unroll[0] > 0


def test_ttt_steps_is_bounded(compose_tiny):
    """Guards against: heads.ttt_steps (or an eagle3 heads.num_heads standing in for it) of 100000 accepted."""
    from medusa_train.config import validate
    from medusa_train.families.eagle3 import MAX_TTT_STEPS

    validate(compose_tiny("heads.kind=eagle3", f"heads.ttt_steps={MAX_TTT_STEPS}"))
    for args in (["heads.ttt_steps=100000"], ["heads.num_heads=100000"]):
        with pytest.raises(UserError, match=rf"heads.{args[0][6:].split('=')[0]}.*1..{MAX_TTT_STEPS}"):
            validate(compose_tiny("heads.kind=eagle3", *args))


# -- issue: values that trained silently, ended in a traceback or wrote files before being refused -------------
LATE_OR_NEVER = [
    (["heads.num_heads=100000"], "heads.num_heads must be in 1..64"),
    (["heads.num_layers=1000000"], "heads.num_layers must be in 0..64"),
    (["heads.kind=hydra", "heads.num_heads=100000"], "heads.num_heads must be in 1..64"),
    (["heads.inner_dim=100000000"], "heads.inner_dim is a mlp_speculator setting, not medusa's"),
    (["heads.scale_input=true"], "heads.scale_input is a mlp_speculator setting, not medusa's"),
    (["heads.kind=eagle3", "heads.inner_dim=64"], "heads.inner_dim is a mlp_speculator setting, not eagle3's"),
    (["heads.kind=mlp_speculator", "heads.inner_dim=100000000"], "lower heads.num_heads, heads.inner_dim"),
    (["trainer.threads=-1"], "trainer.threads must be in 0..1024"),
    (["trainer.threads=100000"], "trainer.threads must be in 0..1024"),
    (["backbone.random_init.hidden_size=-64"], "backbone.random_init.hidden_size must be a positive integer"),
    (["backbone.random_init.num_hidden_layers=0"], "backbone.random_init.num_hidden_layers must be a positive integer"),
    (["backbone.random_init.num_attention_heads=3"],
     "backbone.random_init.hidden_size=64 is not a multiple of backbone.random_init.num_attention_heads=3"),
    (["backbone.random_init.num_key_value_heads=3"],
     "backbone.random_init.num_attention_heads=4 is not a multiple of backbone.random_init.num_key_value_heads=3"),
    (["trainer.seed=99999999999999999999"], "trainer.seed must be in 0..9223372036854775807"),
    (["trainer.seed=-1"], "trainer.seed must be in 0..9223372036854775807"),
    (["data.max_conversations=0"], "data.max_conversations must be >= 1"),
    (["data.eval_conversations=-1"], "data.eval_conversations must be >= 1"),
    (["heads.kind=mlp_speculator", "heads.scale_input=3"], "heads.scale_input must be true or false"),
    (["data.packing=3"], "data.packing must be true or false"),
    (["backbone.attn_implementation=bogus"], "backbone.attn_implementation must be one of auto, eager"),
    (["output_dir="], "output_dir is empty"),
    (["-m", "heads.num_heads=2,0"], "heads.num_heads must be >= 1, got 0"),
    (["-m", "heads.num_heads=2", "data.packing=true,3"], "data.packing must be true or false"),
]


@pytest.mark.parametrize("args, phrase", LATE_OR_NEVER, ids=[" ".join(a) for a, _ in LATE_OR_NEVER])
def test_bad_value_is_refused_before_anything_is_written(args, phrase, tmp_path):
    """Guards against: heads.num_heads=100000 / num_layers=1000000 / an mlp_speculator inner_dim=1e8 passing the
    memory estimate (which did not count the heads' parameters, gradients and AdamW state) and failing after a
    minute with an allocation traceback, with .hydra/ and backbone/ written; trainer.threads=-1 or 100000 and a
    negative or zero backbone.random_init size ending in tracebacks; data.max_conversations=0 refused only after
    the backbone was saved; backbone.random_init attention heads that do not divide the hidden size (a 42-line
    strict-dataclass traceback) or by the key/value heads (a RuntimeError in the first forward, after files were
    written); a trainer.seed torch cannot take (an overflow traceback after .hydra/ was written) or numpy cannot
    (negative); heads.scale_input=3 or data.packing=3 read as true; an unknown
    backbone.attn_implementation silently ignored; output_dir= (empty) training into the current folder; a
    sweep (-m) running its good jobs (and writing multirun/) before refusing a bad one."""
    before = snapshot(tmp_path)
    proc = medusa_train(tmp_path, *args)
    assert_one_line_refusal(proc, phrase)
    assert snapshot(tmp_path) == before, "a refused command wrote files"


def test_sweep_flag_after_an_override_is_refused_in_one_line(tmp_path):
    """Guards against: ``output_dir=DIR -m heads.num_heads=2,0`` (an override before -m) printing Hydra's
    argparse usage block instead of one line: -m is taken anywhere among the arguments."""
    out = tmp_path / "out"
    proc = subprocess.run([console_script("medusa-train"), "debug_tiny", f"output_dir={out}", "-m",
                           "heads.num_heads=2,0"], capture_output=True, text=True, cwd=tmp_path, env=clean_env(),
                          timeout=240)
    assert_one_line_refusal(proc, "heads.num_heads must be >= 1, got 0")
    assert not out.exists()


def test_sweep_flag_after_an_override_runs_the_sweep(tmp_path):
    """Guards against: an override before -m sending the whole command to Hydra's argparse (usage block,
    exit 2) instead of running the sweep."""
    proc = medusa_train(tmp_path, "trainer.max_steps=1", "logger.plot=false", "-m", "heads.num_heads=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out" / "multirun" / "0" / "heads").is_dir()


def test_a_sweep_job_refused_for_its_checkpoint_stops_the_sweep_before_any_job_runs(tmp_path):
    """Guards against: a rerun sweep whose second job cannot resume its checkpoint (another seed) being refused only
    when Hydra reached that job: the first job had trained on and re-exported its heads, and the sweep's
    multirun.yaml had been rewritten with the refused overrides."""
    run = ["trainer.max_steps=2", "trainer.save_every=1", "logger.plot=false"]
    assert medusa_train(tmp_path, *run, "-m", "trainer.seed=0,1").returncode == 0
    before = snapshot(tmp_path)
    proc = medusa_train(tmp_path, "trainer.max_steps=3", *run[1:], "-m", "trainer.seed=0,2")
    assert_one_line_refusal(proc, "multirun/1/checkpoints/step-000002: it was trained with a different configuration")
    assert snapshot(tmp_path) == before


def test_sweep_jobs_cross_the_values_as_hydra_does():
    """Guards against: a sweep's combinations prechecked other than as Hydra runs them (a bad job slipping by)."""
    from medusa_train.launch import sweep_jobs

    jobs = sweep_jobs(["heads.num_heads=1,2", "trainer.max_steps=range(1,3)", "output_dir=x"])
    assert len(jobs) == 4 and ["heads.num_heads=2", "trainer.max_steps=2", "output_dir=x"] in jobs


CONFIG_REFUSED = [
    (["heads.loss_decay=-1"], "heads.loss_decay must be finite and > 0"),
    (["heads.loss_decay=0"], "heads.loss_decay must be finite and > 0"),
    (["heads.loss_weights=[1,-1,1]"], "heads.loss_weights must be finite and >= 0"),
    (["heads.loss_weights=[0,0,0]"], "heads.loss_weights must be finite and >= 0 with at least one > 0"),
    (["trainer.global_batch_size=0"], "trainer.global_batch_size must be >= 1 (or null"),
    (["trainer.global_batch_size=-4"], "trainer.global_batch_size must be >= 1"),
    (["trainer.grad_clip=-1"], "trainer.grad_clip must be >= 0"),
    (["data.bucket_buffer=-1"], "data.bucket_buffer must be >= 0"),
    (["data.shuffle_buffer=-1"], "data.shuffle_buffer must be >= 0"),
    (["data.eval_conversations=0"], "data.eval_conversations must be >= 1"),
    (["data.vocab_scan_conversations=0"], "data.vocab_scan_conversations must be >= 1"),
    (["backbone.random_init.num_attention_heads=-2"], "backbone.random_init.num_attention_heads"),
    (["heads.num_layers=65"], "heads.num_layers must be in 0..64"),
    # accepted and ignored: the run trained one projection per step whatever num_layers said
    (["heads.kind=mlp_speculator", "heads.num_layers=3"], "heads.num_layers must be 1 (or 0, the same), got 3"),
]


@pytest.mark.parametrize("args, phrase", CONFIG_REFUSED, ids=[" ".join(a) for a, _ in CONFIG_REFUSED])
def test_meaningless_value_is_refused_by_validation(args, phrase, compose_tiny):
    """Guards against: a negative loss decay or loss weight (training heads away from their targets), a
    global batch of 0 silently read as the default, a negative grad_clip or buffer, and data.eval_conversations=0
    (which failed only after the backbone loaded: no held-out conversations) training silently or late."""
    from medusa_train.config import validate

    with pytest.raises(UserError, match=re.escape(phrase)):
        validate(compose_tiny(*args))


def test_accepted_edges_still_validate(compose_tiny):
    """Guards against: the new bounds refusing documented values (0 = off / default)."""
    from medusa_train.config import validate

    validate(compose_tiny("trainer.threads=0", "trainer.grad_clip=0", "data.shuffle_buffer=0", "data.bucket_buffer=0",
                          "trainer.global_batch_size=null", "heads.loss_weights=[1,0,0]"))
    validate(compose_tiny("heads.num_heads=64", "heads.num_layers=64"))
    validate(compose_tiny("heads.kind=mlp_speculator", "heads.inner_dim=32", "heads.scale_input=true"))
    validate(compose_tiny(f"trainer.seed={2**63 - 1}", "backbone.random_init.num_key_value_heads=1"))
    validate(compose_tiny("backbone.random_init.num_attention_heads=4", "+backbone.random_init.head_dim=8"))


def test_random_init_heads_are_checked_on_the_built_config():
    """Guards against: attention heads that cannot divide, hidden by what the model type fills in (here
    Mistral's default 8 key/value heads) or by an explicit head_dim, ending in a traceback (transformers'
    StrictDataclassClassValidationError, or a RuntimeError in the first forward) instead of one line."""
    from medusa_train.backbone import random_config

    with pytest.raises(UserError, match=r"^backbone.random_init: num_attention_heads=12 is not a multiple of "
                                        r"num_key_value_heads=8$"):
        random_config({"model_type": "mistral", "hidden_size": 96, "num_attention_heads": 12})
    with pytest.raises(UserError, match=r"^backbone.random_init: The hidden size \(64\) is not a multiple"):
        random_config({"hidden_size": 64, "num_attention_heads": 3, "head_dim": 16})
    assert random_config({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}).head_dim == 16


def test_derived_seeds_stay_in_torchs_range():
    """Guards against: the largest accepted trainer.seed overflowing torch.manual_seed where an epoch's seed is
    derived from it (seed * 1_000_003 + epoch: the feature cache's epoch order; distill's shards alike), and
    the small seeds every run so far used getting another order from the fix."""
    from medusa_train.config import MAX_SEED
    from medusa_train.features import CachedBatches

    manifest = {"shard_batches": 4, "batches": 8}
    assert sorted(CachedBatches(None, manifest, 0, 1, MAX_SEED, "cpu", torch.float32).order(3)) == list(range(8))
    expected = torch.randperm(8, generator=torch.Generator().manual_seed(5 * 1_000_003 + 2)).tolist()
    assert CachedBatches(None, manifest, 0, 1, 5, "cpu", torch.float32).order(2) == expected


@pytest.mark.parametrize("kind", ["medusa", "hydra", "mlp_speculator", "eagle3"])
def test_head_parameter_count_matches_the_trained_heads(kind, compose_tiny):
    """Guards against: the memory estimate counting heads other than those the trainer builds (the estimate
    asks each family for its module, built on the meta device from the spec the trainer writes)."""
    from inference.heads.registry import init_heads
    from inference.heads.spec import HeadsSpec
    from medusa_train.backbone import random_config
    from medusa_train.families import draft_depth, draft_vocabulary, training_family
    from medusa_train.preflight import head_parameter_count

    extra = ["backbone.random_init.num_hidden_layers=8"] if kind == "eagle3" else ["heads.num_layers=2"]
    cfg = compose_tiny(f"heads.kind={kind}", *extra)
    hf = random_config(dict(cfg.backbone.random_init))
    projection, n = draft_vocabulary(cfg.heads, hf.vocab_size)
    spec = HeadsSpec(num_heads=draft_depth(cfg.heads), num_layers=cfg.heads.num_layers, hidden_size=hf.hidden_size,
                     vocab_size=hf.vocab_size, projection=projection, truncated_vocab_size=n, kind=kind,
                     settings=training_family(kind).spec_settings(cfg.heads, hf))
    matrix = torch.zeros(hf.vocab_size, hf.hidden_size)
    heads = init_heads(spec, matrix, matrix, torch.arange(n))
    assert head_parameter_count(cfg.heads, hf) == sum(p.numel() for p in heads.parameters()) > 0


def test_zero_shards_the_heads_state_in_the_memory_estimate():
    """Guards against the memory check counting 16 bytes a head parameter on every process whatever the ZeRO stage:
    heads that fit sharded over 8 GPUs (stage 2: ~4 bytes a parameter each) were refused on any number of them."""
    from types import SimpleNamespace

    from medusa_train.preflight import HEAD_STATE_BYTES, head_state_bytes

    def per_param(stage, precision, world):
        return head_state_bytes(SimpleNamespace(zero_stage=stage, precision=precision), world)

    assert per_param(0, "fp32", 8) == per_param(3, "fp32", 1) == per_param(2, "bf16", 1) == HEAD_STATE_BYTES
    assert per_param(1, "bf16", 8) == 2 + 2 + 12 / 8 + 4    # DeepSpeed's BF16 optimizer: a full fp32 gradient
    assert per_param(2, "bf16", 8) == 2 + 14 / 8
    assert per_param(3, "bf16", 8) == 16 / 8
    assert per_param(2, "fp32", 8) == 4 + 16 / 8             # the ZeRO optimizer's fp32 master partition too


def test_the_heads_logits_and_a_joint_backbone_are_counted(compose_tiny, monkeypatch):
    """Guards against the memory check leaving out what the loss keeps for backward: every head's fp32 logits over
    its projection (several GiB for heads with their own full-vocabulary projection at 8B scale), and under LoRA
    the backbone's own activations (every layer's without gradient checkpointing) and full-vocabulary loss: runs it
    accepted then ran out of memory."""
    from medusa_train import preflight as P
    from medusa_train.backbone import backbone_config
    from medusa_train.families import training_family

    cfg = compose_tiny("heads.projection=own")
    hf_config = backbone_config(cfg.backbone)
    vocab = hf_config.vocab_size
    k = int(cfg.heads.num_heads)
    assert training_family("medusa").loss_bytes(cfg.heads, hf_config, 256, 2) == 2 * 256 * vocab * (4 * k + 8)
    teacher = compose_tiny("heads.projection=own", "heads.teacher_weight=0.5").heads
    assert training_family("medusa").loss_bytes(teacher, hf_config, 256, 2) == 2 * 256 * vocab * (12 * k + 16)
    assert training_family("eagle3").loss_bytes(compose_tiny("heads.kind=eagle3").heads, hf_config, 256, 2) == 0
    joint = compose_tiny("lora.enabled=true")
    whole = compose_tiny("lora.enabled=true", "lora.gradient_checkpointing=false")
    assert P.joint_bytes(whole, hf_config, 256, 2, 4) > P.joint_bytes(joint, hf_config, 256, 2, 4) > 0
    assert P.joint_bytes(cfg, hf_config, 256, 2, 4) == 0

    need = {}
    monkeypatch.setattr(P, "_refuse_fit", lambda cfg, total, *rest: need.setdefault(cfg.lora.enabled, total))
    monkeypatch.setattr(P, "available_memory", lambda device: (1, "RAM available"))
    for c in (compose_tiny(), whole):
        P.check_fits(c)
    assert need[True] - need[False] >= P.joint_bytes(whole, hf_config, cfg.data.max_length,
                                                      cfg.trainer.micro_batch_size, 4)
    monkeypatch.undo()
    monkeypatch.setattr(P, "available_memory", lambda device: (need[True] - 1, "RAM available"))
    with pytest.raises(UserError, match=r"for the heads' logits and the backbone's own gradients \(LoRA\)"):
        P.check_fits(whole)


def test_heads_state_is_counted_in_the_memory_estimate(compose_tiny, monkeypatch):
    """Guards against: check_fits counting the frozen forward and the backbone's weights only, so heads whose
    parameters (with gradients and two fp32 AdamW moments each) cannot fit passed the check and failed after
    the backbone loaded, with an allocation traceback."""
    from medusa_train import preflight as P

    monkeypatch.setattr(P, "available_memory", lambda device: (256 * 2**20, "RAM available"))
    P.check_fits(compose_tiny("heads.kind=mlp_speculator", "heads.inner_dim=64"))
    big = compose_tiny("heads.kind=mlp_speculator", "heads.inner_dim=4096")  # ~4096^2 x 2 params x 16 B > 256 MB
    # not heads.num_layers: an MLP speculator stacks no layers
    with pytest.raises(UserError, match=r"heads.kind=mlp_speculator .* parameters.*lower heads.num_heads, "
                                        r"heads.inner_dim or heads.truncated_vocab_size"):
        P.check_fits(big)


def test_random_init_takes_nested_values_and_says_why_it_refuses(compose_tiny):
    """Guards against: a nested ``backbone.random_init`` value (a rope_scaling dict, a layer_types list) reaching
    transformers as an OmegaConf node, refused with an empty reason ("Validation error for field 'rope_parameters':"
    and nothing after it: the cause line was dropped by a case-sensitive match)."""
    from medusa_train.backbone import random_config

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    cfg = compose_tiny("+backbone.random_init.rope_scaling=" + str(rope).replace("'", "").replace(" ", ""),
                       "+backbone.random_init.layer_types=[full_attention,full_attention]")
    built = random_config(cfg.backbone.random_init)
    assert built.rope_parameters["rope_type"] == "llama3" and built.layer_types == ["full_attention"] * 2
    with pytest.raises(UserError) as e:
        random_config({"layer_types": "full_attention"})
    assert not str(e.value).rstrip().endswith(":") and "\n" not in str(e.value)


def test_random_backbone_takes_the_runs_attention_implementation(tmp_path, capsys):
    """Guards against: a random Gemma-2 backbone (transformers refuses it sdpa) ending in a ValueError traceback
    under ``backbone.attn_implementation=sdpa``, ``backbone.attn_implementation=eager``, which the pretrained path
    honours, being ignored for it, and the default refusing it (``auto``: sdpa, or eager for a class without it)."""
    from medusa_train.backbone import random_backbone

    tiny = {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    with pytest.raises(UserError, match=r"Gemma2ForCausalLM does not support attn_implementation='sdpa' .*: set "
                                        r"backbone.attn_implementation=eager$") as e:
        random_backbone(tiny, attn_implementation="sdpa")
    assert "\n" not in str(e.value)
    assert random_backbone(tiny, attn_implementation="eager").model.config._attn_implementation == "eager"
    assert random_backbone(tiny).model.config._attn_implementation == "eager"
    assert random_backbone({**tiny, "model_type": "llama"}).model.config._attn_implementation == "sdpa"


def test_a_backbone_the_runtime_cannot_decode_trains_with_a_note(compose_tiny, capsys):
    """Guards against: heads trained for a backbone the runtime cannot decode (ALiBi: Falcon-RW) without a word, and
    refused only afterwards by medusa-eval / medusa-generate, or for one it decodes only within a sliding window
    (Gemma-3's default layers) without saying so: the run says so before it starts (the heads still serve in
    engines), and says nothing for a full-attention backbone."""
    from medusa_train.preflight import check_family

    check_family(compose_tiny())
    assert "note:" not in capsys.readouterr().err
    check_family(compose_tiny("backbone.random_init.model_type=falcon", "+backbone.random_init.alibi=true"))
    err = capsys.readouterr().err
    assert "positions its tokens by ALiBi biases" in err and "medusa-eval and medusa-generate will refuse" in err
    check_family(compose_tiny("backbone.random_init.model_type=gemma3_text", "+backbone.random_init.head_dim=16",
                              "+backbone.random_init.sliding_window=64"))
    err = capsys.readouterr().err
    assert err.strip() == ("note: the backbone attends within a 64-token sliding window: medusa-eval and "
                           "medusa-generate decode requests within it (serving engines decode longer ones)"), err


@pytest.mark.parametrize("files, words", [
    (["distill.json", "data/"], "holds self-distillation data (distill.json)"),
    (["config.json", "model.safetensors"], "holds heads or an engine export (config.json)"),
    (["report.json", "report.md"], "holds an evaluation report (report.json)"),
    (["features.json"], "holds a features cache (features.json)"),
])
def test_another_commands_output_is_no_training_runs_folder(files, words, tmp_path):
    """Guards against: ``output_dir=`` naming a distillation's folder, a heads or export folder or an evaluation,
    which the run wrote its heads/, checkpoints/ and record into (the distillation's record overwritten), exit 0."""
    out = tmp_path / "other"
    out.mkdir()
    for name in files:
        if name.endswith("/"):
            (out / name).mkdir()
        else:
            (out / name).write_text("{}")
    before = snapshot(out)
    proc = medusa_train(tmp_path, "trainer.max_steps=1", out=out)
    assert proc.returncode == 2 and words in proc.stderr and "not a training run" in proc.stderr, proc.stderr
    assert snapshot(out) == before


def test_a_finished_run_without_checkpoints_is_not_trained_over_by_another_configuration(compose_tiny, tmp_path,
                                                                                         out_dir):
    """Guards against: a finished run whose checkpoints/ was deleted (nothing to compare a resume with) trained over
    by another configuration: its heads replaced in silence (or, killed midway, its old heads beside the new run's
    record). The same configuration, and trainer.resume=never, still train there."""
    import shutil

    from medusa_train.preflight import check_run_folder

    assert medusa_train(tmp_path, "trainer.max_steps=1", "logger.plot=false", out=out_dir).returncode == 0
    shutil.rmtree(out_dir / "checkpoints")
    before = snapshot(out_dir)
    proc = medusa_train(tmp_path, "heads=hydra", "trainer.max_steps=1", "logger.plot=false", out=out_dir)
    assert proc.returncode == 2 and "holds a finished run trained with another configuration (heads.kind" \
        in proc.stderr, proc.stderr
    assert snapshot(out_dir) == before
    check_run_folder(compose_tiny("trainer.max_steps=3"), resumed=False)   # a safe key: the same run, longer
    check_run_folder(compose_tiny("heads=hydra", "trainer.resume=never"), resumed=False)


def test_a_finished_runs_automatic_keys_written_out_at_their_resolved_values_are_the_same_run(compose_tiny, out_dir):
    """Guards against: the finished-run check refusing a rerun that writes an automatic key out at the value the run
    resolved (EAGLE-3's heads.aux_layers as the default picks them), which a checkpoint's resume accepts."""
    from omegaconf import OmegaConf

    from medusa_train.backbone import backbone_config
    from medusa_train.checkpoint import config_dict, resolved_settings
    from medusa_train.preflight import check_run_folder

    eagle = ["heads=eagle3", "backbone.random_init.num_hidden_layers=8"]
    first = compose_tiny(*eagle)
    (out_dir / "heads").mkdir(parents=True)
    (out_dir / ".hydra").mkdir()
    (out_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(first))
    layers = resolved_settings(config_dict(first), backbone_config(first.backbone))["heads.aux_layers"]
    check_run_folder(compose_tiny(*eagle, f"heads.aux_layers={list(layers)}"), resumed=False)
    with pytest.raises(UserError, match="heads.aux_layers"):
        check_run_folder(compose_tiny(*eagle, f"heads.aux_layers={[1, 2, 3]}"), resumed=False)


def test_a_second_run_into_a_folder_in_use_is_refused_and_writes_nothing(tmp_path):
    """Guards against: two medusa-train launches into one output_dir both running (the second resuming the first's
    checkpoints, metrics.jsonl logging every step twice, each exporting over the other's heads): the second is
    refused in one line, before it writes, while the first holds the folder; once it is gone the folder is free."""
    import fcntl
    import os

    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # as the first run's task holds it
        before = snapshot(tmp_path)
        proc = medusa_train(tmp_path, "trainer.max_steps=1", out=out)
        assert_one_line_refusal(proc, f"output_dir={out} is in use by another medusa-train run")
        assert snapshot(tmp_path) == before
    finally:
        os.close(fd)
    proc = medusa_train(tmp_path, "trainer.max_steps=1", "logger.plot=false", out=out)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_online_logging_without_a_wandb_key_is_refused_before_anything_loads(tmp_path):
    """Guards against ``logger.wandb=online`` with no wandb API key starting the run: the backbone, the data and
    the engine loaded, the run's record was written, and then wandb stopped at its login menu (on a terminal) or
    the run trained unlogged. One line, exit 2, nothing written."""
    pytest.importorskip("wandb")
    env = {k: v for k, v in clean_env().items() if not k.startswith("WANDB_") and k != "NETRC"}
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"))
    before = snapshot(tmp_path)
    proc = subprocess.run([console_script("medusa-train"), "debug_tiny", f"output_dir={tmp_path / 'out'}",
                           f"data.source={TINY_DATA}", "logger.wandb=online", "trainer.progress_bar=false"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240,
                          stdin=subprocess.DEVNULL)
    assert_one_line_refusal(proc, "logger.wandb=online: wandb has no API key here (run `wandb login`")
    assert snapshot(tmp_path) == before, "a refused command wrote files"


def test_an_mlp_speculator_run_recorded_with_more_layers_resumes_under_one(compose_tiny):
    """Guards against stranding a run started before heads.num_layers was refused for an MLP speculator (it stacks
    no layers, so 2 trained what 1 trains): its own command now refused, the corrected one refused as another
    configuration. The key resolves to 1 for both, as an automatic key does."""
    from medusa_train.backbone import random_config
    from medusa_train.checkpoint import config_dict, resolved_settings, unresolved_changes

    new = config_dict(compose_tiny("heads.kind=mlp_speculator"))
    saved = {**new, "heads": {**new["heads"], "num_layers": 2}}
    hf = random_config(dict(new["backbone"]["random_init"]))
    assert unresolved_changes(["heads.num_layers"], saved, new, lambda c: resolved_settings(c, hf)) == []


def test_cached_runs_count_the_larger_phase_not_the_sum(compose_tiny, monkeypatch):
    """Guards against: the memory check of a run trained from the feature cache adding the backbone's weights and
    forward to the heads' training (the body is freed before the heads are built), refusing runs that fit, or
    counting the training phase without the embeddings and lm_head the heads still read."""
    from medusa_train import preflight as P
    from medusa_train.backbone import backbone_config

    need = {}
    monkeypatch.setattr(P, "_refuse_fit", lambda cfg, total, *rest: need.setdefault(cfg.features.mode, total))
    monkeypatch.setattr(P, "available_memory", lambda device: (1, "RAM available"))
    online, cached = compose_tiny(), compose_tiny("features.mode=train")
    P.check_fits(online)
    P.check_fits(cached)
    assert 0 < need["train"] < need["off"]
    hf_config = backbone_config(cached.backbone)
    kept = P._embedding_bytes(hf_config, 4)
    vocab, hidden = hf_config.vocab_size, hf_config.hidden_size
    assert kept == vocab * hidden * 4 * (1 if hf_config.tie_word_embeddings else 2)
    monkeypatch.undo()
    monkeypatch.setattr(P, "available_memory", lambda device: (need["train"] - 1, "RAM available"))
    with pytest.raises(UserError, match=r"the larger of building the feature cache \(.*\) and training from it "
                                        r"\(.*for the embeddings and lm_head kept\)"):
        P.check_fits(cached)
    monkeypatch.setattr(P, "available_memory", lambda device: (need["train"], "RAM available"))
    P.check_fits(cached)


def test_resuming_another_folders_checkpoint_over_a_run_is_refused(tmp_path):
    """Guards against: ``trainer.resume=<A's checkpoint>`` into an output_dir B holding a run of its own being
    accepted (only A's checkpoint was compared): B's checkpoints of the same steps and its heads were written
    over, its metrics appended to with another run's. Into an empty folder, and B's own checkpoint by path,
    stay accepted."""
    run = ["trainer.max_steps=2", "trainer.save_every=1", "logger.plot=false"]
    a, b = tmp_path / "a", tmp_path / "b"
    for out, extra in ((a, []), (b, ["heads.num_heads=2"])):
        assert medusa_train(tmp_path, *run, *extra, out=out).returncode == 0
    before = snapshot(tmp_path)
    proc = medusa_train(tmp_path, *run[1:], "trainer.max_steps=3", f"trainer.resume={a}/checkpoints/step-000001",
                        out=b)
    assert_one_line_refusal(proc, "is another folder's checkpoint but output_dir=")
    assert "holds a run of its own (checkpoints step-000001, step-000002)" in proc.stderr
    assert snapshot(tmp_path) == before
    from medusa_train import preflight as P
    from medusa_train.launch import compose_recipe

    def cfg(out, resume):
        return compose_recipe("debug_tiny", [f"output_dir={out}", f"trainer.resume={resume}", f"data.source={TINY_DATA}"])

    P.check_run_folder(cfg(tmp_path / "c", a / "checkpoints" / "step-000001"), resumed=True)   # an empty folder
    P.check_run_folder(cfg(b, b / "checkpoints" / "step-000001"), resumed=True)   # its own checkpoint


@pytest.mark.parametrize("damage", ["truncate_heads", "drop_optimizer"])
def test_a_damaged_checkpoint_is_refused_before_anything_loads(damage, tmp_path):
    """Guards against: a checkpoint whose heads or optimizer file was cut short (a full disk, a copy interrupted)
    found only by ``load``, after the backbone loaded and the data was scanned, and the refused resume having
    rewritten the run's record (``.hydra/config.yaml``) with its own settings."""
    out = tmp_path / "out"
    assert medusa_train(tmp_path, "trainer.max_steps=2", "trainer.save_every=1", "logger.plot=false").returncode == 0
    ckpt = out / "checkpoints" / "step-000002"
    if damage == "truncate_heads":
        (ckpt / "heads.safetensors").write_bytes((ckpt / "heads.safetensors").read_bytes()[:100])
    else:
        (ckpt / "optimizer.safetensors").unlink()
    before = snapshot(tmp_path)
    proc = medusa_train(tmp_path, "trainer.max_steps=3", "trainer.save_every=1", "logger.plot=false")
    assert_one_line_refusal(proc, f"checkpoint {ckpt} is incomplete or corrupt (")
    assert "delete it to resume from an earlier one" in proc.stderr
    assert snapshot(tmp_path) == before


def test_resuming_on_rewritten_data_is_refused(tmp_path):
    """Guards against: a run resumed after its data file was rewritten, accepted silently: the checkpoint's stream
    position then pointed into other conversations (neither the run continued nor a fresh one). The same data
    resumes; the refusal writes nothing."""
    data = tmp_path / "data.jsonl"
    data.write_text(Path(TINY_DATA).read_text())
    run = ["trainer.max_steps=2", "trainer.save_every=1", "logger.plot=false", f"data.source={data}"]
    assert medusa_train(tmp_path, *run).returncode == 0
    state = json.loads((tmp_path / "out" / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["data_fingerprint"].startswith("1 file, ")
    lines = Path(TINY_DATA).read_text().splitlines(keepends=True)
    data.write_text("".join(lines[1:] + lines[:1]))   # the same conversations, another order
    before = snapshot(tmp_path)
    proc = medusa_train(tmp_path, *run[1:], "trainer.max_steps=3")
    assert_one_line_refusal(proc, f"it was trained on other content of data.source={data}")
    assert snapshot(tmp_path) == before
    data.write_text(Path(TINY_DATA).read_text())
    assert medusa_train(tmp_path, *run[1:], "trainer.max_steps=3").returncode == 0
