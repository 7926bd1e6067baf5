"""A reference FP8_BLOCK mixture-of-experts backend for CPUs without AMX, as a vLLM plugin.

Why it exists: vLLM 0.32 runs FP8 MoE layers on the CPU only through AMX
kernels (`CPUExpertsFp8W8A8`, `CPUExpertsFp8`). On a CPU without AMX both
refuse, `select_fp8_moe_backend` returns `NONE`, and an FP8_BLOCK MoE
checkpoint fails at start-up ("Unsupported FP8 MoE backend: NONE"). This
backend dequantizes every expert's 128x128 blocks to the activations' dtype
and hands them to vLLM's own BF16 CPU MoE kernel (`cpu_fused_moe`, the
portable "vec" path its unquantized experts use), so routing, activation and
the weighted combine are vLLM's; only the dequantization is refit's.

Like the linear reference kernel (`refit.engine.cpu_kernel`), it keeps the
layer's tensors exactly as compressed-tensors loaded them (FP8 codes
`[E, N, K]`, float32 block scales), so layerwise reload copies a refit's
codes into the same storage and nothing derived can go stale; the price is
one dequantization and prepack per forward.

vLLM has no plugin list for MoE backends (its own TODO says so), so
`register()` extends its FP8 MoE oracle in the one place that selection
reads: the CPU priority list gets a last entry, `EMULATION` (a backend whose
weights pass through unconverted), and the kernel classes for that entry on
the CPU are this one. vLLM's native CPU backends keep priority wherever
they can run, unless `REFIT_CPU_REFERENCE_KERNEL=1` is in the engine's
environment: then this backend comes first, as the linear reference kernel
does (refit/engine/cpu_kernel.py says why).
"""

from __future__ import annotations

import functools
import os

import torch
import vllm.platforms

from refit.engine.compat import incompatible_vllm
from refit.engine.config import REFERENCE_KERNEL_ENV, reference_kernels_first
from refit.quantizer.fp8_block import dequantize_fp8_block

__all__ = ["RefitCpuFp8BlockExperts", "register"]


def _incompatible_vllm(problem: str):
    return incompatible_vllm("CPU FP8_BLOCK MoE backend", problem)


try:
    import vllm.model_executor.layers.fused_moe.oracle.fp8 as fp8_oracle
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.logger import init_logger
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8Dynamic128Sym, kFp8Static128BlockSym
except ImportError as exc:  # vLLM only logs a plugin that fails to import
    raise _incompatible_vllm(f"an import fails ({exc})") from exc

_logger = init_logger(f"vllm.{__name__}")
# The backend slot this kernel takes: one whose load-time conversion leaves the FP8 weights as loaded.
_SLOT = fp8_oracle.Fp8MoeBackend.EMULATION


class RefitCpuFp8BlockExperts(CPUUnquantizedExperts):
    """W8A16 FP8_BLOCK experts: dequantize `w13`/`w2` blocks, then vLLM's BF16 CPU MoE kernel.

    Activations stay in their dtype (`expects_unquantized_inputs`, inherited),
    as in vLLM's native CPU W8A16 FP8 MoE kernel.
    """

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 (vLLM's signature)
        super().__init__(*args, **kwargs)
        _logger.warning_once(
            "Using refit's reference FP8_BLOCK MoE backend (%s=%s; vLLM's CPU FP8 MoE kernels need AMX). "
            "It dequantizes every expert on every call, so it is correct but slow.",
            REFERENCE_KERNEL_ENV, os.environ.get(REFERENCE_KERNEL_ENV, "unset"),
        )

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        """FP8 128x128 weight blocks, the scheme the activations would use on a GPU (ignored here)."""
        return (weight_key, activation_key) == (kFp8Static128BlockSym, kFp8Dynamic128Sym)

    def apply(self, output, hidden_states, w1, w2, *args, **kwargs) -> None:  # noqa: ANN001 (vLLM's signature)
        super().apply(output, hidden_states, self._dense(w1, self.w1_scale), self._dense(w2, self.w2_scale), *args, **kwargs)

    def _dense(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """`[E, N, K]` FP8 codes times their block scales, in the kernel's packed layout."""
        block = tuple(self.quant_config.block_shape or (128, 128))
        return cpu_prepack_moe_weight(dequantize_fp8_block(weight, scale, block, dtype=torch.bfloat16), self.isa)


def register() -> None:
    """Make `RefitCpuFp8BlockExperts` vLLM's last-choice FP8 MoE backend on the CPU (first under
    `REFERENCE_KERNEL_ENV`, read at each selection).

    A no-op off the CPU platform and when already registered (vLLM runs
    general plugins more than once per process). Raises `EngineError` naming
    the expected vLLM version if the oracle functions it extends are missing.
    """
    if not vllm.platforms.current_platform.is_cpu():
        return
    for name in ("_get_priority_backends", "backend_to_kernel_cls"):
        if not callable(getattr(fp8_oracle, name, None)):
            raise _incompatible_vllm(f"vllm.model_executor.layers.fused_moe.oracle.fp8.{name} is missing")
    if getattr(fp8_oracle.backend_to_kernel_cls, "_refit", False):
        return
    fp8_oracle._get_priority_backends = _with_reference_placed(fp8_oracle._get_priority_backends)
    fp8_oracle.backend_to_kernel_cls = _reference_in_slot(fp8_oracle.backend_to_kernel_cls)


def _with_reference_placed(priority_backends):
    @functools.wraps(priority_backends)
    def wrapped(*args, **kwargs):
        backends = [b for b in priority_backends(*args, **kwargs) if b is not _SLOT]
        return [_SLOT, *backends] if reference_kernels_first() else [*backends, _SLOT]

    return wrapped


def _reference_in_slot(backend_to_kernel_cls):
    @functools.wraps(backend_to_kernel_cls)
    def wrapped(backend):
        if backend is _SLOT:
            return [RefitCpuFp8BlockExperts]
        return backend_to_kernel_cls(backend)

    wrapped._refit = True
    return wrapped
