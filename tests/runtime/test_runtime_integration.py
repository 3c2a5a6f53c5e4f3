"""Greedy Medusa on the real embedded SmolLM2-135M (fp32) is token-identical to plain greedy.

Untrained heads are fine: losslessness must hold whatever the heads guess. Fresh heads
(``MedusaHeads.from_lm_head``: identity blocks + rows of the base lm_head, truncated to 8192
tokens through a token map) are exported with the embedded backbone's name and fingerprint,
so ``load_medusa`` also resolves ``embedded:smollm2`` on its own.
"""

import json

import pytest
import torch

from inference import assets
from inference.methods import generate
from inference.heads.medusa import MedusaHeads
from inference.heads.native import save_heads
from inference.heads.spec import HeadsSpec, backbone_fingerprint
from inference.backbone import load_backbone
from inference.loading import load_medusa

from runtime_support import one_thread  # noqa: F401 (autouse: 1 thread is ~3x faster on the shared box)

pytestmark = pytest.mark.integration

N_PROMPTS = 20
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def medusa(tmp_path_factory):
    model, _, _ = load_backbone("embedded:smollm2")
    cfg = model.config
    spec = HeadsSpec(num_heads=3, num_layers=1, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                     projection="truncated", truncated_vocab_size=8192, base_model="embedded:smollm2",
                     base_model_fingerprint=backbone_fingerprint(cfg))
    heads = MedusaHeads.from_lm_head(spec, model.get_output_embeddings().weight, torch.arange(8192))
    path = save_heads(heads, tmp_path_factory.mktemp("smollm2") / "heads")
    del model
    return load_medusa(path, dtype=torch.float32)


def _first_turns(n):
    lines = assets.mtbench_questions_path().read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines[:n]]


def test_greedy_medusa_matches_plain_greedy_on_mt_bench(medusa):
    """Guards against any loss of greedy exactness on a real model (masks, positions, RoPE, GQA,
    cache compaction, truncated-head token maps) across 20 real chat prompts."""
    trees = ["tree8", "tree4", "chain3", "tree16"]
    mismatches = []
    for i, question in enumerate(_first_turns(N_PROMPTS)):
        ids = medusa.encode_chat(question)
        plain = generate(medusa, ids, "autoregressive", max_new_tokens=NEW_TOKENS)
        fast = generate(medusa, ids, tree=trees[i % len(trees)], max_new_tokens=NEW_TOKENS)
        assert len(plain.tokens) == NEW_TOKENS or plain.finish_reason == "eos"
        if fast.tokens != plain.tokens:
            mismatches.append((i, plain.tokens, fast.tokens))
    assert not mismatches, mismatches[:2]
