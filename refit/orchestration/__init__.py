"""Sync orchestration: plan, stream, load, report.

- `config`: `SyncConfig`, validated once.
- `checkpoint_format`: a trainer's model under the rollout checkpoint's names and shapes (transformers' save conversion).
- `expected_weights`: what the rollout's model expects, from its checkpoint headers or its config.
- `plan`: what is sent in which form and bucket (made once, reused), checked against the rollout.
- `data_path`: the trainer end (`produce_buckets`) and the rollout end (`loadable_tensors`).
- `calls`: remote calls with deadlines, on Ray actors or plain objects.
- `syncer`: `Syncer` / `sync()`, the main flow, readable top to bottom.
- `report`: what a sync did, per stage and per replica.

Nothing here imports vLLM, so trainer images need not have it; transformers
is imported only where a model is described.
"""

from refit.orchestration.checkpoint_format import CheckpointView, checkpoint_tensors, describe_weights
from refit.orchestration.config import Pause, QuantizeOn, SyncConfig, Transport, Verify
from refit.orchestration.data_path import loadable_tensors, produce_buckets
from refit.orchestration.plan import PlannedTensor, RolloutModelInfo, TensorMeta, TransferPlan, make_plan, module_classes
from refit.orchestration.report import ReplicaReport, SyncReport
from refit.orchestration.syncer import Syncer, sync

__all__ = [
    "CheckpointView",
    "Pause",
    "PlannedTensor",
    "QuantizeOn",
    "ReplicaReport",
    "RolloutModelInfo",
    "SyncConfig",
    "SyncReport",
    "Transport",
    "Syncer",
    "Verify",
    "TensorMeta",
    "TransferPlan",
    "checkpoint_tensors",
    "describe_weights",
    "loadable_tensors",
    "make_plan",
    "module_classes",
    "produce_buckets",
    "sync",
]
