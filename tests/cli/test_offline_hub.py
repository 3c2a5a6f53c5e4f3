"""A hub id on a machine that cannot reach the hub: read from the local cache alone, refused at once in one line.

The hub clients retry a name they cannot resolve for two minutes (transformers) or half a minute (datasets),
printing a line per retry, before the same refusal; ``assets.hub_unreachable`` tries one connection instead."""

from __future__ import annotations

import socket

import pytest

from inference import assets
from inference.errors import UserError


@pytest.fixture
def probe(monkeypatch):
    """``hub_unreachable`` as on a machine without HF_HUB_OFFLINE or a proxy set (the tests set it offline), its
    connections recorded and refused."""
    for var in ("HF_HUB_OFFLINE", "HF_ENDPOINT", *assets.PROXY_VARIABLES):
        monkeypatch.delenv(var, raising=False)
    tried = []

    def refuse(address, timeout=None):
        tried.append((address, timeout))
        raise OSError("Name or service not known")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(assets, "_hub_probe", {})
    yield tried


def test_the_hub_is_probed_once_and_not_where_the_user_said_how_to_reach_it(probe, monkeypatch):
    """Guards against a probe that takes longer than the hub client's own failure (no timeout), that runs for every
    load, that keeps its answer for good (a network back in a notebook), or that overrides what the user set:
    HF_HUB_OFFLINE (the client is offline already), a proxy (a direct connection may fail where the proxy works) and
    HF_ENDPOINT (a mirror is the host to reach, on port 80 for plain http)."""
    clock = [1000.0]
    monkeypatch.setattr(assets.time, "monotonic", lambda: clock[0])
    assert assets.hub_unreachable() == "huggingface.co" and assets.hub_unreachable() == "huggingface.co"
    assert probe == [(("huggingface.co", 443), 3)]
    clock[0] += assets.HUB_PROBE_TTL_S + 1
    assets.hub_unreachable()
    assert len(probe) == 2   # asked again once the answer is a minute old
    for endpoint, host, port in (("https://hub.mirror.example:8443", "hub.mirror.example", 8443),
                                 ("http://mirror.lan", "mirror.lan", 80)):
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        assert assets.hub_unreachable() == host and probe[-1][0] == (host, port)
    for var, value in (("HF_HUB_OFFLINE", "1"), ("HTTPS_PROXY", "http://proxy:3128"), ("http_proxy", "http://p:1")):
        with monkeypatch.context() as m:
            m.setattr(assets, "_hub_probe", {})
            m.setenv(var, value)
            count = len(probe)
            assert assets.hub_unreachable() is None and len(probe) == count


def test_a_backbone_the_hub_cannot_serve_here_is_read_from_the_cache_and_refused_at_once(probe, monkeypatch, tmp_path):
    """Guards against medusa-train / medusa-eval / medusa-generate / medusa-export spending two minutes of retries
    (a line each) on a hub id with no network, then refusing with "the hub has no such model or cannot be reached";
    a local folder is read as before, never limited to the cache."""
    import transformers

    from inference.backbone import load_backbone_config

    seen = []

    def from_pretrained(path, **kwargs):
        seen.append((path, kwargs.get("local_files_only", False)))
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    with pytest.raises(UserError, match="huggingface.co cannot be reached from this machine, and the hub's cache "
                                        "here does not hold it"):
        load_backbone_config("meta-llama/Llama-3.1-8B-Instruct")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(UserError):
        load_backbone_config(str(folder))
    assert seen == [("meta-llama/Llama-3.1-8B-Instruct", True), (str(folder), False)]


def test_a_hub_dataset_the_hub_cannot_serve_here_is_refused_at_once(probe, monkeypatch):
    """Guards against a hub dataset as data.source on a machine with no network costing half a minute of retries
    (a line each) before its refusal: datasets reads its cache alone and the line says why."""
    import datasets

    from medusa_train.data import readers

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)   # as on a machine the tests did not set offline
    seen = []

    def load_dataset(name, **kwargs):
        seen.append(datasets.config.HF_HUB_OFFLINE)
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(UserError, match="'someone/chats' .*huggingface.co cannot be reached from this machine and "
                                        "the datasets cache here does not hold it"):
        next(readers._hub_records("someone/chats", "train"))
    assert seen == [True] and datasets.config.HF_HUB_OFFLINE is False   # the cache alone, then the process's own
