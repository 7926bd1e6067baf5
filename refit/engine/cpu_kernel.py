"""A reference FP8_BLOCK linear kernel for CPUs without AMX, as a vLLM plugin.

Why it exists: vLLM 0.32 implements compressed-tensors FP8_BLOCK linears on
the CPU only through AMX kernels (`CPUFp8W8A8BlockScaledMMKernel`,
`CPUFp8BlockScaledMMKernel`). On a CPU without AMX both refuse, and an
FP8_BLOCK checkpoint fails at start-up with "Failed to find a kernel that can
implement the ScaledMM linear layer". This kernel dequantizes the blocks and
runs one dense linear in the activations' dtype: slow, but exact up to one
bf16 rounding of each weight, so the real FP8_BLOCK load, serve and reload
paths can run (and be tested) on any CPU.

It is appended to vLLM's CPU kernel list, so vLLM's own kernels keep
priority wherever they can run. With `REFIT_CPU_REFERENCE_KERNEL=1` in the
environment of the engine's processes it goes first instead, so every CPU
computes the same numbers: vLLM's AMX kernels pack the weight for their
GEMM, and one of them rounds activations to FP8, so an engine on a CPU with
AMX does not match a bf16 engine on the dequantized weights, or the same
engine on a CPU without AMX, bit for bit (refit's test suite sets it). `register()` is the `vllm.general_plugins`
entry point declared in pyproject.toml; vLLM calls it in every process it
starts (engine core, workers) before any model is built.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import vllm
import vllm.platforms

from refit.engine.compat import EXPECTED_VLLM_VERSION, incompatible_vllm
from refit.engine.config import REFERENCE_KERNEL_ENV, reference_kernels_first
from refit.errors import InvalidTensorError
from refit.quantizer.fp8_block import dequantize_fp8_block

__all__ = ["EXPECTED_VLLM_VERSION", "REFERENCE_KERNEL_ENV", "RefitCpuFp8BlockKernel", "register"]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _incompatible_vllm(problem: str):
    return incompatible_vllm("CPU FP8_BLOCK kernel", problem)


try:
    # A failure here surfaces only as a logged "Failed to load plugin" (vLLM
    # catches import errors of plugins), hence the explicit message; the
    # internals that `register()` needs are checked there, where an error
    # stops the engine.
    from vllm.logger import init_logger
    from vllm.model_executor.kernels.linear import (
        Fp8BlockScaledMMLinearKernel,
        FP8ScaledMMLinearLayerConfig,
    )
    from vllm.platforms import PlatformEnum
except ImportError as exc:
    raise _incompatible_vllm(f"an import fails ({exc})") from exc

# vLLM formats and filters only loggers under "vllm"; this one should read like its peers.
_logger = init_logger(f"vllm.{__name__}")


class RefitCpuFp8BlockKernel(Fp8BlockScaledMMLinearKernel):
    """W8A16 FP8 block-scaled linear: dequantize the weight, then `F.linear`.

    Chosen on CPUs without AMX, where vLLM's native CPU block kernels refuse;
    vLLM picks it only after every native kernel has refused the layer.

    At apply time the layer holds what compressed-tensors loaded, unchanged:
    `weight` float8_e4m3fn `[N, K]` (block kernels are not transposed, unlike
    vLLM's per-tensor/per-channel FP8 path) and `weight_scale` float32
    `[ceil(N/bn), ceil(K/bk)]`, edge blocks partial. Keeping that form, rather
    than a dequantized copy, means the engine holds the same tensors as on a
    GPU, layerwise reload copies FP8 codes into the same storage, and nothing
    derived can go stale after a refit; the price is one dequantization per
    call.

    Activations stay in the input dtype (no FP8 activation quantization), as
    in vLLM's native CPU W8A16 kernel. A GPU W8A8 block kernel also rounds
    activations to FP8 per 128-wide group, so its outputs differ from this
    kernel's by that activation rounding.
    """

    # The base class's apply_weights would otherwise quantize activations to
    # FP8 before apply_block_scaled_mm; this kernel multiplies them as they are.
    apply_input_quant = False

    def __init__(self, config: FP8ScaledMMLinearLayerConfig) -> None:
        super().__init__(config)
        _logger.warning_once(
            "Using refit's reference FP8_BLOCK kernel (%s=%s; vLLM's CPU FP8 block kernels need AMX, which "
            "this CPU has: %s). It dequantizes the weight on every call, so it is correct but slow.",
            REFERENCE_KERNEL_ENV, os.environ.get(REFERENCE_KERNEL_ENV, "unset"), torch.cpu._is_amx_tile_supported(),
        )

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        """Any CPU: the kernel uses only dense torch ops, no AMX or other ISA extension."""
        if not vllm.platforms.current_platform.is_cpu():
            return False, "is refit's CPU reference kernel and runs only on the CPU platform"
        return True, None

    @classmethod
    def can_implement(cls, config: FP8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        """Refuse static activation scales, non-block weight scales and odd dtypes.

        A static activation scale would be silently ignored by a W8A16 kernel;
        per-tensor or per-channel weight scales (row or column -1) are not the
        block layout the dequantization expands.
        """
        ok, reason = super().can_implement(config)
        if not ok:
            return ok, reason
        block = config.weight_quant_key.scale.group_shape
        if block.row <= 0 or block.col <= 0:
            return False, f"needs 2-D weight blocks, got weight group shape {tuple(block)}"
        if config.weight_quant_key.dtype not in _FP8_DTYPES:
            return False, f"needs FP8 E4M3 weights, got {config.weight_quant_key.dtype}"
        if config.weight_quant_key.scale.dtype not in _SCALE_DTYPES:
            return False, f"needs float weight scales, got {config.weight_quant_key.scale.dtype}"
        if config.input_dtype not in _COMPUTE_DTYPES:
            return False, f"computes in the input dtype, so needs a float one, got {config.input_dtype}"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Keep vLLM's `[N, K]` layout; check the block scales once per (re)load.

        The base class only normalises FP8 flavours and pads on ROCm (no-ops
        here). Checking the scale grid at load time turns a mismatched
        checkpoint or reload into an error naming the layer, instead of a
        broadcasting error (or silently wrong edge blocks) at the first
        forward; checking its dtype refuses exponent-only (e8m0) scales, which
        a plain multiply would misread.
        """
        super().process_weights_after_loading(layer)
        params = self._get_layer_params(layer)
        weight, scale = params.weight, params.block_scale
        name = f"{getattr(layer, 'prefix', '') or type(layer).__name__}.{params.block_scale_attr}"
        bn, bk = self.weight_group_shape.row, self.weight_group_shape.col
        grid = (-(-weight.shape[0] // bn), -(-weight.shape[1] // bk))
        if scale.dtype not in _SCALE_DTYPES or tuple(scale.shape) != grid:
            raise InvalidTensorError(
                f"{name}: block scale {scale.dtype} {tuple(scale.shape)} does not fit weight "
                f"{tuple(weight.shape)} in {bn}x{bk} blocks; expected a float scale of shape {grid}"
            )

    def apply_block_scaled_mm(
        self, A: torch.Tensor, B: torch.Tensor, As: torch.Tensor, Bs: torch.Tensor
    ) -> torch.Tensor:
        """`A [M, K]` (input dtype) times the dequantized `B [N, K]`; `As` is unused.

        Dequantization multiplies in float32 (an FP8 code times a bf16 scale
        is exact there) and rounds once to the input dtype, so the weight
        seen by `F.linear` is the exact FP8_BLOCK value rounded once.
        """
        block = (self.weight_group_shape.row, self.weight_group_shape.col)
        return F.linear(A, dequantize_fp8_block(B, Bs, block, dtype=A.dtype))


def register() -> None:
    """Put `RefitCpuFp8BlockKernel` in vLLM's CPU FP8 block kernels: last, or first under `REFERENCE_KERNEL_ENV`.

    A no-op off the CPU platform; once registered, a call only places it again
    (vLLM may call general plugins more than once, and tests call this directly). Raises
    `EngineError` naming the expected vLLM version if the internals this
    relies on are missing: a silent no-op would resurface later as the
    "Failed to find a kernel" start-up error, with the cause hidden.
    """
    if not vllm.platforms.current_platform.is_cpu():
        return
    kernels = _cpu_fp8_block_kernels()
    if RefitCpuFp8BlockKernel in kernels:
        kernels.remove(RefitCpuFp8BlockKernel)
    if reference_kernels_first():
        kernels.insert(0, RefitCpuFp8BlockKernel)
    else:
        kernels.append(RefitCpuFp8BlockKernel)


def _cpu_fp8_block_kernels() -> list[type]:
    """vLLM's CPU FP8 block kernel list, after checking what the kernel relies on."""
    import vllm.model_executor.kernels.linear as linear_kernels

    table = getattr(linear_kernels, "_POSSIBLE_FP8_BLOCK_KERNELS", None)
    if not isinstance(table, dict) or not isinstance(table.get(PlatformEnum.CPU), list):
        raise _incompatible_vllm(
            "vllm.model_executor.kernels.linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU] "
            "is missing"
        )
    if "apply_input_quant" not in vars(Fp8BlockScaledMMLinearKernel):
        # Without it the base class would hand this kernel FP8 activations.
        raise _incompatible_vllm("Fp8BlockScaledMMLinearKernel.apply_input_quant is missing")
    if RefitCpuFp8BlockKernel.__abstractmethods__:
        missing = ", ".join(sorted(RefitCpuFp8BlockKernel.__abstractmethods__))
        raise _incompatible_vllm(
            f"Fp8BlockScaledMMLinearKernel requires {missing}, which RefitCpuFp8BlockKernel lacks"
        )
    return table[PlatformEnum.CPU]
