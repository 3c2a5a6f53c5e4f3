"""Heads in the layouts serving engines load, and foreign Medusa checkpoints in our runtime.

    medusa-export heads=runs/a/heads format=vllm out=runs/a/vllm
    medusa-export heads=runs/a/heads format=tensorrt_llm out=runs/a/trtllm materialize=true

Export (``export.export_heads``) writes one engine's directory: its config keys, weight names,
shapes and dtypes, read from each engine's own loader (the sources are named in ``vllm.py`` and
``reference.py``, and checked by ``tests/engine_specs.py``). Formats:

  vllm          ``model_type: medusa`` dir: config.json + model.safetensors (vLLM's Medusa drafter)
  tensorrt_llm  config.json + medusa_lm_head.safetensors, one projection per head (TensorRT-LLM's
                ``examples/medusa/convert_checkpoint.py --medusa_model_dir``)
  tgi           the same files; TGI's v2 layout (no projections, the base lm_head) for shared heads
                with one layer (``text-generation-launcher --model-id <dir>``)
  medusa_v1     the reference FasterDecoding/Medusa layout (config.json + medusa_lm_head.safetensors)
  eagle3        EAGLE-3 drafters: the ``LlamaForCausalLMEagle3`` dir vLLM and SGLang both serve (``eagle3.py``)

Exporters live in a registry keyed by (format, head kind), so a new head kind (e.g. an
``mlp_speculator`` -> vLLM exporter) plugs in with ``@register_exporter("vllm", "mlp_speculator")``
without touching the formats here; a (format, kind) pair with no exporter is refused by name.

Importers live in a registry too (``importers.register_importer``): each foreign layout registers
how to recognise, read and load its directory from its own module — reference Medusa checkpoints
(``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt``, the latter only with
``torch.load(weights_only=True)``), TGI v2, vLLM Medusa and vLLM mlp_speculator dirs, EAGLE-3 drafters (also
in vLLM's ``speculators`` layout, ``speculators.py``).
``inference.loading.load_heads`` asks them before the native loader, so ``load_medusa`` and
``medusa-eval`` accept those directories as they are.

The formats sit above ``inference.heads``: they import the head families, never the reverse.
This ``__init__`` stays free of torch so that ``medusa-export --help`` is instant.
"""

import importlib

FORMATS = ("vllm", "tensorrt_llm", "tgi", "medusa_v1", "eagle3")
# The formats whose exporters read ``materialize=`` (full per-head projections for shared / truncated heads). The
# others write the heads' projection as it is, so they refuse the key: an export identical with and without it
# looked honoured.
MATERIALIZING_FORMATS = ("vllm", "tensorrt_llm", "tgi", "medusa_v1")
MATERIALIZE_UNREAD = ("materialize= is not read by format={format} (it writes the heads' projection as it is): "
                      "drop materialize=")

# The built-in format modules, one line each: importing one registers its exporters and importers.
# Importers are asked in this order whether a directory is theirs.
BUILTIN_MODULES = (
    "inference.formats.reference",
    "inference.formats.vllm",
    "inference.formats.mlp_speculator",
    "inference.formats.eagle3",
    "inference.formats.speculators",
)


def load_builtin_formats() -> None:
    """Register the built-in exporters and importers (each module once; cheap after the first call)."""
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
