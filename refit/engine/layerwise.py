"""vLLM's layerwise reload of one model, with the modules it must not reload kept out of it.

`initialize_layerwise_reload` walks `model.modules()` and puts each layer's
tensors on the meta device until all of the layer's elements were loaded
again; the layer is then materialized, processed, and copied back into its
original storage. Two kinds of module must not take part:

- **A tied alias.** vLLM ties a `ParallelLMHead` to the input embedding by
  sharing the embedding's weight Parameter (`tie_weights`). The reload gives
  each module a meta tensor of its own, so the tie is broken for the
  reload's duration, and loading the alias too would materialize a second
  vocab x hidden tensor (held beside the first, on the device), copy it and
  copy it back, only to write the embedding's bytes into the embedding's
  storage again. Kept out, the alias keeps the shared Parameter, which the
  embedding's layer copies its new values into, so it holds them without a
  load of its own. What its quant method derived from the weight (vLLM's
  CPU GEMM packs a copy of it) is made again, or taken from the embedding,
  which made the same (`_process_alias`), as soon as the embedding's
  layer holds the shared Parameter again (`process_ready_aliases`, after
  each bucket: while the trainer still makes the next ones), else once the
  reload is finalized (a layer the engine pads beyond the checkpoint's rows
  is processed only then).
  Only aliases whose quant method is vLLM's unquantized embedding method
  are kept out: that method's processing reads the weight and never changes
  it, so running it again is safe. Any other tie is reloaded as before.
- **Modules another model's reload owns.** An MTP drafter shares its
  target's `embed_tokens` and `lm_head`: the target loads and processes
  them, and the draft's reload, walking into them, would put them back on
  the meta device after the target loaded them.

A third kind is a module the engine does not have: a tied head (`TIED_HEAD`,
which a plan for a model that ties its embeddings carries as a copy of the
embedding) where no module of the model is a head, since the model takes
its logits from the embedding itself (vLLM's Gemma 2). There is
nothing to load it into, and the embedding's own load delivers its bytes.

The alias's parameter names (`kept_out`) are never loaded: `load` drops them
from what it hands `load_weights`, and the update from the weights it expects.

One kind of module takes part but must be processed as on its first load:
**unquantized MoE experts on a CPU.** vLLM's unquantized MoE method takes a
call after its kernel exists for a weight update and then skips the
experts' own processing, which on a CPU packs the weights into the grouped
GEMM's layout (`CPUUnquantizedExperts`): the reload would copy the new,
unpacked values into the packed storage and the kernel would read them as
packed (every synced bf16 MoE served garbage). For the reload's duration
such methods have no kernel, so each layer's processing packs its new
weights as the first load did and the reload copies the packed values into
the original storage; `close` gives each method back the kernel it had,
which reads those Parameters.

And one view must be refreshed after the reload, on a CPU: **Mamba2's conv
weights.** `MambaMixer2` keeps `conv_weights`, a view of its `conv1d`
weight taken when the model was built, and its kernels read that view.
vLLM's CPU GEMM dispatch then packs the conv weight into new storage,
keeping the (dim, width) form as `_cpu_unpacked_conv_weight`. A first load
fills the view before the packing; a reload copies the new weight into the
packed storage only, so the view kept the first load's values (a synced
Granite 4.0-H or Falcon-H1 served its old convolutions). `close` copies the
unpacked weight into each such view (`_refresh_conv_views`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from vllm.model_executor.layers.attention import is_deferred_attention_layer
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

from refit.plan.transfer_plan import TIED_HEAD

__all__ = ["LayerwiseReload", "Unfilled", "outermost", "tied_aliases"]


@dataclass(frozen=True, slots=True)
class Unfilled:
    """Tensors of partly loaded layers that an update would leave without its bytes (`LayerwiseReload.unfilled`)."""

    bypassed: tuple[str, ...]  # reported loaded by `load_weights`, written past the reload's loaders
    left_out: tuple[str, ...]  # never loaded: the stream did not carry them, or `load_weights` skipped them


class LayerwiseReload:
    """One update's layerwise reload of `model`: `open` before the first tensor is loaded, `close` after the last.

    `owned_elsewhere`: names of modules another model's reload loads and processes (outermost only).
    """

    def __init__(self, model: torch.nn.Module, model_config: Any, owned_elsewhere: Sequence[str] = ()) -> None:
        self.model, self.model_config = model, model_config
        self._owned_elsewhere = list(owned_elsewhere)
        self._pending: dict[torch.nn.Module, torch.nn.Module] = {}  # tied alias -> the module its Parameter is from
        self.kept_out: frozenset[str] = frozenset()
        self._kernels: list[tuple[Any, Any, Any]] = []  # (MoE method, its kernel, its quant config) while suspended
        self._first_paths = _first_paths(model)
        self._outside: list[str] = []  # modules this reload does not take part in (kept-out aliases, owned elsewhere)
        self.is_open = False

    def open(self) -> None:
        """Put every layer but the kept-out ones in loadable form."""
        aliases = {name: tie for name, tie in tied_aliases(self.model).items() if not _under(name, self._owned_elsewhere)}
        self._pending = dict(aliases.values())
        self.kept_out = frozenset(f"{name}.{param}" for name, (alias, _) in aliases.items()
                                  for param, _ in _own_parameters(alias)) | _absent_head(self.model)
        self._outside = [*self._owned_elsewhere, *aliases]
        with _detached(self.model, self._outside):
            initialize_layerwise_reload(self.model)
        self._kernels = [(method, method.moe_kernel, method.moe_quant_config) for method in _cpu_packed_experts(self.model)]
        for method, _, _ in self._kernels:
            method.moe_kernel = None  # its next processing packs the new weights, as on the first load
        self.is_open = True

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> set[str]:
        """`model.load_weights` of `tensors` but the kept-out names (their bytes arrive through the tie), then the
        aliases that became ready; the tensor names vLLM reported as loaded, each under its module's first path."""
        loadable = [(name, tensor) for name, tensor in tensors if name not in self.kept_out]
        loaded = self.model.load_weights(loadable) if loadable else ()
        self.process_ready_aliases()
        return {self._canonical(name) for name in loaded}

    def _canonical(self, name: str) -> str:
        """`name` under the path `named_modules()` gives its module (the one `named_parameters()` uses).

        Why: vLLM registers some modules under two parents (`SharedFusedMoE`
        holds the layer's router and shared experts inside its fused
        experts too), and a model's `load_weights` may report either path,
        so a loaded weight looked unloaded (dots1's shared experts)."""
        module, _, attribute = name.rpartition(".")
        owner = self._first_paths.get(module)
        if owner is None:
            return name
        return f"{owner}.{attribute}" if owner else attribute

    def unfilled(self, reported: set[str]) -> Unfilled:
        """What finalizing would leave without this update's bytes, in the layers that received part of theirs.

        Why: the reload sees a load only through a tensor's `weight_loader`,
        which it wraps to count and keep the bytes until the layer is whole; a
        layer still waiting at the end is materialized uninitialized, given
        what it kept, processed, and copied back into its kernel tensors,
        persistent buffers included. So in such a layer a tensor it kept
        nothing for is served as uninitialized memory, whether the stream left
        it out (Apertus' xIELU `beta`) or the model's `load_weights` wrote it
        itself with a bare `copy_` onto the meta tensor the reload put there,
        reporting it loaded (vLLM's unquantized gpt-oss experts and attention
        sinks). A layer that received nothing gets its old tensors back (the
        update's parameter check names those), one already processed had
        counted every element it expected, and attention layers are finalized
        on their own.
        `reported`: the names `load` returned in this update.
        """
        bypassed, left_out = [], []
        for path, module in self.model.named_modules():
            info = LAYERWISE_INFO.get(module)
            if (info is None or not info.can_load() or info.kernel_tensors is None
                    or is_deferred_attention_layer(module) or _under(path, self._outside)):
                continue
            seen = {name for name, _ in info.loaded_weights}
            kernel_buffers = info.kernel_tensors[1]
            names = [name for name, tensor in (*module._parameters.items(), *module._buffers.items())
                     if tensor is not None and tensor.is_meta and name not in seen
                     and (name in module._parameters or (name in kernel_buffers
                                                         and name not in info.kernel_non_persistent_buffers))]
            full = [f"{path}.{name}" if path else name for name in names]
            if seen or any(name in reported for name in full):
                for name in full:
                    (bypassed if name in reported else left_out).append(name)
        return Unfilled(tuple(sorted(bypassed)), tuple(sorted(left_out)))

    def process_ready_aliases(self) -> None:
        """Process each tied alias whose source layer was processed: the source holds the shared Parameter again."""
        for alias, source in list(self._pending.items()):
            if all(getattr(source, name, None) is param for name, param in _own_parameters(alias)):
                _process_alias(alias, source)
                del self._pending[alias]

    def close(self) -> None:
        """Finalize the reload (layers that received nothing get their old tensors back), then process the tied
        aliases not processed yet over the values their Parameter now holds."""
        try:
            with _detached(self.model, self._owned_elsewhere):
                finalize_layerwise_reload(self.model, self.model_config)
        finally:
            kernels, self._kernels = self._kernels, []
            for method, kernel, quant_config in kernels:
                method.moe_kernel, method.moe_quant_config = kernel, quant_config
        self.is_open = False
        pending, self._pending = self._pending, {}
        for alias, source in pending.items():
            _process_alias(alias, source)
        _refresh_conv_views(self.model)


def _process_alias(alias: torch.nn.Module, source: torch.nn.Module) -> None:
    """What `alias`'s quant method derives from the weight it shares with `source`, which holds it again.

    Why not always process the alias: on a CPU vLLM's unquantized embedding
    method packs a copy of the weight into a GEMM kernel's layout
    (`cpu_linear`), and it did so for the source as its layer was processed
    (the embedding never multiplies with it, but a model that takes its logits
    from the embedding does). Both derive from the same Parameter by the same
    method, so the alias takes the source's kernel: the reload packs a
    vocab x hidden table once instead of twice, and the rollout stops holding
    a second packed copy. Elsewhere (no `cpu_linear`: a GPU, whose method
    derives nothing) the alias is processed as before.
    """
    kernel = getattr(source, "cpu_linear", None)
    if kernel is not None and type(getattr(source, "quant_method", None)) is type(alias.quant_method):
        alias.cpu_linear = kernel
    else:
        alias.quant_method.process_weights_after_loading(alias)


def tied_aliases(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """Leaf modules of `model` whose every parameter is, under the same name, the Parameter one earlier module
    holds (in `named_modules` order), and whose quant method is vLLM's unquantized embedding method: a tied
    `lm_head`. By name: (the alias, that earlier module)."""
    owners: dict[int, torch.nn.Module] = {}
    aliases = {}
    for name, module in model.named_modules():
        params = _own_parameters(module)
        owned = [owners.get(id(param)) for _, param in params]
        source = owned[0] if owned else None
        if (name and source is not None and all(o is source for o in owned) and next(module.children(), None) is None
                and all(getattr(source, n, None) is param for n, param in params)
                and isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod)):
            aliases[name] = (module, source)
        for _, param in params:
            owners.setdefault(id(param), module)
    return aliases


def _cpu_packed_experts(model: torch.nn.Module) -> list[Any]:
    """The unquantized MoE methods of `model` whose experts pack the weights on a CPU (the module docstring)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM build without its CPU MoE kernels has no such experts
        return []
    methods = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if isinstance(method, UnquantizedFusedMoEMethod) and isinstance(experts, CPUUnquantizedExperts):
            methods.append(method)
    return methods


def _refresh_conv_views(model: torch.nn.Module) -> None:
    """Copy each CPU-packed conv weight's unpacked form into the `conv_weights` view its mixer reads, where the
    packing left that view behind in the weight's old storage (the module docstring)."""
    for module in model.modules():
        conv = getattr(module, "conv1d", None)
        unpacked = getattr(conv, "_cpu_unpacked_conv_weight", None)
        view = module._buffers.get("conv_weights")
        if (unpacked is not None and view is not None and view.shape == unpacked.shape
                and view.untyped_storage().data_ptr() != conv.weight.untyped_storage().data_ptr()):
            view.copy_(unpacked)


def _first_paths(model: torch.nn.Module) -> dict[str, str]:
    """Each later path of a module registered under several, to its first (the one `named_parameters()` uses)."""
    first: dict[int, str] = {}
    later = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if first.setdefault(id(module), name) != name:
            later[name] = first[id(module)]
    return later


def _absent_head(model: torch.nn.Module) -> frozenset[str]:
    """`TIED_HEAD` if no module of `model` is a head (`lm_head`, at any depth): the model computes its logits from the
    embedding, which holds the tied head's bytes (the module docstring)."""
    head = TIED_HEAD.rpartition(".")[0]
    has_head = any(name == head or name.endswith("." + head) for name, _ in model.named_modules())
    return frozenset() if has_head else frozenset({TIED_HEAD})


def _own_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return list(module.named_parameters(recurse=False))


def outermost(names: Sequence[str]) -> list[str]:
    """`names` without those inside another of them."""
    return [name for name in names if not _under(name, [other for other in names if other != name])]


def _under(name: str, others: Sequence[str]) -> bool:
    return any(name == other or name.startswith(other + ".") for other in others)


@contextmanager
def _detached(model: torch.nn.Module, names: Sequence[str]) -> Iterator[None]:
    """`model` without the modules `names` (outermost ones) for the duration, their places kept."""
    parents = []
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        parents.append((parent, dict(parent._modules)))
        del parent._modules[child]
    try:
        yield
    finally:
        for parent, modules in reversed(parents):
            parent._modules.clear()
            parent._modules.update(modules)
