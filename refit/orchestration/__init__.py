"""Sync orchestration: plan, stream, load, report.

- `config`: `SyncConfig`, validated once.
- `plan`: what is sent in which form and bucket (made once, reused).
- `data_path`: the trainer end (`produce_buckets`) and the rollout end (`loadable_tensors`).
- `calls`: remote calls with deadlines, on Ray actors or plain objects.
- `syncer`: `Syncer` / `sync()`, the main flow, readable top to bottom.
- `report`: what a sync did, per stage and per replica.

Nothing here imports vLLM at import time (`make_plan` imports its layer
grouping when called, on the driver).
"""

from refit.orchestration.config import QuantizeOn, SyncConfig
from refit.orchestration.data_path import describe_weights, loadable_tensors, produce_buckets
from refit.orchestration.plan import PlannedTensor, RolloutModelInfo, TensorMeta, TransferPlan, make_plan, module_classes
from refit.orchestration.report import ReplicaReport, SyncReport
from refit.orchestration.syncer import Syncer, sync

__all__ = [
    "PlannedTensor",
    "QuantizeOn",
    "ReplicaReport",
    "RolloutModelInfo",
    "SyncConfig",
    "SyncReport",
    "Syncer",
    "TensorMeta",
    "TransferPlan",
    "describe_weights",
    "loadable_tensors",
    "make_plan",
    "module_classes",
    "produce_buckets",
    "sync",
]
