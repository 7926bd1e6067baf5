"""The quantizer against compressed-tensors' own FP8_BLOCK functions, bit for bit.

Guards the failure class where a hand-written quantizer (fp32 reciprocal
multiply, verl/NeMo-RL style) differs from the checkpoint format in ~3% of
codes: any such drift shows up here as unequal bits.
"""

import pytest
import torch
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from compressed_tensors.quantization.utils.helpers import maybe_pad_tensor_for_block_quant

from refit.errors import InvalidTensorError
from refit.quantizer import _fused_cpu, dequantize_fp8_block, quantize_fp8_block
from refit.quantizer.fp8_block import _quantize_with_torch

ARGS = preset_name_to_scheme("FP8_BLOCK", ["Linear"]).weights


def compressed_tensors_fp8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: compressed-tensors' qparams and quantize on 128x128 blocks."""
    padded = maybe_pad_tensor_for_block_quant(weight, tuple(ARGS.block_structure))
    blocks = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128).transpose(1, 2)
    scale, zero_point = calculate_qparams(blocks.amin(dim=(2, 3)), blocks.amax(dim=(2, 3)), ARGS)
    return ct_quantize(weight, scale, zero_point, ARGS, dtype=torch.float8_e4m3fn), scale


def assert_bits_equal(ours, theirs):
    assert ours[0].dtype == torch.float8_e4m3fn
    assert ours[1].dtype == theirs[1].dtype
    assert ours[0].shape == theirs[0].shape and ours[1].shape == theirs[1].shape
    mismatched = (ours[0].view(torch.uint8) != theirs[0].view(torch.uint8)).sum().item()
    assert mismatched == 0, f"{mismatched} FP8 codes differ"
    assert torch.equal(ours[1].view(torch.uint8), theirs[1].view(torch.uint8)), "scales differ"


def make_weight(shape, dtype, magnitude, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * magnitude
    if shape[0] > 128 and shape[1] > 128:
        w[:128, 128:256] = 0.0  # an all-zero block: scale becomes the dtype's eps
    w[0, 0] = magnitude * 7  # an outlier that sets its block's amax
    return w.to(dtype)


SHAPES = [(256, 256), (300, 200), (129, 1000), (1, 5), (384, 130)]
# Tiny and huge magnitudes within each dtype's range: scales near the
# dtype's smallest normals and largest values, where rounding is fragile
# (bf16 at 1e-38: subnormal scales, whose reciprocal overflows, so the kernel divides).
DTYPE_MAGNITUDES = [
    (torch.bfloat16, m) for m in (0.02, 3.0, 1e-30, 1e30, 1e-38)
] + [(torch.float32, m) for m in (0.02, 3.0, 1e-30, 1e30)] + [(torch.float16, m) for m in (0.02, 3.0, 1e-3, 1e3)]


@pytest.mark.parametrize("dtype, magnitude", DTYPE_MAGNITUDES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bit_identical_to_compressed_tensors(dtype, shape, magnitude):
    w = make_weight(shape, dtype, magnitude)
    assert_bits_equal(quantize_fp8_block(w, name="w"), compressed_tensors_fp8_block(w))


def test_fused_cpu_kernel_is_used_for_bf16_and_matches_torch_path():
    w = make_weight((515, 770), torch.bfloat16, 0.05, seed=3)
    assert _fused_cpu.handles(w), "no C compiler? the fast path must be active in tests"
    assert_bits_equal(_fused_cpu.quantize(w, (128, 128)), _quantize_with_torch(w, (128, 128)))


def test_every_bf16_value_is_coded_like_compressed_tensors():
    # All 65k bf16 bit patterns that are finite, spread over blocks with
    # different amax values, exercise every rounding path of the kernel.
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    w = every[torch.isfinite(every)].reshape(-1)[: 510 * 128].reshape(510, 128)
    assert_bits_equal(quantize_fp8_block(w), compressed_tensors_fp8_block(w))


def test_the_kernels_product_by_a_reciprocal_scale_codes_every_value_as_the_division_does():
    """The kernel multiplies by each block's reciprocal scale where torch divides by the scale; checked for every
    (scale, value) pair a block can hold, in C (a second): no code differs."""
    assert _fused_cpu.handles(torch.zeros(1, dtype=torch.bfloat16)), "no C compiler? the fast path must be active in tests"
    assert _fused_cpu.reciprocal_mismatches() == 0


def test_kernel_fp8_conversion_equals_torch_for_every_bf16_value():
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = every[torch.isfinite(every)]
    expected = (finite + 0.0).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    got = _fused_cpu.bf16_to_fp8_codes(finite)
    assert torch.equal(got, expected), f"{int((got != expected).sum())} codes differ"


def test_non_contiguous_input():
    w = make_weight((256, 384), torch.bfloat16, 0.1).t()
    assert_bits_equal(quantize_fp8_block(w), compressed_tensors_fp8_block(w.contiguous()))


def test_dequantize_round_trip_error_is_bounded():
    w = make_weight((256, 256), torch.bfloat16, 0.02)
    q, s = quantize_fp8_block(w)
    back = dequantize_fp8_block(q, s).float()
    # e4m3 has 3 mantissa bits: relative error per element <= 2^-4, plus bf16 rounding.
    assert ((back - w.float()).abs() <= w.float().abs() * 0.0625 + 1e-6 + s.float().max() * 2**-9).all()


@pytest.mark.parametrize(
    "value, message", [(float("nan"), "NaN or Inf"), (float("inf"), "NaN or Inf"), (float("-inf"), "NaN or Inf")]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_non_finite_weights_are_refused_with_the_tensor_name(value, message, dtype):
    w = torch.zeros(300, 300, dtype=dtype)
    w[200, 150] = value
    with pytest.raises(InvalidTensorError, match=r"layers\.3\.mlp\.down_proj\.weight: block \(1, 1\).*" + message):
        quantize_fp8_block(w, name="model.layers.3.mlp.down_proj.weight")


@pytest.mark.parametrize(
    "tensor, message",
    [
        (torch.zeros(128), "2-D"),
        (torch.zeros(2, 128, 128), "2-D"),
        (torch.zeros(128, 128, dtype=torch.int32), "dtype torch.int32"),
        (torch.zeros(128, 128, dtype=torch.float8_e4m3fn), "dtype torch.float8_e4m3fn"),
        (torch.zeros(128, 128, dtype=torch.float64), "dtype torch.float64"),
    ],
)
def test_bad_input_is_refused_with_the_tensor_name(tensor, message):
    with pytest.raises(InvalidTensorError, match=r"^model\.norm\.weight: .*" + message.replace(".", r"\.")):
        quantize_fp8_block(tensor, name="model.norm.weight")


def test_bad_block_structure_is_refused():
    with pytest.raises(InvalidTensorError, match="block structure"):
        quantize_fp8_block(torch.zeros(128, 128), (0, 128), name="w")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_is_finite_finds_one_bad_value_anywhere(dtype):
    from refit.quantizer.fp8_block import is_finite

    w = torch.randn(1000, 77).to(dtype)
    assert is_finite(w)
    for bad in (float("nan"), float("inf"), float("-inf")):
        v = w.clone()
        v[999, 76] = bad
        assert not is_finite(v)
        assert not is_finite(v.t())  # non-contiguous: the torch path
    assert is_finite(torch.arange(5))


@pytest.fixture
def unbuilt_kernel(monkeypatch):
    """`_fused_cpu`'s library forgotten, so the next call builds or loads it again; forgotten again afterwards, so
    later tests load the one their own environment gives."""
    _fused_cpu._library.cache_clear()
    yield monkeypatch
    _fused_cpu._library.cache_clear()


@pytest.mark.parametrize("environment", ["home-is-a-file", "stale-cc-path"])
def test_a_kernel_that_cannot_be_built_or_loaded_falls_back_to_the_torch_path(environment, unbuilt_kernel, tmp_path):
    """Regression: an OSError while building or loading the kernel (its cache directory not creatable, a compiler
    that is not there) escaped from every quantize_fp8_block and is_finite call instead of using torch ops."""
    if environment == "home-is-a-file":
        (tmp_path / "home").write_text("")
        unbuilt_kernel.setenv("HOME", str(tmp_path / "home"))
        unbuilt_kernel.delenv("XDG_CACHE_HOME", raising=False)
    else:
        unbuilt_kernel.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        unbuilt_kernel.setenv("CC", str(tmp_path / "no-such-cc"))
    from refit.quantizer.fp8_block import is_finite

    w = make_weight((300, 200), torch.bfloat16, 0.05)
    assert_bits_equal(quantize_fp8_block(w, name="w"), _quantize_with_torch(w, (128, 128)))
    assert is_finite(w) and not _fused_cpu.handles(w)


def test_a_cc_with_arguments_builds_the_kernel_under_home_when_xdg_cache_home_is_empty(unbuilt_kernel, tmp_path):
    """Regression: CC="ccache gcc" was run as one file name, and an empty XDG_CACHE_HOME put the kernel cache in
    the working directory; both mean what they mean to make and the XDG spec."""
    unbuilt_kernel.setenv("HOME", str(tmp_path / "home"))
    unbuilt_kernel.setenv("XDG_CACHE_HOME", "")
    unbuilt_kernel.setenv("CC", "gcc -w")
    unbuilt_kernel.chdir(tmp_path)
    w = make_weight((300, 200), torch.bfloat16, 0.05)
    assert _fused_cpu.handles(w)
    assert list((tmp_path / "home" / ".cache" / "refit" / "kernels").glob("*.so")) and not (tmp_path / "refit").exists()
