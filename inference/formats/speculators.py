"""vLLM ``speculators``-format EAGLE-3 drafters (``Eagle3Speculator``, what RedHatAI publishes), imported.

Read from:
  vllm-project/speculators  src/speculators/models/eagle3/config.py (``Eagle3SpeculatorConfig``), core.py
                            (``Eagle3DraftModel``: ``layers.{i}``, ``fc``, ``norm``, ``lm_head``, ``d2t`` / ``t2d``,
                            ``embed_tokens``; ``input_norm`` with ``norm_before_fc`` and ``fc_norm.{i}`` with
                            ``fc_norm``, applied in that order before ``fc`` (its config refuses both at once); the
                            TTT loop feeds the layer's output back and proposes ``speculative_tokens = ttt_steps``),
                            src/speculators/proposals/ (greedy: ``speculative_tokens``; static_tree / dynamic_tree:
                            ``depth``), read through the stored index and at commit
                            c05b95b303f7d4f21e8d7624e0ffa1c2d9b4d73b (``norm_before_fc`` / ``fc_norm``)
  vllm-project/vllm         vllm/transformers_utils/configs/speculators/base.py and algos.py (``update_eagle3``),
                            commit cfb173ab8e1b8e44dd35f8b5188255b6a03e13ec: what vLLM serves such a dir as

The layout: ``config.json`` with ``architectures: ["Eagle3Speculator"]``, ``speculators_model_type: "eagle3"``,
``transformer_layer_config`` (the draft layer's Llama config; its ``vocab_size`` is the target's),
``draft_vocab_size``, ``norm_before_residual``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``
(top level), ``speculators_config`` (``algorithm``, ``proposal_methods``, ``default_proposal_method``,
``verifier: {name_or_path, architectures}``); weights ``layers.0.*``, ``fc.weight``, ``norm.weight``,
``lm_head.weight``, ``d2t``, ``t2d``, maybe ``embed_tokens.weight``, ``input_norm.weight`` / ``fc_norm.{i}.weight``
(with ``norm_before_fc`` / ``fc_norm``).

vLLM builds its ``Eagle3LlamaForCausalLM`` config from ``transformer_layer_config`` with ``draft_vocab_size``,
``target_hidden_size``, the aux ids and ``norm_before_residual`` laid over it (absent: true, as
``update_eagle3`` defaults it), and its loader takes ``layers.0.`` as is (it renames ``midlayer.`` to that).
This importer builds the same config, renames ``layers.0.`` to the ``midlayer.`` the EAGLE-3 importer reads
(``eagle3.py``), and leaves the rest to it: the aux ids (none named: the target's default layers, with the
backbone, as for any EAGLE-3 dir), its refusals in one line, the flags it computes (``norm_before_residual``,
``norm_output``, ``logit_scale``, ``norm_before_fc`` with ``input_norm.weight``, ``fc_norm`` with
``fc_norm.{i}.weight``; its trainer now defaults eagle3 to ``norm_before_fc`` and ``norm_output``; top-level
``norm_output`` means what speculators' ``Eagle3DraftModel`` trains (core.py: norm(r') fed to the next TTT step, lm_head
on norm(r') either way) and vLLM serves (``update_eagle3`` copies it, absent = false; ``llama_eagle3.py`` feeds the
post-norm state back), not SpecForge's norm-before-lm_head reading: ``heads/eagle3.py``),
``tie_word_embeddings`` with an own ``lm_head``, ``embed_tokens`` ignored. The base model is
``speculators_config.verifier.name_or_path``.

Decoding defaults: the default proposal method's depth (greedy / sampling: ``speculative_tokens``, which the
speculators trainer sets to its TTT steps and vLLM takes as ``num_speculative_tokens``; a tree: ``depth``)
becomes the drafter's trained depth (``num_heads``), from which EAGLE-3 decoding fits its tree's depth
(``methods/eagle3.fitted_tree``), as for the depth our own export records; without one, the EAGLE-3 importer's
``FOREIGN_DEPTH``. A tree's widths have no place in the spec and are not read; ``verifier_accept_k`` > 1 /
``accept_tolerance`` > 0 (a lossy acceptance vLLM does not apply either) is ignored with a warning.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from ..errors import UserError
from ..heads.eagle3 import ENGINE_FLAGS
from ..heads.spec import HeadsSpec
from . import eagle3
from .export import FormatWarning
from .importers import register_importer

FORMAT = "speculators"
ARCHITECTURE = "Eagle3Speculator"
# Top-level keys of the speculators config that vLLM's Eagle3 config takes (over transformer_layer_config's).
TOP_LEVEL = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", *ENGINE_FLAGS,
             *eagle3.UNSUPPORTED_FLAGS)
TREES = ("static_tree", "dynamic_tree")


def is_speculators_dir(d: Path) -> bool:
    """Any ``speculators`` config (``speculators_model_type``, or the ``Eagle3Speculator`` architecture), so a
    type this runtime does not import gets this format's one-line refusal, not the native loader's error."""
    raw = eagle3.raw_config(d)
    if not raw:
        return False
    archs = raw.get("architectures")
    return "speculators_model_type" in raw or (isinstance(archs, list) and ARCHITECTURE in archs)


def vllm_config(d: Path, raw: dict) -> dict:
    """The config vLLM builds for its EAGLE-3 drafter from the speculators config ``raw`` (module docstring)."""
    where = d / "config.json"
    speculator_type = raw.get("speculators_model_type")
    if speculator_type != "eagle3":
        raise UserError(f"{where}: speculators format with speculators_model_type {speculator_type!r} is not "
                        "supported: this runtime imports speculators eagle3 drafters only")
    spec_cfg = eagle3.sub_dict(raw, "speculators_config")
    algorithm = spec_cfg.get("algorithm", "eagle3")
    if algorithm != "eagle3":
        raise UserError(f"{where}: speculators format with speculators_config.algorithm {algorithm!r} is not "
                        "supported (eagle3 only)")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise UserError(f"{where}: speculators format eagle3 config without a transformer_layer_config object")
    flat = {**layer, "architectures": [eagle3.ARCHITECTURE]}
    flat.pop(eagle3.META, None)  # only our own export records a depth and fingerprint there
    flat.update({key: raw[key] for key in TOP_LEVEL if raw.get(key) is not None})
    if raw.get("norm_before_residual") is None:
        warnings.warn(f"{where} does not say norm_before_residual: read as true, as vLLM's speculators config "
                      "(update_eagle3) defaults it", FormatWarning, stacklevel=4)
        flat["norm_before_residual"] = True
    verifier = eagle3.sub_dict(spec_cfg, "verifier")
    flat["base_model_name_or_path"] = str(verifier.get("name_or_path") or raw.get("base_model_name_or_path") or "")
    return flat


def trained_depth(d: Path, raw: dict) -> int | None:
    """The default proposal method's depth (the first method's, where none is named default), or None."""
    spec_cfg = eagle3.sub_dict(raw, "speculators_config")
    methods = [m for m in spec_cfg.get("proposal_methods") or () if isinstance(m, dict)]
    if not methods:
        return None
    default = spec_cfg.get("default_proposal_method")
    method = next((m for m in methods if m.get("proposal_type") == default), methods[0])
    proposal = method.get("proposal_type")
    if _number(method.get("verifier_accept_k"), 1) > 1 or _number(method.get("accept_tolerance"), 0) > 0:
        warnings.warn(f"{d / 'config.json'}: proposal method {proposal} asks verifier_accept_k="
                      f"{method.get('verifier_accept_k')}, accept_tolerance={method.get('accept_tolerance')} "
                      "(a lossy acceptance): ignored, this runtime verifies exactly (as vLLM does)",
                      FormatWarning, stacklevel=4)
    value = method.get("depth") if proposal in TREES else method.get("speculative_tokens")
    try:
        depth = int(value)
    except (TypeError, ValueError):
        return None
    return depth if depth >= 1 else None


def _number(value, default: float) -> float:
    try:
        return float(value) if value is not None else default
    except (TypeError, ValueError):
        return default


def read_spec(d: Path, backbone_config=None) -> HeadsSpec:
    raw = eagle3.raw_config(d)
    if raw is None:
        raise UserError(f"{d / 'config.json'} is not a readable JSON object")
    return eagle3.spec_from_config(d, vllm_config(d, raw), backbone_config, depth=trained_depth(d, raw),
                                   layout=f"{FORMAT} format")


def load(d: Path, spec: HeadsSpec):
    """(drafter, None): the tensors under the names the EAGLE-3 importer reads (``layers.0.`` -> ``midlayer.``)."""
    tensors, f = eagle3.read_weights(d)
    renamed = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
               for k, v in tensors.items()}
    layer = (eagle3.raw_config(d) or {}).get("transformer_layer_config")
    tied = isinstance(layer, dict) and bool(layer.get("tie_word_embeddings"))  # what vLLM's config holds
    return eagle3.load_tensors(spec, renamed, f, tied=tied, layout=f"{FORMAT} format"), None


register_importer(FORMAT, detect=is_speculators_dir, read_spec=read_spec, load=load, read_spec_for=read_spec)
