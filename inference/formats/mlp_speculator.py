"""vLLM's and TGI's ``mlp_speculator`` directory: export our ``MLPSpeculatorHeads`` to it, import it back.

Read from vLLM's loader (vllm/model_executor/models/mlp_speculator.py ``MLPSpeculator.__init__``
/ ``load_weights``, and vllm/transformers_utils/configs/mlp_speculator.py ``MLPSpeculatorConfig``;
v0.8-v0.9.2): a ``config.json`` with ``model_type: mlp_speculator``, ``vocab_size``, ``emb_dim``
(the backbone width), ``inner_dim``, ``n_predict``, ``top_k_tokens_per_head``, ``n_candidates``,
``tie_weights``, ``scale_input``; weights ``emb.{k}.weight`` [vocab, inner],
``proj.{k}.weight`` [inner, emb_dim if k == 0 else inner], ``ln.{k}.weight/bias`` [inner],
``head.{k}.weight`` [vocab, inner] — with ``tie_weights`` only emb.0, proj.0, proj.1, ln.0,
head.0 (vLLM repeats one module, so ``named_parameters`` holds those names alone). ``ln0`` has
no parameters. The loader strips a ``speculator.`` prefix and silently skips unknown names,
so a wrong name would load as an uninitialised tensor: the names here are exactly its own, unprefixed (later
copies of the loader note a name before stripping the prefix, so their check that every weight loaded refuses a
prefixed directory such as ``format=tgi``'s).

Which vLLM serves it: only versions that still have the V0 engine. vLLM's V1 engine has no
``mlp_speculator`` path: ``GPUModelRunner.__init__`` (vllm/v1/worker/gpu_model_runner.py, commit
000fc94b754f66aeb60ef5acf1ea2e94cdc65164) builds a drafter for ngram, suffix, eagle/eagle3, medusa,
draft models and a few MTP kinds and raises ``ValueError("Unknown speculative decoding method: ...")``
for anything else, and the model registry (vllm/model_executor/models/registry.py, commit
0002bff0b6cb36a3c8a17364de3303664463c412) has ``MLPSpeculatorPreTrainedModel`` commented out
("Temporarily disabled ... Re-enable this once the MLP Speculator is supported in V1"); the same
registry lists models dropped with the V0 engine as last supported in 0.10.2. The released wheels say more:
0.10.0 has no ``vllm/spec_decode/`` and its ``platforms/cuda.py`` raises "Speculative decoding is not supported on
vLLM V0", while 0.9.2 still routes this speculator to V0's ``spec_decode`` workers (falling back to V0 for it on
its own). So this export serves on vLLM 0.9.2 or older, and ``medusa-export`` says so.

TGI serves the same directory (``format=tgi``), read from its loader (huggingface/text-generation-inference
server/text_generation_server/models/__init__.py ``get_model``, layers/speculative.py, layers/mlp.py, commit
09a1de5cd112a7ff940a2de7ebce7077af5b937c): a config.json with ``model_type: mlp_speculator`` is a speculator dir,
the backbone is its ``base_model_name_or_path``, ``--speculate`` defaults to ``n_predict`` and may not exceed it
(and must not be lower: MLPSpeculatorModel computes ``state_weight = 0.5 ** (0.5 / get_speculate())``, the
``--speculate`` value, where vLLM and training use ``n_predict``; the same at commit db931fcf);
``SpeculativeHead.load`` needs ``architectures[0] == "MLPSpeculatorPreTrainedModel"`` (otherwise it runs with no
speculator), reads ``inner_dim`` (0 would scale the embeddings by 0) and ``tie_weights``, and every
``.safetensors`` file of the dir under the names ``speculator.emb.{k}`` / ``proj`` / ``ln`` / ``head`` (no name
stripping). Its MLPSpeculatorModel computes ``state = proj_k(state) * w_s + emb_k(tok) * w_e sqrt(inner/2)``, then
``gelu(ln_k(state))`` — vLLM's step times ``w_s`` before a scale-invariant norm, equal up to its epsilon — and has
no ``scale_input`` at 09a1de5c; TGI v2.3.0 on (from commit d9fbbaaf) applies it as vLLM does, ``rms_norm(h) / sqrt 2``
in ``MLPSpeculatorHead.forward``, read from this dir's config.json (``SpeculativeHead.load``). Releases (tags
v2.2.0, v2.3.0, v3.3.7 and HEAD db931fcf read): v2.3.0 added ``MLPSpeculatorModelTied`` and ``scale_input``, and
its untied ``MLPSpeculatorModel.__init__`` does ``self.emb.weight *= self.emb_weight`` on a ``ModuleList`` (an
AttributeError at start-up, still at HEAD); v2.2.0 and older build the untied model only and ignore
``scale_input``. So tied heads serve on v2.3.0 and later, untied ones on v2.2.0 and older (scale_input then
unapplied: fewer drafts accepted), and the export says which. As for TGI's
Medusa dirs, the launcher reads this config for its attention choice and the router takes the tokenizer and chat
template from this dir (``reference.tgi_launcher_keys`` / ``tgi_tokenizer_files``).

The head is a full-vocabulary matrix: ``projection=own`` exports as is; ``shared`` and
``truncated`` only with ``materialize=true`` (as for Medusa heads, see ``full_projection``).

Import reads ``model.safetensors`` or, as IBM's fms checkpoints ship, only ``pytorch_model.bin`` (unpickled with
``torch.load(weights_only=True)``: a pickle that needs code is refused, naming it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..errors import UserError
from ..heads.native import check_safetensors, check_shapes, expected_shapes, load_state_checked
from ..heads.registry import build_heads
from ..heads.spec import HeadsSpec
from .export import ExportOptions, ExportPlan, full_projection, materialise_note, register_exporter, written_bytes
from .importers import register_importer
from .reference import load_pickle_weights, tgi_launcher_keys, tgi_tokenizer_files

MODEL_TYPE = "mlp_speculator"
VLLM_LAST = "0.9.2"   # the last vLLM release that serves it (0.10.0 removed V0's speculative decoding)
TGI_TIED = "2.3.0"    # the first TGI release with tied heads and scale_input, and the first that fails untied ones
WEIGHTS = "model.safetensors"
PICKLE = "pytorch_model.bin"  # what IBM's fms-extras checkpoints hold; read with torch.load(weights_only=True)


@register_exporter("vllm", "mlp_speculator", files=(WEIGHTS,))
def export_vllm_mlp_speculator(heads, options: ExportOptions) -> ExportPlan:
    plan = _plan(heads, options, "vLLM")
    spec = heads.spec
    plan.notes.append(f"serve with: --speculative-config '{{\"model\": \"<this dir>\", \"num_speculative_tokens\": "
                      f"{spec.num_heads}}}' (vLLM reads model_type {MODEL_TYPE})")
    plan.notes.append(f"note: only vLLM {VLLM_LAST} and older serve {MODEL_TYPE} (on their V0 engine; 0.10.0 removed "
                      "V0's speculative decoding and the V1 engine refuses it: \"Unknown speculative decoding "
                      "method\"); format=tgi writes it for TGI")
    return plan


@register_exporter("tgi", "mlp_speculator", files=(WEIGHTS,))
def export_tgi_mlp_speculator(heads, options: ExportOptions) -> ExportPlan:
    """The same directory for TGI (module docstring): tensors under ``speculator.``, the launcher's head-size keys
    and the backbone's tokenizer files beside them; heads trained with ``scale_input`` get a note (TGI applies it
    from v2.3.0 on; older versions draft from the unscaled state)."""
    spec = heads.spec
    plan = _plan(heads, options, "TGI")
    if spec.settings.tie_weights:
        plan.notes.append(f"note: tied heads need TGI {TGI_TIED} or later (older releases read one embedding per "
                          "step and stop at start-up on the missing speculator.emb.1)")
    else:
        plan.notes.append(f"warning: TGI {TGI_TIED} and later fail to start with untied heads (layers/mlp.py "
                          "multiplies the ModuleList's .weight: AttributeError): serve them with TGI 2.2.0 or older, "
                          "or train heads.tie_weights=true for a current TGI")
        if spec.settings.scale_input:
            plan.notes.append("these heads were trained with heads.scale_input=true, which TGI 2.2.0 and older "
                              "ignore: they draft from the unscaled backbone state, so fewer drafts are accepted "
                              "(the output is the same)")
    plan.tensors = {f"speculator.{k}": t for k, t in plan.tensors.items()}
    reader = options.backbone_config
    keys, note = tgi_launcher_keys(reader() if reader is not None else None, spec)
    plan.config.update(keys)
    if note:
        plan.notes.append(note)
    plan.extra_files.update(tgi_tokenizer_files(options, plan.notes))
    # Not "--speculate 1..n": TGI's MLPSpeculatorModel takes its state / embedding weights from --speculate
    # (get_speculate()), not from n_predict as vLLM and training do, so fewer steps change every step's drafts.
    plan.notes.append(f"serve: text-generation-launcher --model-id <this dir> (TGI reads the backbone from "
                      f"base_model_name_or_path; leave --speculate unset or give {spec.num_heads}: with fewer, TGI "
                      f"weighs every step for that count, not the {spec.num_heads} these heads were trained for)")
    return plan


def _plan(heads, options: ExportOptions, engine: str) -> ExportPlan:
    """vLLM's and TGI's common directory: config.json and the tensors under the names both loaders give them
    (TGI adds the ``speculator.`` prefix vLLM strips)."""
    spec = heads.spec
    if spec.projection != "own" and not options.materialize:
        raise UserError(f"{engine}'s mlp_speculator needs a full-vocabulary head.{{k}}; these heads use a "
                        f"{spec.projection} projection: pass materialize=true to expand it")
    tensors: dict[str, torch.Tensor] = {}
    for name, t in heads.state_dict().items():
        if not name.startswith(("head.", "token_map")):
            tensors[name] = t.detach()
    notes = []
    n_proj = 1 if spec.settings.tie_weights else spec.num_heads
    before = after = 0
    for k in range(n_proj):
        w, materialised = full_projection(heads, k, options)
        if materialised:
            local = heads.projections_list[k].weight if heads.projections_list is not None else None
            before += 0 if local is None else written_bytes(local, options)   # in the dtype written (dtype=)
            after += written_bytes(w, options)
        tensors[f"head.{k}.weight"] = w
    if after:
        notes.append(materialise_note(heads, f"{engine} mlp_speculator", before, after))
    inner = spec.settings.inner_dim or spec.hidden_size
    config = {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": MODEL_TYPE,
        "vocab_size": spec.vocab_size,
        "emb_dim": spec.hidden_size,
        "inner_dim": inner,
        "n_predict": spec.num_heads,
        "top_k_tokens_per_head": [1] * spec.num_heads,
        "n_candidates": spec.num_heads,
        "tie_weights": spec.settings.tie_weights,
        "scale_input": spec.settings.scale_input,
        "base_model_name_or_path": options.base_model or spec.base_model,
        "torch_dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
    }
    return ExportPlan(config=config, weights_file=WEIGHTS, tensors=tensors, notes=notes)


# -- import -------------------------------------------------------------------------------------
def is_mlp_speculator_dir(d: Path) -> bool:
    cfg = d / "config.json"
    if not cfg.is_file() or not ((d / WEIGHTS).is_file() or (d / PICKLE).is_file()):
        return False
    try:   # a config.json of another shape (a list, unreadable) is no such folder; its own reader says why
        raw = json.loads(cfg.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") == MODEL_TYPE


def read_spec(d: Path) -> HeadsSpec:
    raw = json.loads((d / "config.json").read_text())
    try:
        emb_dim, vocab, n = int(raw["emb_dim"]), int(raw["vocab_size"]), int(raw["n_predict"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{d / 'config.json'} is not an mlp_speculator config (missing or bad {e})") from None
    inner = int(raw.get("inner_dim") or 0) or emb_dim
    tied = raw.get("tie_weights", raw.get("tie_wts"))   # fms-extras' converter writes tie_wts
    return HeadsSpec(num_heads=n, num_layers=0, hidden_size=emb_dim, vocab_size=vocab, projection="own",
                     base_model=str(raw.get("base_model_name_or_path") or ""), kind=MODEL_TYPE,
                     inner_dim=inner if inner != emb_dim else None, tie_weights=bool(tied),
                     scale_input=bool(raw.get("scale_input")))


def load(d: Path, spec: HeadsSpec):
    f = d / WEIGHTS if (d / WEIGHTS).is_file() else d / PICKLE
    if f.name == WEIGHTS:
        check_safetensors(f)   # a cut file: one line, not safetensors' traceback
    raw = load_file(str(f)) if f.name == WEIGHTS else load_pickle_weights(f)
    tensors = {k.removeprefix("speculator."): v for k, v in raw.items()}
    expected = expected_shapes(spec)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise UserError(f"{f} lacks {missing[:4]} for an mlp_speculator of {spec.num_heads} steps")
    check_shapes(spec, {k: tuple(tensors[k].shape) for k in expected}, f, expected)   # before building at its sizes
    heads = build_heads(spec)
    load_state_checked(heads, {k: tensors[k] for k in expected}, f)
    return heads, None


register_importer("vllm_mlp_speculator", detect=is_mlp_speculator_dir, read_spec=read_spec, load=load)
