"""Tracks, from facts, where every scale of a running vLLM model came from.

The facts are: the engine's load format, the tensor names actually present in
the checkpoint it loaded, and, per sync, the parameter names `load_weights`
reported as loaded and the checkpoint names of the tensors it was given.

A mixture-of-experts layer holds all its experts' scales in two fused
parameters (`w13_weight_scale` for gate and up, `w2_weight_scale` for
down). Each expert gets its own record (module `<experts>.<e>`, in checkpoint
names), sourced from
that expert's own checkpoint tensors, so an expert a sync did not send is
never reported as refitted. The upstream fix this replaces (verl PR 8483)
inferred "uncalibrated" from a missing `kv_cache_scheme`, which also wiped
calibrated scales loaded from a real checkpoint; nothing here is inferred
from config fields.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from refit.provenance.records import ScaleRecord, ScaleSource

__all__ = ["ATTENTION_SCALES", "ScaleProvenanceTracker", "checkpoint_tensor_names"]

# The live attention scales vLLM keeps, each as `_<name>` (a tensor the
# kernels read) plus host-side float copies.
ATTENTION_SCALES = ("q_scale", "k_scale", "v_scale", "prob_scale")
_WEIGHT_SCALES = ("weight_scale", "weight_scale_inv")
# vLLM's fused-experts scale parameters, and which projection of each expert's checkpoint feeds them.
_EXPERT_SCALES = {"w13_weight_scale": ("gate", "up"), "w2_weight_scale": ("down",)}


def checkpoint_tensor_names(model_dir: str | Path) -> frozenset[str]:
    """Names of every tensor in a safetensors checkpoint (headers only, no data read)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return frozenset(names)


class ScaleProvenanceTracker:
    """Per-module, per-scale provenance of one vLLM model (one worker).

    Lifecycle: `record_initial_load` once after the engine loaded, then for
    every sync `record_streamed` (what the trainer sent) and `record_set`
    (what the post-refit stage wrote).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._sources: dict[tuple[str, str], tuple[ScaleSource, int | None]] = {}
        self._kinds: dict[tuple[str, str], str] = {}
        self._experts: dict[tuple[str, str], _ExpertScale] = {}  # per-expert records of fused MoE scales
        self._packed_modules: Mapping[str, list[str]] = {}
        for module_name, module in model.named_modules():
            if is_attention_layer(module):
                for scale in ATTENTION_SCALES:
                    if hasattr(module, f"_{scale}"):
                        self._kinds[(module_name, scale)] = "attention"
            elif getattr(module, "quant_method", None) is not None:
                for scale in _WEIGHT_SCALES:
                    if isinstance(getattr(module, scale, None), torch.Tensor):
                        self._kinds[(module_name, scale)] = "weight"
                for scale, projections in _EXPERT_SCALES.items():
                    fused = getattr(module, scale, None)
                    if isinstance(fused, torch.Tensor) and fused.dim() == 3:
                        names = [getattr(module, f"ckpt_{p}_proj_name", f"{p}_proj") for p in projections]
                        # vLLM 0.32 wraps the experts in a runner that has the checkpoint's name.
                        prefix = module_name.removesuffix(".routed_experts")
                        for expert in range(fused.shape[0]):
                            key = (f"{prefix}.{expert}", scale)
                            self._kinds[key] = "weight"
                            self._experts[key] = _ExpertScale(
                                module_name, expert, tuple(f"{prefix}.{expert}.{n}.weight_scale" for n in names))

    def record_initial_load(
        self, load_format: str, checkpoint_names: frozenset[str], packed_modules: Mapping[str, list[str]]
    ) -> None:
        """What the engine's own load left in each scale.

        `packed_modules` is the model's `packed_modules_mapping` (e.g.
        `qkv_proj -> [q_proj, k_proj, v_proj]`): a fused module's scale came
        from the checkpoint only if every shard's scale was there.
        `checkpoint_names` holds each attention scale under the vLLM name
        the engine's loader maps it to (`self_attn.k_scale`,
        `self_attn.k_proj.k_scale` ... -> `self_attn.attn.k_scale`).
        """
        self._packed_modules = packed_modules
        for module, scale in self._kinds:
            expert = self._experts.get((module, scale))
            names = expert.checkpoint_names if expert else _checkpoint_names(module, scale, packed_modules)
            if load_format == "dummy":
                source = ScaleSource.DUMMY
            elif all(name in checkpoint_names for name in names):
                source = ScaleSource.CHECKPOINT
            else:
                source = ScaleSource.PLACEHOLDER
            self._sources[(module, scale)] = (source, None)

    def record_streamed(self, loaded_param_names: Iterable[str], streamed_names: Iterable[str], version: int) -> None:
        """Scales among the vLLM parameter names `load_weights` reported as loaded.

        An expert's scale counts only if its own checkpoint tensors were among
        `streamed_names` too: the fused parameter is reported loaded as soon as
        any one expert is.
        """
        loaded, streamed = set(loaded_param_names), set(streamed_names)
        for module, scale in self._kinds:
            expert = self._experts.get((module, scale))
            if expert is None:
                sent = f"{module}.{scale}" in loaded
            else:
                sent = f"{expert.module}.{scale}" in loaded and all(n in streamed for n in expert.checkpoint_names)
            if sent:
                self._sources[(module, scale)] = (ScaleSource.REFIT, version)

    def record_set(self, module: str, scale: str, source: ScaleSource, version: int | None) -> None:
        self._sources[(module, scale)] = (source, version)

    def source(self, module: str, scale: str) -> ScaleSource:
        return self._sources[(module, scale)][0]

    def weight_scales(self) -> list[WeightScale]:
        """Every FP8 weight scale: its record's name, the vLLM parameter holding it, and its checkpoint pieces in row order."""
        out = []
        for (module, scale), kind in self._kinds.items():
            if kind != "weight":
                continue
            expert = self._experts.get((module, scale))
            if expert:
                out.append(WeightScale(module, scale, expert.module, expert.index, expert.checkpoint_names))
            else:
                out.append(WeightScale(module, scale, module, None, tuple(_checkpoint_names(module, scale, self._packed_modules))))
        return out

    def attention_scales(self) -> list[tuple[str, str]]:
        return [key for key, kind in self._kinds.items() if kind == "attention"]

    def records(self) -> list[ScaleRecord]:
        """Every tracked scale with its current value, in model order."""
        modules = dict(self._model.named_modules())
        out = []
        for (module, scale), kind in self._kinds.items():
            source, version = self._sources[(module, scale)]
            expert = self._experts.get((module, scale))
            if expert is None:
                value = _scale_value(modules[module], scale, kind)
            else:
                value = float(getattr(modules[expert.module], scale)[expert.index].detach().abs().max())
            out.append(ScaleRecord(module, scale, kind, source, version, value))
        return out


class WeightScale(NamedTuple):
    """One FP8 weight scale as a record names it, where vLLM holds it, and the checkpoint scales it is made of."""

    module: str  # as in the provenance record
    scale: str
    vllm_module: str
    index: int | None  # the expert, within a fused-experts parameter
    checkpoint_names: tuple[str, ...]  # concatenated by rows, in this order


class _ExpertScale(NamedTuple):
    """One expert's slice of a fused MoE scale parameter, and the checkpoint tensors it is loaded from."""

    module: str  # the fused-experts module
    index: int
    checkpoint_names: tuple[str, ...]


def is_attention_layer(module: torch.nn.Module) -> bool:
    """vLLM attention layers are the modules holding live KV-cache scales."""
    return hasattr(module, "_k_scale") and hasattr(module, "_k_scale_float") and hasattr(module, "kv_cache_dtype")


def _checkpoint_names(module: str, scale: str, packed_modules: Mapping[str, list[str]]) -> list[str]:
    parent, _, leaf = module.rpartition(".")
    if scale in ATTENTION_SCALES:
        # Checkpoints name these several ways (llmcompressor `self_attn.k_scale`, ModelOpt `k_proj.k_scale`,
        # vLLM's own); the caller maps them onto the live layer's name, as vLLM's loader does.
        return [f"{module}.{scale}"]
    shards = packed_modules.get(leaf, [leaf])
    prefix = f"{parent}." if parent else ""
    return [f"{prefix}{shard}.weight_scale" for shard in shards]


def _scale_value(module: torch.nn.Module, scale: str, kind: str) -> float:
    if kind == "attention":
        return float(getattr(module, f"_{scale}").reshape(-1)[0])
    return float(getattr(module, scale).detach().abs().max())
