"""The driver of a sync: plan once, then begin, stream, finish (or abort) on every replica, and report.

- `syncer`: `Syncer` / `sync()`, the main flow, readable top to bottom.
- `calls`: remote calls with deadlines, on Ray actors or plain objects.
- `fleet`: who takes part in one sync, and who was dropped from it (replica names, the quorum).
- `report`: what a sync did, per stage and per replica.
- `metrics`: the same exported as Ray metrics.

What the driver shares with trainers and replicas (the config, the plan,
the data path) lives in `refit.plan`. Nothing here imports vLLM, so
trainer images need not have it.
"""

from refit.orchestration.report import DroppedReplica, ReplicaReport, SyncReport
from refit.orchestration.syncer import Syncer, sync

__all__ = ["DroppedReplica", "ReplicaReport", "SyncReport", "Syncer", "sync"]
