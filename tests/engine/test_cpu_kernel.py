"""RefitCpuFp8BlockKernel: selection, registration, and its numbers.

The layers under test are real vLLM `ReplicatedLinear`s with the
compressed-tensors FP8_BLOCK config llmcompressor writes, loaded through their
own weight loaders and `process_weights_after_loading`, so the tests see the
layout vLLM really holds at apply time.

Tolerance, established here rather than guessed:
- Against a dense `F.linear` on the weight dequantized explicitly, block by
  block, in the same precision (FP8 code times float32 scale in float32, one
  rounding to bf16): bitwise. Each weight element is one IEEE multiply and one
  round-to-nearest-even in both, so the two bf16 weights are identical, and
  the same `F.linear` on identical inputs is deterministic on the CPU.
- Against exact (float64) math: the kernel rounds each weight to bf16 (unit
  roundoff u = 2^-8), accumulates in float32 (at most K * 2^-24 relative to
  sum |x||w|) and rounds the output to bf16 (u). So
  |y - y_exact| <= (2u + K * 2^-24) * sum_k |x_k| |w_k| (to first order).
  A bf16-accumulating matmul or a wrongly scaled block breaks that bound.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points

import pytest
import torch
import torch.nn.functional as F
import vllm.model_executor.kernels.linear as linear_kernels
import vllm.platforms
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import (
    cleanup_dist_env_and_memory,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    GroupShape,
    QuantKey,
    create_fp8_quant_key,
    kFp8StaticChannelSym,
    kFp8StaticTensorSym,
)
from vllm.platforms import PlatformEnum
from vllm.platforms.interface import UnspecifiedPlatform
from vllm.utils.torch_utils import set_default_torch_dtype

from fixtures import tiny_qwen3_config
from refit.engine.compat import EXPECTED_VLLM_VERSION
from refit.engine.cpu_kernel import REFERENCE_KERNEL_ENV, RefitCpuFp8BlockKernel, register
from refit.errors import EngineError, InvalidTensorError

pytestmark = pytest.mark.engine  # starts or imports vLLM

BLOCK = 128
MakeLayer = Callable[..., ReplicatedLinear]


@pytest.fixture(scope="module")
def make_layer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MakeLayer]:
    """Build FP8_BLOCK `ReplicatedLinear(in=K, out=N)` layers as vLLM's model loader does.

    vLLM's layer constructors read the current vLLM config (for the model
    dtype) and the tensor-parallel group, so a world of one is set up here,
    like vLLM's own `dist_init` test fixture, and torn down afterwards.
    """
    model = tmp_path_factory.mktemp("config")
    tiny_qwen3_config(tied=True).save_pretrained(model)
    quant = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme("FP8_BLOCK", ["Linear"])},
        format="float-quantized",
        quantization_status="compressed",
        ignore=["lm_head"],
    )
    quant_config = CompressedTensorsConfig.from_config(quant.model_dump())
    register()
    vllm_config = VllmConfig(model_config=ModelConfig(model=str(model), dtype="bfloat16"))
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{model / 'dist_init'}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)

        def build(n: int, k: int, *, native_allowed: bool = False) -> ReplicatedLinear:
            # The reference kernel's own tests build it wherever they run: on a CPU with AMX vLLM's native
            # kernels would win the selection (test_selected_for_cpu_fp8_block_linear checks that they do).
            kernels = linear_kernels._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
            listed = list(kernels)
            if not native_allowed:
                kernels[:] = [RefitCpuFp8BlockKernel]
            try:
                with set_default_torch_dtype(torch.bfloat16):
                    return ReplicatedLinear(
                        k, n, bias=False, quant_config=quant_config, prefix="test.proj", disable_tp=True
                    )
            finally:
                kernels[:] = listed

        try:
            yield build
        finally:
            cleanup_dist_env_and_memory()


def _random_fp8_block(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes `[n, k]` and distinct per-block float32 scales, as llmcompressor saves them.

    Scales are bf16 values (llmcompressor stores them in the weight's dtype)
    and differ per block, so a block mapped to the wrong scale shows.
    """
    gen = torch.Generator().manual_seed(seed)
    codes = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = (-(-n // BLOCK), -(-k // BLOCK))
    scale = ((torch.rand(grid, generator=gen) + 0.5) * 2**-6).to(torch.bfloat16).float()
    return codes, scale


def _loaded_layer(
    make_layer: MakeLayer, codes: torch.Tensor, scale: torch.Tensor
) -> ReplicatedLinear:
    layer = make_layer(*codes.shape)
    layer.weight.weight_loader(layer.weight, codes)
    layer.weight_scale.weight_loader(layer.weight_scale, scale)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _dequantize_block_by_block(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Independent of the kernel's expansion: one slice per block, edges by slicing."""
    out = torch.empty(codes.shape, dtype=dtype)
    rows, cols = scale.shape
    for i, j in itertools.product(range(rows), range(cols)):
        block = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
        out[block] = (codes[block].to(dtype=scale.dtype) * scale[i, j]).to(dtype)
    return out


SHAPES = [(256, 384), (200, 300), (129, 130), (64, 96)]
"""(N, K): multiples of 128, partial edge blocks, one-element edges, a single partial block."""


def test_selected_for_cpu_fp8_block_linear(make_layer: MakeLayer, monkeypatch: pytest.MonkeyPatch) -> None:
    """On this machine vLLM picks the reference kernel only where its AMX kernels cannot run, unless the
    environment asks for it first (as this suite's does: tests/conftest.py)."""
    monkeypatch.delenv(REFERENCE_KERNEL_ENV, raising=False)
    register()
    try:
        chosen = type(make_layer(256, 384, native_allowed=True).scheme.fp8_linear)
        if torch.cpu._is_amx_tile_supported():
            assert chosen is not RefitCpuFp8BlockKernel, "a native AMX kernel should win where it runs"
        else:
            assert chosen is RefitCpuFp8BlockKernel
        monkeypatch.setenv(REFERENCE_KERNEL_ENV, "1")
        register()
        assert type(make_layer(256, 384, native_allowed=True).scheme.fp8_linear) is RefitCpuFp8BlockKernel
    finally:
        monkeypatch.undo()
        register()


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_keeps_checkpoint_layout_after_loading(make_layer: MakeLayer, n: int, k: int) -> None:
    """At apply time the kernel reads the checkpoint's form: FP8 `[N, K]`, fp32 scale grid."""
    codes, scale = _random_fp8_block(n, k, seed=n * k)
    layer = _loaded_layer(make_layer, codes, scale)
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.weight.view(torch.uint8), codes.view(torch.uint8))
    assert layer.weight_scale.dtype == torch.float32
    assert torch.equal(layer.weight_scale, scale)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_equals_dense_linear_on_dequantized_weight(make_layer: MakeLayer, n: int, k: int) -> None:
    codes, scale = _random_fp8_block(n, k, seed=n + k)
    layer = _loaded_layer(make_layer, codes, scale)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)

    out, _ = layer(x)

    expected = F.linear(x, _dequantize_block_by_block(codes, scale, torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_error_against_exact_math_is_bf16_rounding_only(
    make_layer: MakeLayer, n: int, k: int
) -> None:
    codes, scale = _random_fp8_block(n, k, seed=2 * n + k)
    layer = _loaded_layer(make_layer, codes, scale)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)

    out, _ = layer(x)

    exact_w = _dequantize_block_by_block(codes, scale.double(), torch.float64)
    exact = x.double() @ exact_w.T
    bound = (2 * 2**-8 + k * 2**-24) * (x.double().abs() @ exact_w.abs().T)
    excess = (out.double() - exact).abs() - bound
    assert excess.max() <= 0, f"error exceeds the bf16 bound by {excess.max():.3g}"


@pytest.mark.parametrize(
    "bad_scale",
    [torch.ones(1, 3), torch.ones(2, 3).to(torch.float8_e8m0fnu)],
    ids=["grid-too-small", "e8m0-exponent-only"],
)
def test_rejects_block_scales_it_would_misapply(
    make_layer: MakeLayer, bad_scale: torch.Tensor
) -> None:
    """A (200, 300) weight needs a float (2, 3) scale grid; anything else fails at load."""
    layer = make_layer(200, 300)
    layer.weight_scale.data = bad_scale
    expected = r"test\.proj\.weight_scale: .*expected a float scale of shape \(2, 3\)"
    with pytest.raises(InvalidTensorError, match=expected):
        layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize(
    ("weight_key", "activation_key", "reason"),
    [
        (
            create_fp8_quant_key(static=True, group_shape=GroupShape(BLOCK, BLOCK)),
            kFp8StaticTensorSym,
            "dynamic",
        ),
        (
            kFp8StaticChannelSym,
            create_fp8_quant_key(static=False, group_shape=GroupShape(1, BLOCK)),
            "2-D weight blocks",
        ),
    ],
    ids=["static-activation-scale", "per-channel-weight-scale"],
)
def test_refuses_what_it_cannot_compute(
    weight_key: QuantKey, activation_key: QuantKey, reason: str
) -> None:
    config = linear_kernels.FP8ScaledMMLinearLayerConfig(
        weight_quant_key=weight_key,
        activation_quant_key=activation_key,
        weight_shape=(256, 256),
        input_dtype=torch.bfloat16,
        out_dtype=torch.bfloat16,
    )
    ok, why = RefitCpuFp8BlockKernel.can_implement(config)
    assert not ok
    assert reason in why


def test_vllm_finds_register_through_its_plugin_entry_point() -> None:
    """vLLM runs `vllm.general_plugins` in every process it starts: how engines get the kernel."""
    plugins = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert plugins["refit_cpu_fp8_block_kernel"].load() is register


def test_register_places_it_once_last_or_first_as_the_environment_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    table = linear_kernels._POSSIBLE_FP8_BLOCK_KERNELS
    native = [k for k in table[PlatformEnum.CPU] if k is not RefitCpuFp8BlockKernel]
    try:
        monkeypatch.delenv(REFERENCE_KERNEL_ENV, raising=False)
        register()
        register()
        assert table[PlatformEnum.CPU] == [*native, RefitCpuFp8BlockKernel]

        monkeypatch.setenv(REFERENCE_KERNEL_ENV, "1")
        register()
        register()
        assert table[PlatformEnum.CPU] == [RefitCpuFp8BlockKernel, *native]
        others = [k for platform, ks in table.items() if platform != PlatformEnum.CPU for k in ks]
        assert RefitCpuFp8BlockKernel not in others
    finally:
        monkeypatch.undo()
        register()


def test_register_is_a_no_op_off_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """No other platform can run here, so one is substituted for vLLM's detected CPU."""
    table = linear_kernels._POSSIBLE_FP8_BLOCK_KERNELS
    native = [k for k in table[PlatformEnum.CPU] if k is not RefitCpuFp8BlockKernel]
    monkeypatch.setitem(table, PlatformEnum.CPU, native)
    monkeypatch.setattr(vllm.platforms, "_current_platform", UnspecifiedPlatform())

    register()

    assert table[PlatformEnum.CPU] == native
    assert RefitCpuFp8BlockKernel.is_supported() == (
        False,
        "is refit's CPU reference kernel and runs only on the CPU platform",
    )


def test_register_names_the_expected_vllm_when_internals_are_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Simulates a vLLM upgrade that moved the kernel table: fail loudly, naming versions."""
    monkeypatch.delattr(linear_kernels, "_POSSIBLE_FP8_BLOCK_KERNELS")
    expected = rf"vLLM {EXPECTED_VLLM_VERSION}.*_POSSIBLE_FP8_BLOCK_KERNELS"
    with pytest.raises(EngineError, match=expected):
        register()
