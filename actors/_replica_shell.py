"""The replica methods `refit.Syncer` calls, for refit's threaded rollout actors, each in its concurrency group.

`RolloutActor` and `ServerRollout` differ only in the engine their
`ReplicaCore` drives (an in-process `vllm.LLM`, or a `vllm serve` server
over HTTP); everything the Syncer calls delegates to that core here, so
both actors answer the same way. Three concurrency groups keep the roles
apart, and each actor class declares them: "update" runs the update steps
in submission order (one thread), "serve" runs what waits out an update as
a request would, and "observe" answers status questions without waiting for
either. Which method runs in which group is declared once, with the method,
in `refit.protocols.REPLICA_METHODS`; `delegate_to_replica` makes the
delegating methods from it. (`refit.ReplicaMethods` is the same delegation
without Ray's groups, for a user's own actor, which declares none.)
"""

from __future__ import annotations

from typing import get_args

import ray

from refit.engine.replica import ReplicaCore, delegate_to_replica
from refit.protocols import ConcurrencyGroup
from refit.provenance import format_table, to_json

__all__ = ["CONCURRENCY_GROUPS", "ReplicaShell"]

CONCURRENCY_GROUPS = dict.fromkeys(get_args(ConcurrencyGroup), 1)
"""What an actor taking `ReplicaShell` passes to `ray.remote(concurrency_groups=...)`."""


@delegate_to_replica(ray_groups=True)
class ReplicaShell:
    replica: ReplicaCore

    @ray.method(concurrency_group="observe")
    def node_id(self) -> str:
        """The Ray node the replica runs on."""
        return ray.get_runtime_context().get_node_id()

    @ray.method(concurrency_group="serve")
    def scale_table(self, as_json: bool = False) -> str:
        records = self.scale_records()
        return to_json(records) if as_json else format_table(records, digest=(self.replica.last_update() or {}).get("digest"))
