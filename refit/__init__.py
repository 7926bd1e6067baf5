"""refit: weight sync for RL on LLMs.

Streams a trainer's weights, FP8_BLOCK-quantized, into running vLLM engines
over Ray, records where every scale came from, and repairs placeholder
KV-cache scales after each refit.

    report = refit.sync(trainer, rollouts)            # one-off
    syncer = refit.Syncer(trainer, rollouts, config)  # plans once, reuse per step

Public names load on first use, and none of them imports vLLM except the
engine side (`refit.engine.llm`, `refit.engine.async_llm` and the vLLM plugins), so trainer and driver
processes need only torch and Ray (and so does `actors.ServerRollout`, which reaches a `vllm serve` server over HTTP).

Words used throughout:
- *trainer*: the weight source (`refit.protocols.WeightSource`);
- *replica* / *rollout*: one vLLM engine refit updates (`refit.protocols.RolloutReplica`);
- *engine*: the `vllm.LLM` or `AsyncLLM` inside a replica, or the `vllm serve` server behind one
  (`refit.engine.replica.ReplicaCore` drives it);
- *loadable form*: the tensors vLLM's loaders take for a weight (for FP8_BLOCK:
  FP8 `weight` plus `weight_scale`, as an llmcompressor checkpoint holds them);
- *checkpoint*: a model directory on disk, and nothing else;
- *adapter*: a LoRA adapter synced alone over a replica's base (`Syncer.sync_adapter`, refit/adapters/);
- *checkpoint format*: the names and shapes a checkpoint of the model holds,
  which is what vLLM's loaders take (MoE experts one by one, where transformers
  fuses them in memory; `refit.CheckpointView` maps one to the other).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from refit.errors import (
    ActorDiedError,
    BaseMismatchError,
    ConfigError,
    EngineError,
    EngineGoneError,
    EngineHungError,
    GatherFailedError,
    InvalidTensorError,
    LifecycleError,
    PlanMismatchError,
    RefitError,
    ReplicaRefusingError,
    ServerError,
    ServerGoneError,
    SyncTimeoutError,
    TransportError,
    UnsupportedSchemeError,
    VerificationError,
)

if TYPE_CHECKING:  # what `_LAZY` resolves at run time, spelled out for type checkers and IDEs
    from refit.adapters import AdapterMeta, AdapterWeights, ServedAdapter
    from refit.engine.async_llm import AsyncReplica, AsyncReplicaMethods, async_llm_replica
    from refit.engine.config import EngineConfig, engine_kwargs
    from refit.engine.lifecycle import FinishedUpdate, Phase, ReplicaStatus
    from refit.engine.llm import llm_replica
    from refit.engine.replica import ReplicaCore, ReplicaMethods, Serving
    from refit.engine.server import server_replica
    from refit.orchestration import AdapterSyncReport, Syncer, SyncReport, sync
    from refit.plan import (
        CheckpointView,
        Delta,
        Draft,
        Pause,
        QuantizeOn,
        RolloutModelInfo,
        SyncConfig,
        TensorMeta,
        TransferPlan,
        Transport,
        Verify,
        checkpoint_tensors,
        describe_weights,
        produce_buckets,
    )
    from refit.protocols import FullRolloutReplica, FullWeightSource, RolloutReplica, ShardedWeightSource, WeightSource
    from refit.provenance import KvScalePolicy, ScaleRecord, ScaleSource
    from refit.quantizer import Fp8BlockQuantizer, Fp8BlockScheme, quantize_fp8_block
    from refit.source_methods import TrainerWeights, delegate_to_weights
    from refit.transport.buckets import WireBucket

_LAZY = {
    "sync": "refit.orchestration",
    "Syncer": "refit.orchestration",
    "SyncConfig": "refit.plan",
    "QuantizeOn": "refit.plan",
    "Transport": "refit.plan",
    "Pause": "refit.plan",
    "Delta": "refit.plan",
    "Draft": "refit.plan",
    "Verify": "refit.plan",
    "SyncReport": "refit.orchestration",
    "AdapterSyncReport": "refit.orchestration",
    "AdapterWeights": "refit.adapters",
    "AdapterMeta": "refit.adapters",
    "ServedAdapter": "refit.adapters",
    "Serving": "refit.engine.replica",
    "TensorMeta": "refit.plan",
    "TransferPlan": "refit.plan",
    "describe_weights": "refit.plan",
    "checkpoint_tensors": "refit.plan",
    "CheckpointView": "refit.plan",
    "produce_buckets": "refit.plan",
    "WireBucket": "refit.transport.buckets",
    "RolloutModelInfo": "refit.plan",
    "EngineConfig": "refit.engine.config",
    "engine_kwargs": "refit.engine.config",
    "llm_replica": "refit.engine.llm",
    "async_llm_replica": "refit.engine.async_llm",
    "server_replica": "refit.engine.server",
    "AsyncReplica": "refit.engine.async_llm",
    "ReplicaCore": "refit.engine.replica",
    "ReplicaMethods": "refit.engine.replica",
    "AsyncReplicaMethods": "refit.engine.async_llm",
    "ReplicaStatus": "refit.engine.lifecycle",
    "FinishedUpdate": "refit.engine.lifecycle",
    "Phase": "refit.engine.lifecycle",
    "WeightSource": "refit.protocols",
    "TrainerWeights": "refit.source_methods",
    "delegate_to_weights": "refit.source_methods",
    "RolloutReplica": "refit.protocols",
    "ShardedWeightSource": "refit.protocols",
    "FullWeightSource": "refit.protocols",
    "FullRolloutReplica": "refit.protocols",
    "KvScalePolicy": "refit.provenance",
    "ScaleSource": "refit.provenance",
    "ScaleRecord": "refit.provenance",
    "quantize_fp8_block": "refit.quantizer",
    "Fp8BlockQuantizer": "refit.quantizer",
    "Fp8BlockScheme": "refit.quantizer",
}

__all__ = [
    "ActorDiedError",
    "BaseMismatchError",
    "ConfigError",
    "EngineError",
    "EngineGoneError",
    "EngineHungError",
    "GatherFailedError",
    "InvalidTensorError",
    "LifecycleError",
    "PlanMismatchError",
    "RefitError",
    "ReplicaRefusingError",
    "ServerError",
    "ServerGoneError",
    "SyncTimeoutError",
    "TransportError",
    "UnsupportedSchemeError",
    "VerificationError",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'refit' has no attribute {name!r}")
