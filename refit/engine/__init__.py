"""refit's integration with vLLM engines, through vLLM's supported extension points.

- `config`: `EngineConfig`, how an engine starts (memory included); imports no vLLM.
- `lifecycle`: one replica's update state machine and serving gate; pure Python.
- `rollout_engine`: `RolloutEngine`, a running `vllm.LLM` refit updates in place.
- `async_engine`: `AsyncRolloutEngine`, the same for vLLM's `AsyncLLM` (continuous batching).
- `transfer_backend`: the "refit" backend of vLLM's weight-transfer API (worker side).
- `worker_extension`: worker methods reached by `collective_rpc` (provenance, KV stage, collective group).
- `cpu_kernel`: the FP8_BLOCK reference kernel for CPUs without AMX (a general plugin).
- `compat`: the vLLM release all of the above was written against.

Only `config` and `lifecycle` are imported here: the rest imports vLLM, which
trainer and driver processes may not have.
"""

from refit.engine.config import EngineConfig
from refit.engine.lifecycle import FinishedUpdate, Phase, ReplicaStatus, UpdateLifecycle

__all__ = ["EngineConfig", "FinishedUpdate", "Phase", "ReplicaStatus", "UpdateLifecycle"]
