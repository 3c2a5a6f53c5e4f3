"""Medusa-2's joint step with and without gradient checkpointing of the backbone: time and saved tensors.

On the embedded SmolLM2-135M (the ``medusa1_smollm2`` recipe's backbone), a LoRA adapter on the attention
projections and three shared-projection heads: one forward + backward of ``lora.JointWithLoss`` (KL to the
adapter-free model) over random token rows, ``lora.gradient_checkpointing`` off and on, interleaved step by step
(the first round dropped as warm-up). Reported: each one's median seconds, its range, the ratio of the medians, and
the bytes autograd saves for backward in one step (what checkpointing trades for the recompute).

    python scripts/bench.py joint-checkpointing                 # 2 x 512 tokens, 6 rounds
    python scripts/bench.py joint-checkpointing --rounds 9 --length 1024
"""

from __future__ import annotations

import copy
import json
import statistics
import time
import types

from benchmarks.options import Parser, positive_int


def _joint(base, on: bool):
    import torch

    from inference.heads.medusa import MedusaHeads
    from inference.heads.spec import HeadsSpec
    from medusa_train import lora

    torch.manual_seed(0)
    model = copy.deepcopy(base)
    lcfg = types.SimpleNamespace(r=16, alpha=32, dropout=0.05, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                 gradient_checkpointing=on, backbone_loss="kl", backbone_weight=1.0,
                                 heads_coefficient=0.2, heads_warmup_steps=0, load_in_bits=0)
    peft_model = lora.apply_lora(model, lcfg)
    cfg = model.config
    spec = HeadsSpec(num_heads=3, num_layers=1, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                     projection="shared")
    heads = MedusaHeads.from_lm_head(spec, model.lm_head.weight.detach())
    heads.attach_lm_head(model.lm_head.weight)
    return lora.JointWithLoss(peft_model, peft_model.get_base_model().model, model.lm_head, heads,
                              [0.8, 0.64, 0.512], None, lcfg)


def _saved_bytes(step) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``step()`` runs its forward."""
    import torch

    seen, total = set(), [0]

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return total[0]


def main(argv: list[str] | None = None) -> None:
    ap = Parser(prog="bench.py joint-checkpointing", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=positive_int, default=6, help="interleaved rounds (the first is warm-up)")
    ap.add_argument("--batch", type=positive_int, default=2)
    ap.add_argument("--length", type=positive_int, default=512)
    ap.add_argument("--threads", type=positive_int, default=2)
    args = ap.parse_args(argv)

    import torch

    from medusa_train.backbone import load_backbone
    from medusa_train.launch import compose_recipe

    torch.set_num_threads(args.threads)
    base = load_backbone(compose_recipe("medusa1_smollm2", ["trainer.device=cpu"]).backbone, "cpu", seed=0).model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, base.config.vocab_size, (args.batch, args.length), generator=g)
    labels = ids.clone()
    labels[:, : args.length // 5] = -100   # a user turn: no labels
    rest = (torch.arange(args.length).expand(args.batch, -1), torch.ones_like(ids), labels, torch.ones_like(ids))
    joints = {on: _joint(base, on) for on in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            joint = joints[on]
            joint.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            joint(ids, rest[0], rest[1], rest[2], rest[3]).backward()
            if r:
                times[on].append(time.perf_counter() - t0)
    out = {}
    for on in (False, True):
        joint = joints[on]
        joint.zero_grad(set_to_none=True)
        out[f"checkpointing_{'on' if on else 'off'}"] = {
            "median_s": round(statistics.median(times[on]), 3), "range_s": [round(min(times[on]), 3),
                                                                          round(max(times[on]), 3)],
            "saved_bytes": _saved_bytes(lambda: joint(ids, *rest))}
    out["ratio_on_off"] = round(out["checkpointing_on"]["median_s"] / out["checkpointing_off"]["median_s"], 3)
    print(json.dumps(out, indent=2))
