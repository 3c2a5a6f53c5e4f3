"""Recipes, the structured-config schema, ``validate``, the batch arithmetic and the DeepSpeed config."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import TINY_DATA
from inference.errors import UserError
from medusa_train.cli import available_recipes, recipe_summary
from medusa_train.launch import compose_recipe
from medusa_train.config import (BatchPlan, HeadsConfig, Precision, RecipeConfig, TrainerConfig, derived_batch,
                                 loss_weights, validate)
from medusa_train.deepspeed_config import check_consistent, deepspeed_config


# -- recipes ---------------------------------------------------------------------------------
def test_recipes_are_found():
    """Guards against: the recipe package data (recipes/*.yaml) not being found, so --help lists nothing."""
    names = available_recipes()
    assert "debug_tiny" in names and "medusa1_smollm2" in names
    assert all(not n.startswith("base") for n in names)  # base/ holds fragments, not recipes


@pytest.mark.parametrize("name", available_recipes())
def test_every_recipe_composes_and_validates(name, monkeypatch):
    """Guards against: a shipped recipe with an unknown key, a wrong type or an invalid combination
    (e.g. bf16 with ZeRO 0), which would only surface when a user runs it. No model is built."""
    import medusa_train.backbone as backbone

    def no_models(*a, **k):
        raise AssertionError("composing a recipe must not build a model")

    monkeypatch.setattr(backbone, "load_backbone", no_models)
    cfg = compose_recipe(name, [])
    validate(cfg)
    assert cfg.recipe == name
    assert cfg.output_dir  # every recipe names where it writes
    assert recipe_summary(name)  # and has a one-line purpose for --help
    derived_batch(cfg.trainer, 1)  # its batch arithmetic holds on one process
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves


def test_recipe_overrides_apply_with_types():
    """Guards against: overrides being ignored or kept as strings (the schema must type them)."""
    cfg = compose_recipe("debug_tiny", ["trainer.max_steps=3", "heads.projection=own", "optim.lr=0.5"])
    assert cfg.trainer.max_steps == 3 and isinstance(cfg.trainer.max_steps, int)
    assert cfg.heads.projection.value == "own"
    assert cfg.optim.lr == 0.5


@pytest.mark.parametrize("override, key", [
    ("trainer.nope=1", "nope"),
    ("trainer.max_steps=abc", "max_steps"),
    ("heads.projection=bogus", "projection"),
    ("trainer.precision=fp8", "precision"),
])
def test_schema_rejects_unknown_keys_and_wrong_types(override, key):
    """Guards against: a typo'd key or an ill-typed value being silently accepted by the recipe."""
    with pytest.raises(Exception) as info:
        compose_recipe("debug_tiny", [override])
    assert key in str(info.value) + str(info.value.__cause__)


# -- validate ----------------------------------------------------------------------------------
def _cfg(**sections):
    """The schema's config with ``section__key=value`` set; ``heads__kind`` picks that family's heads schema (what
    its config group composes), and a key the schema lacks is added anyway, for ``validate`` to judge."""
    from medusa_train.families import training_family

    cfg = OmegaConf.structured(RecipeConfig)
    kind = sections.get("heads__kind")
    if kind is not None:
        cfg.heads = OmegaConf.structured(training_family(kind).config(kind=kind))
    for dotted, value in sections.items():
        OmegaConf.update(cfg, dotted.replace("__", "."), value, force_add=True)
    return cfg


def test_default_schema_is_valid():
    """Guards against: the schema's own defaults failing validation."""
    validate(_cfg())


@pytest.mark.parametrize("overrides, key", [
    ({"trainer__precision": "bf16", "trainer__zero_stage": 0}, "trainer.precision"),
    ({"trainer__precision": "fp16", "trainer__zero_stage": 0}, "trainer.precision"),
    ({"trainer__max_steps": 0}, "trainer.max_steps"),
    ({"trainer__zero_stage": 4}, "trainer.zero_stage"),
    ({"trainer__device": "tpu"}, "trainer.device"),
    ({"trainer__keep_last": 0}, "trainer.keep_last"),
    ({"heads__num_heads": 0}, "heads.num_heads"),
    ({"heads__num_layers": -1}, "heads.num_layers"),
    ({"heads__tie_weights": True}, "heads.tie_weights"),
    ({"heads__kind": "mlp_speculator", "heads__tie_weights": True, "heads__num_heads": 1}, "heads.tie_weights"),
    ({"heads__teacher_weight": 1.5}, "heads.teacher_weight"),
    ({"heads__feature_noise": -0.1}, "heads.feature_noise"),
    ({"heads__feature_noise": 2.0}, "heads.feature_noise"),
    ({"heads__loss_weights": [1.0, 0.5]}, "heads.loss_weights"),
    ({"data__max_length": 4}, "data.max_length"),
    ({"backbone__dtype": "int8"}, "backbone.dtype"),
    ({"optim__lr": -1.0}, "optim.lr"),
    ({"optim__lr": 0.0}, "optim.lr"),
    ({"optim__betas": [1.5, 0.9]}, "optim.betas"),
    ({"optim__betas": [0.9, -0.1]}, "optim.betas"),
    ({"optim__betas": [0.9]}, "optim.betas"),
    ({"optim__weight_decay": -1.0}, "optim.weight_decay"),
    ({"optim__eps": -1.0}, "optim.eps"),
    ({"optim__warmup_steps": -1}, "optim.warmup_steps"),
    ({"optim__min_lr_ratio": 1.5}, "optim.min_lr_ratio"),
    ({"optim__lr": float("inf")}, "optim.lr must be finite"),
    ({"optim__weight_decay": float("inf")}, "optim.weight_decay must be finite"),
    ({"optim__eps": float("inf")}, "optim.eps must be finite"),
    ({"heads__loss_decay": float("inf")}, "heads.loss_decay must be finite"),
    ({"heads__loss_weights": [float("nan"), 1.0, 1.0]}, "heads.loss_weights must be finite"),
    ({"heads__loss_weights": [float("inf"), 1.0, 1.0]}, "heads.loss_weights must be finite"),
])
def test_validate_rejects_bad_values_naming_the_key(overrides, key):
    """Guards against: an invalid value or combination reaching the trainer (e.g. bf16 without ZeRO,
    which would checkpoint bf16 weights instead of fp32 masters), or an error not naming the key; an infinite
    rate, decay or loss weight (or a NaN weight: NaN < 0 is false) loading everything to stop at step 1 with "loss
    became NaN/inf ... try trainer.precision=fp32", or an infinite eps training nothing and exiting 0."""
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        validate(_cfg(**overrides))


def test_output_dir_that_is_a_file_or_under_one_is_refused(tmp_path):
    """Guards against: output_dir naming a file (or a folder under a file) surfacing as a traceback from
    mkdir after the backbone loaded; validate refuses it in one line and creates nothing."""
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        validate(_cfg(output_dir=str(tmp_path / "f")))
    with pytest.raises(UserError, match="cannot be created"):
        validate(_cfg(output_dir=str(tmp_path / "f" / "run")))
    validate(_cfg(output_dir=str(tmp_path / "new" / "run")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


@pytest.mark.parametrize("source, words", [
    ("/nonexistent/chats.jsonl", "data file not found"), ("embedded:nope", "unknown embedded dataset"),
    ("{tmp}/empty", "no .json/.jsonl/.parquet files"), ("{tmp}/data.csv", "unsupported data file"),
    ("", "data.source is empty"), ("  ", "data.source is empty")])
def test_local_data_source_checked_before_loading(source, words, tmp_path):
    """Guards against: a missing or unreadable data file being found only after the backbone loaded, and an empty
    data.source read as the current folder (every JSON file under it, earlier runs' metrics and configs too)."""
    from medusa_train.config import check_data_source

    (tmp_path / "empty").mkdir()
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(UserError, match=words):
        check_data_source(source.replace("{tmp}", str(tmp_path)))
    check_data_source("embedded:sharegpt")
    check_data_source("org/some-hub-dataset")  # left to the reader


def test_named_backbone_clears_the_recipes_random_init():
    """Guards against: `medusa-train debug_tiny backbone.name_or_path=<dir>` silently training the recipe's
    random backbone; naming random_init too on the command line is refused, also when the name given is the
    default's (`embedded:smollm2`, which the config's own check cannot tell from no name: it trained the random
    backbone); a config with both is refused by validate."""
    assert compose_recipe("debug_tiny", ["backbone.name_or_path=/m"]).backbone.random_init is None
    assert compose_recipe("debug_tiny", ["++backbone.name_or_path=/m"]).backbone.random_init is None
    for name in ("/m", "embedded:smollm2"):
        for random in ("backbone.random_init.hidden_size=32", "+backbone.random_init={hidden_size: 32}"):
            with pytest.raises(UserError, match="both name a backbone"):
                compose_recipe("debug_tiny", [f"backbone.name_or_path={name}", random])
    cleared = compose_recipe("debug_tiny", ["backbone.name_or_path=/m", "backbone.random_init=null"])
    assert cleared.backbone.random_init is None
    both = compose_recipe("debug_tiny", ["backbone.random_init.hidden_size=32"])
    both.backbone.name_or_path = "/m"
    with pytest.raises(UserError, match="both name a backbone"):
        validate(both)
    assert compose_recipe("debug_tiny", []).backbone.random_init  # the recipe alone keeps its random backbone


def test_max_length_checked_against_positions_and_memory(monkeypatch):
    """Guards against: data.max_length beyond the backbone's max_position_embeddings (IndexError deep in the
    forward) or too large for memory (killed at 23 GB) being accepted; both come from the config alone."""
    import medusa_train.backbone as B
    import medusa_train.preflight as P

    def no_weights(*a, **k):
        raise AssertionError("check_fits must not build the model")

    monkeypatch.setattr(B, "random_backbone", no_weights)
    P.check_fits(compose_recipe("debug_tiny", ["trainer.device=cpu"]))  # the recipe fits
    with pytest.raises(UserError, match="exceeds the 512 positions"):
        P.check_fits(compose_recipe("debug_tiny", ["data.max_length=513", "trainer.device=cpu"]))
    monkeypatch.setattr(P, "available_memory", lambda device: (2**20, "RAM available"))
    with pytest.raises(UserError, match=r"data.max_length=256 x trainer.micro_batch_size=2 needs about .* only 0.0 GB of RAM available"):
        P.check_fits(compose_recipe("debug_tiny", ["trainer.device=cpu"]))
    # the estimate: mask (B*T*T*(4+4)) + per-token layer tensors (B*T*(6H+3I)*4)
    cfg = B.random_config({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4})
    assert P.micro_batch_bytes(cfg, 100, 2, 4) == 2 * (100 * (6 * 64 + 3 * 128) * 4 + 100 * 100 * 8)


def test_bf16_with_zero1_is_accepted():
    """Guards against: the bf16 rule refusing the supported combination (bf16 + ZeRO >= 1)."""
    validate(_cfg(trainer__precision="bf16", trainer__zero_stage=1))


def test_loss_weights_default_decay_and_explicit():
    """Guards against: lambda_k off by one (decay**0 for head 1) or explicit weights being ignored."""
    assert loss_weights(HeadsConfig(num_heads=3, loss_decay=0.8)) == pytest.approx([0.8, 0.64, 0.512])
    assert loss_weights(HeadsConfig(num_heads=2, loss_weights=[1.0, 0.25])) == [1.0, 0.25]


# -- batch arithmetic ---------------------------------------------------------------------------
@pytest.mark.parametrize("micro, glob, world, accum", [
    (2, None, 1, 1), (2, None, 4, 1), (2, 8, 1, 4), (2, 8, 2, 2), (1, 6, 3, 2), (4, 64, 8, 2),
])
def test_derived_batch_arithmetic(micro, glob, world, accum):
    """Guards against: global batch != micro x accumulation x world (wrong effective batch / LR scale)."""
    plan = derived_batch(TrainerConfig(micro_batch_size=micro, global_batch_size=glob), world)
    assert plan.grad_accum == accum
    assert plan.global_batch_size == plan.micro_batch_size * plan.grad_accum * plan.world_size


@pytest.mark.parametrize("micro, glob, world", [(2, 5, 1), (2, 6, 2), (3, 8, 2), (0, None, 1)])
def test_derived_batch_rejects_non_multiples(micro, glob, world):
    """Guards against: a global batch that is not a multiple of micro x world being rounded silently."""
    with pytest.raises(UserError, match="micro_batch_size"):
        derived_batch(TrainerConfig(micro_batch_size=micro, global_batch_size=glob), world)


# -- DeepSpeed config ---------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_deepspeed_config_per_stage(stage, precision):
    """Guards against: DeepSpeed batch keys disagreeing with the plan, bf16/fp16 flags crossed, or a
    ZeRO stage's keys leaking into another stage."""
    t = TrainerConfig(micro_batch_size=2, global_batch_size=16, zero_stage=stage, precision=Precision(precision),
                      grad_clip=0.5)
    plan = derived_batch(t, 2)
    cfg = deepspeed_config(t, plan)
    check_consistent(cfg)
    assert cfg["train_batch_size"] == 16
    assert cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["gradient_accumulation_steps"] == 4
    assert cfg["train_batch_size"] == (cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
                                       * plan.world_size)
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["zero_optimization"]["stage"] == stage
    assert cfg["bf16"]["enabled"] is (precision == "bf16")
    assert cfg["fp16"]["enabled"] is (precision == "fp16")
    zero = cfg["zero_optimization"]
    assert ("reduce_bucket_size" in zero) is (stage >= 2)
    assert ("stage3_param_persistence_threshold" in zero) is (stage == 3)
    if stage == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    # no DeepSpeed optimizer/scheduler blocks: torch objects are passed instead (no fused/CPU-Adam ops)
    assert "optimizer" not in cfg and "scheduler" not in cfg


@pytest.mark.parametrize("broken, names", [
    ({"train_batch_size": 10}, ["train_batch_size", "train_micro_batch_size_per_gpu",
                                "gradient_accumulation_steps"]),
    ({"gradient_accumulation_steps": 3}, ["train_batch_size", "gradient_accumulation_steps"]),
    ({"train_micro_batch_size_per_gpu": None}, ["train_micro_batch_size_per_gpu"]),
])
def test_check_consistent_names_broken_keys(broken, names):
    """Guards against: a hand-edited DeepSpeed config with inconsistent batch keys reaching deepspeed.initialize."""
    cfg = deepspeed_config(TrainerConfig(micro_batch_size=2, global_batch_size=8), BatchPlan(1, 2, 4, 8))
    cfg.update(broken)
    with pytest.raises(ValueError) as info:
        check_consistent(cfg)
    for n in names:
        assert n in str(info.value)


def test_check_consistent_refuses_bf16_and_fp16_together():
    """Guards against: both mixed-precision modes enabled at once."""
    cfg = deepspeed_config(TrainerConfig(), BatchPlan(1, 2, 1, 2))
    cfg["bf16"]["enabled"] = cfg["fp16"]["enabled"] = True
    with pytest.raises(ValueError, match="bf16.*fp16"):
        check_consistent(cfg)


def test_an_output_dir_inside_the_data_folder_is_refused(tmp_path):
    """Guards against: a run writing into its own local data folder (data.source=. with output_dir=run): its
    metrics.jsonl and heads' config.json then read as data (dropped records, or worse) by the next run on it."""
    from medusa_train.config import check_output_outside_data

    data = tmp_path / "data"
    data.mkdir()
    for out in (data / "run", data, data / "a" / ".." / "b"):
        with pytest.raises(UserError, match="is inside data.source"):
            check_output_outside_data(str(data), str(out))
    check_output_outside_data(str(data), str(tmp_path / "run"))
    check_output_outside_data(str(data / "x.jsonl"), str(data / "run"))   # a file: its folder is not read
    check_output_outside_data("org/hub-dataset", "org/hub-dataset/run")


def test_a_feature_cache_inside_the_data_folder_is_refused(tmp_path):
    """Guards against: ``features.cache_dir`` inside the ``data.source`` folder accepted: the build wrote
    eval.safetensors and features.json there, then failed half-way (the data reader took "eval" for a split)
    and every later run on that folder was refused. Not refused while the cache is off."""
    from medusa_train.launch import compose_recipe
    from medusa_train.preflight import preflight

    data = tmp_path / "data"
    data.mkdir()
    (data / "conv.jsonl").write_text(Path(TINY_DATA).read_text())
    base = [f"data.source={data}", f"output_dir={tmp_path / 'run'}", f"features.cache_dir={data / 'cache'}"]
    with pytest.raises(UserError, match=r"^features.cache_dir=.*/data/cache is inside data.source="):
        preflight(compose_recipe("debug_tiny", [*base, "features.mode=build"]))
    assert sorted(p.name for p in data.iterdir()) == ["conv.jsonl"]
    preflight(compose_recipe("debug_tiny", base), resume=False)


def test_an_unknown_random_init_model_type_is_one_short_line():
    """Guards against: a mistyped backbone.random_init.model_type answered with transformers' own message, one line
    listing every one of its several hundred model types (thousands of characters), with no hint of the near one."""
    from medusa_train.backbone import random_config

    with pytest.raises(UserError) as err:
        random_config({"model_type": "lama", "hidden_size": 32})
    assert "model_type='lama' is not a transformers model type (did you mean llama?)" in str(err.value)
    assert len(str(err.value)) < 200
    with pytest.raises(UserError, match="'bogus' is not a transformers model type; e.g. llama"):
        random_config({"model_type": "bogus"})


def test_a_gguf_file_beside_a_random_backbone_is_refused():
    """Guards against: backbone.gguf_file given with a recipe's random_init backbone, accepted and never read (the
    run trained on the random backbone, the file's model unused, exit 0)."""
    with pytest.raises(UserError, match="backbone.gguf_file=x.gguf names a file inside backbone.name_or_path"):
        validate(compose_recipe("debug_tiny", ["backbone.gguf_file=x.gguf"]))


def test_a_quoted_home_path_is_the_home_folder(monkeypatch):
    """Guards against: ``output_dir='~/run'`` (quoted: the shell left the ~) checked at $HOME/run but written to a
    folder literally named ``~`` in the working directory (Hydra and the writers do not expand it; a later
    ``rm -rf ~...`` to clean it up is a hazard). Only path keys change; a ~ override (deletion) stays."""
    from medusa_train.overrides import recipe_overrides

    monkeypatch.setenv("HOME", "/home/u")
    got = recipe_overrides(["output_dir='~/run'", "data.source=~/d.jsonl", 'features.cache_dir="~/c"',
                            "logger.run_name=~x", "~trainer.resume"])
    assert got == ["output_dir='/home/u/run'", "data.source=/home/u/d.jsonl", 'features.cache_dir="/home/u/c"',
                   "logger.run_name=~x", "~trainer.resume"]
    assert compose_recipe("debug_tiny", ["output_dir='~/run'"]).output_dir == "/home/u/run"
