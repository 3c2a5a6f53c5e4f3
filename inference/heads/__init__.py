"""Draft heads: the families, their spec, their drafting interface and the native export.

This package is the bottom of ``inference/``: it knows no serving format, no backbone loader and
no decoding method (those sit above it and import from here, never the other way round), so the
trainer and every format can share one definition of what heads are.

Rooms (one concept each):
  registry       one ``HeadFamily`` record per kind; ``family(kind)``, ``build_heads``, ``init_heads``
  spec           ``HeadsSpec`` (config.json: common fields + the family's ``settings``), ``check_compatible``
  inputs         ``BackboneInputs``: what a family declares it trains on (the trainer reads it, never the kind)
  projection     ``ResBlock`` and ``ProjectedHeads``, what every family shares (projection modes)
  drafting       the drafting interface decoders call (``IndependentDrafting`` / ``PathDrafting``)
  dependent      the recurrent interface of heads fed the path they extend
  medusa, hydra, mlp_speculator, eagle3   one family each: its module, settings, inputs and registration
  native         the native export directory (config.json + model.safetensors), atomic writes

This ``__init__`` is kept free of torch: ``KINDS`` is read by the trainer's config validation
before anything heavy loads. A family module is imported the first time its kind is asked for.
"""

# The one list of head kinds: kind -> the module that defines and registers the family.
# Adding a built-in family is one line here plus its module (which calls ``register_family``).
FAMILY_MODULES = {
    "medusa": "inference.heads.medusa",
    "hydra": "inference.heads.hydra",
    "mlp_speculator": "inference.heads.mlp_speculator",
    "eagle3": "inference.heads.eagle3",
}
KINDS = tuple(FAMILY_MODULES)
