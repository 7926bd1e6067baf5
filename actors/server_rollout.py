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
from actors._replica_shell import CONCURRENCY_GROUPS, ReplicaShell
from refit.engine.server import server_replica

__all__ = ["ServerRollout"]


@ray.remote(num_cpus=0, concurrency_groups=CONCURRENCY_GROUPS)
class ServerRollout(ReplicaShell):
    """The server at `url` (started by `refit serve`, or by `vllm serve` with refit's options) as a replica.

    Construction fails, naming the URL and the fix, when no server answers
    within `connect_timeout_s` or it lacks refit's worker extension,
    weight-transfer backend or dev routes. The methods `refit.Syncer` calls
    are `ReplicaShell`'s (actors/_replica_shell.py); `finish_update`'s last
    step sets the server's weight version to the sync's.
    """

    def __init__(self, url: str, connect_timeout_s: float = 30.0) -> None:
        show_refit_logs()
        self.replica = server_replica(url, connect_timeout_s=connect_timeout_s)

    @ray.method(concurrency_group="observe")
    def url(self) -> str:
        return self.replica.engine.url
