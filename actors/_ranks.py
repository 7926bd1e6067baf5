"""What every rank actor of a sharded trainer shares, whatever shards its model (FSDP2, megatron-core).

A rank is a process in one torch.distributed group: it says which rank it
was constructed as, offers rank 0's rendezvous, streams its `RankSource`'s
parts (the weight source methods come from `TrainerWeights`), reports what
its last stream cost, and leaves its groups so its process can join
another. `start_ranks` and `on_every_rank` are the group handle's side:
start or check the ranks, then call a collective on all of them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import ray
import torch

from actors._logging import show_refit_logs
from actors._measure import private_rss_bytes
from refit.errors import ConfigError
from refit.orchestration.calls import is_actor, wait_until_started
from refit.plan.tensors import TensorMeta
from refit.plan.transfer_plan import TransferPlan
from refit.sharding.process_group import free_port
from refit.source_methods import TrainerWeights
from refit.transport.buckets import WireBucket

__all__ = ["RankProcess", "on_every_rank", "start_ranks"]

_RSS_SAMPLE_PERIOD_S = 0.002


class RankProcess:
    """The rank-side half every rank actor class inherits; the class adds `setup` (which sets `self.source`,
    a `RankSource`) and its model's methods."""

    _model_attributes: tuple[str, ...] = ("model", "optimizer", "source")  # what `leave_group` drops

    def __init__(self, rank: int, world_size: int) -> None:
        show_refit_logs()
        self.rank, self.world_size = rank, world_size
        self._peak_bytes = 0
        self.weights = TrainerWeights(self._metadata, self._produce, self._stream_stats)

    def position(self) -> tuple[int, int]:
        """(rank, world_size) as constructed: a group checks them before the rank joins it."""
        return self.rank, self.world_size

    def rendezvous(self) -> tuple[str, int]:
        """Where the group meets: this node's address and a free port on it (asked of rank 0)."""
        return ray.util.get_node_ip_address(), free_port()

    def _stream_stats(self) -> dict[str, int]:
        """In the last stream: bytes this rank all-gathered, its peak private memory above the stream's start,
        the tensors it sent per route, and the bytes of its shards (with its seconds: `last_stream_stats`)."""
        if "source" not in self.__dict__:
            return {}  # no model (yet, or any more)
        return {"gathered_bytes": self.source.gathered_bytes, "peak_bytes": self._peak_bytes, **self.source.sent,
                "shard_bytes": self.source.shard_bytes()}

    def leave_group(self) -> None:
        """Leave every group this rank is in and drop its model, so that this process can join another group.

        torch keeps one default group per process: a rank that is to set up
        again (a new group, after its peers were replaced) must destroy the old
        one first. Its collectives' peers may be gone; destroying the group
        needs none of them. A sync's collective transport group goes too, and
        with it the delta base: those rows were this rank's share of the old
        model, so the first sync from the new group is a full one. The
        torch.distributed group is destroyed even if closing the transport
        fails: a rank left in it could never set up again.
        """
        try:
            self.weights.close()
        finally:
            for attribute in self._model_attributes:
                self.__dict__.pop(attribute, None)
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()

    def _metadata(self) -> list[TensorMeta]:
        return self.source.metadata()

    def _produce(self, plan: TransferPlan) -> Iterator[WireBucket]:
        """This rank's parts, sampling its peak private memory growth while it makes them."""
        baseline = private_rss_bytes()
        self._peak_bytes = 0
        stop = threading.Event()
        sampler = threading.Thread(target=self._sample_rss, args=(baseline, stop), daemon=True)
        sampler.start()
        try:
            yield from self.source.stream(plan)
        finally:
            stop.set()
            sampler.join()

    def _sample_rss(self, baseline: int, stop: threading.Event) -> None:
        while not stop.wait(_RSS_SAMPLE_PERIOD_S):
            self._peak_bytes = max(self._peak_bytes, private_rss_bytes() - baseline)


def start_ranks(rank_class, world_size: int, resources: Sequence[dict[str, float]] | None,
                ranks: Sequence[ray.actor.ActorHandle] | None, startup_timeout_s: float, timeout_s: float) -> list:
    """The group's rank actors: started here (`resources[r]` pinning rank r), or `ranks` started elsewhere, each
    checked to be the rank its place says; every one's process is up when this returns."""
    name = rank_class.__ray_metadata__.class_name if hasattr(rank_class, "__ray_metadata__") else rank_class.__name__
    if world_size < 1:
        raise ConfigError(f"world_size={world_size}: a trainer group needs at least one rank")
    if resources is not None and len(resources) != world_size:
        raise ConfigError(f"resources: {len(resources)} entries for {world_size} ranks")
    if ranks is not None and resources is not None:
        raise ConfigError("resources place the ranks a group starts; ranks passed in are placed already: give one of them")
    if ranks is not None and len(ranks) != world_size:
        raise ConfigError(f"ranks: {len(ranks)} actors for world_size={world_size}")
    for r, rank in enumerate(ranks or ()):
        if not is_actor(rank):
            raise ConfigError(f"ranks[{r}] is {rank!r}, not an actor handle: pass {name}.remote({r}, {world_size})")
    started = list(ranks) if ranks is not None else [
        rank_class.options(num_cpus=0, resources=(resources or [{}] * world_size)[r]).remote(r, world_size)
        for r in range(world_size)
    ]
    wait_until_started([(f"trainer rank {r}", rank) for r, rank in enumerate(started)], timeout_s=startup_timeout_s)
    if ranks is not None:
        positions = ray.get([rank.position.remote() for rank in started], timeout=timeout_s)
        for r, (rank, size) in enumerate(positions):
            if (rank, size) != (r, world_size):
                raise ConfigError(f"ranks[{r}] was constructed as rank {rank} of {size}: this group needs rank {r} "
                                  f"of {world_size} there ({name}.remote({r}, {world_size}))")
    return started


def on_every_rank(ranks: Sequence, method: str, *args, deadline_s: float, **kwargs) -> list:
    """Call a collective on every rank at once; every rank's answer, in rank order."""
    return ray.get([getattr(rank, method).remote(*args, **kwargs) for rank in ranks], timeout=deadline_s)
