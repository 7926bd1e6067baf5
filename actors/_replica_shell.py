"""The replica methods `refit.Syncer` calls, for refit's threaded rollout actors, each in its concurrency group.

`RolloutActor` and `ServerRollout` differ only in the engine their
`ReplicaCore` drives (an in-process `vllm.LLM`, or a `vllm serve` server
over HTTP); everything the Syncer calls delegates to that core here, so
both actors answer the same way. Three concurrency groups keep the roles
apart, and each actor class declares them: "update" runs the update steps
in submission order (one thread), "serve" runs what waits out an update as
a request would, and "observe" answers status questions without waiting for
either. (`refit.ReplicaMethods` is the same delegation without Ray's
groups, for a user's own actor, which declares none.)
"""

from __future__ import annotations

import ray

from refit.engine.lifecycle import FinishedUpdate, ReplicaStatus
from refit.engine.replica import ReplicaCore
from refit.plan.config import SyncConfig
from refit.plan.transfer_plan import RolloutModelInfo, TransferPlan
from refit.provenance import ScaleRecord, format_table, to_json
from refit.transport.buckets import BucketContents, WireBucket
from refit.transport.collective import Rendezvous
from refit.verification import ProbeRequest

__all__ = ["CONCURRENCY_GROUPS", "ReplicaShell"]

CONCURRENCY_GROUPS = {"update": 1, "serve": 1, "observe": 1}
"""What an actor taking `ReplicaShell` passes to `ray.remote(concurrency_groups=...)`."""


class ReplicaShell:
    replica: ReplicaCore

    # -- observation ("observe": never waits for an update or a request) -----
    @ray.method(concurrency_group="observe")
    def describe(self) -> RolloutModelInfo:
        return self.replica.describe()

    @ray.method(concurrency_group="observe")
    def status(self) -> ReplicaStatus:
        return self.replica.status()

    @ray.method(concurrency_group="observe")
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    @ray.method(concurrency_group="observe")
    def transport_ranks(self) -> int:
        """How many ranks this replica takes in a collective group: one per vLLM worker."""
        return self.replica.transport_ranks()

    @ray.method(concurrency_group="observe")
    def transport_group(self) -> str | None:
        """The collective group this replica's workers are in, if any."""
        return self.replica.transport_group()

    @ray.method(concurrency_group="observe")
    def base_digest(self, transport: str) -> str | None:
        """The served version's digest, if this replica keeps it as a delta base for `transport`."""
        return self.replica.base_digest(transport)

    @ray.method(concurrency_group="observe")
    def last_update(self) -> dict | None:
        """The last update's outcome as plain data: sync id, version, buckets, seconds, scales written."""
        return self.replica.last_update()

    # -- update lifecycle ("update": one thread, submission order) ------------
    @ray.method(concurrency_group="update")
    def join_transport(self, rendezvous: Rendezvous, member_offset: int, sync_id: str | None = None) -> None:
        self.replica.join_transport(rendezvous, member_offset, sync_id)

    @ray.method(concurrency_group="update")
    def leave_transport(self) -> None:
        self.replica.leave_transport()

    @ray.method(concurrency_group="update")
    def begin_update(self, plan: TransferPlan, sync_id: str, config: SyncConfig) -> int:
        return self.replica.begin_update(plan, sync_id, config)

    @ray.method(concurrency_group="update")
    def load_bucket(
        self, sync_id: str, version: int, bucket: WireBucket | list[WireBucket | ray.ObjectRef | BucketContents],
        next_bucket_bytes: list[int | None] | None = None,
    ) -> float:
        return self.replica.load_bucket(sync_id, version, bucket, next_bucket_bytes)

    @ray.method(concurrency_group="update")
    def finish_update(self, sync_id: str, version: int, probe: ProbeRequest | None = None) -> FinishedUpdate:
        return self.replica.finish_update(sync_id, version, probe)

    @ray.method(concurrency_group="update")
    def abort_update(self, sync_id: str, reason: str) -> ReplicaStatus:
        return self.replica.abort_update(sync_id, reason)

    # -- provenance ("serve": waits out an update, as a request would) ---------
    @ray.method(concurrency_group="serve")
    def scale_records(self) -> list[ScaleRecord]:
        """Where every scale came from (also while refusing: that is when it matters most)."""
        return self.replica.scale_records()

    @ray.method(concurrency_group="serve")
    def scale_table(self, as_json: bool = False) -> str:
        records = self.scale_records()
        return to_json(records) if as_json else format_table(records, digest=(self.replica.last_update() or {}).get("digest"))
