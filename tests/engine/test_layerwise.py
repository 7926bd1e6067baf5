"""refit's wrapper of vLLM's layerwise reload: which modules it keeps out, and what it does for them.

Real vLLM reload functions on small torch modules; the end-to-end proof that a
tied `lm_head` serves the new embedding after a sync is in
tests/sync/test_architectures.py (a tied Llama against a fresh engine).
"""

from __future__ import annotations

import pytest
import torch
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

from refit.engine.layerwise import LayerwiseReload, outermost, tied_aliases

pytestmark = pytest.mark.engine  # imports vLLM


class Table(torch.nn.Module):
    """An embedding-like leaf: one weight, vLLM's unquantized embedding method as its quant method."""

    def __init__(self, weight: torch.nn.Parameter, quant_method=None) -> None:
        super().__init__()
        self.weight = weight
        self.quant_method = quant_method if quant_method is not None else UnquantizedEmbeddingMethod()


class Model(torch.nn.Module):
    def __init__(self, tied: bool, quant_method=None) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = Table(torch.nn.Parameter(torch.randn(64, 32), requires_grad=False))
        self.model.norm = torch.nn.LayerNorm(32)
        weight = self.model.embed_tokens.weight if tied else torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
        self.lm_head = Table(weight, quant_method)


def test_a_head_sharing_the_embeddings_weight_is_its_tied_alias():
    model = Model(tied=True)
    assert tied_aliases(model) == {"lm_head": (model.lm_head, model.model.embed_tokens)}
    assert tied_aliases(Model(tied=False)) == {}


def test_a_tie_whose_quant_method_is_not_the_unquantized_embeddings_is_reloaded_as_before():
    class Other:  # a quant method whose processing may change the weight: never run twice
        pass

    assert tied_aliases(Model(tied=True, quant_method=Other())) == {}


def test_outermost_drops_names_inside_another():
    assert outermost(["model.embed_tokens", "lm_head", "model.embed_tokens.weight_holder", "model"]) == ["lm_head", "model"]


def test_the_alias_keeps_the_shared_parameter_through_the_reload_and_is_processed_again(monkeypatch):
    model = Model(tied=True)
    shared = model.model.embed_tokens.weight
    record_metadata_for_reloading(model)
    processed = []
    monkeypatch.setattr(model.lm_head.quant_method, "process_weights_after_loading", processed.append)
    reload = LayerwiseReload(model, model_config=None)
    reload.open()
    assert reload.kept_out == {"lm_head.weight"}
    assert model.model.embed_tokens.weight.is_meta  # in loadable form
    assert model.lm_head.weight is shared  # kept out: never on the meta device
    reload.close()  # nothing loaded: the embedding gets its old Parameter back
    assert model.model.embed_tokens.weight is shared and model.lm_head.weight is shared
    assert processed == [model.lm_head]
    assert not reload.is_open


def test_the_alias_is_processed_once_as_soon_as_its_source_holds_the_shared_parameter_again(monkeypatch):
    model = Model(tied=True)
    embed, shared = model.model.embed_tokens, model.model.embed_tokens.weight
    record_metadata_for_reloading(model)
    processed = []
    monkeypatch.setattr(model.lm_head.quant_method, "process_weights_after_loading", processed.append)
    reload = LayerwiseReload(model, model_config=None)
    reload.open()
    reload.process_ready_aliases()
    assert processed == []  # the embedding is still in loadable form: the alias would derive from old values
    del embed.weight
    embed.register_parameter("weight", shared)  # as vLLM does once the embedding's layer is processed
    reload.process_ready_aliases()
    reload.process_ready_aliases()
    assert processed == [model.lm_head]
    reload.close()
    assert processed == [model.lm_head]  # not again


def test_a_weight_reported_under_a_modules_second_path_counts_under_its_first():
    """vLLM's `SharedFusedMoE` registers the router and shared experts inside the fused experts too, and dots1's
    `load_weights` reports them there (regression: loaded weights counted as unloaded and every sync was refused)."""

    class Reporting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Linear(4, 4)
            self.experts = torch.nn.Module()
            self.experts.gate = self.gate

        def load_weights(self, weights):
            return {f"experts.{name}" for name, _ in weights}

    model = Reporting()
    loaded = LayerwiseReload(model, model_config=None).load([("gate.weight", torch.ones(4, 4)), ("gate.bias", torch.ones(4))])
    assert loaded == {"gate.weight", "gate.bias"} == {name for name, _ in model.named_parameters()}
