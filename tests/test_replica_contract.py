"""Every replica and every weight source has exactly the methods `refit.protocols` declares, each where it belongs.

The replica's methods (and a weight source's) are declared once, in
refit/protocols.py, each marked required or optional and, for a replica,
with the Ray concurrency group a threaded actor runs it in
(`REPLICA_METHODS`, `SOURCE_METHODS`). The delegating layers are made from
that declaration; this checks them, and the layers written by hand
(`ReplicaCore`, `AsyncReplica`, the trainers), against it. Pure class
inspection: no engine is started.
"""

from __future__ import annotations

import inspect

import pytest

from refit.protocols import (
    REPLICA_METHODS,
    SOURCE_METHODS,
    FullRolloutReplica,
    FullWeightSource,
    RolloutReplica,
    WeightSource,
    declared_methods,
    missing_methods,
)

# What a replica kind has besides the declared methods, and why; anything else public is a method the declaration lacks.
EXTRAS = {
    "ReplicaCore": {"request", "close", "drop_delta_base"},  # the engine's holder: users' requests, teardown, memory
    "AsyncReplica": {"serve"},  # one user request
    "ReplicaMethods": set(),
    "AsyncReplicaMethods": set(),
    "ReplicaShell": {"scale_table"},  # `refit inspect`'s table
    "RolloutActor": {"generate", "scale_table"},
    "AsyncRolloutActor": {"generate", "scale_table"},
    "ServerRollout": {"scale_table", "url"},
}
# Where the actor runs is the actor's to say, not the engine holder's.
ACTOR_ONLY = {"node_id"}


def _replica_kinds() -> dict[str, tuple[type, bool]]:
    """name -> (class, whether Ray concurrency groups apply to it)."""
    from actors import AsyncRolloutActor, RolloutActor, ServerRollout
    from actors._replica_shell import ReplicaShell
    from refit.engine.async_llm import AsyncReplica, AsyncReplicaMethods
    from refit.engine.replica import ReplicaCore, ReplicaMethods

    return {
        "ReplicaCore": (ReplicaCore, False),
        "AsyncReplica": (AsyncReplica, False),
        "ReplicaMethods": (ReplicaMethods, False),
        "AsyncReplicaMethods": (AsyncReplicaMethods, False),
        "ReplicaShell": (ReplicaShell, True),
        "RolloutActor": (RolloutActor.__ray_metadata__.modified_class, True),
        "AsyncRolloutActor": (AsyncRolloutActor.__ray_metadata__.modified_class, False),  # async: one event loop
        "ServerRollout": (ServerRollout.__ray_metadata__.modified_class, True),
    }


def _public_methods(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, callable) if not name.startswith("_")}


def _group(cls: type, name: str) -> str | None:
    """The Ray concurrency group `cls.<name>` runs in: what `ray.method(concurrency_group=...)` set on the function,
    which Ray 2.60 reads into `__ray_metadata__.method_meta.concurrency_group_for_methods` (checked below)."""
    return getattr(getattr(cls, name), "__ray_concurrency_group__", None)


def test_the_declaration_marks_every_method_and_the_typed_protocols_hold_the_required_ones():
    assert set(REPLICA_METHODS) == set(declared_methods(FullRolloutReplica))
    assert set(SOURCE_METHODS) == set(declared_methods(FullWeightSource))
    for protocol, full in [(RolloutReplica, FullRolloutReplica), (WeightSource, FullWeightSource)]:
        methods = [n for c in (protocol, full) for n in vars(c) if not n.startswith("_") and callable(getattr(c, n))]
        marks = declared_methods(full)
        assert set(methods) == set(marks), "a protocol method without @required or @optional"
        assert {n for n in vars(protocol) if n in marks} == {n for n, s in marks.items() if not s.optional}
        assert {n for n in vars(full) if n in marks} == {n for n, s in marks.items() if s.optional}
    assert {name for name, spec in REPLICA_METHODS.items() if spec.optional} == {
        "base_digest", "join_transport", "leave_transport", "transport_group", "transport_ranks", "transports", "last_update",
        "scale_records", "stage_adapter", "serve_adapter", "unstage_adapter",
    }
    assert all(spec.group in {"observe", "update", "serve"} for spec in REPLICA_METHODS.values())
    assert all(spec.group is None for spec in SOURCE_METHODS.values())


def test_the_syncer_asks_only_for_the_required_methods():
    """`missing_methods` (the Syncer's check of each replica and source) names only what is required."""

    class Bare:
        pass

    assert missing_methods(Bare(), RolloutReplica) == [n for n, s in REPLICA_METHODS.items() if not s.optional]
    assert missing_methods(Bare(), WeightSource) == ["weight_metadata", "stream_buckets"]
    assert missing_methods(Bare(), FullRolloutReplica) == missing_methods(Bare(), RolloutReplica)


@pytest.mark.parametrize("kind", list(EXTRAS))
def test_every_replica_kind_has_exactly_the_declared_methods(kind):
    cls, ray_groups = _replica_kinds()[kind]
    declared = set(REPLICA_METHODS) - (ACTOR_ONLY if kind in {"ReplicaCore", "AsyncReplica"} else set())
    assert _public_methods(cls) == declared | EXTRAS[kind]
    for name in declared:
        wanted = [(p.name, p.default) for p in inspect.signature(getattr(FullRolloutReplica, name)).parameters.values()]
        given = [(p.name, p.default) for p in inspect.signature(getattr(cls, name)).parameters.values()]
        assert given[: len(wanted)] == wanted, (kind, name, given)  # the protocol's parameters, in order, with defaults
        if ray_groups:
            assert _group(cls, name) == REPLICA_METHODS[name].group, (kind, name)


@pytest.mark.parametrize("kind", ["AsyncReplica", "AsyncReplicaMethods", "AsyncRolloutActor"])
def test_an_async_replica_observes_without_awaiting_and_awaits_the_rest(kind):
    """On an async actor's event loop, "observe" methods answer at once; the update steps and provenance are coroutines."""
    cls, _ = _replica_kinds()[kind]
    for name, spec in REPLICA_METHODS.items():
        if hasattr(cls, name):
            assert inspect.iscoroutinefunction(getattr(cls, name)) == (spec.group != "observe"), (kind, name)


@pytest.mark.parametrize("actor", ["RolloutActor", "ServerRollout"])
def test_ray_reads_the_declared_groups_and_the_actor_declares_them(actor):
    import actors

    metadata = getattr(actors, actor).__ray_metadata__
    groups = metadata.method_meta.concurrency_group_for_methods
    assert {name: groups[name] for name in REPLICA_METHODS} == {n: s.group for n, s in REPLICA_METHODS.items()}
    assert set(groups.values()) <= set(metadata.concurrency_groups)


def test_the_delegating_methods_carry_the_protocols_docstrings():
    from actors._replica_shell import ReplicaShell
    from refit.engine.async_llm import AsyncReplicaMethods
    from refit.engine.replica import ReplicaMethods

    for cls in (ReplicaMethods, AsyncReplicaMethods, ReplicaShell):
        for name in REPLICA_METHODS:
            assert getattr(cls, name).__doc__ == getattr(FullRolloutReplica, name).__doc__, (cls.__name__, name)


@pytest.mark.parametrize("source", ["TrainerActor", "TrainerRank"])
def test_every_trainer_has_every_declared_source_method(source):
    """A trainer's other methods (training, generation) are its own: the declared ones must all be there, required
    ones taking the protocol's parameters first."""
    import actors

    cls = getattr(actors, source).__ray_metadata__.modified_class
    assert set(SOURCE_METHODS) <= _public_methods(cls)
    for name in SOURCE_METHODS:
        declared = list(inspect.signature(getattr(FullWeightSource, name)).parameters)
        given = list(inspect.signature(getattr(cls, name)).parameters)
        assert len(given) >= len(declared), (source, name, given)
        if not SOURCE_METHODS[name].optional:
            assert given[: len(declared)] == declared, (source, name, given)
