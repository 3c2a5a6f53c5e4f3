"""Medusa-2: LoRA backbone + heads trained jointly (medusa_train/lora.py), and the runtime's
adapter merge (inference/adapter.py)."""

from __future__ import annotations

import json
import math
import re
import types

import pytest
import torch

from inference.runtime.adapter import merge_lora
from inference.methods import generate
from inference.errors import UserError
from inference.loading import load_medusa
from medusa_train import lora
from medusa_train import trainer as T
from medusa_train.tracking import read_metrics

LORA = ["lora.enabled=true", "trainer.save_every=0", "logger.plot=false", "trainer.log_every=1"]


def make_trainer(cfg) -> T.MedusaTrainer:
    trainer = T.MedusaTrainer(cfg)
    trainer.setup()
    return trainer


def test_joint_training_moves_only_adapter_and_heads(compose_tiny):
    """Guards against Medusa-2 touching the frozen base weights (they must stay bit-identical:
    only LoRA matrices and heads train), an adapter that never trains, and a teacher that is not
    the original model (adapter disabled must give the untouched backbone's logits)."""
    trainer = make_trainer(compose_tiny(*LORA, "trainer.max_steps=3"))
    peft_model = trainer.source.peft_model
    base = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" not in n}
    adapter = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" in n}
    heads = {n: p.detach().clone() for n, p in trainer.module.heads.named_parameters()}
    assert adapter and all(p.requires_grad for n, p in peft_model.named_parameters() if "lora_" in n)
    assert not any(p.requires_grad for n, p in peft_model.named_parameters() if "lora_" not in n)
    batch = next(iter(trainer.batches))
    ids = batch["input_ids"][:1, :32]
    with torch.no_grad():
        before = trainer.backbone.model(input_ids=ids).logits.clone()
    trainer.train()
    for n, p in peft_model.named_parameters():
        if "lora_" in n:
            continue
        assert torch.equal(p.detach(), base[n]), f"frozen weight {n} changed"
    assert any(not torch.equal(p.detach(), adapter[n]) for n, p in peft_model.named_parameters() if "lora_" in n)
    assert any(not torch.equal(p.detach(), heads[n]) for n, p in trainer.module.heads.named_parameters())
    peft_model.eval()
    with torch.no_grad(), peft_model.disable_adapter():
        teacher = trainer.backbone.model(input_ids=ids).logits
        torch.testing.assert_close(teacher, before, atol=0, rtol=0)
    with torch.no_grad():
        assert not torch.allclose(trainer.backbone.model(input_ids=ids).logits, before)
    records = [r for r in read_metrics(trainer.output_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert records and all(math.isfinite(r["backbone_loss"]) and math.isfinite(r["heads_loss"]) for r in records)
    trainer.cleanup(plot=False)


def test_heads_learn_faster_than_the_adapter_and_the_coefficient_warms_up(compose_tiny):
    """Guards against the heads' learning-rate multiplier or the coefficient warm-up being
    ignored (Medusa-2's recipe depends on both to keep fresh heads from wrecking the backbone)."""
    trainer = make_trainer(compose_tiny(*LORA, "trainer.max_steps=2", "lora.heads_lr_multiplier=4.0",
                                        "lora.heads_warmup_steps=4", "lora.heads_coefficient=0.2"))
    groups = {g["name"]: g for g in trainer.optimizer.param_groups}
    assert groups["heads"]["initial_lr"] == pytest.approx(4.0 * groups["lora"]["initial_lr"])
    cfg = types.SimpleNamespace(heads_coefficient=0.2, heads_warmup_steps=4)
    assert [lora.heads_coefficient(s, cfg) for s in range(5)] == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.2])
    trainer.cleanup(plot=False)


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_export_with_adapter_decodes_losslessly_on_the_merged_backbone(compose_tiny, out_dir, tiny_backbone,
                                                                       zero_stage):
    """Guards against an adapter export the runtime cannot apply, or applies differently from
    peft (merged weights must reproduce the tuned model), and against lossy decoding on it. With ZeRO-3
    (every parameter of the engine's module partitioned, the frozen backbone's too) against a ``merged/`` of
    the empty local shards (zero-size tensors: from_pretrained failed with a size mismatch). With ZeRO-2 against
    the save at the end crashing ("exp_avg not found": DeepSpeed linked the heads' group before it had state)."""
    import copy

    summary = T.run(compose_tiny(*LORA, "trainer.max_steps=3", "lora.merge=true",
                                 f"trainer.zero_stage={zero_stage}"))
    assert summary["step"] == 3
    heads_dir = out_dir / "heads"
    spec = json.loads((heads_dir / "config.json").read_text())
    assert spec["backbone_adapter"] == "adapter"
    assert (heads_dir / "adapter" / "adapter_config.json").is_file()
    drift = json.loads((out_dir / "drift.json").read_text())
    assert drift["heldout_tokens"] > 0 and 0 <= drift["argmax_agreement"] <= 1

    model = copy.deepcopy(tiny_backbone.model)
    assert merge_lora(model, heads_dir / "adapter") > 0
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out_dir / "merged", attn_implementation="sdpa")
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(model(input_ids=ids).logits, tiny_backbone.model(input_ids=ids).logits)
    m = load_medusa(heads_dir, backbone=model)
    ref = generate(m, [1, 2, 3, 4], "autoregressive", max_new_tokens=20, eos_token_ids=()).tokens
    assert generate(m, [1, 2, 3, 4], tree=[[0], [1], [0, 0]], max_new_tokens=20, eos_token_ids=()).tokens == ref


def test_a_bf16_run_merges_its_fp32_adapter_into_a_full_precision_model(compose_tiny, out_dir, tiny_backbone):
    """Guards against: trainer.precision=bf16 writing merged/ as the live bf16 model merged in bf16 (about 15% of each
    layer's adapter change rounded away, the model saved in bf16), not the full-precision model its docstring and
    the README promise: merged/ must be the bf16-trained base in fp32 plus the exported fp32 adapter's change, and
    the ZeRO-1 save of two parameter groups must not crash ("exp_avg not found")."""
    import copy

    from transformers import AutoModelForCausalLM

    T.run(compose_tiny(*LORA, "trainer.max_steps=3", "lora.merge=true", "trainer.precision=bf16",
                       "trainer.zero_stage=1", "optim.lr=2e-4"))
    merged = AutoModelForCausalLM.from_pretrained(out_dir / "merged")
    assert merged.dtype == torch.float32
    want = copy.deepcopy(tiny_backbone.model).to(torch.bfloat16).float()   # the base it trained on, in fp32
    assert merge_lora(want, out_dir / "heads" / "adapter") > 0
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_the_merge_reads_the_adapters_fp32_masters_not_the_live_copy(compose_tiny, tiny_backbone, tmp_path):
    """Guards against: merged/ merged from the live (bf16) adapter when the fp32 masters are given (their names not
    matching the model's would fall back to the live copy silently): the saved model must hold the masters' change."""
    import copy

    from transformers import AutoModelForCausalLM

    peft_model = lora.apply_lora(copy.deepcopy(tiny_backbone.model), compose_tiny(*LORA).lora)
    torch.manual_seed(0)
    masters = {}
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                masters[f"peft_model.{name}"] = torch.randn_like(p) * 0.05   # what the optimizer holds in fp32
                p.copy_(torch.randn_like(p) * 0.05)   # a live copy that is not it
    peft_model.to(torch.bfloat16)
    out = lora.save_merged(peft_model, None, tmp_path / "merged", adapter_fp32=masters)
    merged = AutoModelForCausalLM.from_pretrained(out)
    want = lora.apply_lora(copy.deepcopy(tiny_backbone.model).to(torch.bfloat16).float(), compose_tiny(*LORA).lora)
    want.load_state_dict({k.removeprefix("peft_model."): v for k, v in masters.items()}, strict=False)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want.merge_and_unload()(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="do not fit the model to merge"):
        lora.save_merged(peft_model, None, tmp_path / "again", adapter_fp32={"peft_model.nope.lora_A": torch.ones(1)})


def test_merge_of_a_gguf_converted_backbone_saves_a_full_precision_model(compose_tiny, tiny_backbone, tmp_path):
    """Guards against ``lora.merge=true`` crashing on the default ``embedded:`` backbone: its cached GGUF
    conversion (inference/assets.py ``converted_gguf_dir``) holds dequantized float weights under a config.json
    that still says ``quantization_config: gguf``, and save_merged raised "The model is quantized with gguf
    and is not serializable". The merged model must be a plain full-precision one (no quantization_config)
    that transformers and the runtime's loader read back with the tuned model's logits."""
    import copy

    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import GgufConfig

    from inference.backbone import load_backbone

    # What converted_gguf_dir writes: a model rebuilt from the GGUF-loaded config (its quantization_config
    # included), given the dequantized state dict, saved with save_pretrained.
    config = copy.deepcopy(tiny_backbone.model.config)
    config.quantization_config = GgufConfig(gguf_file="tiny.Q4_1.gguf")
    converted = AutoModelForCausalLM.from_config(config)
    converted.load_state_dict(tiny_backbone.model.state_dict(), strict=True)
    src = tmp_path / "converted"
    converted.save_pretrained(src)
    tiny_backbone.tokenizer.save_pretrained(src)
    assert json.loads((src / "config.json").read_text())["quantization_config"]["quant_method"] == "gguf"

    model, tokenizer, _ = load_backbone(str(src))  # as the trainer loads the cached conversion
    peft_model = lora.apply_lora(model, compose_tiny(*LORA).lora)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # a fresh adapter is the identity (B = 0): give it something to merge
                p.normal_(std=0.05)
    peft_model.eval()
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        tuned = peft_model(input_ids=ids).logits
        assert not torch.allclose(tuned, tiny_backbone.model(input_ids=ids).logits)

    out = lora.save_merged(peft_model, tokenizer, tmp_path / "merged")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(out)
    runtime, _, _ = load_backbone(str(out))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, tuned, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(runtime(input_ids=ids).logits, tuned, atol=1e-5, rtol=1e-5)
    assert not getattr(merged, "hf_quantizer", None)
    # the live model keeps its adapter (unmerged) and its own config
    assert peft_model.get_base_model().config.quantization_config is not None
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, tuned, atol=0, rtol=0)


def test_two_stage_recipe_starts_from_stage_one_heads(compose_tiny, tmp_path, monkeypatch):
    """Guards against stage 2 silently starting from fresh heads, or from heads of another shape; against it
    scanning the data for a truncated vocabulary it then discards for stage 1's (minutes on a real data set); and
    against lora.init_heads being ignored without lora.enabled=true (fresh heads saved as if continued)."""
    T.run(compose_tiny("trainer.max_steps=2", "trainer.save_every=0", "logger.plot=false", out=tmp_path / "s1"))
    stage1 = tmp_path / "s1" / "heads"
    with pytest.raises(UserError, match="lora.init_heads .* needs lora.enabled=true"):
        make_trainer(compose_tiny("trainer.max_steps=1", f"lora.init_heads={stage1}", out=tmp_path / "s0"))
    monkeypatch.setattr(T.MedusaTrainer, "_token_map", lambda *a: pytest.fail("stage 2 scanned the data"))
    trainer = make_trainer(compose_tiny(*LORA, "trainer.max_steps=1", f"lora.init_heads={stage1}",
                                        out=tmp_path / "s2"))
    from inference.loading import load_heads

    loaded = load_heads(stage1)
    for name, t in loaded.state_dict().items():
        assert torch.equal(trainer.module.heads.state_dict()[name], t), name
    trainer.cleanup(plot=False)
    with pytest.raises(UserError, match="num_heads"):
        make_trainer(compose_tiny(*LORA, "heads.num_heads=2", f"lora.init_heads={stage1}", out=tmp_path / "s3"))


def _heads_folder(folder, cfg, **changes):
    """A heads export's config.json for ``cfg``'s heads on its backbone, with ``changes``, beside an empty weights
    file: the early check reads the config alone, never the weights."""
    from inference.heads.spec import backbone_fingerprint
    from medusa_train.backbone import random_config
    from medusa_train.preflight import recipe_heads_spec

    hf = random_config(dict(cfg.backbone.random_init))
    spec = {**recipe_heads_spec(cfg.heads, hf).to_dict(), "base_model": "tiny",
            "base_model_fingerprint": backbone_fingerprint(hf), **changes}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(spec))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


STAGE1_REFUSED = [
    ("missing", {}, r"lora.init_heads=\S*missing: heads directory not found"),
    ("file", {}, r"lora.init_heads=\S*file is a file, not a heads folder"),
    ("run", {}, r"lora.init_heads=\S*run: \S*run is not a heads export"),
    ("eagle3", {}, r"lora.init_heads=\S* holds eagle3 heads, this recipe trains heads.kind=medusa"),
    ("heads", {"num_heads": 2}, r"differ from this recipe's in num_heads \(2 vs 3\)"),
    ("heads", {"num_layers": 2}, r"differ from this recipe's in num_layers \(2 vs 1\)"),
    ("heads", {"projection": "own", "truncated_vocab_size": None}, r"in projection \(own vs truncated\)"),
    ("heads", {"truncated_vocab_size": 100}, r"in truncated_vocab_size \(100 vs 128\)"),
    ("heads", {"hidden_size": 128}, r"lora.init_heads=\S* were trained for hidden size 128, the backbone has 64"),
    ("heads", {"vocab_size": 640}, r"were trained for vocab size 640, the backbone has 320"),
    ("heads", {"base_model_fingerprint": "0123456789abcdef"}, r"config fingerprint 0123456789abcdef \(tiny\)"),
    # Medusa-2 heads: their adapter was dropped silently and the heads trained on the bare backbone from there
    ("heads", {"backbone_adapter": "adapter"}, r"holds Medusa-2 heads trained with a LoRA adapter \(adapter/\)"),
]


@pytest.mark.parametrize("what, changes, words", STAGE1_REFUSED, ids=[f"{w}{c or ''}" for w, c, _ in STAGE1_REFUSED])
def test_stage_one_heads_are_checked_before_the_backbone_loads(what, changes, words, compose_tiny, tmp_path):
    """Guards against: lora.init_heads checked only once the backbone had loaded (lora.init_heads_from): a missing
    path, a file, a folder that is no heads export, heads of another family, shape or backbone refused after
    seconds to minutes of loading, eagle3 heads for a medusa recipe with a line about embedding shapes that never
    named lora.init_heads, and heads of another backbone of the same sizes (config fingerprint) not at all."""
    from medusa_train.preflight import check_init_heads, preflight

    (tmp_path / "file").write_text("x")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    if what == "eagle3":   # another family's export: its config names kind eagle3
        _heads_folder(tmp_path / what, compose_tiny("heads.kind=eagle3", "backbone.random_init.num_hidden_layers=8"))
    elif what == "heads":
        _heads_folder(tmp_path / what, compose_tiny(), **changes)
    cfg = compose_tiny(*LORA, f"lora.init_heads={tmp_path / what}")
    with pytest.raises(UserError, match=words) as e:
        check_init_heads(cfg)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=words):   # the preflight medusa-train runs before anything loads
        preflight(cfg, resume=False)


def test_stage_one_heads_of_this_recipe_pass_the_early_check(compose_tiny, tmp_path):
    """Guards against: the early check refusing the heads stage 2 is meant to start from (same family, shape and
    backbone: the fingerprint preflight computes from the recipe's config is the one the export recorded)."""
    from medusa_train.preflight import check_init_heads

    check_init_heads(compose_tiny(*LORA, f"lora.init_heads={_heads_folder(tmp_path / 'h', compose_tiny())}"))
    T.run(compose_tiny("trainer.max_steps=1", "trainer.save_every=0", "logger.plot=false", out=tmp_path / "s1"))
    check_init_heads(compose_tiny(*LORA, f"lora.init_heads={tmp_path / 's1' / 'heads'}"))


def test_a_finished_stage_two_rerun_does_not_need_its_stage_one_heads(compose_tiny, tmp_path, monkeypatch):
    """Guards against the early lora.init_heads check refusing the rerun of a finished Medusa-2 run whose stage-1
    heads were deleted since: that rerun has nothing to do (``trainer._already_exported``) and never reads them.
    An unfinished run's resume still needs them (its joint source loads them) and is still refused early."""
    import medusa_train.preflight as pf

    cfg = compose_tiny(*LORA, f"lora.init_heads={tmp_path / 'gone'}", "trainer.max_steps=3")
    monkeypatch.setattr(pf, "check_resume", lambda cfg: {"step": 3})
    pf.preflight(cfg)
    monkeypatch.setattr(pf, "check_resume", lambda cfg: {"step": 2})
    with pytest.raises(UserError, match="lora.init_heads="):
        pf.preflight(cfg)


LORA_OFF_REFUSED = [
    ("lora.r=0", "lora.r must be >= 1"),
    ("lora.alpha=0", "lora.alpha > 0"),
    ("lora.dropout=nan", "lora.dropout must be in [0, 1)"),
    ("lora.dropout=1.0", "lora.dropout must be in [0, 1)"),
    ("lora.load_in_bits=3", "lora.load_in_bits=3: a quantised frozen base (QLoRA) is not implemented"),
    # once accepted, and the base loaded unquantised all the same (no memory saved, silently)
    ("lora.load_in_bits=4", "lora.load_in_bits=4: a quantised frozen base (QLoRA) is not implemented"),
    ("lora.backbone_loss=mse", "lora.backbone_loss must be kl or ce"),
    ("lora.heads_coefficient=-1", "lora.heads_coefficient"),
    ("lora.backbone_weight=inf", "lora.backbone_weight"),
    ("lora.heads_lr_multiplier=0", "lora.heads_lr_multiplier > 0"),
    ("lora.heads_warmup_steps=-1", "lora.heads_warmup_steps must be >= 0"),
    ("lora.target_modules=[]", "lora.target_modules must name at least one"),
]


@pytest.mark.parametrize("value, words", LORA_OFF_REFUSED, ids=[v for v, _ in LORA_OFF_REFUSED])
def test_lora_values_are_checked_with_the_adapter_off(value, words, compose_tiny):
    """Guards against: a bad lora.* value (lora.r=0, a NaN dropout) accepted silently while lora.enabled=false,
    to bite only the day the adapter is switched on (distill.temperature=nan is refused in any run)."""
    from medusa_train.config import validate

    for enabled in ("false", "true"):
        with pytest.raises(UserError, match=re.escape(words)):
            validate(compose_tiny(f"lora.enabled={enabled}", value))


@pytest.mark.parametrize("extra, fragment", [
    (["lora.target_modules=[q_proj,wq]"], "wq"),
    (["lora.target_modules=[q_proj,lm_head]"], "ties that layer's weight to its input embedding"),
    # untied: the loss gave the shared heads the base lm_head, decoding and the exports the merged one
    (["backbone.random_init.tie_word_embeddings=false", "heads.projection=shared",
      "lora.target_modules=[q_proj,lm_head]"], "heads.projection=shared projects the heads through that layer"),
    (["lora.backbone_loss=mse"], "lora.backbone_loss"),
    (["features.mode=train"], "features.mode=off"),
])
def test_lora_mistakes_are_one_line_errors(compose_tiny, extra, fragment):
    """Guards against a LoRA target typo adapting nothing, an adapter on an lm_head tied to the input embedding
    (its merge moved the embedding too: merged logits off by 3, the heads' by 65), and cached features standing in
    for a backbone that is being trained."""
    with pytest.raises(UserError, match=fragment.replace(".", r"\.")):
        make_trainer(compose_tiny(*LORA, *extra))


def test_runtime_refuses_a_broken_adapter(tmp_path, tiny_backbone):
    """Guards against decoding on a half-applied adapter: a missing file or a layer the backbone
    does not have is a clear error."""
    with pytest.raises(UserError, match="not a LoRA adapter"):
        merge_lora(tiny_backbone.model, tmp_path)
    from safetensors.torch import save_file

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "peft_type": "LORA"}))
    save_file({"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(2, 64),
               "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight": torch.zeros(64, 2)},
              str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(UserError, match="does not have"):
        merge_lora(tiny_backbone.model, tmp_path)


def test_runtime_applies_the_adapter_from_a_path_and_reports_drift(compose_tiny, out_dir, tiny_backbone, tmp_path):
    """Guards against Medusa-2 heads evaluated on the original backbone (their acceptance would
    be measured on a model they were not trained with) and against a drift report that cannot
    tell the tuned model from the original."""
    from inference.evaluation.drift import greedy_drift

    T.run(compose_tiny(*LORA, "trainer.max_steps=3", "optim.lr=3e-2"))
    base_dir = tmp_path / "base"
    tiny_backbone.model.save_pretrained(base_dir)
    tiny_backbone.tokenizer.save_pretrained(base_dir)
    plain = load_medusa(out_dir / "heads", backbone=str(base_dir), apply_adapter=False)
    tuned = load_medusa(out_dir / "heads", backbone=str(base_dir), apply_adapter=True)
    assert tuned.adapter_applied and not plain.adapter_applied
    prompts = [[1, 2, 3, 4], [7, 8, 9]]
    same = greedy_drift(plain, plain, prompts, max_new_tokens=12)
    assert same == {"prompts": 2, "greedy_token_agreement": 1.0, "identical_answers": 1.0}
    drift = greedy_drift(tuned, plain, prompts, max_new_tokens=12)
    assert 0.0 <= drift["greedy_token_agreement"] <= 1.0
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        assert not torch.equal(tuned.model(input_ids=ids).logits, plain.model(input_ids=ids).logits)


def test_a_zero3_merge_keeps_the_backbones_generation_config(compose_tiny, tiny_backbone, tmp_path):
    """Guards against: ``lora.merge=true`` under ZeRO-3 (the merge runs on a replica built from the config) saving
    a generation config derived from config.json alone: the checkpoint's list of end ids (Llama-3's <|eot_id|>,
    <|eom_id|>) and its sampling defaults lost, so the merged model, decoded or served, never stopped at the end of
    a turn (ZeRO 0-2 copy the model and kept them)."""
    import copy

    model = copy.deepcopy(tiny_backbone.model)
    model.generation_config.eos_token_id = [1, 4, 5]
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.6
    peft_model = lora.apply_lora(model, compose_tiny(*LORA).lora)
    replica = lora._gathered_replica(peft_model, keep=True)   # no partitions here: the gathers return them whole
    assert replica.get_base_model().generation_config.eos_token_id == [1, 4, 5]
    out = lora.save_merged(peft_model, tiny_backbone.tokenizer, tmp_path / "merged")
    saved = json.loads((out / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [1, 4, 5] and saved["temperature"] == 0.6


def test_a_finished_run_missing_its_drift_report_or_merge_writes_them_again(compose_tiny, out_dir):
    """Guards against a Medusa-2 run killed after its heads export but before ``drift.json`` / ``merged/`` were
    complete: the rerun said "nothing to do" and never wrote them (a partial or empty ``merged/`` was taken for
    done, and the export then named it as the backbone to serve). The rerun now writes both again."""
    cfg = compose_tiny(*LORA, "trainer.max_steps=2", "lora.merge=true")
    T.run(cfg)
    (out_dir / "drift.json").unlink()
    for f in (out_dir / "merged").iterdir():
        f.unlink()
    T.run(cfg)
    assert json.loads((out_dir / "drift.json").read_text())["heldout_tokens"] > 0
    assert (out_dir / "merged" / "config.json").is_file() and (out_dir / "merged" / "model.safetensors").is_file()
    (out_dir / "merged" / "model.safetensors").unlink()   # an older in-place save killed inside its weights
    T.run(cfg)
    assert (out_dir / "merged" / "model.safetensors").is_file()
    alone = compose_tiny(*LORA, "trainer.max_steps=2", out=out_dir.parent / "alone")   # drift.json alone missing
    T.run(alone)
    (out_dir.parent / "alone" / "drift.json").unlink()
    T.run(alone)
    assert (out_dir.parent / "alone" / "drift.json").is_file()


def test_the_merged_backbone_is_written_whole_or_not_at_all(tiny_backbone, tmp_path):
    """Guards against ``merged/`` written file by file in place: a kill (here an interrupt in the tokenizer's
    save, the last write) left a folder of the weights without a tokenizer, which a rerun took for done. The
    merge now writes beside it and swaps it in: nothing at ``merged/`` and no temporary folder left."""
    import copy

    peft_model = lora.apply_lora(copy.deepcopy(tiny_backbone.model),
                                 types.SimpleNamespace(r=2, alpha=4, dropout=0.0, target_modules=["q_proj"],
                                                       gradient_checkpointing=False))

    class Interrupted:
        def save_pretrained(self, path):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        lora.save_merged(peft_model, Interrupted(), tmp_path / "merged")
    assert list(tmp_path.iterdir()) == []
    assert lora.save_merged(peft_model, tiny_backbone.tokenizer, tmp_path / "merged") == tmp_path / "merged"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]
    assert (tmp_path / "merged" / "config.json").is_file() and (tmp_path / "merged" / "tokenizer_config.json").is_file()


def test_drift_on_no_held_out_token_is_not_measured(capsys):
    """Guards against drift.json reporting perplexities of 1.0 and 0% argmax agreement on 0 held-out tokens (an
    empty held-out split): made-up numbers read as a perfect, totally drifted backbone. They are null now."""
    model = types.SimpleNamespace(training=False, eval=lambda: None)
    assert lora.drift(model, None, None, [], "cpu") == {"heldout_tokens": 0, "perplexity_base": None,
                                                        "perplexity_tuned": None, "argmax_agreement": None}
