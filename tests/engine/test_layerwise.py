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

from refit.engine.layerwise import LayerwiseReload, Unfilled, outermost, tied_aliases

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


def opened_reload(model: Model, monkeypatch) -> tuple[LayerwiseReload, list]:
    """`model`'s layerwise reload, opened, and the list its head's processing is recorded in (instead of run)."""
    record_metadata_for_reloading(model)
    processed = []
    monkeypatch.setattr(model.lm_head.quant_method, "process_weights_after_loading", processed.append)
    reload = LayerwiseReload(model, model_config=None)
    reload.open()
    return reload, processed


def give_back(module: torch.nn.Module, weight: torch.nn.Parameter) -> None:
    """As vLLM does once a module's layer is processed: it holds its Parameter again."""
    del module.weight
    module.register_parameter("weight", weight)


def test_the_alias_keeps_the_shared_parameter_through_the_reload_and_is_processed_again(monkeypatch):
    model = Model(tied=True)
    shared = model.model.embed_tokens.weight
    reload, processed = opened_reload(model, monkeypatch)
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
    reload, processed = opened_reload(model, monkeypatch)
    reload.process_ready_aliases()
    assert processed == []  # the embedding is still in loadable form: the alias would derive from old values
    give_back(embed, shared)
    reload.process_ready_aliases()
    reload.process_ready_aliases()
    assert processed == [model.lm_head]
    reload.close()
    assert processed == [model.lm_head]  # not again


def test_the_alias_takes_the_cpu_kernel_its_source_derived_from_the_shared_weight_instead_of_packing_its_own(monkeypatch):
    """On a CPU vLLM's unquantized embedding method packs the weight into a GEMM kernel (`cpu_linear`) for the
    embedding as its layer is processed; the tied head's would pack the same Parameter again."""
    model = Model(tied=True)
    embed, shared = model.model.embed_tokens, model.model.embed_tokens.weight
    reload, processed = opened_reload(model, monkeypatch)
    give_back(embed, shared)
    embed.cpu_linear = kernel = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)  # as vLLM's method sets it
    reload.process_ready_aliases()
    assert model.lm_head.cpu_linear is kernel and processed == []

    other = Model(tied=True)  # a source processed by another method derives something else: the alias is processed
    other.model.embed_tokens.quant_method = object()
    other.model.embed_tokens.cpu_linear = kernel
    reload, processed = opened_reload(other, monkeypatch)
    reload.close()
    assert processed == [other.lm_head] and not hasattr(other.lm_head, "cpu_linear")


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


class PartlyLoaded(torch.nn.Module):
    """Layers an update can leave without its bytes: an attention sink the model's `load_weights` writes with a bare
    `copy_` (vLLM's gpt-oss loader), an activation with a parameter beside a constant held as a buffer (vLLM's
    xIELU) and a table, a module of buffers only, and a rotary-like module nothing is sent for."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False)
        self.attn = torch.nn.Module()
        self.attn.sinks = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.act = torch.nn.Module()
        self.act.alpha = torch.nn.Parameter(torch.ones(1), requires_grad=False)
        self.act.register_buffer("beta", torch.tensor(0.5))
        self.act.register_buffer("table", torch.arange(4.0), persistent=False)
        self.codes = torch.nn.Module()
        self.codes.register_buffer("low", torch.zeros(2))
        self.codes.register_buffer("high", torch.zeros(2))
        self.rotary = torch.nn.Module()
        self.rotary.register_buffer("cache", torch.ones(4))

    def load_weights(self, weights):
        tensors = dict(self.named_parameters()) | dict(self.named_buffers())
        for name, value in weights:
            if name.endswith("sinks"):
                tensors[name].data.copy_(value)
            else:
                tensors[name].weight_loader(tensors[name], value)
        return {name for name, _ in weights}


def test_what_a_partly_loaded_layer_would_lack_is_named_and_why():
    """A layer still waiting for tensors at the end is materialized uninitialized and copied back: a tensor the
    stream left out (a buffer too: Apertus' xIELU `beta`, regression: served as NaN) or one `load_weights` wrote past
    the reload (gpt-oss' sinks and experts in vLLM 0.32, regression: served the dummy values, the sync reported
    success) would be served without the update's bytes. A module sent nothing gets its old tensors back."""
    model = PartlyLoaded()
    record_metadata_for_reloading(model)
    reload = LayerwiseReload(model, model_config=None)
    reload.open()
    loaded = reload.load([("proj.weight", torch.full((4, 4), 2.0)), ("attn.sinks", torch.ones(4)),
                          ("act.alpha", torch.full((1,), 3.0)), ("codes.low", torch.ones(2))])
    assert loaded == {"proj.weight", "attn.sinks", "act.alpha", "codes.low"}
    assert reload.unfilled(loaded) == Unfilled(bypassed=("attn.sinks",), left_out=("act.beta", "codes.high"))
    reload.close()
    assert torch.equal(model.proj.weight, torch.full((4, 4), 2.0))  # whole, so processed when its weight came
    assert torch.equal(model.attn.sinks, torch.zeros(4))  # the bare copy_ kept nothing: the old values are back
    assert torch.equal(model.rotary.cache, torch.ones(4))


def test_an_update_that_filled_every_layer_it_touched_lacks_nothing():
    model = PartlyLoaded()
    record_metadata_for_reloading(model)
    reload = LayerwiseReload(model, model_config=None)
    reload.open()
    loaded = reload.load([("act.alpha", torch.ones(1)), ("act.beta", torch.tensor(0.25)), ("codes.low", torch.ones(2)),
                          ("codes.high", torch.ones(2))])
    assert reload.unfilled(loaded) == Unfilled((), ())
    reload.close()
    assert float(model.act.beta) == 0.25 and torch.equal(model.act.table, torch.arange(4.0))
