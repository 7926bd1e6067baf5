"""The `ray` transport's receiving end: a bucket's parts fetched from Ray's object store, and what a failed fetch means.

Through Ray a replica gets each bucket as `[ref, ...]`, one object ref per
sending rank, and fetches the parts itself; a trainer that failed while
producing a part stored its exception in that object.
"""

from __future__ import annotations

import time
from typing import Any

from refit.errors import ActorDiedError, PlanMismatchError, RefitError, SyncTimeoutError
from refit.transport.buckets import WireBucket

__all__ = ["fetch_parts", "remote_error"]


def fetch_parts(bucket: WireBucket | list[Any], timeout_s: float) -> list[WireBucket]:
    """The bucket's parts, fetched where they are refs, all within `timeout_s` (`SyncConfig.timeout_s`)."""
    if isinstance(bucket, WireBucket):
        return [bucket]
    deadline = time.monotonic() + timeout_s
    parts = []
    for rank, part in enumerate(bucket):
        who = "the trainer" if len(bucket) == 1 else f"trainer rank {rank}"
        if not isinstance(part, WireBucket):
            part = _fetch_part(part, who, deadline - time.monotonic(), timeout_s)
        if not isinstance(part, WireBucket):  # what a hand-written stream yielded
            raise PlanMismatchError(f"{who}'s stream_buckets yielded a {type(part).__name__}, not a WireBucket: yield what "
                                    "refit.produce_buckets or refit.transport.buckets.pack_bucket make")
        parts.append(part)
    return parts


def _fetch_part(ref: Any, who: str, remaining_s: float, timeout_s: float) -> WireBucket:
    import ray

    try:
        return ray.get(ref, timeout=max(remaining_s, 0.0))
    except ray.exceptions.GetTimeoutError:
        raise SyncTimeoutError(f"fetching a bucket from the trainer took over {timeout_s:.0f} s (SyncConfig.timeout_s)") from None
    except Exception as error:  # the trainer raised (a refused tensor, ...) or is gone
        raise remote_error(error, who, "stream_buckets") from None


def remote_error(error: Exception, who: str, method: str) -> Exception:
    """What a failed `ray.get` of `who`'s `method` means: the remote exception itself, or that `who` is gone.

    One of refit's own errors comes back as it was raised: its message says what went wrong and where, and Ray's
    wrapper would put the remote traceback in front of it. Any other exception keeps the wrapper, whose traceback
    shows where in the remote code it arose."""
    import ray

    if isinstance(error, ray.exceptions.RayTaskError):
        if isinstance(error.cause, RefitError):
            return error.cause
        cause = error.as_instanceof_cause()
        if method == "stream_buckets" and isinstance(error.cause, AttributeError) and "attribute 'send'" in str(error.cause):
            cause.add_note(f"{who}'s stream_buckets did `yield from` an iterator that is not a generator (a list's, say): "
                           "Ray drives a streaming method with send(), which such an iterator lacks; yield each bucket "
                           "in a for loop instead")
        return cause
    if isinstance(error, ray.exceptions.ActorUnavailableError) and "restart" in str(error):  # restarting, or restarted
        # Ray restarts it (max_restarts): a new process, without anything a sync gave the old one.
        advice = ("; once it has started, add it back with Syncer.add_replica: the next sync sends it every weight"
                  if who.startswith("rollout") else "")
        gone = ActorDiedError(f"{who} died and Ray restarts it ({method}): a new process, with none of the old "
                              f"one's state{advice}", who)
        gone.__cause__ = error
        return gone
    if isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)):
        # Ray's message ends with the cause (e.g. the exception that failed the actor's constructor).
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        gone = ActorDiedError(f"{who} died or is unreachable ({method}): {type(error).__name__}: {lines[-1] if lines else ''}", who)
        gone.__cause__ = error
        return gone
    return error
