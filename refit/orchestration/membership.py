"""The Syncer's fleet between syncs: who is a member, who joins and leaves, and what an actor must be to be synced.

Why a module of its own: a Syncer's replicas change between syncs, and a
replica that cannot be synced (a class where an actor is expected, a
missing method, another model) is refused at the door, by name, rather
than failing a sync of the whole fleet later. Each replica is named
`rollout <id>`, an id given when it joined and never reused, so a name in
an error, a log line or a report means one replica whatever joined or left
since. Actors still being constructed are waited for once, before the
first remote call (`SyncConfig.startup_timeout_s`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from refit.errors import ConfigError
from refit.orchestration.calls import call_all, is_actor, raise_first_error, wait_until_started
from refit.orchestration.fleet import replica_name
from refit.orchestration.progress import progress_bar
from refit.plan.config import SyncConfig, Transport, Verify
from refit.plan.transfer_plan import RolloutModelInfo
from refit.protocols import RolloutReplica, WeightSource, has_method, missing_methods

__all__ = [
    "Membership",
    "actor_problems",
    "check_same_model",
    "checked_sources",
    "refuse_actor_classes",
    "wait_for_actors",
    "weight_sources",
]

log = logging.getLogger("refit.orchestration")


class Membership:
    """The replicas the next sync updates, (name, handle) in the order they joined, and the next id to give."""

    def __init__(self, replicas: Sequence[RolloutReplica], config: SyncConfig) -> None:
        self.config = config
        self.members: list[tuple[str, Any]] = []
        for i, replica in enumerate(replicas):
            if (member := self.find(replica)) is not None:
                # Both would take part in one sync as two replicas: the second begin_update would find the first's
                # update open and refuse it as another sync's, a confusing way to fail.
                raise ConfigError(f"{replica_name(i)} is {member} again (the same actor); pass each replica once")
            self.members.append((replica_name(i), replica))
        self._next_id = len(self.members)  # ids are never reused: a name in a log or report means one replica

    @property
    def names(self) -> list[str]:
        return [who for who, _ in self.members]

    def check(self, members: list[tuple[str, Any]]) -> list[str]:
        """What each of `members` lacks to be synced under this config: the protocol's methods, and the transport's."""
        problems = []
        for who, replica in members:
            problems += [f"{who} lacks {m}()" for m in missing_methods(replica, RolloutReplica)]
            if self.config.transport is not Transport.AUTO:  # else the choice weighs what each member has
                kind = self.config.transport_kind
                problems += [f"{who} lacks {m}(), which transport={kind.name!r} needs"
                             for m in kind.traits.replica_methods if not has_method(replica, m)]
        return problems

    def add(self, replica: RolloutReplica, model: RolloutModelInfo | None) -> str:
        """Check `replica`, wait until it started, compare it with the fleet's `model` (once described), then admit it."""
        if (member := self.find(replica)) is not None:
            raise ConfigError(f"this replica is already {member} of this Syncer")
        who = replica_name(self._next_id)
        refuse_actor_classes([(who, replica)])
        problems = self.check([(who, replica)])
        if problems:
            raise ConfigError("this actor cannot be synced (see refit.protocols):\n  " + "\n  ".join(problems))
        wait_until_started([(who, replica)], timeout_s=self.config.startup_timeout_s)
        if model is not None:
            (info,) = raise_first_error(call_all([(who, replica)], "describe", timeout_s=self.config.timeout_s))
            check_same_model([("the fleet's rollout model", model), (who, info)])
        self._next_id += 1
        self.members.append((who, replica))
        log.info("%s joined (%d replica(s)); the next sync sends it every weight", who, len(self.members))
        return who

    def remove(self, replica: RolloutReplica | int | str) -> str:
        """Remove a member by handle, id or name; returns its name. Nothing is called on it."""
        if isinstance(replica, int) and not isinstance(replica, bool):
            who = replica_name(replica)
        elif isinstance(replica, str):
            who = replica
        else:
            who = self.find(replica) or repr(replica)
        if who not in self.names:
            raise ConfigError(f"{who!r} is not a replica of this Syncer; its replicas: {', '.join(self.names) or 'none'}")
        self.members = [(name, handle) for name, handle in self.members if name != who]
        log.info("%s left (%d replica(s))", who, len(self.members))
        return who

    def keep(self, survivors: Sequence[tuple[str, Any]]) -> None:
        """After a sync: only the members it did not drop stay."""
        names = {who for who, _ in survivors}
        self.members = [(who, handle) for who, handle in self.members if who in names]

    def find(self, replica: Any) -> str | None:
        """The member name of `replica`: the same object, or a handle of the same actor (Ray handles compare by actor)."""
        return next((who for who, handle in self.members if _same_actor(handle, replica)), None)


def _same_actor(one: Any, other: Any) -> bool:
    """The same object, or two Ray handles of one actor (they compare by actor id)."""
    return one is other or (is_actor(one) and is_actor(other) and one == other)


def checked_sources(trainer: Any, fleet: Membership) -> list[tuple[str, Any]]:
    """(name, source) of every rank of `trainer` that streams, once the trainer and the fleet are checked: running
    actors, not classes, with every method the protocols and `fleet.config` need (all problems named at once)."""
    refuse_actor_classes([("the trainer", trainer), *fleet.members])
    sources = weight_sources(trainer)
    problems = actor_problems(sources, fleet)
    if problems:
        raise ConfigError("these actors cannot be synced (see refit.protocols):\n  " + "\n  ".join(problems))
    return sources


def actor_problems(sources: list[tuple[str, Any]], fleet: Membership) -> list[str]:
    """What the trainer's ranks and the fleet lack to be synced: the protocol's methods, then what the probe and the
    transport need of the ranks."""
    config = fleet.config
    problems = [f"{who} lacks {m}()" for who, source in sources for m in missing_methods(source, WeightSource)]
    problems += fleet.check(fleet.members)
    if config.verify is Verify.PROBE:
        problems += [f"{who} lacks reference_logprobs(), which verify='probe' needs"
                     for who, source in sources if not has_method(source, "reference_logprobs")]
    if config.transport is not Transport.AUTO:
        kind = config.transport_kind
        problems += [f"{who} lacks {m}(), which transport={kind.name!r} needs"
                     for who, source in sources for m in kind.traits.sender_methods if not has_method(source, m)]
    return problems


def wait_for_actors(actors: list[tuple[str, Any]], config: SyncConfig) -> float:
    """Wait for `actors` still being constructed (`SyncConfig.startup_timeout_s`), with a bar; seconds waited."""
    with progress_bar(config.progress, len(actors), "refit: actors started") as bar:
        seconds = wait_until_started(actors, timeout_s=config.startup_timeout_s, on_started=bar.update)
    if seconds > 1.0:
        log.info("every trainer rank and replica started (waited %.1f s)", seconds)
    return seconds


def weight_sources(trainer: Any) -> list[tuple[str, Any]]:
    """(name, source) of every rank that streams: a sharded trainer's `ranks`, or the trainer itself."""
    ranks = getattr(trainer, "ranks", None)
    if ranks is None or is_actor(trainer):
        return [("the trainer", trainer)]
    ranks = list(ranks)
    if not ranks:
        raise ConfigError("the sharded trainer has no ranks")
    return [(f"trainer rank {r}", rank) for r, rank in enumerate(ranks)]


def check_same_model(infos: list[tuple[str, RolloutModelInfo]]) -> None:
    """Every (name, model info) describes the first one's model: one plan serves them all."""
    first_who, first = infos[0]
    for who, info in infos[1:]:
        if info != first:
            raise ConfigError(
                f"{who} runs a differently configured model than {first_who} "
                f"({', '.join(_differences(first, info))}); use one Syncer per model"
            )


def _differences(one: RolloutModelInfo, other: RolloutModelInfo, model: str = "") -> list[str]:
    """What two unequal model infos differ in, named as a user configures it (a draft's as the draft model's)."""
    if (one.draft is None) != (other.draft is None):
        return ["a speculative draft model: one has one, the other none"]
    differ = [field for field in ("quantization_config", "tie_word_embeddings", "vocab_size", "mtp_prefixes")
              if getattr(one, field) != getattr(other, field)]
    if one.serves_lora != other.serves_lora:  # a plan sends the base merged or not, for one kind
        differ.append("LoRA on or off (EngineConfig.lora_rank)")
    if one.weights != other.weights:
        names = {w.name: w for w in one.weights or ()}, {w.name: w for w in other.weights or ()}
        odd = sorted(n for n in {*names[0], *names[1]} if names[0].get(n) != names[1].get(n))
        differ.append(f"expected weights, e.g. {', '.join(odd[:3])}" if odd else "expected weights")
    differ = [model + field for field in differ]
    if one.draft is not None and other.draft is not None and one.draft != other.draft:
        differ += _differences(one.draft, other.draft, "the draft model's ")
    return differ


def _class_name(cls: Any) -> str:
    # A Ray actor class keeps the decorated class's name in its metadata; repr() says "ActorClass(Name)".
    name = getattr(getattr(cls, "__ray_metadata__", None), "class_name", None) or getattr(cls, "__name__", None)
    return name or repr(cls)


def refuse_actor_classes(members: list[tuple[str, Any]]) -> None:
    """A class where an actor is expected (`TrainerActor` for `TrainerActor.remote(...)`), or a plain value (None, a
    name), fails far from here: name it."""
    try:
        from ray.actor import ActorClass
    except ImportError:  # a single-process setup without Ray
        ActorClass = type  # noqa: N806
    classes = [(who, m) for who, m in members if isinstance(m, (ActorClass, type))]
    problems = [f"{who} is the class {_class_name(m)}, not an actor: pass the handle {_class_name(m)}.remote(...) returns"
                for who, m in classes]
    # A value rather than an actor (a name, an id, None) would be listed as lacking every method: say what it is.
    problems += [f"{who} is {m!r} ({type(m).__name__}), not an actor" for who, m in members
                 if m is None or isinstance(m, (str, bytes, int, float))]
    if problems:
        raise ConfigError("refit syncs running actors:\n  " + "\n  ".join(problems))
