"""The post-refit stage: make every live attention scale valid and honest.

Runs after each sync, between requests, never inside the engine's forward:
data-dependent work in a compiled forward breaks torch.compile and CUDA
graphs (vLLM PR 21640, which removed vLLM's own runtime scale calculation). Scales are written in place, into
the tensors the kernels already hold, so captured graphs see new values.

Policies:
- `auto`: reset to 1.0 only scales whose provenance is `dummy` or
  `placeholder`; `checkpoint`, `refit` and `calibrated` scales stay as they
  are (the upstream fix reset everything and lost calibrated scales).
- `recompute`: set q/k/v scales to amax / 448 measured on a calibration
  batch at the current weights (`AttentionAmaxRecorder`), as the KV cache
  sees them: K after its norm and RoPE.
- `keep`: write nothing.
Whatever the policy, a non-positive or non-finite scale left afterwards, or
one still holding a dummy load's value, is refused with the names of the
layers, so it never reaches a kernel.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum

import torch

from refit.errors import EngineError, InvalidTensorError
from refit.provenance.records import UNINFORMED, ScaleSource
from refit.provenance.tracker import ATTENTION_SCALES, ScaleProvenanceTracker, is_attention_layer
from refit.quantizer.fp8_block import FP8_E4M3_MAX, first_invalid_scale_value, is_valid_scale

__all__ = [
    "AttentionAmaxRecorder",
    "KvScalePolicy",
    "apply_kv_scale_policy",
    "live_attention_scales",
    "refuse_invalid_scales",
    "restore_attention_scales",
    "write_attention_scale",
]


class KvScalePolicy(StrEnum):
    AUTO = "auto"
    RECOMPUTE = "recompute"
    KEEP = "keep"


def write_attention_scale(layer: torch.nn.Module, scale: str, value: float | torch.Tensor) -> None:
    """Set one live attention scale in place (every element to `value`, or to a tensor's values), with the host
    copies backends read."""
    live = getattr(layer, f"_{scale}")
    if isinstance(value, torch.Tensor):
        live.copy_(value)
        first = float(live.reshape(-1)[0])
    else:
        live.fill_(value)
        first = value  # exactly as given, not rounded through the tensor's dtype
    setattr(layer, f"_{scale}_float", first)
    host = getattr(layer, f"_{scale}_cpu", None)
    if isinstance(host, torch.Tensor):  # a 0-d copy of a 1-element scale, say
        host.copy_(live.reshape(host.shape)) if host.numel() == live.numel() else host.fill_(first)


def live_attention_scales(model: torch.nn.Module, tracker: ScaleProvenanceTracker) -> dict[tuple[str, str], torch.Tensor]:
    """A copy of every live attention scale, to put back what an update resets without sending it
    (`restore_attention_scales`)."""
    modules = dict(model.named_modules())
    return {(module, scale): getattr(modules[module], f"_{scale}").detach().clone()
            for module, scale in tracker.attention_scales()}


def restore_attention_scales(model: torch.nn.Module, before: Mapping[tuple[str, str], torch.Tensor],
                             sent: set[str]) -> list[str]:
    """Put back each attention scale the update changed but did not send ("module.scale" not in `sent`); returns
    those put back.

    Why: vLLM's reload makes a layer's attention scales anew once any of
    them arrives (`create_weights`), so a trainer that streams k and v
    scales (NeMo-RL's way) resets q to a placeholder, and one that sends
    some layers' v only resets their k; the record would still say
    calibrated or checkpoint, and the post-refit stage would trust it.
    """
    modules = dict(model.named_modules())
    restored = []
    for (module, scale), value in before.items():
        live = getattr(modules[module], f"_{scale}")
        if f"{module}.{scale}" in sent or live.shape != value.shape or torch.equal(live, value.to(live.device)):
            continue  # sent, made anew in another shape (nothing to put back into), or unchanged
        write_attention_scale(modules[module], scale, value)
        restored.append(f"{module}.{scale}")
    return restored


def apply_kv_scale_policy(
    model: torch.nn.Module,
    tracker: ScaleProvenanceTracker,
    policy: KvScalePolicy,
    version: int,
    measured_amax: Mapping[tuple[str, str], float] | None = None,
) -> list[str]:
    """Apply `policy` to every attention scale; returns "module.scale" of those written.

    Raises `EngineError` naming the layers if any scale is left invalid.
    """
    modules = dict(model.named_modules())
    written: list[str] = []
    for module, scale in tracker.attention_scales():
        # An amax of 0 (K or V all zero on the calibration prompts) measured nothing: a scale made of it would be
        # subnormal, and the first nonzero value served would saturate the FP8 cache.
        if policy is KvScalePolicy.RECOMPUTE and measured_amax and measured_amax.get((module, scale), 0.0) > 0:
            value = max(measured_amax[(module, scale)], torch.finfo(torch.float32).tiny) / FP8_E4M3_MAX
            source = ScaleSource.CALIBRATED
        elif policy is not KvScalePolicy.KEEP and tracker.source(module, scale) in UNINFORMED:
            value, source = 1.0, ScaleSource.DEFAULT
        else:
            continue
        write_attention_scale(modules[module], scale, value)
        tracker.record_set(module, scale, source, version)
        written.append(f"{module}.{scale}")
    invalid = []
    for r in tracker.records():
        live = getattr(modules[r.module], f"_{r.scale}") if r.kind == "attention" else None
        # Every element: a per-head scale with one bad head is as unservable as a bad scalar. A dummy load's value is
        # a random draw whose sign depends on the device's generator: never servable, positive or not (`keep`).
        if live is not None and (r.source is ScaleSource.DUMMY or not is_valid_scale(live)):
            shown = r.value if is_valid_scale(live) else first_invalid_scale_value(live)
            invalid.append(f"{r.module}.{r.scale}={shown:.4g} ({r.source})")
    if invalid:
        raise EngineError(
            f"{len(invalid)} attention scale(s) are not positive and finite, or hold a dummy load's random values, "
            f"after the '{policy}' post-refit stage, refusing to serve with them: {', '.join(invalid[:8])}"
            + (" ..." if len(invalid) > 8 else "")
            + ". Use kv_scales='auto' or 'recompute', or stream valid scales from the trainer."
        )
    return written


def refuse_invalid_scales(tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Streamed attention scales must be positive and finite; raise naming the first that is not.

    Checked on the trainer before anything is sent, and again by the rollout
    before a bucket is loaded, so an invalid scale never reaches the engine.
    """
    for name, tensor in tensors:
        if name.rpartition(".")[2] in ATTENTION_SCALES and tensor.is_floating_point() and not is_valid_scale(tensor):
            raise InvalidTensorError(
                f"{name}: streamed scale holds non-positive or non-finite values "
                f"(min {float(tensor.float().min()):.4g}); fix the trainer's calibration"
            )


class AttentionAmaxRecorder:
    """amax of q, k, v entering every attention layer between `start` and `stop`.

    Forward pre-hooks see what the KV cache will store (K after norm and
    RoPE). They only fire in an eager forward: a calibration pass that left
    some attention layer unseen is refused rather than half-applied.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._layers = {n: m for n, m in model.named_modules() if is_attention_layer(m)}
        self._amax: dict[tuple[str, str], float] = {}
        self._handles: list = []

    def start(self) -> None:
        self._amax.clear()
        self._handles = [m.register_forward_pre_hook(self._hook_for(n), with_kwargs=True) for n, m in self._layers.items()]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def stop(self) -> dict[tuple[str, str], float]:
        self.remove_hooks()
        for name, layer in self._layers.items():
            # A layer that shares another's KV cache (Gemma 3n's last layers) is called without k and v: they are
            # the target's, and this layer dequantizes that cache with its own k and v scales, so it takes the
            # target's amax.
            target = getattr(layer, "kv_sharing_target_layer_name", None)
            for scale in ("k_scale", "v_scale") if target else ():
                if (target, scale) in self._amax:
                    self._amax[(name, scale)] = self._amax[(target, scale)]
        missing = [n for n in self._layers if (n, "k_scale") not in self._amax]
        if missing:
            raise EngineError(
                f"KV-scale recompute saw no activations for {len(missing)} attention layer(s) "
                f"(e.g. {missing[0]}): the calibration pass did not run eagerly. Start the engine "
                "with enforce_eager=True to use kv_scales='recompute'."
            )
        return dict(self._amax)

    def _hook_for(self, name: str) -> Callable:
        # By the forward's parameter names where it has them: a call may pass some of q, k, v by position and the
        # rest by keyword. A forward of `*args` (a wrapper's) is read by position.
        signature = inspect.signature(self._layers[name].forward)
        named = {"query", "key", "value"} <= signature.parameters.keys()

        def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments if named else None
            except TypeError:  # a call the signature does not describe (a keyword it lacks): read by position
                bound = None
            if bound is not None:
                q, k, v = (bound.get(n) for n in ("query", "key", "value"))
            else:
                q, k, v = (args + tuple(kwargs.get(n) for n in ("query", "key", "value")))[:3]
            for scale, tensor in (("q_scale", q), ("k_scale", k), ("v_scale", v)):
                if tensor is not None and tensor.numel():
                    seen = float(tensor.detach().abs().amax())
                    self._amax[(name, scale)] = max(self._amax.get((name, scale), 0.0), seen)

        return record
