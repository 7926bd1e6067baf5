"""FP8_BLOCK weight quantization, bit-identical to compressed-tensors.

The format vLLM loads for an FP8_BLOCK compressed-tensors checkpoint is
`weight` (float8_e4m3fn, `[out, in]`) plus `weight_scale` (the weight's own
dtype, `[ceil(out/bh), ceil(in/bw)]`). The math, which must be copied exactly
or ~3% of FP8 codes differ (an fp32 reciprocal-multiply variant, as verl and NeMo-RL use, was measured against it), is compressed-tensors':

1. per block (zero-padded at the edges): `scale = amax(|w|) / 448`, computed
   in the weight's dtype, an exact-zero scale replaced by that dtype's eps;
2. `q = clamp(w / scale + 0, -448, 448).to(float8_e4m3fn)`, the division in
   the weight's dtype, so a bf16 quotient is rounded to bf16 before it is
   rounded to FP8. The `+ 0` is compressed-tensors adding its zero point:
   it turns -0.0 into +0.0, so a -0 weight is coded 0x00, not 0x80.

Two implementations share that contract. `_quantize_with_torch` is the
plain tensor-op version (any device, any float dtype). The CPU bf16 path,
the one every refit on a CPU trainer takes, goes through a fused kernel
(`_fused_cpu`) that reads each block once from memory instead of once per
torch op.
"""

from __future__ import annotations

import torch

from refit.errors import InvalidTensorError

__all__ = [
    "FP8_E4M3_MAX",
    "SUPPORTED_DTYPES",
    "loadable_form",
    "loadable_layout",
    "dequantize_fp8_block",
    "is_finite",
    "first_invalid_scale_value",
    "non_finite",
    "is_valid_scale",
    "quantize_fp8_block",
]

FP8_E4M3_MAX = 448.0
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_fp8_block(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128), *, name: str = "<unnamed>",
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to FP8_BLOCK; returns `(weight_fp8, weight_scale)`.

    Runs on the tensor's own device. Raises `InvalidTensorError`, naming
    `name`, for a tensor that is not 2-D, not bf16/fp16/fp32, or holds NaN or
    Inf; nothing is returned for such a tensor, so nothing half-made can be
    sent on. `out`: `(weight_fp8, weight_scale)` tensors of the shapes and
    dtypes `loadable_layout` gives, written in place (a bucket's buffer).
    """
    _check_quantizable(weight, block, name)
    from refit.quantizer import _fused_cpu

    if _fused_cpu.handles(weight) and (out is None or out[0].device.type == "cpu"):
        q, scale = _fused_cpu.quantize(weight, block, out)
    else:
        q, scale = _quantize_with_torch(weight, block)
        if out is not None:
            q, scale = out[0].copy_(q), out[1].copy_(scale)
    if not bool(torch.isfinite(scale).all()):
        # amax is NaN/Inf exactly when the block holds NaN/Inf: checking the
        # few scales costs nothing, a separate pass over the weight would not.
        rows, cols = torch.nonzero(~torch.isfinite(scale))[0].tolist()
        raise InvalidTensorError(
            f"{name}: block ({rows}, {cols}) of {tuple(weight.shape)} holds NaN or Inf; "
            "refusing to quantize it. Check the trainer step that produced this weight."
        )
    return q, scale


def scale_name(name: str) -> str:
    """The checkpoint name of FP8_BLOCK weight `name`'s block scale (`x.weight` -> `x.weight_scale`)."""
    return name + "_scale"


def loadable_form(
    name: str, weight: torch.Tensor, block: tuple[int, int] | None
) -> list[tuple[str, torch.Tensor]]:
    """The tensors standing for `name` in the format vLLM's loaders take: itself, or FP8 `name` plus `name_scale`."""
    if block is None:
        return [(name, weight)]
    q, scale = quantize_fp8_block(weight, block, name=name)
    return [(name, q), (scale_name(name), scale)]


def loadable_layout(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, block: tuple[int, int] | None
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """`(name, dtype, shape)` of what `loadable_form` makes of such a weight, known before it is made."""
    if block is None:
        return [(name, dtype, tuple(shape))]
    (rows, cols), (bh, bw) = shape, block
    return [(name, torch.float8_e4m3fn, (rows, cols)), (scale_name(name), dtype, (-(-rows // bh), -(-cols // bw)))]


def is_valid_scale(scale: torch.Tensor) -> bool:
    """True if every value of a scale (a weight's block scales, an attention scale) is finite and positive: a zero,
    negative or NaN scale would turn every value it multiplies to garbage, silently."""
    return bool(_valid_scale_values(scale.float()).all())


def first_invalid_scale_value(scale: torch.Tensor) -> float:
    """The first value of a scale that `is_valid_scale` refuses (for an error that shows it)."""
    values = scale.detach().float().reshape(-1)
    return float(values[~_valid_scale_values(values)][0])


def _valid_scale_values(values: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(values) & (values > 0)


def is_finite(tensor: torch.Tensor) -> bool:
    """True if a tensor holds no NaN or Inf (non-float tensors always do)."""
    if not tensor.is_floating_point():
        return True
    from refit.quantizer import _fused_cpu

    fast = _fused_cpu.all_finite(tensor)
    return fast if fast is not None else not bool(non_finite(tensor).any())


def non_finite(tensor: torch.Tensor) -> torch.Tensor:
    """Where a floating-point tensor holds NaN or Inf."""
    if tensor.dtype == torch.float8_e4m3fn:
        # torch has no isfinite for it (a trainer's FP8 tensor sent as it is failed naming none); NaN is its only
        # non-finite value, coded S.1111.111.
        return (tensor.view(torch.uint8) & 0x7F) == 0x7F
    return ~torch.isfinite(tensor)


def dequantize_fp8_block(
    weight_fp8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Expand FP8_BLOCK codes `[..., rows, cols]` back to `dtype` (the reference the kernels are tested with).

    Leading dimensions (MoE experts) are independent weights with their own scale grids.
    """
    rows, cols = weight_fp8.shape[-2:]
    expanded = scale.to(torch.float32).repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    return (weight_fp8.to(torch.float32) * expanded[..., :rows, :cols]).to(dtype)


def _check_quantizable(weight: torch.Tensor, block: tuple[int, int], name: str) -> None:
    if not isinstance(weight, torch.Tensor):
        raise InvalidTensorError(f"{name}: expected a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise InvalidTensorError(
            f"{name}: FP8_BLOCK quantizes 2-D [out, in] weights, got shape {tuple(weight.shape)}; "
            "if this tensor should pass through unquantized, add its module to the config's `ignore`."
        )
    if weight.dtype not in SUPPORTED_DTYPES:
        raise InvalidTensorError(
            f"{name}: dtype {weight.dtype} cannot be quantized; expected one of "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        )
    if len(block) != 2 or min(block) <= 0:
        raise InvalidTensorError(f"{name}: block structure {block!r} must be two positive ints")


def _quantize_with_torch(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' arithmetic, op for op, as a handful of torch ops."""
    rows, cols = weight.shape
    bh, bw = block
    nbr, nbc = -(-rows // bh), -(-cols // bw)
    padded = torch.nn.functional.pad(weight, (0, nbc * bw - cols, 0, nbr * bh - rows))
    blocks = padded.reshape(nbr, bh, nbc, bw).transpose(1, 2)
    scale = blocks.abs().amax(dim=(2, 3)) / FP8_E4M3_MAX
    scale = torch.where(scale == 0, torch.finfo(weight.dtype).eps, scale)
    scaled = (blocks / scale[:, :, None, None] + 0.0).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = scaled.to(torch.float8_e4m3fn).transpose(1, 2).reshape(nbr * bh, nbc * bw)
    return q[:rows, :cols].contiguous(), scale
