"""Sync orchestration: plan, stream, load, report.

- `plan`: what is sent in which form and bucket (made once, reused).
- `stream`: the trainer end (`produce_buckets`) and the rollout end (`checkpoint_tensors`).
- `syncer`: `Syncer` / `sync()`, the main flow, readable top to bottom.
- `report`: what a sync did, per stage and per replica.
"""

from refit.orchestration.plan import PlannedTensor, TensorMeta, TransferPlan, make_plan
from refit.orchestration.report import ReplicaReport, SyncReport
from refit.orchestration.stream import checkpoint_tensors, describe_weights, produce_buckets
from refit.orchestration.syncer import SyncConfig, Syncer, sync

__all__ = [
    "PlannedTensor",
    "ReplicaReport",
    "SyncConfig",
    "SyncReport",
    "Syncer",
    "TensorMeta",
    "TransferPlan",
    "checkpoint_tensors",
    "describe_weights",
    "make_plan",
    "produce_buckets",
    "sync",
]
