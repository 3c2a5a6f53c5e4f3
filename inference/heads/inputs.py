"""What a head family reads from the backbone and the batch while it trains: its declared inputs.

The trainer's feature cache, batch sources and loss never ask which family they feed; they read this
declaration (``HeadFamily.inputs``) and hand the heads exactly those tensors (SpecForge declares the
same per algorithm, ``specforge/algorithms/contracts.py``). It lives in ``inference.heads`` because the
family modules declare it, and the trainer imports it from here (``inference`` never imports the
trainer). Free of torch, like the registry.

What a run's own options add is not the family's to declare: the backbone's greedy ids are read for
``heads.targets=backbone`` and its last hidden state for a teacher term, whatever the family, so the
trainer computes ``hidden`` (and the cache stores it) for every family.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BackboneInputs:
    """The tensors one family's heads train on.

    last_hidden:  the backbone's last hidden state h_t (after its final norm), ``hidden`` [B, T, H].
    aux_layers:   hidden states of the layers its settings name (``settings.aux_layers``, transformers'
                  hidden_states ids), concatenated as ``aux`` [B, T, len x H] (EAGLE-3's low/mid/high).
    path_tokens:  the true tokens after t, x_{t+1..t+K} (teacher forcing: heads fed the path they extend).
    positions:    the batch's position ids (a drafter with its own RoPE) and its packed-document mask.
    """

    last_hidden: bool = True
    aux_layers: bool = False
    path_tokens: bool = False
    positions: bool = False

    def layers(self, settings) -> tuple[int, ...]:
        """The backbone layers to tap besides the last one, in the order the settings name them (the order
        the heads' weights expect them concatenated); () for a family that reads no other layer."""
        if not self.aux_layers:
            return ()
        return tuple(int(i) for i in (settings.aux_layers or ()))

