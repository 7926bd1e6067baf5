"""Actor processes that outlive the test that used them.

Starting a `RolloutActor` costs ~8 s of CPU on a 2-core CPU and a
`TrainerActor` ~4 s, nearly all of it a new Ray worker (~1.3 s) importing
vLLM, torch and transformers; vLLM's own engine start takes 1-2 s. The
suite asks for well over a hundred actors, so the test factory lends actors
from a pool: a pooled actor is an instance of the
same class, whose `restart` runs that class's constructor again in the
process that already imported everything. What a test then talks to is
what the constructor built, exactly as in a new process. Between tests a
pooled actor is parked: its engine shut down, or its model dropped (a
trainer group's or Megatron group's rank also leaves its torch.distributed
group, and Megatron's parallel state).

Nothing a test leaves reaches the next: `restart` clears the instance's
attributes before the constructor runs, and an actor is taken back only if
every one of its threads answers within `RETURN_CHECK_S` and it is in no update and no
collective group (a test that killed it, hung it or left a group open gets
it killed, as before). Tests that need a process of their own ask for one:
a constructor that must fail, environment variables, a name another driver
looks up, worker processes.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from dataclasses import dataclass
from unittest.mock import patch

import ray

from actors import MegatronRank, RolloutActor, TrainerActor, TrainerRank
from actors._replica_shell import CONCURRENCY_GROUPS
from refit.engine.config import EngineConfig
from refit.import_heap import freeze_import_heap
from tests.support.actors import STARTUP_S

IDLE_PER_NODE = {"rollout": 2, "trainer": 4, "rank": 1, "megatron": 1}
"""Idle actors kept per node, by kind (a rollout's process holds ~0.8 GB, a trainer's ~0.55 GB); more are killed when
returned. Trainers mostly run on node 0, and some modules hold several at once; a test's trainer group has one rank
on each of two nodes, as have most Megatron groups."""

RETURN_CHECK_S = 10
"""How long a returned actor has to show it is idle; one that does not is killed, never waited for."""

_Rollout = RolloutActor.__ray_metadata__.modified_class.__ray_actor_class__
_Trainer = TrainerActor.__ray_metadata__.modified_class.__ray_actor_class__
_Rank = TrainerRank.__ray_metadata__.modified_class.__ray_actor_class__
_MegatronRank = MegatronRank.__ray_metadata__.modified_class.__ray_actor_class__


def _in_no_transport_group(self) -> bool:
    """A pooled trainer's or rank's `idle`: what a test may leave it in that the next must not find is a collective group."""
    return self.transport_group() is None


@ray.remote(concurrency_groups=CONCURRENCY_GROUPS)
class PooledRollout(_Rollout):
    """A `RolloutActor` whose engine can be replaced by another in the same process.

    Another driver reaches the session's shared replicas by name (a killed driver's test), and loads this class
    from Ray's pickled copy of it: its methods call no function of this module (pickled by reference, so loaded by
    importing this module, which that driver cannot; Ray would give its handle a stand-in class whose methods take
    no positional arguments).
    """

    def park(self) -> None:
        """Shut the engine down while the actor waits in the pool.

        An idle engine is not free: its ~13 gloo process groups (vLLM makes them even at world size 1)
        each run a loop thread that wakes every 10 ms, 4% of a core an engine (measured with
        /proc/<pid>/task: 3.9% gloo, the rest Ray's threads); a parked actor costs Ray's ~1%, and
        frees the engine's memory.
        """
        from vllm.distributed import cleanup_dist_env_and_memory

        if "engine" not in self.__dict__:
            return
        try:
            # vLLM's own teardown: it unfreezes the heap and destroys its process groups; its two full collections of
            # the whole heap are skipped for the one below, which finds the engine dropped too.
            with patch.object(gc, "collect", lambda generation=2: 0):
                self.engine.llm.llm_engine.engine_core.shutdown()
        except BaseException:
            cleanup_dist_env_and_memory()  # what that shutdown ends with: the next engine must find no groups
            raise
        finally:  # parked even if the shutdown failed: the next start must not find the old engine in place
            self.__dict__.clear()
            # One pass over the unfrozen heap frees the old engine's cycles; what is left (the imports) is frozen
            # again, so later passes skip it. Each full pass walks every object the imports made.
            gc.collect()
            freeze_import_heap()
        # Every vLLM worker start registers the platform's overrides of vLLM's Triton kernels (on a CPU without
        # Triton's CPU backend: C++ ones, rebinding the module attributes that hold the kernels, found by scanning
        # every attribute of every module loaded, most of a pooled engine's start, with a warning per kernel on each
        # start after the first). The modules outlive the engine: the next engine in this process finds them in place.
        from vllm.platforms import current_platform

        type(current_platform).register_triton_kernel_overrides = classmethod(lambda cls: None)

    def restart(self, config: EngineConfig) -> None:
        self.park()
        _Rollout.__init__(self, config)

    def unpark(self, config: EngineConfig) -> None:
        """Start an engine with `config` if the actor is parked; one that is running is left as it is."""
        if "engine" not in self.__dict__:
            _Rollout.__init__(self, config)

    def idle(self) -> bool:
        return self.replica.transport_group() is None and self.replica.lifecycle.open_update() is None

    @ray.method(concurrency_group="update")
    def update_thread_free(self) -> bool:
        return True

    @ray.method(concurrency_group="serve")
    def serve_thread_free(self) -> bool:
        return True


@ray.remote
class PooledTrainer(_Trainer):
    """A `TrainerActor` whose model can be replaced by another in the same process."""

    def park(self) -> None:
        """Drop the model while the actor waits in the pool (its memory, not its CPU: an idle trainer costs Ray's ~1%)."""
        if not self.__dict__:
            return  # parked already: nothing new to collect
        self.__dict__.clear()
        gc.collect()

    def restart(self, model_dir: str, **kwargs) -> None:
        self.park()
        _Trainer.__init__(self, model_dir, **kwargs)

    idle = _in_no_transport_group


class _ParkedRank:
    """A rank process (`actors._ranks.RankProcess`) that can join another group in the same process (as another rank)."""

    def park(self) -> None:
        """Leave the group and drop the model: what a rank must do before it sets up again."""
        if not self.__dict__:
            return  # parked already (returned to the pool, then restarted): it has left, and its model was collected
        try:
            self.leave_group()
        finally:
            self.__dict__.clear()
            gc.collect()

    def restart(self, rank: int, world_size: int) -> None:
        self.park()
        super().__init__(rank, world_size)

    idle = _in_no_transport_group


@ray.remote
class PooledTrainerRank(_ParkedRank, _Rank):
    """A `TrainerRank` that can join another group in the same process."""


@ray.remote
class PooledMegatronRank(_ParkedRank, _MegatronRank):
    """A `MegatronRank` that can join another group in the same process: leaving one destroys Megatron's parallel
    state (`destroy_model_parallel`) with the torch.distributed group, so the next `setup` initializes both anew."""


@dataclass(frozen=True)
class Lent:
    kind: str  # a key of IDLE_PER_NODE
    node: int
    actor: object


class ActorPool:
    """Idle pooled actors by kind and node, for one pytest worker's cluster."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list] = defaultdict(list)

    def rollout(self, node: int, options: dict, config: EngineConfig) -> Lent:
        return self._lend("rollout", PooledRollout, node, options, config)

    def trainer(self, node: int, options: dict, model_dir: str, **kwargs) -> Lent:
        return self._lend("trainer", PooledTrainer, node, options, model_dir, **kwargs)

    def rank(self, kind: str, node: int, options: dict, rank: int, world_size: int) -> Lent:
        """A rank of a trainer group (`kind` "rank") or of a Megatron group ("megatron")."""
        return self._lend(kind, {"rank": PooledTrainerRank, "megatron": PooledMegatronRank}[kind], node, options, rank,
                          world_size)

    def _lend(self, kind: str, actor_class, node: int, options: dict, *args, **kwargs) -> Lent:
        """An idle `kind` actor on `node` restarted with these constructor arguments, or a new one started with them."""
        idle = self._idle[(kind, node)]
        if not idle:
            return Lent(kind, node, actor_class.options(**options).remote(*args, **kwargs))
        actor = idle.pop()
        try:
            ray.get(actor.restart.remote(*args, **kwargs), timeout=STARTUP_S)
        except BaseException:
            ray.kill(actor)  # whatever state the failed start left is not lent again
            raise
        return Lent(kind, node, actor)

    def give_back(self, lent: list[Lent]) -> None:
        """Keep the actors that show within `RETURN_CHECK_S` they are idle (up to `IDLE_PER_NODE` a node); kill the others."""
        checks = {entry: [entry.actor.idle.remote()] for entry in lent}
        for entry in lent:
            if entry.kind == "rollout":
                checks[entry] += [entry.actor.update_thread_free.remote(), entry.actor.serve_thread_free.remote()]
        refs = [ref for group in checks.values() for ref in group]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=RETURN_CHECK_S)
        answered = set(ready)
        for entry, group in checks.items():
            idle = self._idle[(entry.kind, entry.node)]
            if len(idle) < IDLE_PER_NODE[entry.kind] and all(ref in answered for ref in group) and _all_true(group):
                # Not waited for: `restart` runs after it on the actor's one default thread, and parks it itself if
                # this failed.
                entry.actor.park.remote()
                idle.append(entry.actor)
            else:
                ray.kill(entry.actor)

    def kill_all(self) -> None:
        for actors in self._idle.values():
            for actor in actors:
                ray.kill(actor)
        self._idle.clear()


def _all_true(refs: list) -> bool:
    try:
        return all(ray.get(refs, timeout=RETURN_CHECK_S))
    except (ray.exceptions.RayError, TimeoutError):
        return False

