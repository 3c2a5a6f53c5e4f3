"""A new head family with a setting of its own plugs in from one place: its heads module (a settings dataclass
and declared inputs, registered with ``register_family``) and its training record (a heads config schema and
its own checks, registered with ``register_training_family``). Nothing shared names it: the spec reads and
writes its setting, the training config composes and validates it, the trainer taps the backbone layers it
declares and feeds them to it, and the export records it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch
from torch import nn

from conftest import call_main
from inference.errors import UserError
from inference.heads import KINDS, registry
from inference.heads.drafting import IndependentDrafting
from inference.heads.inputs import BackboneInputs
from inference.heads.projection import ProjectedHeads
from inference.heads.registry import HeadFamily, family, register_family
from inference.heads.spec import HeadsSpec
from medusa_train import families
from medusa_train.families import HeadsConfig, TrainingFamily, backbone_layers, register_training_family

RUN = ["trainer.max_steps=2", "trainer.log_every=1", "trainer.save_every=0", "logger.plot=false"]


# -- the toy family: everything a family with a setting writes ---------------------------------------------------
@dataclass
class ToySettings:
    aux_layers: Optional[list] = dataclasses.field(
        default=None, metadata={"help": "the one backbone layer (hidden_states id) the heads read"})


class ToyHeads(IndependentDrafting, ProjectedHeads):
    """Head k = projection of tanh(scale_k * a_t), a_t the backbone layer its setting names."""

    calls: list = []  # the aux features each training step fed the heads (class-level: the trainer builds them)

    def __init__(self, spec):
        super().__init__()
        self.scales = nn.Parameter(torch.ones(spec.num_heads))
        self._init_projection(spec, spec.hidden_size)

    def head_logits(self, hidden, k):
        return self.project(torch.tanh(self.scales[k] * hidden), k)

    def ttt_features(self, aux, future, positions, mask0, steps):
        ToyHeads.calls.append(tuple(aux.shape))
        return [torch.tanh(self.scales[k] * aux) for k in range(steps)]


def validate_toy(spec) -> None:
    if len(spec.settings.aux_layers or ()) != 1:
        raise UserError(f"toy heads read one backbone layer, got aux_layers={spec.settings.aux_layers}")


@dataclass
class ToyHeadsConfig(HeadsConfig):
    kind: str = "toy"
    aux_layers: Optional[List[int]] = None  # the one backbone layer the heads read (null = layer 1)


class ToyTraining(TrainingFamily):
    config = ToyHeadsConfig

    def validate(self, cfg) -> None:
        if cfg.heads.aux_layers is not None and len(cfg.heads.aux_layers) != 1:
            raise UserError(f"heads.aux_layers must name one layer for heads.kind=toy, got {list(cfg.heads.aux_layers)}")

    def spec_settings(self, h, hf_config) -> ToySettings:
        return ToySettings(aux_layers=list(h.aux_layers) if h.aux_layers is not None else [1])


def register_toy() -> None:
    register_family(HeadFamily("toy", ToyHeads, IndependentDrafting, settings=ToySettings,
                               inputs=BackboneInputs(aux_layers=True), validate=validate_toy))
    register_training_family(ToyTraining("toy"))
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def toy(monkeypatch):
    """The toy family registered for one test (the built-in ones first, so they outlive the copies)."""
    for kind in KINDS:
        family(kind)
        families.training_family(kind)
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    monkeypatch.setattr(families, "_TRAINING", dict(families._TRAINING))
    ToyHeads.calls = []
    register_toy()


def config_json(**settings) -> dict:
    return {"num_heads": 2, "num_layers": 0, "hidden_size": 64, "vocab_size": 320, "projection": "own",
            "kind": "toy", **settings}


def test_a_family_setting_is_read_from_and_written_to_config_json(toy):
    """Guards against: a family's setting needing a field on HeadsSpec (a shared file) to be stored, or being
    lost or moved on its way through config.json; the family's own check runs on it."""
    spec = HeadsSpec.from_dict(config_json(aux_layers=[2]))
    assert spec.settings == ToySettings(aux_layers=[2]) and not hasattr(spec, "aux_layers")  # on the family's settings only
    assert HeadsSpec.from_dict(spec.to_dict()) == spec
    assert json.loads(json.dumps(spec.to_dict()))["aux_layers"] == [2]  # flat beside the common keys
    assert HeadsSpec(**config_json(), settings=ToySettings([3])).settings.aux_layers == [3]
    with pytest.raises(UserError, match="toy heads read one backbone layer"):
        HeadsSpec.from_dict(config_json(aux_layers=[1, 2]))


def test_an_unknown_family_setting_is_refused_in_one_line(toy):
    """Guards against: a config.json key the family does not have (a typo, another family's setting) loading
    silently or surfacing as a TypeError traceback; format 1's unset keys of other families still load."""
    with pytest.raises(UserError) as e:
        HeadsSpec.from_dict(config_json(aux_layers=[1], scale=2.0))
    assert "\n" not in str(e.value) and "'scale'" in str(e.value) and "toy" in str(e.value)
    assert "aux_layers" in str(e.value)  # what it does read
    old = HeadsSpec.from_dict(config_json(aux_layers=[1], inner_dim=None, tie_weights=False, draft_layer=None))
    assert old.settings == ToySettings([1])
    with pytest.raises(UserError, match=r"unknown keys \['inner_dim'\]"):
        HeadsSpec.from_dict(config_json(aux_layers=[1], inner_dim=64))


def test_training_config_composes_and_validates_the_familys_own_keys(toy, compose_tiny, out_dir, capsys):
    """Guards against: the training config knowing a fixed list of families (a new family's keys refused by the
    schema, or its checks never run), and a family's key given to another family passing silently; on the
    command line that refusal is one line, exit 2, nothing written."""
    from medusa_train.cli import main
    from medusa_train.config import validate

    cfg = compose_tiny("heads.kind=toy", "heads.aux_layers=[1]")
    assert cfg.heads.kind == "toy" and list(cfg.heads.aux_layers) == [1]
    validate(cfg)
    with pytest.raises(UserError, match="must name one layer for heads.kind=toy"):
        validate(compose_tiny("heads=toy", "heads.aux_layers=[0,1]"))
    code, _, err = call_main(main, ["debug_tiny", f"output_dir={out_dir}", "heads.aux_layers=[1]"], capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and "heads.aux_layers is" in lines[0] and "toy" in lines[0], err
    assert "not medusa's" in lines[0] and "(heads=eagle3)" in lines[0] and not out_dir.exists()


def test_the_trainer_feeds_and_exports_the_layers_the_family_declares(toy, compose_tiny, tmp_path):
    """Guards against: the feature cache, the batch sources or the loss deciding what to feed by the kind
    (a new family that reads a backbone layer getting none, or the last hidden state instead); online and
    from the cache, the heads are fed exactly the declared layer, and the export records the setting."""
    from inference.backbone import text_config
    from medusa_train import trainer as T
    from medusa_train.backbone import backbone_config
    from medusa_train.features import FeatureCache

    cfg = compose_tiny(*RUN, "heads.kind=toy", "heads.aux_layers=[1]", out=tmp_path / "online")
    hidden = text_config(backbone_config(cfg.backbone)).hidden_size
    assert backbone_layers(cfg.heads, backbone_config(cfg.backbone)) == (1,)
    T.run(cfg)
    assert ToyHeads.calls and all(shape[-1] == hidden for shape in ToyHeads.calls)  # one layer: H wide
    exported = json.loads((tmp_path / "online" / "heads" / "config.json").read_text())
    assert exported["kind"] == "toy" and exported["aux_layers"] == [1]

    ToyHeads.calls = []
    cache = tmp_path / "cache"
    T.run(compose_tiny(*RUN, "heads.kind=toy", "heads.aux_layers=[1]", "features.mode=train",
                       f"features.cache_dir={cache}", out=tmp_path / "cached"))
    assert FeatureCache(cache).manifest()["aux_layers"] == [1]
    assert ToyHeads.calls and all(shape[-1] == hidden for shape in ToyHeads.calls)
