"""refit's integration with vLLM engines, through vLLM's supported extension points.

- `config`: `EngineConfig`, how an engine starts (memory included); imports no vLLM.
- `lifecycle`: one replica's update state machine and serving gate; pure Python.
- `replica`: `ReplicaCore`, the one implementation of a replica's side of a sync, written against an
  `EngineAdapter` (call the workers, generate, hold/pause/resume/release requests), and
  `ReplicaMethods`, the mixin that hands a user's actor's replica methods to it.
- `facts`: `EngineFacts`, what a replica knows of its engine (model, workers, KV-cache dtype).
- `llm`: starting a `vllm.LLM`, and its adapter (`llm_replica(llm)`: a user's engine as a replica).
- `async_llm`: the same for vLLM's `AsyncLLM` (continuous batching), with `AsyncReplica` and
  `AsyncReplicaMethods` for async actors.
- `server`: a running `vllm serve` server as a replica (`ServerAdapter`: HTTP for control, a collective
  group for the bytes), and the options `refit serve` adds.
- `worker_rpc`: the RPC contract with the workers, both ends (`WorkerCalls`, `RefitWorkerExtension`).
- `transfer_backend`: the "refit" backend of vLLM's weight-transfer API (worker side).
- `layerwise`: vLLM's layerwise reload of one model, with tied aliases and a drafter's shared modules kept out.
- `readback`: the engine's FP8 weight scales read back against what the sync sent.
- `cpu_kernel`, `cpu_moe`: FP8_BLOCK reference linear kernel and MoE backend for CPUs without AMX (general plugins).
- `cpu_kv_cache`: a reference FP8 KV-cache attention for x86 CPUs without AVX-512 (a general plugin).
- `cpu_amx`: asks Linux for AMX in every engine process, which vLLM's AMX attention needs (a general plugin).
- `compat`: the vLLM release all of the above was written against.
- `vllm_logs`: the vLLM warnings every healthy start and sync logs, kept from the driver; imports no vLLM.

Only `config` and `lifecycle` are imported here: the rest imports vLLM, which
trainer and driver processes may not have.
"""

from refit.engine.config import EngineConfig
from refit.engine.lifecycle import FinishedUpdate, Phase, ReplicaStatus, UpdateLifecycle

__all__ = ["EngineConfig", "FinishedUpdate", "Phase", "ReplicaStatus", "UpdateLifecycle"]
