"""Smoke test: a real vLLM engine serves the llmcompressor FP8_BLOCK fixture on this CPU.

It pins the start-up failure this project first hit: without AMX, vLLM finds
no FP8 block kernel ("Failed to find a kernel that can implement the ScaledMM
linear layer") unless refit's plugin is installed and loaded through its
`vllm.general_plugins` entry point; this test never calls `register()`.
The FP8 KV cache exercises the CPU attention path that refuses non-positive
KV scales. Engine start-up costs 3-8 s here (plus ~10 s to import vLLM), so
one engine serves every check in this module.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.distributed import cleanup_dist_env_and_memory

from fixtures import NEW_TOKENS, PROMPT_LEN, accuracy, make_prompts, model_dir
from refit.engine.cpu_kernel import RefitCpuFp8BlockKernel

pytestmark = pytest.mark.engine  # starts or imports vLLM

N_PROMPTS = 32


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    """One in-process engine (no engine-core subprocess), shut down after the module."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        engine = LLM(
            model=str(model_dir(tied=True, variant="fp8_block")),
            skip_tokenizer_init=True,
            enforce_eager=True,
            max_model_len=128,
            kv_cache_dtype="fp8_e4m3",
            dtype="bfloat16",
        )
        try:
            yield engine
        finally:
            engine.llm_engine.engine_core.shutdown()
            del engine
            cleanup_dist_env_and_memory()


def test_fp8_block_linears_run_on_a_kernel_this_cpu_has(llm: LLM) -> None:
    kernels = llm.apply_model(
        lambda model: {
            type(module.scheme.fp8_linear).__name__
            for module in model.modules()
            if hasattr(getattr(module, "scheme", None), "fp8_linear")
        }
    )
    assert kernels[0], "no FP8 linear in the engine: is the fixture really FP8_BLOCK?"
    if not torch.cpu._is_amx_tile_supported():
        assert kernels[0] == {RefitCpuFp8BlockKernel.__name__}


def test_greedy_generation_solves_the_counting_task(llm: LLM) -> None:
    prompts = make_prompts(N_PROMPTS, PROMPT_LEN, seed=1234)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    outputs = [list(r.outputs[0].token_ids) for r in results]
    assert all(len(out) == NEW_TOKENS for out in outputs)
    assert accuracy(prompts, outputs) >= 0.9
