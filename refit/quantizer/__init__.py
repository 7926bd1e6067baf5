"""FP8_BLOCK quantization of trainer weights, bit-identical to compressed-tensors.

- `fp8_block`: the math on one tensor (`quantize_fp8_block`).
- `scheme`: which tensors are quantized, read from the rollout's config.
- `model_quantizer`: per parameter name, quantize or pass through, as the rollout expects.
"""

from refit.quantizer.fp8_block import FP8_E4M3_MAX, dequantize_fp8_block, quantize_fp8_block
from refit.quantizer.model_quantizer import Fp8BlockQuantizer
from refit.quantizer.scheme import Fp8BlockScheme

__all__ = ["FP8_E4M3_MAX", "Fp8BlockQuantizer", "Fp8BlockScheme", "dequantize_fp8_block", "quantize_fp8_block"]
