"""LoRA adapters installed in a running engine from memory, and unloaded: the worker's half of an adapter sync.

Why by hand: vLLM 0.32 loads an adapter only from a directory (the
`LoRARequest`'s path, read by the worker's `WorkerLoRAManager` the first
time a request names it); loading one from memory is the open RFC
vllm#48297. A sync that wrote every adapter version to disk on every
rollout node, only for vLLM to read it back, would be the directory round
trip refit exists to avoid. So the worker builds the adapter the way vLLM's
own loader does once it has read the files (`PEFTHelper` from the config,
`LoRAModel.from_lora_tensors`, the same rank check), registers it with the
worker's adapter manager and pins it: a request naming its id then finds it
loaded and never reads the path, and the LRU cache never evicts it.

What vLLM's loader checks that `from_lora_tensors` does not is checked here
first: that every module the adapter names is one this model can adapt
(otherwise vLLM keeps the weights and applies them nowhere, silently).

Runs in each vLLM worker (imports vLLM); `RefitWorkerExtension` calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from refit.adapters.weights import AdapterWeights, check_values, lora_module
from refit.errors import ConfigError, InvalidTensorError

__all__ = ["adapters_kept", "install_adapter", "lora_rank_of", "remove_adapter", "unwrap_lora_layers"]

def lora_rank_of(vllm_config: Any) -> int | None:
    """The engine's `max_lora_rank`, or None if it serves no LoRA."""
    lora = getattr(vllm_config, "lora_config", None)
    return None if lora is None else int(lora.max_lora_rank)


def unwrap_lora_layers(model: torch.nn.Module) -> Callable[[], None]:
    """Put each of vLLM's LoRA layers' base layers back where the LoRA layer sits in `model`; returns the undo.

    Why: with LoRA on, vLLM replaces every adaptable layer by a LoRA layer
    holding the original as `base_layer`, so the base's parameters are named
    `<module>.base_layer.weight`. The model's `load_weights`, the layerwise
    reload, the expected weights and the scale provenance all speak the
    checkpoint's names (`<module>.weight`): a weight sync through the
    wrapped tree would load nothing into those layers. Unwrapped for the
    length of an update, the same parameter objects are loaded under their
    own names; the LoRA layers, put back, apply the adapters to them again.
    """
    try:
        from vllm.lora.layers import BaseLayerWithLoRA
    except ImportError:  # a vLLM build without LoRA
        return lambda: None
    swapped = []
    for name, module in list(model.named_modules()):
        if isinstance(module, BaseLayerWithLoRA):
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attribute, module.base_layer)
            swapped.append((parent, attribute, module))

    def restore() -> None:
        while swapped:
            parent, attribute, wrapper = swapped.pop()
            setattr(parent, attribute, wrapper)

    return restore


def install_adapter(worker: Any, lora_id: int, plain: dict[str, Any]) -> str:
    """Check, build and pin the adapter `plain` (`AdapterWeights.to_plain`) as `lora_id`; returns its digest."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = _lora_manager(worker)
    adapter = AdapterWeights.from_plain(plain)
    check_values(adapter)
    adaptable = _adaptable_modules(manager._adapter_manager)
    for name in sorted(adapter.tensors):
        module, _ = lora_module(name)
        if module.rsplit(".", 1)[-1] not in adaptable:
            raise InvalidTensorError(
                f"adapter tensor {name!r}: this model cannot apply LoRA to {module!r}; it adapts {sorted(adaptable)}"
            )
    try:
        helper = PEFTHelper.from_dict(dict(adapter.config))
        helper.validate_legal(manager.lora_config)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"adapter {adapter.name!r}: its config is refused by vLLM: {error}") from None
    adapter_manager = manager._adapter_manager
    model = adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_id, dict(adapter.tensors), helper, device="cpu", dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size, weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    adapter_manager.add_adapter(lora)
    adapter_manager.pin_adapter(lora_id)
    return adapter.digest()


@contextmanager
def adapters_kept(worker: Any) -> Iterator[None]:
    """Register and pin again, after the block, the adapters refit installed (those pinned) that it dropped.

    Why: vLLM's worker, finishing an update of the base, drops every adapter (`reset_lora_state`). One loaded
    from a directory is read again by the next request naming it; refit's were installed from memory and name
    no directory, so every request on the adapter served would fail ("No adapter found") until the next adapter
    sync. An adapter's weights do not depend on the base's, so the same `LoRAModel`s go back.
    """
    manager = getattr(worker.model_runner, "lora_manager", None)
    if manager is None:
        yield
        return
    adapter_manager = manager._adapter_manager
    pinned = set(adapter_manager._registered_adapters.pinned_items)
    kept = [lora for lora_id, lora in adapter_manager.list_adapters().items() if lora_id in pinned]
    try:
        yield
    finally:
        for lora in kept:
            if adapter_manager.get_adapter(lora.id) is None:
                adapter_manager.add_adapter(lora)
                adapter_manager.pin_adapter(lora.id)


def remove_adapter(worker: Any, lora_id: int) -> bool:
    """Unload `lora_id` (unpinned with it); False if it was not loaded."""
    return bool(_lora_manager(worker)._adapter_manager.remove_adapter(lora_id))


def _lora_manager(worker: Any) -> Any:
    manager = getattr(worker.model_runner, "lora_manager", None)
    if manager is None:
        raise ConfigError("this engine serves no LoRA adapters: start it with EngineConfig(lora_rank=...)")
    return manager


def _adaptable_modules(adapter_manager: Any) -> set[str]:
    """The module names vLLM's own loader accepts in an adapter (`WorkerLoRAManager._load_adapter`'s list)."""
    packed = adapter_manager.packed_modules_mapping
    names: set[str] = set()
    for module in adapter_manager.supported_lora_modules:
        names.update(packed.get(module, [module]))
    return names
