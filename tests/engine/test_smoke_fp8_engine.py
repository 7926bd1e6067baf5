"""Smoke test: a real vLLM engine serves the llmcompressor FP8_BLOCK fixture on this CPU.

It pins the start-up failure this project first hit: without AMX, vLLM finds
no FP8 block kernel ("Failed to find a kernel that can implement the ScaledMM
linear layer") unless refit's plugin is installed and loaded through its
`vllm.general_plugins` entry point; this test never calls `register()`.
The FP8 KV cache exercises the CPU attention path that refuses non-positive
KV scales. Engine start-up costs 3-8 s here (plus ~10 s to import vLLM), so
one engine serves every check in this module; it starts the way refit starts
every rollout (`start_llm`, so `skip_tokenizer_init=True`), and what vLLM
logs meanwhile is kept for the start-up log check.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.distributed import cleanup_dist_env_and_memory

from fixtures import NEW_TOKENS, PROMPT_LEN, accuracy, make_prompts, model_dir
from refit import EngineConfig
from refit.engine.config import REFERENCE_KERNEL_ENV
from refit.engine.cpu_kernel import RefitCpuFp8BlockKernel
from refit.engine.llm import start_llm
from tests.support.scripts import run_python

pytestmark = pytest.mark.engine  # starts or imports vLLM

N_PROMPTS = 32


@pytest.fixture(scope="module")
def started() -> Iterator[tuple[LLM, list[str]]]:
    """One in-process engine (no engine-core subprocess), shut down after the module, and vLLM's log of its start.

    The log is every line (tracebacks included) of each record a vLLM logger
    hands to its handlers: a handler of our own would not do, since vLLM
    re-applies its logging config while the engine starts, which replaces
    the handlers of every `vllm` logger.
    """
    lines: list[str] = []
    formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")
    call_handlers = logging.Logger.callHandlers

    def recording(logger: logging.Logger, record: logging.LogRecord) -> None:
        if record.name.split(".")[0] == "vllm":
            lines.extend(formatter.format(record).splitlines())
        call_handlers(logger, record)

    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # start_llm drops it; EngineConfig sizes the cache (1 GiB)
        with pytest.MonkeyPatch.context() as logs:
            logs.setattr(logging.Logger, "callHandlers", recording)
            llm = start_llm(EngineConfig(model=str(model_dir(tied=True, variant="fp8_block")), max_model_len=128,
                                         kv_cache_dtype="fp8_e4m3"))
        try:
            yield llm, lines
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            cleanup_dist_env_and_memory()


@pytest.fixture
def llm(started: tuple[LLM, list[str]]) -> LLM:
    return started[0]


def test_engine_start_logs_no_chat_template_warmup_traceback(started: tuple[LLM, list[str]]) -> None:
    """vLLM's chat-template warmup cannot run without a tokenizer; its failure is not the user's (the issue)."""
    _, start_log = started
    assert start_log, "no vLLM log line captured while the engine started: the capture is broken"
    assert not [line for line in start_log if "Chat template warmup failed" in line or "Traceback" in line], start_log


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


# A fresh engine in a process of its own, with what a user's environment has: no REFIT_CPU_REFERENCE_KERNEL.
USERS_ENGINE = f"""
import json, os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import SamplingParams
from fixtures import NEW_TOKENS, PROMPT_LEN, accuracy, make_prompts, model_dir
from refit import EngineConfig
from refit.engine.llm import start_llm
llm = start_llm(EngineConfig(model=str(model_dir(tied=True, variant="fp8_block")), max_model_len=128,
                             kv_cache_dtype="fp8_e4m3", kv_cache_bytes=64 << 20))
greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
prompts = make_prompts({N_PROMPTS}, PROMPT_LEN, seed=1234)
llm.generate([{{"prompt_token_ids": prompts[0][:3]}}], greedy, use_tqdm=False)  # first, a batch of three tokens
results = llm.generate([{{"prompt_token_ids": p}} for p in prompts], greedy, use_tqdm=False)
print(json.dumps(accuracy(prompts, [list(r.outputs[0].token_ids) for r in results])))
"""


def test_an_engine_on_vllms_own_cpu_kernels_serves_from_its_first_request() -> None:
    """What a user's engine runs (the suite's reference kernels not put first): on a CPU with AMX, vLLM's own FP8
    kernels and its AMX attention, whose first call killed the process (SIGILL) until refit asked Linux for AMX
    (refit/engine/cpu_amx.py), unless a batch large enough for oneDNN to run (and ask) came first; elsewhere the
    same engine on refit's reference kernels."""
    out = run_python(["-c", USERS_ENGINE], timeout=900, without=(REFERENCE_KERNEL_ENV,))
    assert json.loads(out.strip().splitlines()[-1]) >= 0.9, out
