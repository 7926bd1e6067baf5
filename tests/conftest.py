"""Shared test infrastructure: one 3-node local Ray cluster for the session.

Every Ray test shares it (starting a cluster costs ~15 s). Node i carries a
custom resource `node<i>`, so a test can pin an actor to a node and then
assert where it ran. Actors come from the `actors_factory` fixture, which
lends them from a pool of processes reused across tests (tests/support/pool.py:
a new rollout process spends ~8 s of CPU, mostly importing vLLM) and takes them back, or
kills them, when the test ends.

Tests that start Ray or vLLM carry the `engine` marker (added here for every
test that uses the cluster); `pytest -m "not engine"` is the fast tier.
`make test` runs the modules on two pytest-xdist workers, which share one
cluster started by the xdist controller; a module never spans two workers.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import pytest

from fixtures.cluster import QUIET_ENV
from refit.engine.config import REFERENCE_KERNEL_ENV

# Every engine the suite starts (Ray nodes and `vllm serve` subprocesses inherit this environment) computes FP8_BLOCK
# linears with refit's reference kernel, on CPUs with AMX too, so comparisons between engines hold bit for bit on
# any CPU (refit/engine/cpu_kernel.py says why vLLM's AMX kernels do not).
os.environ[REFERENCE_KERNEL_ENV] = "1"
from tests.support.names import NAMESPACE, SHARED_REPLICAS

NODES = 3
TEST_KV_CACHE_BYTES = 64 << 20
"""A test engine's KV cache: ~2k tokens of the fixtures, ample for 128-token sequences. The library's
CPU default (1 GiB) would hold 1 GB of memory per engine, and two test sessions may run side by side."""


CLUSTER_FIXTURES = {"ray_cluster", "actor_pool", "actors_factory", "module_actors", "shared_replicas", "moe_checkpoint_replica"}

LONGEST_MODULES = ("tests/test_examples.py", "tests/sync/test_faults.py", "tests/sync/test_server_rollout.py",
                   "tests/sync/test_sharded_trainer.py")
"""The modules that take longest (several worker-minutes each on a 2-core CPU), started before every other module.

A module never spans two workers, so the one the scheduler hands out last
bounds the run: started last, a long module runs alone while the other
worker idles, and the run lasts that module's minutes longer than its work
needs. Only the order depends on this list; a stale entry costs minutes,
never a result."""


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session):
    """Collecting imports vLLM, torch and transformers into this process: without the collector's passes, then
    frozen, as in refit's actor processes (refit/import_heap.py says why); this process lives as long as the run."""
    from refit.import_heap import collector_paused, freeze_import_heap

    with collector_paused():
        collected = yield
    freeze_import_heap()
    return collected


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.engine)
    # `make test` hands whole modules to two workers in this order (pytest-xdist, --dist loadfile): the longest
    # first, then the other engine modules, then the fast tier, which fills the gaps at the end.
    items.sort(key=lambda item: (_start_rank(item), item.get_closest_marker("engine") is None))


def _start_rank(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return LONGEST_MODULES.index(path) if path in LONGEST_MODULES else len(LONGEST_MODULES)


_SHARED_CLUSTER_ADDRESS = "refit_ray_address"
_controller_cluster = ExitStack()
_controller_address: str | None = None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """In the pytest-xdist controller, once per worker: every worker joins the one cluster started here.

    One cluster, not one per worker: each costs ~15 s to start, and its daemons
    (raylets, dashboard and runtime-env agents, log monitors, GCS) ~7% of a core
    the whole run. The controller outlives every worker, so it owns the cluster.
    """
    global _controller_address
    from fixtures.cluster import started_cluster

    if _controller_address is None:
        _controller_address = _controller_cluster.enter_context(started_cluster(NODES)).address
    node.workerinput[_SHARED_CLUSTER_ADDRESS] = _controller_address


_segment_watcher = None
_socket_dir: tempfile.TemporaryDirectory | None = None
RPC_BASE_PATH_ENV = "VLLM_RPC_BASE_PATH"


def pytest_configure(config: pytest.Config) -> None:
    """In the process that runs the session (the xdist controller, or the only one): keep what the session's
    processes leave behind off the machine.

    Shared-memory segments: tests/support/shm_hygiene.py. vLLM's ZMQ sockets between an engine's processes
    (`ipc://` files under `VLLM_RPC_BASE_PATH`, the system's temp directory by default) are left by every engine
    a test kills: they go into a directory of the session's own, which every process started after this inherits
    (xdist workers, Ray nodes and their workers, `vllm serve` subprocesses), removed when the session ends.
    """
    global _segment_watcher, _socket_dir
    if not hasattr(config, "workerinput") and _segment_watcher is None:
        from tests.support.shm_hygiene import SegmentWatcher

        _segment_watcher = SegmentWatcher()
        if RPC_BASE_PATH_ENV not in os.environ:
            _socket_dir = tempfile.TemporaryDirectory(prefix="refit-tests-rpc-", ignore_cleanup_errors=True)
            os.environ[RPC_BASE_PATH_ENV] = _socket_dir.name


def pytest_unconfigure(config: pytest.Config) -> None:
    try:
        _controller_cluster.close()
    finally:
        if _segment_watcher is not None:
            _segment_watcher.stop()
        if _socket_dir is not None:
            _socket_dir.cleanup()


@dataclass(frozen=True)
class RunningCluster:
    address: str


@pytest.fixture(scope="session")
def ray_cluster(pytestconfig: pytest.Config) -> Iterator[RunningCluster]:
    """The session's cluster, joined: the xdist controller's, shared by the workers, or one of its own without xdist.

    Workers share its nodes, not their actors: each has its own pool and its own namespace for named actors
    (tests/support/names.py).
    """
    from fixtures.cluster import joined_cluster, local_cluster

    address = getattr(pytestconfig, "workerinput", {}).get(_SHARED_CLUSTER_ADDRESS)
    if address is not None:
        with joined_cluster(address, QUIET_ENV):
            yield RunningCluster(address)
    else:
        with local_cluster(NODES) as cluster:
            yield RunningCluster(cluster.address)


class ActorFactory:
    """Creates trainer and rollout actors pinned to nodes; kills them (or returns them to the pool) at teardown.

    With a pool (tests/support/pool.py), an actor is lent from it unless the test asks for a process of its
    own (`own_process=True`), or its start needs one: environment variables, worker processes.
    """

    def __init__(self, pool=None) -> None:
        self.created: list = []
        self.lent: list = []
        self.pool = pool

    def trainer(self, model_dir, *, node: int = 0, own_process: bool = False, **kwargs):
        options = _on_node(node)
        if self.pool is not None and not own_process:
            return self.lend(self.pool.trainer(node, options, str(model_dir), **kwargs))
        from actors import TrainerActor

        return self.keep(TrainerActor.options(**options).remote(str(model_dir), **kwargs))

    def rollout(self, model_dir, *, node: int = 0, env: dict[str, str] | None = None, own_process: bool = False,
                **engine_kwargs):
        from actors import RolloutActor

        config = _engine_config(model_dir, **engine_kwargs)
        options = _on_node(node)
        if self.pool is not None and not (own_process or env or config.tensor_parallel_size > 1):
            return self.lend(self.pool.rollout(node, options, config))
        if env:
            options["runtime_env"] = {"env_vars": {**QUIET_ENV, **env}}
        return self.keep(RolloutActor.options(**options).remote(config))

    def trainer_group(self, model_dir, *, nodes: tuple[int, ...] = (0, 1), **kwargs):
        """An FSDP2 `TrainerGroup` with rank r on node `nodes[r]`, its ranks lent from the pool (`TrainerGroup(ranks=...)`)."""
        from actors import TrainerGroup, TrainerRank

        return TrainerGroup(model_dir, len(nodes), ranks=self._ranks(TrainerRank, "rank", nodes), **kwargs)

    def megatron_group(self, model_dir, parallel, *, nodes: tuple[int, ...], **kwargs):
        """A `MegatronGroup` with rank r on node `nodes[r]`, its ranks lent from the pool (`MegatronGroup(ranks=...)`)."""
        from actors import MegatronGroup, MegatronRank

        return MegatronGroup(model_dir, len(nodes), parallel, ranks=self._ranks(MegatronRank, "megatron", nodes), **kwargs)

    def _ranks(self, rank_class, kind: str, nodes: tuple[int, ...]) -> list:
        """Rank r of a group on node `nodes[r]`: lent from the pool's `kind` ranks, or started as `rank_class`."""
        world_size = len(nodes)
        if self.pool is None:
            return [self.keep(rank_class.options(**_on_node(node)).remote(r, world_size)) for r, node in enumerate(nodes)]
        return [self.lend(self.pool.rank(kind, node, _on_node(node), r, world_size)) for r, node in enumerate(nodes)]

    def keep(self, actor):
        self.created.append(actor)
        return actor

    def lend(self, lent):
        self.lent.append(lent)
        return lent.actor

    def kill_all(self) -> None:
        import ray

        for actor in self.created:
            ray.kill(actor)
        self.created.clear()
        if self.lent:
            self.pool.give_back(self.lent)
            self.lent.clear()


def _engine_config(model_dir, **engine_kwargs):
    """A test engine's config: 128-token sequences and `TEST_KV_CACHE_BYTES` of KV cache unless given."""
    from refit import EngineConfig

    engine_kwargs.setdefault("kv_cache_bytes", TEST_KV_CACHE_BYTES)
    return EngineConfig(model=str(model_dir), max_model_len=128, **engine_kwargs)


def _on_node(node: int) -> dict:
    """Ray options that pin an actor to node `node` (its custom resource) and take no CPU of the 1 each node has."""
    return {"num_cpus": 0, "resources": {f"node{node}": 0.01}}


def _actors(pool) -> Iterator[ActorFactory]:
    factory = ActorFactory(pool)
    try:
        yield factory
    finally:
        factory.kill_all()


@pytest.fixture(scope="session")
def actor_pool(ray_cluster) -> Iterator[object]:
    """Trainer and rollout processes reused across this worker's tests (tests/support/pool.py)."""
    from tests.support.pool import ActorPool

    pool = ActorPool()
    try:
        yield pool
    finally:
        pool.kill_all()


@pytest.fixture
def actors_factory(actor_pool) -> Iterator[ActorFactory]:
    yield from _actors(actor_pool)


@pytest.fixture(scope="module")
def module_actors(actor_pool) -> Iterator[ActorFactory]:
    """Actors shared by the tests of one module (fixtures only).

    A test's own actors come from `actors_factory`: returned when the test ends, their processes serve the
    module's next test; held here, they would stay out of the pool until the module ends, and each later
    test of the module would start new ones.
    """
    yield from _actors(actor_pool)


@pytest.fixture(scope="session")
def _shared_replica_processes(ray_cluster) -> Iterator[list]:
    """The processes behind `shared_replicas`: started once a session, their engines parked between the modules."""
    import ray

    from tests.support.pool import PooledRollout

    # Named, so that another driver process reaches them with ray.get_actor(name, namespace=NAMESPACE).
    actors = [PooledRollout.options(**_on_node(node), name=name, namespace=NAMESPACE).remote(_shared_replica_config())
              for node, name in zip((1, 2), SHARED_REPLICAS)]
    try:
        yield actors
    finally:
        for actor in actors:
            ray.kill(actor)


@pytest.fixture(scope="module")
def shared_replicas(_shared_replica_processes) -> Iterator[list]:
    """Two FP8_BLOCK replicas started the README's way (dummy load, FP8 KV cache) on nodes 1 and 2, for a module.

    A rollout process costs ~8 s of CPU to start, and most fault and sync tests prove nothing
    new by owning one, so modules share these. Named (`SHARED_REPLICAS` in
    `NAMESPACE`) so that another driver process can reach them. The contract
    of a user: its first sync makes them whole again (a failed sync may have
    left them refusing); it never kills them, never leaves an update open past
    its test, and never relies on their version numbers, only on versions it
    saw. A test that needs a replica that never served (a dummy replica's
    placeholder scales, its refusal before the first sync) starts its own.

    Each module gets them with engines just started in the session's processes, and parks them when it ends:
    idle between modules, two engines cost ~8% of a core (pool.py's `park` says why).
    """
    import ray

    from tests.support.actors import STARTUP_S

    ray.get([actor.unpark.remote(_shared_replica_config()) for actor in _shared_replica_processes], timeout=STARTUP_S)
    try:
        yield _shared_replica_processes
    finally:
        for actor in _shared_replica_processes:
            actor.park.remote()  # not waited for: the next module's `unpark` runs after it


def _shared_replica_config():
    return _engine_config(_fixture_model("fp8_block"), load_format="dummy", kv_cache_dtype="fp8_e4m3")


@pytest.fixture(scope="module")
def moe_checkpoint_replica(module_actors) -> object:
    """A replica serving the Qwen3-MoE fixture's llmcompressor FP8_BLOCK checkpoint as loaded (node 1, bf16 KV cache).

    The reference for what that checkpoint serves, for the modules that
    compare against it: no user may sync it (a refused plan leaves it as is).
    Per module, from the pool: a session-long engine would sit idle between
    its two modules at ~4% of a core (pool.py's `park` says why).
    """
    from fixtures import model_dir

    return module_actors.rollout(model_dir(False, "fp8_block", arch="qwen3_moe"), node=1)


def _fixture_model(variant: str) -> str:
    from fixtures import model_dir

    return str(model_dir(True, variant))


# For tests that start a plain `vllm.LLM` in the test process (no refit, so no
# EngineConfig): engine core in-process and a 1 GiB KV cache, as the brief asks.
PLAIN_VLLM_ENV = {**QUIET_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(autouse=True)
def _plain_vllm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in PLAIN_VLLM_ENV.items():
        monkeypatch.setenv(key, value)
