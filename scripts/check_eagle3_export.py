"""Export a trained EAGLE-3 drafter (``format=eagle3``) and run it through the restated vLLM and SGLang
loaders and forward math (``tests/engine_specs.py``) on real backbone features: max |logit difference|
against the runtime's drafter, fp32, target vocabulary (BENCHMARKS.md "EAGLE-3 beside the other families").

    .venv/bin/python scripts/check_eagle3_export.py runs/eagle3_smollm2/heads runs/eagle3_smollm2/eagle3

Two passes, as decoding runs them: the drafter over a real chat prompt's positions (fed fc of the
backbone's three aux layers, which the engines tap as their own ``aux_hidden_states``), then two rows
continuing the chain from the last pre-norm state with the first pass's KV.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from engine_specs import (eagle3_engine_forward, sglang_eagle3_aux_ids, sglang_eagle3_load,  # noqa: E402
                          sglang_eagle3_logits, vllm_eagle3_aux_ids, vllm_eagle3_load, vllm_eagle3_logits)

from inference.backbone import HiddenStateTap  # noqa: E402
from inference.formats.export import export_heads  # noqa: E402
from inference.loading import load_medusa  # noqa: E402


def main(heads_dir: str, out: str) -> dict:
    m = load_medusa(heads_dir, kernels="stock")
    d, model = m.heads, m.model
    h, vocab = d.spec.hidden_size, m.vocab_size
    export_heads(d, "eagle3", out)
    ids = torch.tensor([m.encode_chat("Write a Python function that checks whether a number is prime.")])
    n = ids.shape[1]
    with HiddenStateTap(model, d.spec.aux_layers) as tap, torch.no_grad():
        m.body(input_ids=ids, position_ids=torch.arange(n)[None], use_cache=False)
    aux = tap.features()[0]
    tokens, pos = torch.cat([ids[0, 1:], ids.new_tensor([0])]), torch.arange(n)
    nxt_tok, nxt_pos = ids[0, -2:], n + torch.arange(2)

    def scatter(logits):
        if d.token_map is None:
            return logits
        full = logits.new_full((logits.shape[0], vocab), float("-inf"))
        full[:, d.token_map] = logits
        return full

    with torch.no_grad():
        normed, pre, kv = d.forward_step(tokens[None], d.combine(aux)[None], pos[None])
        ours = [scatter(d.project(normed)[0])]
        normed2, _, _ = d.forward_step(nxt_tok[None], pre[:, -1:].expand(1, 2, h), nxt_pos[None], past=kv)
        ours.append(scatter(d.project(normed2)[0]))
    embed = model.get_input_embeddings().weight.detach()
    result = {"positions": n, "aux_layers": d.spec.aux_layers}
    num_layers = m.config.num_hidden_layers
    for name, load, layer, logits_fn, aux_ids in (
            ("vllm", vllm_eagle3_load, "model.layers.0.", vllm_eagle3_logits, vllm_eagle3_aux_ids),
            ("sglang", sglang_eagle3_load, "model.midlayer.", sglang_eagle3_logits, sglang_eagle3_aux_ids)):
        params, cfg, problems = load(Path(out), h, vocab)
        if problems:
            raise SystemExit(f"{name} would not load {out}: {problems}")
        with torch.no_grad():
            a, p, (k, v) = eagle3_engine_forward(params, cfg, layer, embed, tokens, aux, pos)
            theirs = [logits_fn(params, cfg, a)]
            b, _, _ = eagle3_engine_forward(params, cfg, layer, embed, nxt_tok, p[-1:].expand(2, h), nxt_pos,
                                            past=(k, v))
            theirs.append(logits_fn(params, cfg, b))
        diff = 0.0
        for x, y in zip(ours, theirs):
            if not torch.equal(torch.isfinite(x), torch.isfinite(y)):
                raise SystemExit(f"{name}: the draft vocabulary maps to other target ids than the runtime's")
            fin = torch.isfinite(x)
            diff = max(diff, float((x[fin] - y[fin]).abs().max()))
        same = all(torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(ours, theirs))
        result[name] = {"max_abs_logit_diff": diff, "same_argmax": same,
                        "aux_layers_tapped": list(aux_ids(cfg, num_layers))}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: check_eagle3_export.py <eagle3 heads dir> <export dir>")
    main(sys.argv[1], sys.argv[2])
