"""The "refit" weight-transfer backend: its registration with vLLM, and what an update must load."""

from importlib.metadata import entry_points

import pytest
import torch
import vllm
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

from refit.engine.config import TRANSFER_BACKEND
from refit.engine.layerwise import LayerwiseReload
from refit.engine.transfer_backend import RefitTransferBackend, _expected_weights, register
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


class XieluLike(torch.nn.Module):
    """Parameters beside constants held as buffers, as vLLM's Apertus activation holds them, and a rotary-like table."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = torch.nn.Parameter(torch.ones(1), requires_grad=False)
        self.register_buffer("beta", torch.tensor(0.5))
        self.register_buffer("table", torch.arange(4.0), persistent=False)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = XieluLike()
        self.rotary = torch.nn.Module()
        self.rotary.register_buffer("cache", torch.ones(4))  # a module of buffers only: restored if nothing loads it
        self.gate = torch.nn.Linear(4, 4)
        self.experts = torch.nn.Module()
        self.experts.bias = self.gate.bias  # one Parameter under two modules, as vLLM's MoE router bias


def test_an_update_must_load_every_parameter_once_and_the_persistent_buffers_beside_them():
    """The reload copies a parameter-holding module's persistent buffers back from uninitialized memory unless they
    were loaded, so they are expected too (regression: only parameters were, and a stream without Apertus' `beta`
    was finished and served NaN); tables and buffer-only modules are not, nor a parameter's second path."""
    model = Net()
    record_metadata_for_reloading(model)
    reload = LayerwiseReload(model, model_config=None)
    reload.open()
    try:
        assert model.act.beta.is_meta  # in loadable form, as the backend sees the model
        assert _expected_weights(model) == {"act.alpha", "act.beta", "gate.weight", "gate.bias"}
    finally:
        reload.close()
