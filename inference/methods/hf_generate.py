"""transformers' own greedy ``generate`` (method ``hf_generate``): the baseline a user gets today.

Not a ``Decoder``: it registers a runner. Its default cache, timed like the others, with stock
kernels (no ``linear_kernels`` routing) and transformers' own sdpa (not ``runtime.attention``); the
output is cut after the first EOS, as the runtime cuts. Greedy mode only, from a clean greedy config
(``greedy_config``): the backbone's own ``generation_config`` (a repetition_penalty, no_repeat_ngram_size,
min_new_tokens, num_beams it ships) is not applied, or this would be another decoder than plain greedy.

``hf_generate_batch`` is its batched form (the batched evaluation's second baseline): one
``generate`` call over left-padded prompts with an attention mask, each row cut after its first
EOS, returned as a ``BatchOutput`` like ``generate_batch``'s.

``hf_generate_static`` (method ``hf_generate_static``) is the same call with
``cache_implementation="static"``: what a user who follows transformers' advice for GPU decoding gets.
What transformers 5.25 does with it (``generation/utils.py``): ``_valid_auto_compile_criteria`` (l. 2438)
compiles the model's forward on its own when the cache is compileable (a ``StaticCache``) and the device is
cuda / xpu / mps / tpu / neuron (on the CPU only if ``compile_config._compile_all_devices`` is set), unless
``disable_compile``; ``get_compiled_call`` (``modeling_utils.py`` l. 4888) wraps ``__call__`` in
``torch.compile`` with ``CompileConfig``'s defaults (inductor, ``mode="reduce-overhead"``: CUDA graphs). Only
the one-token decode steps run compiled; the prefill runs eager (``_prefill``, l. 4346, without
``prefill_chunk_size``). So on CUDA the first call per cache length compiles (untimed here: a warm-up), on
the CPU nothing compiles and this is the eager static-cache loop. The cache length is kept per model
(``_cache_length``), so prompts of other lengths reuse the compiled graph. Not batched: the batched
evaluation keeps ``hf_generate_batch`` as its only transformers baseline. (The line numbers are 5.25's; 5.17, the
GPU image's, has the same functions at other lines.)
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager

import torch
from transformers import GenerationConfig

from ..runtime.attention import transformers_attention
from ..runtime.batch_decode import BatchOutput
from ..runtime.decode import GenerationOutput, eos_set
from ..runtime.linear_kernels import stock_kernels
from ..runtime.model import MedusaModel
from .registry import Costs, Method, register, slot_costs


def hf_generate(m: MedusaModel, prompt_ids: list[int], max_new_tokens: int, sampling=None, seed=None,
                options=None, eos_token_ids=None) -> GenerationOutput:
    ids = torch.tensor([prompt_ids], device=m.device)
    new, dt = _generate(m, ids, torch.ones_like(ids), max_new_tokens, eos=eos_token_ids)
    g = _output(new[0], len(prompt_ids), eos_set(m, eos_token_ids))
    g.decode_s = dt
    return g


def pad_id(m: MedusaModel) -> int:
    """The id ``generate`` pads with: the tokenizer's, else the model's, else EOS (else 0)."""
    for pad in (getattr(m.tokenizer, "pad_token_id", None), getattr(m.model.config, "pad_token_id", None)):
        if isinstance(pad, int):
            return pad
    eos = list(m.eos_token_ids)
    return eos[0] if eos else 0  # no EOS at all (a random backbone, EOS disabled): any id pads nothing


@contextmanager
def model_defaults_off(model):
    """The backbone's own ``generation_config`` replaced by transformers' defaults while ``generate`` runs.
    ``generate`` fills every key the config it is given leaves unset from the model's (``_prepare_generation_config``:
    "user kwargs > self.generation_config > global defaults"), so a backbone shipping repetition_penalty,
    no_repeat_ngram_size, min_new_tokens, num_beams, an EOS, ... made this baseline another decoder than the greedy
    loop it is compared with, and an empty EOS set fall back to the model's EOS."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def greedy_config(**keys) -> tuple[GenerationConfig, dict]:
    """(a clean greedy ``GenerationConfig`` with ``keys`` set, transformers' defaults for the rest; the keys it has no
    field for, passed to ``generate`` as transformers itself passes them on). Sampling keys are never set: every
    transformers baseline here is greedy."""
    config = GenerationConfig()
    rest = config.update(do_sample=False, num_beams=1, **keys)
    return config, rest


def _generate(m: MedusaModel, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, eos=None,
              **extra) -> tuple[list, float]:
    """Greedy ``generate`` of [B, L] ids (``extra``: more ``generate`` keys) -> (each row's new tokens cut after its
    first EOS, wall seconds), with a clean config (``greedy_config``, ``model_defaults_off``): only what is set here
    decides. ``eos``: the ids to stop at, as the runtime's ``eos_set`` reads them (None = the model's, ``()`` =
    never stop early)."""
    eos = sorted(eos_set(m, eos))
    config, rest = greedy_config(max_new_tokens=max_new_tokens, eos_token_id=eos or None, pad_token_id=pad_id(m),
                                 **extra)
    t0 = time.perf_counter()
    with torch.inference_mode(), stock_kernels(), transformers_attention(m.model), model_defaults_off(m.model):
        out = m.model.generate(input_ids=ids, attention_mask=mask, generation_config=config, **rest)
    if m.device.type == "cuda":
        torch.cuda.synchronize(m.device)
    dt = time.perf_counter() - t0
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        for i, t in enumerate(row):
            if t in eos:
                row = row[:i + 1]
                break
        rows.append(row)
    return rows, dt


def _output(new: list[int], prompt_tokens: int, eos: set[int]) -> GenerationOutput:
    """``GenerationOutput`` of one row's new tokens, cut after its first EOS (one of ``eos``): its finish reason as
    the runtime's (``eos``, else ``length``: generate stops early only at an EOS)."""
    finish = "eos" if new and new[-1] in eos else "length"
    g = GenerationOutput(tokens=new, prompt_tokens=prompt_tokens, finish_reason=finish)
    g.accept_lengths = [1] * max(len(new) - 1, 0)
    return g


def hf_generate_batch(m: MedusaModel, prompts: list[list[int]], max_new_tokens: int) -> BatchOutput:
    """One greedy ``generate`` over the prompts, left-padded (``pad_id``) with an attention mask; each row
    counts its tokens up to and including its first EOS. The whole call's time is ``decode_s``."""
    width = max(len(p) for p in prompts)
    pad = pad_id(m)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=m.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=m.device)
    rows, dt = _generate(m, ids, mask, max_new_tokens)
    outs = [_output(new, len(p), eos_set(m, None)) for new, p in zip(rows, prompts)]
    for g in outs:
        g.decode_s = dt
    return BatchOutput(outs, decode_s=dt)


# -- the static-cache baseline ------------------------------------------------------------------
CACHE_ROUNDING = 256   # cache lengths are multiples of this: a few distinct lengths (compiles) per model
WARMUP_TOKENS = 16     # the untimed warm-up's length: the prefill plus enough compiled decode steps
_static: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # backbone -> {"length": int, "warm": set}


def _cache_length(m: MedusaModel, needed: int) -> int:
    """The static cache length for a call needing ``needed`` slots: the model's longest so far, grown (rounded up
    to ``CACHE_ROUNDING``) when this call needs more. transformers sizes a static cache to ``max_length - 1``
    unless ``max_cache_len`` is given (``_prepare_cache_for_generation``, generation/utils.py l. 2294-2305)
    and itself keeps the longest length it used on the model (``_prepare_static_cache``, l. 2182-2213: a new
    ``StaticCache`` per call of ``max(asked, _previous_max_cache_length)``); a new length is a new shape for
    the compiled forward, so a recompile. Its remembered length is folded in so the length recorded is the one
    transformers allocates."""
    state = _static.setdefault(m.model, {"length": 0, "warm": set()})
    rounded = -(-needed // CACHE_ROUNDING) * CACHE_ROUNDING
    state["length"] = max(rounded, state["length"], getattr(m.model, "_previous_max_cache_length", 0))
    return state["length"]


def _compiles(m: MedusaModel) -> bool:
    """Whether transformers compiles a static-cache ``generate`` of ``m``: off the CPU (module docstring)."""
    return m.device.type != "cpu"


def hf_generate_static(m: MedusaModel, prompt_ids: list[int], max_new_tokens: int, sampling=None, seed=None,
                       options=None, eos_token_ids=None) -> GenerationOutput:
    """``hf_generate`` with transformers' static cache (module docstring): timed at steady state, the compile a
    new cache length causes on a GPU done by an untimed warm-up call first."""
    ids = torch.tensor([prompt_ids], device=m.device)
    length = _cache_length(m, len(prompt_ids) + max_new_tokens)
    static = dict(cache_implementation="static", max_cache_len=length)
    warm = _static[m.model]["warm"]
    if _compiles(m) and length not in warm:
        # min_new_tokens holds EOS back (a logits processor, outside the compiled forward), so the warm-up
        # reaches the compiled decode steps; no more than the timed call's tokens, so the cache length is its
        n = min(WARMUP_TOKENS, max_new_tokens)
        _generate(m, ids, torch.ones_like(ids), n, min_new_tokens=n, **static)
        warm.add(length)
    new, dt = _generate(m, ids, torch.ones_like(ids), max_new_tokens, eos=eos_token_ids, **static)
    g = _output(new[0], len(prompt_ids), eos_set(m, eos_token_ids))
    g.decode_s = dt
    return g


def _static_costs(m: MedusaModel, options, run_length: int) -> Costs:
    """The static cache's slots beyond prompt + max_new_tokens (its length rounded up, or a longer earlier one)."""
    state = _static.get(m.model)
    length = state["length"] if state else -(-run_length // CACHE_ROUNDING) * CACHE_ROUNDING
    return slot_costs(m, max(length - run_length, 0))


register(Method("hf_generate", "transformers' greedy generate (baseline, greedy mode only)", runner=hf_generate,
                baseline=True, greedy_only=True))
register(Method("hf_generate_static", "transformers' greedy generate with its static cache, compiled by transformers "
                "on a GPU (baseline on CUDA, greedy mode only)", runner=hf_generate_static, baseline=True,
                greedy_only=True, costs=_static_costs, devices=("cuda",)))
