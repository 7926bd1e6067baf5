"""A local multi-node Ray cluster on loopback, for tests and the demo.

Ray binds to the machine's primary address by default; on sandboxed machines
connections to that address can be refused, and tests should not talk to
anything but loopback anyway. Ray's own switch for "single machine, use
127.0.0.1" is RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when Ray starts and
inherited by every raylet and worker it spawns.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

__all__ = ["ENGINE_ENV", "local_cluster"]

# What every rollout actor needs on a CPU machine: vLLM in-process, small KV cache.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


@contextmanager
def local_cluster(nodes: int = 3, env: Mapping[str, str] = ENGINE_ENV) -> Iterator[object]:
    """Start `nodes` Ray nodes (1 CPU each, custom resource `node<i>`) and connect.

    Shut down on exit, even after an error, so no dead cluster address is
    left for a later `ray.init()` to join.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 256 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "resources": {"node0": 1}})
    try:
        for i in range(1, nodes):
            cluster.add_node(**node, resources={f"node{i}": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, runtime_env={"env_vars": dict(env)})
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
