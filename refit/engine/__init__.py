"""refit's integration with vLLM engines.

So far: the CPU FP8_BLOCK reference kernel that vLLM loads as a plugin.
"""

from refit.engine.cpu_kernel import EXPECTED_VLLM_VERSION, RefitCpuFp8BlockKernel, register

__all__ = ["EXPECTED_VLLM_VERSION", "RefitCpuFp8BlockKernel", "register"]
