"""refit: weight sync for RL on LLMs.

Streams a trainer's weights, FP8_BLOCK-quantized, into running vLLM engines
over Ray, records where every scale came from, and repairs placeholder
KV-cache scales after each refit.

    report = refit.sync(trainer, rollouts)            # one-off
    syncer = refit.Syncer(trainer, rollouts, config)  # plans once, reuse per step

Public names load on first use, and none of them imports vLLM except the
engine side (`refit.engine.rollout_engine` and below), so trainer and driver
processes need only torch and Ray.

Words used throughout:
- *trainer*: the weight source (`refit.protocols.WeightSource`);
- *replica* / *rollout*: one vLLM engine refit updates (`refit.protocols.RolloutReplica`);
- *engine*: the `vllm.LLM` inside a replica (`refit.engine.rollout_engine.RolloutEngine`);
- *loadable form*: the tensors vLLM's loaders take for a weight (for FP8_BLOCK:
  FP8 `weight` plus `weight_scale`, as an llmcompressor checkpoint holds them);
- *checkpoint*: a model directory on disk, and nothing else;
- *checkpoint format*: the names and shapes a checkpoint of the model holds,
  which is what vLLM's loaders take (MoE experts one by one, where transformers
  fuses them in memory; `refit.CheckpointView` maps one to the other).
"""

from __future__ import annotations

import importlib
from typing import Any

from refit.errors import (
    ConfigError,
    EngineError,
    InvalidTensorError,
    LifecycleError,
    PlanMismatchError,
    RefitError,
    ReplicaRefusingError,
    SyncTimeoutError,
    TransportError,
    UnsupportedSchemeError,
)

_LAZY = {
    "sync": "refit.orchestration",
    "Syncer": "refit.orchestration",
    "SyncConfig": "refit.orchestration",
    "QuantizeOn": "refit.orchestration",
    "Transport": "refit.orchestration",
    "Pause": "refit.orchestration",
    "SyncReport": "refit.orchestration",
    "TensorMeta": "refit.orchestration",
    "TransferPlan": "refit.orchestration",
    "describe_weights": "refit.orchestration",
    "checkpoint_tensors": "refit.orchestration",
    "CheckpointView": "refit.orchestration",
    "produce_buckets": "refit.orchestration",
    "WireBucket": "refit.transport.buckets",
    "RolloutModelInfo": "refit.orchestration",
    "EngineConfig": "refit.engine.config",
    "ReplicaStatus": "refit.engine.lifecycle",
    "Phase": "refit.engine.lifecycle",
    "WeightSource": "refit.protocols",
    "RolloutReplica": "refit.protocols",
    "ShardedWeightSource": "refit.protocols",
    "KvScalePolicy": "refit.provenance",
    "ScaleSource": "refit.provenance",
    "ScaleRecord": "refit.provenance",
    "quantize_fp8_block": "refit.quantizer",
    "Fp8BlockQuantizer": "refit.quantizer",
    "Fp8BlockScheme": "refit.quantizer",
}

__all__ = [
    "ConfigError",
    "EngineError",
    "InvalidTensorError",
    "LifecycleError",
    "PlanMismatchError",
    "RefitError",
    "ReplicaRefusingError",
    "SyncTimeoutError",
    "TransportError",
    "UnsupportedSchemeError",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'refit' has no attribute {name!r}")
