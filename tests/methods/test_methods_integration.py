"""Greedy draft-model, lookahead and prompt-lookup decoding on the real embedded SmolLM2-135M (fp32)
are token-identical to plain greedy decoding, and a draft loaded by name passes the tokenizer check.

Kept short (5 MT-Bench first turns, 48 new tokens): the unit tier covers the mechanics on tiny
models; this tier checks RoPE, GQA, the real tokenizer and float behaviour of a real checkpoint.
Medusa's own identity on real prompts is tests/runtime/test_runtime_integration.py.
"""

import json

import pytest

from inference import assets
from inference.backbone import load_backbone
from inference.methods import generate
from inference.methods.draft import DraftSettings, load_draft
from inference.methods.lookahead import LookaheadSettings
from inference.methods.registry import extra_parameters
from inference.runtime.model import MedusaModel

from runtime_support import one_thread  # noqa: F401 (autouse: 1 thread is ~3x faster on the shared box)

pytestmark = pytest.mark.integration

N_PROMPTS = 5
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def smollm2():
    model, tok, _ = load_backbone("embedded:smollm2")
    return MedusaModel(model=model, tokenizer=tok, heads=None)


@pytest.fixture(scope="module")
def cases(smollm2):
    lines = assets.mtbench_questions_path().read_text().splitlines()[:N_PROMPTS]
    out = []
    for line in lines:
        ids = smollm2.encode_chat(json.loads(line)["turns"][0])
        out.append((ids, generate(smollm2, ids, "autoregressive", max_new_tokens=NEW_TOKENS).tokens))
    return out


@pytest.mark.parametrize("method", ["draft-self8", "draft-self30", "lookahead", "prompt_lookup"])
def test_greedy_methods_match_plain_greedy_on_mt_bench(smollm2, cases, method):
    """Guards against any loss of greedy exactness on a real model (masks, positions, RoPE, GQA,
    cache roll-back / compaction, the shallow self-draft sharing the backbone's modules)."""
    mismatches, taus = [], []
    for i, (ids, plain) in enumerate(cases):
        if method.startswith("draft"):
            out = generate(smollm2, ids, "draft", options=DraftSettings(k=4),
                                       max_new_tokens=NEW_TOKENS, draft=f"self:{method[10:]}")
        elif method == "lookahead":
            out = generate(smollm2, ids, "lookahead", options=LookaheadSettings(), max_new_tokens=NEW_TOKENS)
        else:
            out = generate(smollm2, ids, "prompt_lookup", max_new_tokens=NEW_TOKENS)
        taus.append(out.tau)
        if out.tokens != plain:
            mismatches.append((i, plain, out.tokens))
    assert not mismatches, mismatches[:1]
    if method == "draft-self30":          # the full model as its own draft accepts everything
        assert min(taus) > 4.0


def test_a_draft_loaded_by_name_passes_the_tokenizer_check_and_counts_its_weights(smollm2):
    """Guards against the tokenizer-identity check refusing a draft that shares the tokenizer, and
    against a separately loaded draft being reported as free (it holds its own weights)."""
    draft = load_draft("embedded:smollm2", smollm2)
    count, _ = extra_parameters(draft.model, smollm2.model)
    assert count == sum(p.numel() for p in smollm2.model.parameters())
    assert extra_parameters(load_draft("self:4", smollm2).model, smollm2.model) == (0, 0)
