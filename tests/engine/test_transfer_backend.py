"""The "refit" weight-transfer backend's registration with vLLM."""

from importlib.metadata import entry_points

import pytest
import vllm
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from refit.engine.config import TRANSFER_BACKEND
from refit.engine.transfer_backend import RefitTransferBackend, register
from refit.errors import EngineError

pytestmark = pytest.mark.engine  # starts or imports vLLM


def test_registered_through_the_plugin_entry_point_idempotently():
    plugins = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert plugins["refit_weight_transfer"].load() is register
    register()
    register()
    assert WeightTransferEngineFactory._registry[TRANSFER_BACKEND]() is RefitTransferBackend


def test_another_vllm_release_is_refused_with_the_expected_version(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    with pytest.raises(EngineError, match=r"weight-transfer backend was written for vLLM 0\.32\.0.*installed vLLM 0\.33\.1"):
        register()
