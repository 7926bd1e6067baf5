"""A trainer's peft model as refit sees it: its adapter alone, or its base with the adapter merged in.

Two ways to sync a model that trains LoRA over a frozen base:
- adapter-only (`peft_adapter`): the adapter's tensors under the names a
  PEFT checkpoint gives them, for rollouts that serve LoRA
  (`Syncer.sync_adapter`); a few MiB where the base is GiB;
- merged (`MergedLora`): every base weight, the adapted ones as
  W + B A scaling, under the base checkpoint's names, for rollouts that
  serve no LoRA (an ordinary `Syncer.sync`). Each adapted weight is merged
  as peft's own `merge_adapter` does it (peft's delta, in the adapter's
  dtype, added to the weight with one rounding to the weight's dtype), so
  the rollout serves what a `merge_and_unload`ed
  checkpoint holds, bit for bit; the trainer's own base is never modified
  (merging in place and unmerging after would drift it by a rounding each
  step).

Imports peft only inside the functions: refit itself does not need it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import torch

from refit.adapters.weights import AdapterWeights
from refit.errors import ConfigError
from refit.plan.checkpoint_format import CheckpointView
from refit.plan.tensors import TensorMeta

__all__ = ["MergedLora", "peft_adapter"]

_BASE_LAYER = ".base_layer."


def peft_adapter(model: Any, name: str = "policy") -> AdapterWeights:
    """The active adapter of peft `model` as an adapter sync carries it, under `name` (bytes copied, not views)."""
    from peft import get_peft_model_state_dict

    adapter = _active_adapter(model)
    state = get_peft_model_state_dict(model, adapter_name=adapter)
    tensors = {key: value.detach().clone() for key, value in state.items()}
    return AdapterWeights(name, _plain(model.peft_config[adapter].to_dict()), tensors)


class MergedLora:
    """A peft model's weights with its active adapter merged in, under the base checkpoint's names (merge mode).

    `metadata()` and `tensor(name)` are `CheckpointView`'s, over the base model
    inside the peft wrapper: peft keeps each adapted layer's weight as
    `<module>.base_layer.weight` and its adapter beside it, so the names are
    taken back to `<module>.weight` and the adapter's own tensors left out.
    What peft's `merge_and_unload` does besides adding B A scaling is done
    here too, with peft's own code where it has one: a variant's merge (DoRA's
    magnitude), a LoRA bias added to the base's bias, and a module trained
    whole (`modules_to_save`) sent in place of the frozen original. What this
    class cannot merge (LoRA on layers other than Linear and Embedding,
    trainable tokens) is refused by name when it is made: sending the base
    unmerged would serve a model the trainer never trained. `unmerged(name)`
    is the base alone, for rollouts that apply the adapter themselves.
    """

    def __init__(self, model: Any) -> None:
        self._model = model
        self._read()

    def _read(self) -> None:
        """Capture the model as it is now: its active adapter, the base's tensor objects, the adapted layers."""
        from peft.tuners.lora import Embedding, Linear
        from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

        model = self._model
        self._adapter = _active_adapter(model)
        base = model.get_base_model()
        self._view = CheckpointView(base)
        self._layers = {name: module for name, module in base.named_modules()
                        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer") and self._adapts(module)}
        unmergeable = [f"{name} ({type(module).__name__})" for name, module in self._layers.items()
                       if not isinstance(module, (Linear, Embedding))]
        unmergeable += [f"{name} ({type(module).__name__})" for name, module in base.named_modules()
                        if isinstance(module, AuxiliaryTrainingWrapper) and not isinstance(module, ModulesToSaveWrapper)]
        if unmergeable:
            raise ConfigError(f"refit cannot merge adapter {self._adapter!r} into {', '.join(unmergeable)}: merge mode "
                              "merges LoRA on Linear and Embedding layers and modules_to_save; sync the adapter alone "
                              "(Syncer.sync_adapter) to rollouts that serve LoRA")
        self._embeddings = {name for name, module in self._layers.items() if isinstance(module, Embedding)}
        # module -> whether the active adapter trains its own copy of it (else the frozen original is sent)
        self._saved = {name: self._adapter in module.modules_to_save for name, module in base.named_modules()
                       if isinstance(module, ModulesToSaveWrapper)}
        self._source: dict[str, str] = {}  # base checkpoint name -> the view's name
        self._metas: list[TensorMeta] = []
        for meta in self._view.metadata():
            if self._checkpoint_name(meta.name) is None:
                continue
            merged = meta.renamed(lambda name: self._checkpoint_name(name) or name)
            self._source[merged.name] = meta.name
            self._metas.append(merged)

    def metadata(self) -> list[TensorMeta]:
        if self._view.outdated() or _active_adapter(self._model) != self._adapter:  # as `_current_source`, whole
            self._read()
        return list(self._metas)

    def tensor(self, name: str) -> torch.Tensor:
        source = self._current_source(name)
        value = self._view.tensor(source)
        module, _, param = source.rpartition(_BASE_LAYER)
        layer = self._layers.get(module) if module else None
        if layer is None:
            return value
        adapter = self._adapter
        with torch.no_grad():
            if param == "weight":
                variant = getattr(layer, "lora_variant", {}).get(adapter)
                if variant is not None:  # DoRA: peft's own merge, which reads the base weight itself
                    return variant.merge_safe(layer, adapter, value).to(value.dtype)
                # As peft merges: a Linear's `weight += delta`, one rounding in the weight's dtype; an Embedding's
                # delta is rounded to the weight's dtype first.
                delta = layer.get_delta_weight(adapter)
                return (value + (delta.to(value.dtype) if module in self._embeddings else delta)).to(value.dtype)
            if param == "bias" and getattr(layer, "lora_bias", {}).get(adapter):
                return (value + layer.lora_B[adapter].bias * layer.scaling[adapter]).to(value.dtype)
        return value

    def unmerged(self, name: str) -> torch.Tensor:
        """Checkpoint tensor `name` as the trainer holds it, the adapter not merged in: for rollouts that serve the
        adapter over their base (`TransferPlan.lora_served`)."""
        return self._view.tensor(self._current_source(name))

    def _current_source(self, name: str) -> str:
        """The view's name of checkpoint tensor `name`, the view re-read first if the model changed under it."""
        # The view reads the tensor objects it captured: a base parameter replaced since (`load_state_dict(...,
        # assign=True)`), or another adapter made active, would otherwise be sent as it was then.
        if not self._view.reads_current(self._source[name]) or _active_adapter(self._model) != self._adapter:
            self._read()
        return self._source[name]

    def _adapts(self, layer: Any) -> bool:
        """Whether the active adapter has LoRA weights in `layer` (a Linear's `lora_A`, an Embedding's own dict)."""
        return any(self._adapter in getattr(layer, tensors, {}) for tensors in ("lora_A", "lora_embedding_A"))

    def _checkpoint_name(self, name: str) -> str | None:
        """The base checkpoint's name of the view's tensor `name`, or None for one that is not sent (the adapter's
        own tensors, the frozen original of a module trained whole, another adapter's copy of it)."""
        if _is_adapter_tensor(name):
            return None
        for module, trained in self._saved.items():
            if not name.startswith(module + "."):
                continue
            rest = name[len(module) + 1:]
            if rest.startswith("original_module."):  # sent only where the active adapter trains no copy of it
                return None if trained else f"{module}.{rest.removeprefix('original_module.')}"
            adapter, _, tail = rest.removeprefix("modules_to_save.").partition(".")
            return f"{module}.{tail}" if rest.startswith("modules_to_save.") and adapter == self._adapter else None
        return name.replace(_BASE_LAYER, ".")


def _active_adapter(model: Any) -> str:
    adapters = getattr(model, "active_adapters", None)
    if not adapters or not hasattr(model, "peft_config"):
        raise ConfigError(f"{type(model).__name__} is not a peft model with an active adapter (peft.get_peft_model)")
    if len(adapters) != 1:
        raise ConfigError(f"the peft model has {len(adapters)} active adapters {list(adapters)}; refit syncs one")
    return adapters[0]


def _is_adapter_tensor(name: str) -> bool:
    return any(f".{part}." in name for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
                                               "lora_magnitude_vector"))


def _plain(value: Any) -> Any:
    """peft's config dict as JSON-able data (its sets become sorted lists, its enums their values)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value
