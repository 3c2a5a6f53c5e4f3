"""``medusa-eval`` and ``medusa-generate``: measure heads, or decode with them.

    medusa-eval heads=runs/medusa1_smollm2/heads                       # MT-Bench first turns, tree=auto
    medusa-eval heads=runs/a/heads num_prompts=10 max_new_tokens=96 out=runs/a/eval
    medusa-eval heads=runs/a/heads tree=tree8 turns=both prompts=my_prompts.jsonl
    medusa-eval heads=runs/a/heads mode=sample temperature=0.7 methods=[medusa,autoregressive]
    medusa-generate heads=runs/a/heads prompt="Write a haiku about the sea." tree=runs/a/eval/tree.json

Key=value overrides as in ``medusa-train`` (Hydra). The runtime library never imports Hydra;
only these entry points do. User mistakes print one line and exit 2.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import List, Optional

EXIT_USER_ERROR = 2


@dataclass
class RuntimeConfig:
    heads: str = "???"  # a heads export directory (required)
    backbone: Optional[str] = None  # default: the base model recorded in the heads' config.json
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # float32 | bfloat16 | float16
    tree: str = "auto"  # auto (measured) | a default name (tree8, chain3, ...) | a tree JSON path
    mode: str = "greedy"  # greedy (lossless) | typical (lossy) | sample (exact)
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    max_new_tokens: int = 128
    seed: int = 0
    threads: int = 0  # torch CPU threads (0 = default)
    trust_remote_code: bool = False


@dataclass
class EvalConfig(RuntimeConfig):
    prompts: str = "embedded:mtbench"  # or a JSONL of prompts
    num_prompts: Optional[int] = None  # first N prompts (calibration prompts are taken after them)
    turns: str = "first"  # first | both
    methods: List[str] = field(default_factory=lambda: ["medusa", "autoregressive", "hf_generate"])
    calibration_prompts: int = 8
    calibration_tokens: int = 48
    tree_budgets: List[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
    out: Optional[str] = None  # default: <heads>/../eval
    progress_bar: bool = True


@dataclass
class GenerateConfig(RuntimeConfig):
    prompt: Optional[str] = None
    tree: str = "tree4"
    system: Optional[str] = None


def _fail(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


def _load(cfg):
    import torch

    from .model import load_medusa

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.heads in ("???", ""):
        from .errors import UserError

        raise UserError("heads=<export directory> is required")
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return load_medusa(cfg.heads, backbone=cfg.backbone, device=device, dtype=cfg.dtype,
                       trust_remote_code=cfg.trust_remote_code)


def _sampling(cfg):
    from .verify import SamplingConfig

    return SamplingConfig(mode=cfg.mode, temperature=cfg.temperature if cfg.mode != "greedy" else 1.0,
                          top_k=cfg.top_k, top_p=cfg.top_p, typical_epsilon=cfg.typical_epsilon,
                          typical_delta=cfg.typical_delta)


def run_eval(cfg) -> dict:
    from pathlib import Path

    from omegaconf import OmegaConf

    from .evaluate import evaluate, load_prompts, write_report

    sampling = _sampling(cfg)
    prompts = load_prompts(cfg.prompts)
    wanted = cfg.num_prompts
    if wanted is not None and wanted < 1:
        from .errors import UserError

        raise UserError(f"num_prompts must be >= 1, got {wanted}")
    if wanted is not None:  # keep the calibration prompts apart from the evaluated ones
        prompts = prompts[:wanted] + prompts[wanted:][-cfg.calibration_prompts:] if cfg.tree == "auto" \
            else prompts[:wanted]
    m = _load(cfg)
    settings = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(vars(cfg))
    report = evaluate(m, prompts, methods=list(cfg.methods), tree=cfg.tree, max_new_tokens=cfg.max_new_tokens,
                      sampling=sampling, turns=cfg.turns, calibration_prompts=cfg.calibration_prompts,
                      calibration_tokens=cfg.calibration_tokens, budgets=list(cfg.tree_budgets), seed=cfg.seed,
                      progress=cfg.progress_bar, settings=settings)
    out = Path(cfg.out) if cfg.out else Path(cfg.heads).resolve().parent / "eval"
    paths = write_report(out, report)
    if report["tree"]["choices"]:
        from .tree import MedusaTree

        MedusaTree(report["tree"]["choices"], name=report["tree"]["name"]).save(out / "tree.json")
        paths.append(out / "tree.json")
    tps = report["tokens_per_s"]
    print(f"\ntau {report.get('tau', 1.0):.3f} | medusa {tps.get('medusa', 0):.2f} tok/s | "
          f"autoregressive {tps.get('autoregressive', 0):.2f} tok/s | HF generate {tps.get('hf_generate', 0):.2f} tok/s")
    print(f"speedup vs autoregressive {report.get('speedup_vs_autoregressive', float('nan')):.2f}x | "
          f"vs HF generate {report.get('speedup_vs_hf_generate', float('nan')):.2f}x | "
          f"identical to greedy: {report.get('greedy_identical_fraction', 'n/a')}")
    print("report: " + ", ".join(str(p) for p in paths))
    return report


def run_generate(cfg) -> None:
    from .decode import medusa_stream
    from .errors import UserError

    if not (cfg.prompt or "").strip():
        raise UserError('prompt="..." is required and must not be empty')
    m = _load(cfg)
    ids = m.encode_chat(cfg.prompt, system=cfg.system)
    stream = medusa_stream(m, ids, tree=cfg.tree, max_new_tokens=cfg.max_new_tokens, sampling=_sampling(cfg),
                           seed=cfg.seed)
    shown, tokens = "", []
    for chunk in stream:  # decode the whole answer each time: multi-byte characters span tokens
        tokens += chunk
        text = m.tokenizer.decode(tokens, skip_special_tokens=True)
        sys.stdout.write(text[len(shown):])
        sys.stdout.flush()
        shown = text
    out = stream.result
    print(f"\n\n[{len(out.tokens)} tokens, tau {out.tau:.2f}, {out.tokens_per_s:.1f} tokens/s, "
          f"finish: {out.finish_reason}]", file=sys.stderr)


def _main(prog: str, schema, task, argv: Optional[list[str]]) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(__doc__.strip())
        return
    if any(not ("=" in a) or a.startswith("-") for a in argv):
        bad = [a for a in argv if "=" not in a or a.startswith("-")][0]
        _fail(prog, f"arguments are key=value overrides, got {bad!r} (see {prog} --help)")
    from omegaconf import OmegaConf

    from .errors import UserError

    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.from_dotlist(argv))
    except Exception as e:  # unknown key / wrong type: keep the lines that say what is wrong
        noise = ("full_key", "reference_type", "object_type")
        lines = [l.strip() for l in str(e).splitlines() if l.strip() and not l.strip().startswith(noise)]
        key = getattr(e, "full_key", None)
        _fail(prog, (f"{key}: " if key else "") + (" ".join(lines) or type(e).__name__) + f" (see {prog} --help)")
    try:
        task(cfg)
    except UserError as e:
        _fail(prog, str(e))


def eval_main(argv: Optional[list[str]] = None) -> None:
    _main("medusa-eval", EvalConfig, run_eval, argv)


def generate_main(argv: Optional[list[str]] = None) -> None:
    _main("medusa-generate", GenerateConfig, run_generate, argv)
