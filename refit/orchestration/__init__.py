"""The driver of a sync: plan once, then begin, stream, finish (or abort) on every replica, and report.

- `syncer`: `Syncer` / `sync()`, the main flow, readable top to bottom.
- `adapter_sync`: `Syncer.sync_adapter`'s flow, a LoRA adapter alone (staged on every replica, then served).
- `membership`: the fleet between syncs (who joins and leaves, what an actor must be, waiting for actors to start).
- `delta_negotiation`: which replicas get deltas and which whole buckets.
- `collective_group`: the collective group's lifecycle (made, kept, made again, broken, begun again).
- `streaming`: handing each bucket to every replica as it is produced, bounded in flight.
- `failures`: what a failed sync raises (a dead member's death, not its echoes) and the cleanup.
- `reporting`: gathering what a sync did into its report.
- `calls`: remote calls with deadlines, on Ray actors or plain objects.
- `fleet`: who takes part in one sync, and who was dropped from it (replica names, the quorum).
- `progress`: progress bars for the driver's waits.
- `report`: what a sync did, per stage and per replica.
- `metrics`: the same exported as Ray metrics.

What the driver shares with trainers and replicas (the config, the plan,
the data path) lives in `refit.plan`. Nothing here imports vLLM, so
trainer images need not have it.
"""

from refit.orchestration.report import AdapterSyncReport, DroppedReplica, ReplicaReport, SyncReport
from refit.orchestration.syncer import Syncer, sync

__all__ = ["AdapterSyncReport", "DroppedReplica", "ReplicaReport", "SyncReport", "Syncer", "sync"]
