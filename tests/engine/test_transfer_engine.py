"""The "refit" weight-transfer backend's registration with vLLM."""

import pytest
import vllm
from importlib.metadata import entry_points
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from refit.engine.transfer_engine import BACKEND, RefitWeightTransferEngine, register
from refit.errors import EngineError


def test_registered_through_the_plugin_entry_point_idempotently():
    plugins = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert plugins["refit_weight_transfer"].load() is register
    register()
    register()
    assert WeightTransferEngineFactory._registry[BACKEND]() is RefitWeightTransferEngine


def test_another_vllm_release_is_refused_with_the_expected_version(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    with pytest.raises(EngineError, match=r"weight-transfer backend was written for vLLM 0\.32\.0.*installed vLLM 0\.33\.1"):
        register()
