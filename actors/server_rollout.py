"""A `vllm serve` server as a rollout replica: refit syncs it like any other, its users keep its OpenAI API.

A thin shell over `ReplicaCore` (refit/engine/replica.py) with the
`ServerAdapter` (refit/engine/server.py), which reaches the server over
HTTP for control messages only; the weights arrive over a collective group
the server's workers join (`SyncConfig(transport="collective")`). The
actor holds no engine and needs no vLLM: place it anywhere that reaches the
server's URL and whose node the collective group's members can reach.

After each sync the server's weight version (`/weight_info`, vLLM's
per-output weight-version spans) is set to the sync's version, so
responses can be tied to the weights that produced them. How requests are
paused and resumed around an update, and what a refusing server still
does, is in refit/engine/server.py.
"""

from __future__ import annotations

import ray

from actors._logging import show_refit_logs
from refit.engine.lifecycle import FinishedUpdate, ReplicaStatus
from refit.engine.server import server_replica
from refit.plan.config import SyncConfig
from refit.plan.transfer_plan import RolloutModelInfo, TransferPlan
from refit.provenance import ScaleRecord, format_table, to_json
from refit.transport.buckets import BucketContents
from refit.transport.collective import Rendezvous
from refit.verification import ProbeRequest

__all__ = ["ServerRollout"]


@ray.remote(num_cpus=0, concurrency_groups={"update": 1, "serve": 1, "observe": 1})
class ServerRollout:
    """The server at `url` (started by `refit serve`, or by `vllm serve` with refit's options) as a replica.

    Construction fails, naming the URL and the fix, when no server answers
    within `connect_timeout_s` or it lacks refit's worker extension,
    weight-transfer backend or dev routes.
    """

    def __init__(self, url: str, connect_timeout_s: float = 30.0) -> None:
        show_refit_logs()
        self.replica = server_replica(url, connect_timeout_s=connect_timeout_s)

    # -- observation ("observe": never waits for an update) ----------------------
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
        """How many ranks the server takes in a collective group: one per vLLM worker."""
        return self.replica.transport_ranks()

    @ray.method(concurrency_group="observe")
    def transport_group(self) -> str | None:
        return self.replica.transport_group()

    @ray.method(concurrency_group="observe")
    def last_update(self) -> dict | None:
        return self.replica.last_update()

    @ray.method(concurrency_group="observe")
    def url(self) -> str:
        return self.replica.engine.url

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
        self, sync_id: str, version: int, bucket: list[BucketContents], next_bucket_bytes: list[int | None] | None = None,
    ) -> float:
        return self.replica.load_bucket(sync_id, version, bucket, next_bucket_bytes)

    @ray.method(concurrency_group="update")
    def finish_update(self, sync_id: str, version: int, probe: ProbeRequest | None = None) -> FinishedUpdate:
        """The core's finish; its last step sets the server's weight version to `version`."""
        return self.replica.finish_update(sync_id, version, probe)

    @ray.method(concurrency_group="update")
    def abort_update(self, sync_id: str, reason: str) -> ReplicaStatus:
        return self.replica.abort_update(sync_id, reason)

    # -- provenance ("serve": waits out an update, as a request would) -------------
    @ray.method(concurrency_group="serve")
    def scale_records(self) -> list[ScaleRecord]:
        """Where every scale came from (also while refusing)."""
        return self.replica.scale_records()

    @ray.method(concurrency_group="serve")
    def scale_table(self, as_json: bool = False) -> str:
        records = self.scale_records()
        return to_json(records) if as_json else format_table(records)
