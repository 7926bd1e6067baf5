"""refit's integration with vLLM engines, through vLLM's supported extension points.

- `rollout_engine`: `RolloutEngine`, a running `vllm.LLM` refit updates in place.
- `transfer_engine`: the "refit" backend of vLLM's weight-transfer API (worker side).
- `worker_extension`: worker methods reached by `collective_rpc` (provenance, KV stage).
- `cpu_kernel`: the FP8_BLOCK reference kernel for CPUs without AMX (a general plugin).
- `compat`: the vLLM release all of the above was written against.
"""

from refit.engine.compat import EXPECTED_VLLM_VERSION
from refit.engine.cpu_kernel import RefitCpuFp8BlockKernel
from refit.engine.rollout_engine import EngineConfig, EngineDescription, Generation, RolloutEngine

__all__ = [
    "EXPECTED_VLLM_VERSION",
    "EngineConfig",
    "EngineDescription",
    "Generation",
    "RefitCpuFp8BlockKernel",
    "RolloutEngine",
]
