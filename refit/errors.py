"""Every exception refit raises, in one place.

Each message names the offending tensor, setting or replica, what was
expected, and what to do, so a failed refit can be fixed without reading
refit's source. All of them derive from `RefitError`, so callers can catch
one type; each also derives from the builtin a caller would expect
(`ValueError` for bad input, `RuntimeError` for a failed step,
`TimeoutError` for a missed deadline). The one exception here that is not a
`RefitError`, `GroupBroken`, never leaves a sync: the Syncer catches it.

This module imports nothing of refit, so any module may import it.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = [
    "ActorDiedError",
    "BaseMismatchError",
    "ConfigError",
    "EngineError",
    "EngineGoneError",
    "EngineHungError",
    "GatherFailedError",
    "GroupBroken",
    "InvalidTensorError",
    "LifecycleError",
    "PlanMismatchError",
    "RefitError",
    "ReplicaRefusingError",
    "ServerError",
    "ServerGoneError",
    "SyncTimeoutError",
    "TransportError",
    "UnsupportedSchemeError",
    "VerificationError",
]

_SETTLEMENT = "_refit_settlement"


class RefitError(Exception):
    """Base class of refit's errors."""


class ConfigError(RefitError, ValueError):
    """A setting of `SyncConfig`, `EngineConfig` or the CLI is invalid."""


class InvalidTensorError(RefitError, ValueError):
    """A weight or token id cannot be used as it is (NaN/Inf, dtype, rank, out of range)."""


class UnsupportedSchemeError(RefitError, ValueError):
    """A quantization config asks for something refit does not implement."""


class PlanMismatchError(RefitError, ValueError):
    """A weight source's tensors do not match the plan made for them, or the rollout's weights."""


class LifecycleError(RefitError, RuntimeError):
    """An update lifecycle step was called out of order, or the replica (or a sharded trainer's ranks) is busy with
    another sync."""


class ReplicaRefusingError(LifecycleError):
    """The replica holds no whole, valid model (a failed update, placeholder scales) and will not serve."""


class EngineError(RefitError, RuntimeError):
    """A rollout engine refused or failed an update."""


class VerificationError(RefitError, RuntimeError):
    """A verified sync found that a replica would not hold what the trainer sent: bytes altered in
    transit, a tensor missing, a scale the engine holds differently, or a breached probe."""


class BaseMismatchError(VerificationError):
    """A rebuilt tensor's bytes differ from the sender's: this replica's base is not the one the delta was made against."""


class ActorDiedError(EngineError):
    """A trainer rank or rollout replica died, failed to start, or cannot be reached; `who` names it."""

    def __init__(self, message: str, who: str = "") -> None:
        super().__init__(message)
        self.who = who  # pickled with the instance's __dict__, so it survives Ray


class EngineGoneError(EngineError):
    """A replica's engine is gone while the replica's actor lives on: a server that died, or restarted as another
    server (that replica can never serve again), or a process Ray restarted since the sync's begin reached the one
    before (its actor can be added back, `Syncer.add_replica`). A fleet drops it as it drops a dead actor."""


class ServerError(EngineError):
    """A `vllm serve` replica's server cannot be reached, lacks what refit needs (dev mode, refit's worker
    extension or weight-transfer backend), or restarted; the message names its URL and what to do."""


class ServerGoneError(ServerError, EngineGoneError):
    """A `vllm serve` replica's server stopped answering connections, or restarted since the replica connected."""


class SyncTimeoutError(RefitError, TimeoutError):
    """A remote call of a sync missed its deadline (a dead or hung trainer or replica)."""


class EngineHungError(SyncTimeoutError):
    """A replica's engine did not answer within the sync's deadline while the replica's actor answers (a hung or
    overloaded `vllm serve` server): a fleet drops it as it drops an actor that missed the deadline."""


class TransportError(RefitError, RuntimeError):
    """A transport cannot carry a sync: an unreachable rendezvous, a group a member left, no CUDA for `ipc`."""


class GatherFailedError(RefitError, RuntimeError):
    """A rank of a sharded trainer could not read its part of a tensor its stream gathers, or make room for the whole
    (out of memory, say): every rank of that gather raises this at once (the failing rank with its cause, the others
    naming it), and their collectives stay paired."""


class GroupBroken(Exception):
    """Members lost mid-broadcast: the collective group is broken for every member, so the survivors begin again.

    Internal to a sync (`Syncer.sync` catches it); never reaches a caller.
    `lost` holds `refit.orchestration.fleet.Lost` items (name, how, error);
    `refit.orchestration.fleet.broken_group` builds one from a sync's losses.
    """

    def __init__(self, lost: list[tuple[str, str, BaseException]]) -> None:
        super().__init__(", ".join(f"{who} {how}" for who, how, _ in lost))
        self.lost = lost


# Beside the exceptions (and not exported): what an error still owes once it is reported.


def with_settlement(error: BaseException, settle: Callable[[], None]) -> BaseException:
    """`error`, carrying what its stream still owes the processes it streams with once the error is reported (a
    sharded rank's gathers that its peers wait in: `refit.sharding.RankSource.stream`)."""
    setattr(error, _SETTLEMENT, settle)
    return error


def take_settlement(error: BaseException) -> Callable[[], None] | None:
    """What `with_settlement` gave `error` (or None), taken off it: the error is pickled when reported, and the
    settlement holds the stream's source (a rank's model, its group's store)."""
    return error.__dict__.pop(_SETTLEMENT, None)
