"""The "refit" weight-transfer backend: its registration with vLLM, and a draft model beside its target."""

from importlib.metadata import entry_points

import pytest
import torch
import vllm
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

from refit.engine.config import TRANSFER_BACKEND
from refit.engine.layerwise import LayerwiseReload, Unfilled
from refit.engine.transfer_backend import DraftModel, RefitTransferBackend, register
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


class Drafter(torch.nn.Module):
    """An MTP drafter as vLLM builds one: the target's head placed twice (`lm_head` and `shared_head.head`)."""

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False)
        self.lm_head = head
        self.shared_head = torch.nn.Module()
        self.shared_head.head = head

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].weight_loader(params[name], tensor)
        return {name for name, _ in weights}


def test_a_module_a_draft_shares_under_two_paths_stays_out_of_the_drafts_reload():
    """Regression: only the first path of a shared module was kept out, so the draft's reload put the target's head,
    already processed, back in loadable form through the other one, and the target's update was refused as if its
    head had been written past the reload (vLLM's MTP drafters of DeepSeek-V3 and GLM-4.5)."""
    target = torch.nn.Module()
    target.lm_head = torch.nn.Linear(4, 4, bias=False)
    drafter = Drafter(target.lm_head)
    record_metadata_for_reloading(target)
    record_metadata_for_reloading(drafter)
    reload = LayerwiseReload(target, model_config=None)
    reload.open()
    loaded = {"lm_head.weight"}
    target.lm_head.weight.weight_loader(target.lm_head.weight, torch.ones(4, 4))  # whole: processed at once
    draft = DraftModel(drafter, model_config=None, load_format="dummy", target=target)
    draft.load([("proj.weight", torch.ones(4, 4))])
    assert reload.unfilled(loaded) == draft.unfilled()[1] == Unfilled((), ())
    assert not target.lm_head.weight.is_meta
    draft.finalize(set(), None)
    reload.close()
    assert torch.equal(target.lm_head.weight, torch.ones(4, 4))
