"""Evaluation: what the heads are worth on this machine, measured honestly.

One place defines the metrics (ANCHORS.md gives the field's definitions):
  tau                mean tokens per verification step, bonus counted (plain decoding = 1.0);
                     pooled over all steps of all prompts.
  acceptance_rate    accepted draft tokens / proposed draft tokens, where a step proposes as
                     many tokens as the tree is deep (the most it could accept, as vLLM
                     counts its K speculative tokens).
  n_alpha            P(the draft token at depth n is accepted | depths < n were accepted).
  head accuracy      per head, top-1..top-5 against the backbone's own greedy tokens.
  tokens_per_s       new tokens / wall time including prefill, per method, summed over prompts.
  speedup_vs_*       medusa tokens/s over the runtime's own autoregressive loop (same cache,
                     same token choice) and over transformers' ``generate`` (greedy).
  greedy_identical_fraction  prompts whose Medusa output equals plain greedy decoding.
The same numbers are computed for every method in ``per_method`` (tau and acceptance for the
draft model, lookahead and prompt lookup use the tokens each step proposed: K for the draft
model, the candidate trie's depth for lookahead, the looked-up length for prompt lookup, the
merged trie's depth for medusa_lookup).

Methods (``METHODS``): medusa (needs heads), draft (draft-model speculative sampling,
``speculative.py``), lookahead (``lookahead.py``), prompt_lookup (``prompt_lookup.py``),
medusa_lookup (needs heads: Medusa's tree + a prompt-lookup branch verified in one forward,
``hybrid.py``; it uses medusa's tree and the prompt_lookup settings), autoregressive (the
runtime's own one-token loop: the speedup baseline) and hf_generate (transformers' greedy
``generate``). They run interleaved prompt by prompt (their order
rotates), in one process, so the machine's background load hits them alike.

The trade-off matrix (``write_compare``: compare.md + compare.png) adds what each method costs:
extra parameters loaded (counted from the real modules, tensors shared with the backbone
excluded: a self-draft or heads projecting through the backbone's lm_head add nothing for
it), extra KV cache (the cache slots a method allocates beyond plain decoding's prompt +
max_new_tokens, in bytes at the run's longest prompt, from each model's KV shape and dtype)
and the training it needs (none / heads / draft).

Tree choice (``tree=auto``): per-depth, per-rank head accuracy is measured on calibration
prompts (held out from the evaluated ones); a tree is grown greedily for each node budget;
each candidate's verification-step latency is measured on this device; the tree maximising
expected tau / step time wins — or none, when no tree beats plain decoding's rate, in which
case "medusa" decodes autoregressively and says so (weak heads must never make it slower), and
"medusa_lookup" runs prompt lookup alone. medusa_lookup uses the same tree as medusa.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from .. import assets
from ..runtime.decode import (GenerationOutput, autoregressive_generate, measure_head_accuracy, measure_step_latency,
                     medusa_generate)
from ..errors import UserError
from ..methods.medusa_lookup import hybrid_generate
from ..runtime.linear_kernels import routing_summary
from ..methods.lookahead import LookaheadSettings, lookahead_generate
from ..runtime.model import MedusaModel
from ..methods.prompt_lookup import PromptLookupSettings, prompt_lookup_generate
from ..methods.draft import DraftDecoder, DraftSettings, drive, load_draft
from ..runtime.tree import MedusaTree, expected_tau, grow_tree, resolve_tree
from ..runtime.verify import SamplingConfig
from .reports import (COMPARE_FILES, compare_markdown, markdown, plot_compare, plot_report,  # noqa: F401
                      write_compare, write_report)

METHODS = ("medusa", "draft", "lookahead", "prompt_lookup", "medusa_lookup", "autoregressive", "hf_generate")
HEAD_METHODS = ("medusa", "medusa_lookup")  # need heads and a tree
BASELINES = ("autoregressive", "hf_generate")
DEFAULT_METHODS = ("medusa", "autoregressive", "hf_generate")
DEFAULT_BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
CODE_PROMPTS = Path(__file__).parent / "data" / "code_prompts.jsonl"
PROMPT_SETS = {"code": CODE_PROMPTS, "embedded:code": CODE_PROMPTS}


@dataclass
class MethodOptions:
    """Settings of the methods beside Medusa (the CLI's keys in brackets)."""

    draft: Any = "self:4"  # [draft] "self:N", a model name/path, or a loaded MedusaModel
    draft_settings: DraftSettings = field(default_factory=DraftSettings)          # [draft_k, draft_adaptive]
    lookahead: LookaheadSettings = field(default_factory=LookaheadSettings)       # [lookahead_*]
    prompt_lookup: PromptLookupSettings = field(default_factory=PromptLookupSettings)  # [prompt_lookup_*]
    trust_remote_code: bool = False  # [trust_remote_code] for a draft checkpoint with custom code

    def to_dict(self) -> dict:
        d = self.draft if isinstance(self.draft, str) else type(self.draft).__name__
        return {"draft": d, "draft_k": self.draft_settings.k, "draft_adaptive": self.draft_settings.adaptive,
                "lookahead_window": self.lookahead.window, "lookahead_ngram": self.lookahead.ngram,
                "lookahead_guesses": self.lookahead.guesses, "prompt_lookup_tokens": self.prompt_lookup.num_tokens,
                "prompt_lookup_ngram": [self.prompt_lookup.max_ngram, self.prompt_lookup.min_ngram]}


def check_methods(methods: Sequence[str], m: Optional[MedusaModel] = None) -> list[str]:
    """Known names, no duplicates, heads present when Medusa is asked for; else one ``UserError`` line."""
    if isinstance(methods, str) or not methods:
        raise UserError(f"methods must be a non-empty list of names from {', '.join(METHODS)}")
    unknown = [x for x in methods if x not in METHODS]
    if unknown:
        raise UserError(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise UserError(f"a method is listed twice in {list(methods)}")
    needing = [x for x in HEAD_METHODS if x in methods]
    if m is not None and needing and m.heads is None:
        raise UserError(f"method {needing[0]} needs Medusa heads (heads=<export directory>); the training-free "
                        "methods draft, lookahead and prompt_lookup run without them")
    return list(methods)


# -- prompts -------------------------------------------------------------------------------
@dataclass
class Prompt:
    id: str
    turns: list[str]
    category: str = ""


def load_prompts(source: str, limit: Optional[int] = None) -> list[Prompt]:
    """MT-Bench (``embedded:mtbench``), the bundled code/structured-output set (``code``) or a
    JSONL file of prompts.

    A JSONL line may be ``{"prompt": str}``, ``{"text": str}``, ``{"turns": [str, ...]}``
    (MT-Bench's form) or ``{"messages": [{"role": "user", "content": str}, ...]}``.
    """
    if source in ("embedded:mtbench", "mtbench"):
        path = assets.mtbench_questions_path()
    else:
        path = PROMPT_SETS.get(source) or Path(source).expanduser()
    if not Path(path).is_file():
        raise UserError(f"prompts file not found: {source}")
    prompts: list[Prompt] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{source}:{n} is not valid JSON") from None
            turns = _turns(rec)
            if not turns or any(not isinstance(t, str) or not t.strip() for t in turns):
                raise UserError(f"{source}:{n} has an empty or missing prompt")
            pid = str(rec.get("question_id", rec.get("id", n))) if isinstance(rec, dict) else str(n)
            prompts.append(Prompt(pid, turns, rec.get("category", "") if isinstance(rec, dict) else ""))
    if not prompts:
        raise UserError(f"no prompts in {source}")
    return prompts[:limit] if limit else prompts


def _turns(rec) -> list:
    if isinstance(rec, str):
        return [rec]
    if not isinstance(rec, dict):
        return []
    if isinstance(rec.get("turns"), list):
        return rec["turns"]
    for key in ("prompt", "text", "question"):
        if isinstance(rec.get(key), str):
            return [rec[key]]
    if isinstance(rec.get("messages"), list):
        return [m.get("content") for m in rec["messages"] if isinstance(m, dict) and m.get("role") == "user"]
    return []


# -- tree choice ---------------------------------------------------------------------------
@dataclass
class TreeChoice:
    tree: Optional[MedusaTree]  # None: plain decoding is faster than any tree on this machine
    reason: str
    accuracies: Optional[list] = None  # [K][rank] measured on calibration prompts
    candidates: list = field(default_factory=list)  # {nodes, expected_tau, step_ms, rate}
    autoregressive_step_ms: float = 0.0

    def to_dict(self) -> dict:
        t = self.tree
        return {"name": t.name if t is not None else "none (plain decoding)",
                "nodes": t.num_nodes if t is not None else 0,
                "choices": t.choices if t is not None else [],
                "reason": self.reason, "candidates": self.candidates,
                "autoregressive_step_ms": self.autoregressive_step_ms}


def _median_ar_step(m: MedusaModel, prompt_ids: list[int], steps: int = 8) -> float:
    out = autoregressive_generate(m, prompt_ids, max_new_tokens=steps + 3, eos_token_ids=())
    return statistics.median(out.step_s[2:]) if len(out.step_s) > 2 else statistics.median(out.step_s)


def calibrated_choice(tree_setting: str) -> Optional[int]:
    """N for ``tree=calibrated:N`` (grow the best N-node tree from measured accuracy and use it
    whatever its speed: the same node budget for every set of heads being compared), else None."""
    if not isinstance(tree_setting, str) or not tree_setting.startswith("calibrated:"):
        return None
    n = tree_setting.split(":", 1)[1]
    if not n.isdigit() or int(n) < 2:
        raise UserError(f"tree=calibrated:N needs N >= 2 nodes (root included), got {tree_setting!r}")
    return int(n)


def choose_tree(m: MedusaModel, calibration: Sequence[Sequence[int]], latency_prompt: Sequence[int], *,
                budgets: Sequence[int] = DEFAULT_BUDGETS, calibration_tokens: int = 48, topk: int = 10,
                latency_steps: int = 6, latency_rounds: int = 2,
                log: Callable[[str], None] = print, fixed_nodes: Optional[int] = None) -> TreeChoice:
    """Grow a tree per budget from measured accuracy; keep the one with the best tau / step time.
    With ``fixed_nodes`` grow that one tree and keep it (no latency measurement)."""
    acc = measure_head_accuracy(m, calibration, max_new_tokens=calibration_tokens, topk=topk)
    per_rank = acc.per_rank.tolist()
    if fixed_nodes is not None:
        tree, tau = grow_tree(per_rank, fixed_nodes - 1, name=f"calibrated{fixed_nodes}", fill=True)
        log(f"  tree {tree.name}: {tree.num_nodes} nodes, expected tau {tau:.3f} (fixed budget)")
        return TreeChoice(tree, f"fixed budget of {fixed_nodes} nodes grown from measured accuracy", per_rank,
                          [{"name": tree.name, "nodes": tree.num_nodes, "expected_tau": round(tau, 4)}])
    trees = []
    seen = set()
    for b in sorted(set(budgets)):
        tree, tau = grow_tree(per_rank, b, name=f"auto{b}")
        key = tuple(map(tuple, tree.choices))
        if tree.num_nodes == 0 or key in seen:
            continue
        seen.add(key)
        trees.append((tree, tau))
    # Rounds interleave plain decoding and every tree, and each keeps its fastest median, so
    # a burst of background load does not decide the choice (this machine is shared).
    ar_step, lat = float("inf"), {}
    for _ in range(latency_rounds):
        ar_step = min(ar_step, _median_ar_step(m, list(latency_prompt)))
        if trees:
            for name, sec in measure_step_latency(m, list(latency_prompt), [t for t, _ in trees],
                                                  steps=latency_steps).items():
                lat[name] = min(lat.get(name, float("inf")), sec)
    best = (None, 1.0 / ar_step, "plain decoding is fastest")
    cands = []
    if trees:
        for tree, tau in trees:
            step = lat[tree.name]
            rate = tau / step
            cands.append({"name": tree.name, "nodes": tree.num_nodes, "expected_tau": round(tau, 4),
                          "step_ms": round(step * 1e3, 2), "expected_tokens_per_s": round(rate, 2)})
            log(f"  tree {tree.name:>7}: {tree.num_nodes:>2} nodes, expected tau {tau:.3f}, "
                f"step {step * 1e3:.1f} ms -> {rate:.1f} tok/s expected")
            if rate > best[1]:
                best = (tree, rate, f"best expected tau / step time ({rate:.1f} tok/s vs plain "
                                    f"{1 / ar_step:.1f})")
    log(f"  plain decoding: step {ar_step * 1e3:.1f} ms -> {1 / ar_step:.1f} tok/s")
    return TreeChoice(best[0], best[2], per_rank, cands, round(ar_step * 1e3, 2))


# -- measurement -----------------------------------------------------------------------------
@dataclass
class Sample:
    prompt_id: str
    turn: int
    outputs: dict = field(default_factory=dict)  # method -> GenerationOutput-like dict
    tokens: dict = field(default_factory=dict)  # method -> token ids


def hf_generate(m: MedusaModel, prompt_ids: list[int], max_new_tokens: int) -> GenerationOutput:
    """transformers' own greedy ``generate`` (its default cache), timed like the others, with stock
    kernels (no ``linear_kernels`` routing): the baseline is what a user gets from transformers."""
    from ..runtime.linear_kernels import stock_kernels

    ids = torch.tensor([prompt_ids], device=m.device)
    eos = list(m.eos_token_ids)
    pad = m.tokenizer.pad_token_id if m.tokenizer is not None and m.tokenizer.pad_token_id is not None else eos[0]
    t0 = time.perf_counter()
    with torch.inference_mode(), stock_kernels():
        out = m.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                               do_sample=False, eos_token_id=eos, pad_token_id=pad)
    if m.device.type == "cuda":
        torch.cuda.synchronize(m.device)
    dt = time.perf_counter() - t0
    new = out[0, len(prompt_ids):].tolist()
    for i, t in enumerate(new):  # cut after the first EOS, as the runtime does
        if t in eos:
            new = new[:i + 1]
            break
    g = GenerationOutput(tokens=new, prompt_tokens=len(prompt_ids), finish_reason="hf")
    g.decode_s = dt
    g.accept_lengths = [1] * max(len(new) - 1, 0)
    return g


def run_method(method: str, m: MedusaModel, prompt_ids: list[int], tree: Optional[MedusaTree],
               max_new_tokens: int, sampling: SamplingConfig, seed: int, options: Optional[MethodOptions] = None,
               draft: Optional[MedusaModel] = None) -> GenerationOutput:
    """One generation with ``method``; ``draft`` is the loaded draft model for method "draft"."""
    options = options or MethodOptions()
    kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed)
    if method == "medusa":
        if tree is None:  # the tree choice found plain decoding faster
            return autoregressive_generate(m, prompt_ids, **kw)
        return medusa_generate(m, prompt_ids, tree=tree, **kw)
    if method == "draft":
        if draft is None:
            draft = load_draft(options.draft, m, options.trust_remote_code)
        dec = DraftDecoder(m, draft, options.draft_settings, sampling, seed)
        return drive(dec, m, prompt_ids, max_new_tokens, None, None, None)
    if method == "lookahead":
        return lookahead_generate(m, prompt_ids, settings=options.lookahead, **kw)
    if method == "prompt_lookup":
        return prompt_lookup_generate(m, prompt_ids, settings=options.prompt_lookup, **kw)
    if method == "medusa_lookup":
        if tree is None:  # the tree choice found plain decoding faster than any tree: lookup alone
            return prompt_lookup_generate(m, prompt_ids, settings=options.prompt_lookup, **kw)
        return hybrid_generate(m, prompt_ids, tree=tree, settings=options.prompt_lookup, **kw)
    if method == "autoregressive":
        return autoregressive_generate(m, prompt_ids, **kw)
    if method == "hf_generate":
        if not sampling.is_greedy:
            raise UserError("hf_generate is measured in greedy mode only")
        return hf_generate(m, prompt_ids, max_new_tokens)
    raise UserError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def _proposed(out: GenerationOutput, method: str, depth: int) -> Optional[list[int]]:
    """Draft tokens proposed per step: recorded by the chain methods; for Medusa the tree depth
    (the most a step can accept), so a tree's acceptance rate compares with a chain's."""
    if method == "medusa":
        return [depth] * len(out.accept_lengths)
    return list(out.proposed) if out.proposed else None


def method_summary(samples: list[Sample], method: str, methods: Sequence[str], rates: dict, depth: int = 0) -> dict:
    """tau, acceptance rate, tokens/s, speedups and greedy identity of one method (module docstring)."""
    lengths = [n for s in samples for n in s.outputs[method].accept_lengths]
    out: dict = {"tokens_per_s": round(rates[method], 3),
                 "tau": round(sum(lengths) / len(lengths), 4) if lengths else 1.0}
    if method not in BASELINES:
        proposed = [_proposed(s.outputs[method], method, depth) for s in samples]
        total = sum(sum(p) for p in proposed if p is not None)
        accepted = sum(n - 1 for n in lengths)
        out["acceptance_rate"] = round(accepted / total, 4) if total else 0.0
        out["proposed_per_step"] = round(total / len(lengths), 3) if lengths else 0.0
    for base, key in (("autoregressive", "speedup_vs_autoregressive"), ("hf_generate", "speedup_vs_hf_generate")):
        if base in methods and rates[base] > 0:
            out[key] = round(rates[method] / rates[base], 4)
    if "autoregressive" in methods:
        same = [s.tokens[method] == s.tokens["autoregressive"] for s in samples]
        out["greedy_identical_fraction"] = round(sum(same) / len(same), 4)
    return out


def summarize(samples: list[Sample], methods: Sequence[str], tree: Optional[MedusaTree]) -> dict:
    """The report's headline numbers from the per-sample outputs (definitions: module docstring).

    Top-level keys describe Medusa (as before); ``per_method`` has the same numbers per method."""
    def total(method, attr):
        return sum(getattr(s.outputs[method], attr) for s in samples)

    rates = {}
    for meth in methods:
        tokens = sum(len(s.outputs[meth].tokens) for s in samples)
        secs = total(meth, "prefill_s") + total(meth, "decode_s")
        rates[meth] = tokens / secs if secs > 0 else 0.0
    depth = tree.max_depth if tree is not None else 0
    out: dict = {"tokens_per_s": {k: round(v, 3) for k, v in rates.items()},
                 "per_method": {meth: method_summary(samples, meth, methods, rates, depth) for meth in methods}}
    if "medusa" in methods:
        lengths = [n for s in samples for n in s.outputs["medusa"].accept_lengths]
        accepted = [n - 1 for n in lengths]
        out["tau"] = round(sum(lengths) / len(lengths), 4) if lengths else 1.0
        out["acceptance_rate"] = round(sum(accepted) / (depth * len(lengths)), 4) if depth and lengths else 0.0
        out["n_alpha"] = [round(sum(a >= n for a in accepted) / max(sum(a >= n - 1 for a in accepted), 1), 4)
                          for n in range(1, depth + 1)]
        out["accept_length_histogram"] = {str(k): lengths.count(k) for k in sorted(set(lengths))}
        for key in ("speedup_vs_autoregressive", "speedup_vs_hf_generate", "greedy_identical_fraction"):
            if key in out["per_method"]["medusa"]:
                out[key] = out["per_method"]["medusa"][key]
    if "hf_generate" in methods and "autoregressive" in methods:
        same = [s.tokens["hf_generate"] == s.tokens["autoregressive"] for s in samples]
        out["hf_generate_identical_fraction"] = round(sum(same) / len(same), 4)
    return out


# -- what each method costs --------------------------------------------------------------------
def kv_bytes_per_token(m: MedusaModel) -> int:
    """Bytes of keys + values one token occupies in ``m``'s KV cache (all layers)."""
    cfg = m.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = torch.empty((), dtype=m.dtype).element_size()
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * itemsize


def extra_parameters(module, backbone) -> tuple[int, int]:
    """(count, bytes) of ``module``'s parameters that are not tensors of ``backbone``."""
    if module is None:
        return 0, 0
    shared = {p.data_ptr() for p in backbone.parameters()}
    own = [p for p in module.parameters() if p.data_ptr() not in shared]
    return sum(p.numel() for p in own), sum(p.numel() * p.element_size() for p in own)


def method_costs(method: str, m: MedusaModel, tree: Optional[MedusaTree], options: MethodOptions,
                 draft: Optional[MedusaModel], run_length: int) -> dict:
    """Extra parameters, extra KV cache bytes (``run_length`` = prompt + max_new_tokens) and training."""
    per_token = kv_bytes_per_token(m)
    params, kv, training = (0, 0), 0, "none"
    if method == "medusa":
        params, training = extra_parameters(m.heads, m.model), "heads"
        kv = (tree.num_nodes if tree is not None else 0) * per_token
    elif method == "draft":
        is_self = getattr(draft, "self_draft_layers", None) is not None
        params = extra_parameters(draft.model, m.model) if draft is not None else (0, 0)
        training = "none (self-draft)" if is_self else "draft"
        slack = options.draft_settings.extra_kv_tokens
        kv = slack * per_token + ((run_length + slack + 1) * kv_bytes_per_token(draft) if draft is not None else 0)
    elif method == "lookahead":
        kv = options.lookahead.extra_kv_tokens * per_token
    elif method == "prompt_lookup":
        kv = options.prompt_lookup.extra_kv_tokens * per_token
    elif method == "medusa_lookup":
        params, training = extra_parameters(m.heads, m.model), "heads"
        kv = ((tree.num_nodes if tree is not None else 1) + options.prompt_lookup.num_tokens) * per_token
    return {"extra_parameters": params[0], "extra_parameter_bytes": params[1], "extra_kv_cache_bytes": kv,
            "training": training}


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# -- the whole evaluation ------------------------------------------------------------------
def evaluate(m: MedusaModel, prompts: list[Prompt], *, methods: Sequence[str] = DEFAULT_METHODS, tree="auto",
             max_new_tokens: int = 128, sampling: Optional[SamplingConfig] = None, turns: str = "first",
             calibration_prompts: int = 8, calibration_tokens: int = 48, budgets: Sequence[int] = DEFAULT_BUDGETS,
             seed: int = 0, progress: bool = True, log: Callable[[str], None] = print,
             settings: Optional[dict] = None, options: Optional[MethodOptions] = None) -> dict:
    """Run ``methods`` interleaved on ``prompts`` and summarise them (module docstring).

    ``options`` sets the draft model, lookahead and prompt-lookup methods; ``m.heads`` may be
    None when "medusa" is not among the methods."""
    sampling = sampling or SamplingConfig()
    options = options or MethodOptions()
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    methods = check_methods(methods, m)
    if "hf_generate" in methods and not sampling.is_greedy:
        raise UserError("hf_generate is measured in greedy mode only")
    if turns not in ("first", "both"):
        raise UserError(f"turns must be first|both, got {turns!r}")
    calib: list[list[int]] = []
    fixed = calibrated_choice(tree)
    with_tree = any(x in methods for x in HEAD_METHODS)
    if (tree == "auto" or fixed) and with_tree:
        if len(prompts) > calibration_prompts >= 1:
            calib_src, prompts = prompts[-calibration_prompts:], prompts[:-calibration_prompts]
        else:
            calib_src = prompts[:max(calibration_prompts, 1)]
        calib = [m.encode_chat(p.turns[0]) for p in calib_src]
        log(f"choosing the tree: head accuracy on {len(calib)} calibration prompts, step latency on this device")
        choice = choose_tree(m, calib, calib[0], budgets=budgets, calibration_tokens=calibration_tokens, log=log,
                             fixed_nodes=fixed)
    else:
        t = resolve_tree(tree, m.num_heads) if with_tree else None
        choice = TreeChoice(t, "given")
    if with_tree:
        log(f"tree: {choice.to_dict()['name']} ({choice.reason})")
    # the draft model is loaded once and reused for every prompt
    draft = load_draft(options.draft, m, options.trust_remote_code) if "draft" in methods else None

    samples: list[Sample] = []
    jobs = [(p, 0) for p in prompts]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs) * (2 if turns == "both" else 1), desc="eval", unit="prompt")
    for i, (p, _) in enumerate(jobs):
        history: list[dict] = []
        for turn, text in enumerate(p.turns[: 2 if turns == "both" else 1]):
            msgs = history + [{"role": "user", "content": text}]
            ids = m.encode_chat(msgs)
            sample = Sample(p.id, turn + 1)
            order = list(methods[i % len(methods):]) + list(methods[: i % len(methods)])
            for meth in order:
                g = run_method(meth, m, ids, choice.tree, max_new_tokens, sampling, seed + i, options, draft)
                sample.outputs[meth] = g
                sample.tokens[meth] = list(g.tokens)
            samples.append(sample)
            ref = sample.tokens.get("autoregressive") or next(iter(sample.tokens.values()))
            answer = m.tokenizer.decode(ref, skip_special_tokens=True) if m.tokenizer is not None else ""
            history = msgs + [{"role": "assistant", "content": answer}]
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()

    run_length = max((s.outputs[methods[0]].prompt_tokens for s in samples), default=0) + max_new_tokens
    report = {"settings": settings or {}, "machine": machine(), "num_samples": len(samples),
              "methods": list(methods), "tree": choice.to_dict(), **summarize(samples, methods, choice.tree),
              "method_options": options.to_dict(), "run_length": run_length,
              "costs": {meth: method_costs(meth, m, choice.tree, options, draft, run_length) for meth in methods},
              "linear_kernels": routing_summary(m.kernel_plans) if m.kernel_plans else "stock"}
    if choice.accuracies is not None:
        cum = torch.tensor(choice.accuracies).cumsum(1)
        report["head_accuracy"] = {"per_rank": choice.accuracies, "topk": cum.tolist(),
                                   "measured_on": f"{len(calib)} calibration prompts (backbone greedy tokens)"}
        if choice.tree is not None:
            report["tree"]["expected_tau"] = round(expected_tau(choice.tree, choice.accuracies), 4)
    report["samples"] = [{"prompt_id": s.prompt_id, "turn": s.turn,
                          **{f"{k}_tokens": len(v.tokens) for k, v in s.outputs.items()},
                          **{f"{k}_tau": round(v.tau, 3) for k, v in s.outputs.items() if k not in BASELINES}}
                         for s in samples]
    return report
