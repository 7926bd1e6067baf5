"""A `vllm serve` server as a rollout replica: refit syncs it like any other, its users keep its OpenAI API.

A thin shell over `ReplicaCore` (refit/engine/replica.py) with the
`ServerAdapter` (refit/engine/server.py), which reaches the server over
HTTP for control messages only; the weights arrive over a collective group
the server's workers join (`SyncConfig(transport="collective")`). The
actor holds no engine and needs no vLLM: place it anywhere that reaches the
server's URL and whose node the collective group's members can reach.

After each sync the server's weight version (`/weight_info`, vLLM's
per-output weight-version spans) is set to the sync's version, so
responses can be tied to the weights that produced them. The actor sends
the server's key on every request (`api_key`, else `REFIT_API_KEY`). How
users' requests are held around an update (until the KV-scale stage and
the probe have passed), and what a refusing server still does, is in
refit/engine/server.py.
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

    `api_key`: the server's key (`refit serve` requires it on every route),
    else `REFIT_API_KEY` in the actor's environment. Construction fails,
    naming the URL and the fix, when no server answers within
    `connect_timeout_s`, it has no key or refuses it, it is not a refit
    server, or it lacks refit's worker extension, weight-transfer backend or
    dev routes. The methods `refit.Syncer` calls
    are `ReplicaShell`'s (actors/_replica_shell.py); `finish_update`'s last
    step sets the server's weight version to the sync's.
    """

    def __init__(self, url: str, api_key: str | None = None, connect_timeout_s: float = 30.0) -> None:
        show_refit_logs()
        self.replica = server_replica(url, api_key, connect_timeout_s=connect_timeout_s)

    @ray.method(concurrency_group="observe")
    def url(self) -> str:
        return self.replica.engine.url
