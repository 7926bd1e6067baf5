"""One replica's update state machine, and the gate between serving and updating.

Engine-agnostic and pure Python, so every transition is tested in
milliseconds (tests/engine/test_lifecycle.py); `actors.RolloutActor` drives a
real engine with it. The states:

    SERVING(v)  --begin-->  UPDATING  --finished(v')-->  SERVING(v')
    REFUSING    --begin-->  UPDATING  --failed-->        SERVING(v) if nothing was loaded
                                                         and the replica was serving before,
                                                         REFUSING(reason) otherwise

Requests run only in SERVING. `begin` closes the gate to new requests and
waits (bounded) for in-flight ones, so no request ever sees a half-updated
model. Versions are the replica's: `begin` proposes one above anything it
served or began, so a version number never names two sets of weights, and a
failed update never advances the served version.

An open update belongs to one sync (`sync_id`) and holds a lease renewed by
each of its calls. Another sync's `begin` is refused while the lease is
live; once it lapses (the driver died or was interrupted) the owner of this
object closes the update (`expired`), so no replica is stranded.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum

from refit.adapters.serving import ServedAdapter
from refit.errors import EngineGoneError, LifecycleError, ReplicaRefusingError, SyncTimeoutError

__all__ = ["FinishedUpdate", "Phase", "ReplicaStatus", "UpdateLifecycle"]

log = logging.getLogger("refit.engine")


class Phase(StrEnum):
    SERVING = "serving"
    UPDATING = "updating"
    REFUSING = "refusing"


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    phase: Phase
    served_version: int | None  # the version of the weights it serves (None: what it started with)
    reason: str | None = None  # why it refuses, when it does
    sync_id: str | None = None  # the sync whose update is open, when updating
    adapter: ServedAdapter | None = None  # the LoRA adapter new requests run with (refit/adapters/)

    def __str__(self) -> str:
        version = "its initial weights" if self.served_version is None else f"v{self.served_version}"
        if self.adapter is not None:
            version += f" with adapter {self.adapter}"
        if self.phase is Phase.SERVING:
            return f"serving {version}"
        if self.phase is Phase.UPDATING:
            return f"updating (sync {self.sync_id})"
        return f"refusing to serve: {self.reason}"


@dataclass(frozen=True, slots=True)
class FinishedUpdate:
    """What a replica's `finish_update` reports: the update it now serves, and how it was checked."""

    seconds: float  # verification, reload finalization, post-refit stage, probe
    kv_scales_written: tuple[str, ...] = ()  # attention scales the post-refit stage wrote
    verification: str = "off"  # what was verified, and the probe's outcome
    probe_passed: bool | None = None  # None: no probe ran
    bytes_received: int = 0  # bucket bytes this replica received: a delta sync's are a fraction of a full one's
    digest: str | None = None  # of the version served, when the replica keeps it as a delta base
    draft_acceptance: float | None = None  # share of its draft model's tokens accepted on the probe prompts, if it has one


@dataclass(slots=True)
class _Update:
    sync_id: str
    proposed_version: int
    lease_s: float
    deadline: float
    resume: ReplicaStatus  # where a failure with nothing loaded returns to
    buckets_loaded: int = 0
    version: int | None = None  # the version the loaded buckets carry (every bucket of an update carries one)


class UpdateLifecycle:
    def __init__(self, *, refusal: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`refusal`: why the replica must not serve before its first update (e.g. a dummy load)."""
        self._clock = clock
        self._cond = threading.Condition()
        self._status = ReplicaStatus(Phase.REFUSING if refusal else Phase.SERVING, None, refusal)
        self._update: _Update | None = None
        self._highest_version = 0
        self._requests = 0
        self._quiet = False  # `quiesced`: new requests wait, the phase does not change
        # The syncs that began an update here (the last few): a step of a sync that never did comes from a driver
        # that began it on an earlier process of this replica (`_owned`).
        self._begun: collections.deque[str] = collections.deque(maxlen=64)

    def status(self) -> ReplicaStatus:
        with self._cond:
            return self._status

    @property
    def requests_in_flight(self) -> int:
        """Requests running now (an update's `begin` waits for them)."""
        with self._cond:
            return self._requests

    # -- serving -------------------------------------------------------------
    @contextmanager
    def request(self, *, allow_refusing: bool = False) -> Iterator[None]:
        """Run a request on a whole model: waits out an update (bounded by its lease), refuses if refusing."""
        with self._cond:
            self._cond.wait_for(lambda: self._status.phase is not Phase.UPDATING and not self._quiet)
            if self._status.phase is Phase.REFUSING and not allow_refusing:
                raise ReplicaRefusingError(f"this replica refuses to serve: {self._status.reason}")
            self._requests += 1
        try:
            yield
        finally:
            with self._cond:
                self._requests -= 1
                self._cond.notify_all()

    @contextmanager
    def quiesced(self, timeout_s: float) -> Iterator[None]:
        """No request runs inside this: new ones wait, and it waits (bounded) for those in flight.

        For a change beside the weights that an engine cannot take while it
        generates (an adapter installed into an in-process `vllm.LLM`); the
        served version does not change, so it is not an update.
        """
        with self._cond:
            self._cond.wait_for(lambda: not self._quiet)
            self._quiet = True
            if not self._cond.wait_for(lambda: self._requests == 0, timeout=timeout_s):
                self._quiet = False
                self._cond.notify_all()
                raise SyncTimeoutError(f"{self._requests} request(s) still running after {timeout_s:.0f} s; nothing was changed")
        try:
            yield
        finally:
            with self._cond:
                self._quiet = False
                self._cond.notify_all()

    # -- updating ------------------------------------------------------------
    def begin(self, sync_id: str, *, lease_s: float, drain_timeout_s: float) -> int:
        """Open an update for `sync_id`; returns the lowest version this replica accepts for it."""
        with self._cond:
            if self._update is not None:
                other = self._update
                raise LifecycleError(
                    f"another sync ({other.sync_id}) is updating this replica and its last call was "
                    f"{self._clock() - (other.deadline - other.lease_s):.1f} s ago; run one sync at a time "
                    f"per replica (its update closes by itself after {other.lease_s:.0f} s without a call)"
                )
            self._begun.append(sync_id)
            resume = self._status
            proposed = self._highest_version + 1
            self._update = _Update(sync_id, proposed, lease_s, self._clock() + lease_s, resume)
            self._status = ReplicaStatus(Phase.UPDATING, resume.served_version, None, sync_id)
            if not self._cond.wait_for(lambda: self._requests == 0, timeout=drain_timeout_s):
                self._update, self._status = None, resume
                self._cond.notify_all()
                raise SyncTimeoutError(
                    f"{self._requests} request(s) still running after {drain_timeout_s:.0f} s; the update "
                    "did not start and the replica keeps serving (raise SyncConfig.timeout_s for long requests)"
                )
            self._highest_version = proposed
            log.debug("sync %s: update began (version >= %d; was %s)", sync_id, proposed, resume)
            return proposed

    def loading(self, sync_id: str, version: int) -> None:
        """Before a bucket is loaded: checks the caller owns the update, counts the bucket, renews the lease.

        Counted before loading: a bucket that fails half-way has still changed the model.
        """
        with self._cond:
            update = self._owned(sync_id, "load_bucket")
            if version < update.proposed_version:
                raise LifecycleError(
                    f"load_bucket: version {version} is below {update.proposed_version}, the lowest this "
                    "replica accepts (it has begun or served that number already)"
                )
            if update.version not in (None, version):
                raise LifecycleError(
                    f"load_bucket: a bucket of version {version} during the update to version {update.version}; "
                    "one update loads one version"
                )
            update.version = version
            update.buckets_loaded += 1
            update.deadline = self._clock() + update.lease_s
            self._highest_version = max(self._highest_version, version)

    def renew(self, sync_id: str, step: str) -> None:
        with self._cond:
            update = self._owned(sync_id, step)
            update.deadline = self._clock() + update.lease_s

    def finishing(self, sync_id: str, version: int) -> None:
        """Before an update is finished: the caller owns it, and `version` is the one it began and loaded.

        Why: a finish naming another version would serve the loaded weights
        under a label they do not have (and burn version numbers).
        """
        with self._cond:
            update = self._owned(sync_id, "finish_update")
            if version < update.proposed_version or update.version not in (None, version):
                loaded = f"its buckets carry version {update.version}" if update.version is not None else "no bucket was loaded"
                raise LifecycleError(
                    f"finish_update: version {version} is not the version sync {sync_id} began ({loaded}, the lowest "
                    f"accepted is {update.proposed_version}); nothing was finished"
                )
            update.deadline = self._clock() + update.lease_s

    def finished(self, sync_id: str, version: int) -> None:
        """The update is complete and valid: serve `version`."""
        with self._cond:
            self._owned(sync_id, "finish_update")
            self._update = None
            self._status = ReplicaStatus(Phase.SERVING, version)
            self._highest_version = max(self._highest_version, version)
            self._cond.notify_all()
            log.debug("sync %s: serving v%d", sync_id, version)

    def failed(self, sync_id: str, reason: str, *, model_changed: bool | None = None) -> ReplicaStatus:
        """Close `sync_id`'s update after a failure (a no-op if it holds none); returns the new status.

        `model_changed` overrides the bucket count (e.g. a failed post-refit
        stage after a complete load has changed the model too).
        """
        with self._cond:
            update = self._update
            if update is None or update.sync_id != sync_id:
                return self._status
            changed = update.buckets_loaded > 0 if model_changed is None else model_changed
            if changed or update.resume.phase is Phase.REFUSING:
                why = reason if changed else update.resume.reason
                self._status = ReplicaStatus(Phase.REFUSING, update.resume.served_version, why)
            else:
                self._status = update.resume
            self._update = None
            self._cond.notify_all()
            log.warning("sync %s: update to v%d closed after %d bucket(s) (%s); now %s",
                        sync_id, update.proposed_version, update.buckets_loaded, reason, self._status)
            return self._status

    def check_group_change(self, sync_id: str | None) -> None:
        """A replica's workers may change collective groups outside an update, or within their own sync's update."""
        with self._cond:
            if self._update is None:
                return
            if self._update.sync_id != sync_id:
                raise LifecycleError(f"cannot change collective groups during sync {self._update.sync_id}'s update")
            self._update.deadline = self._clock() + self._update.lease_s

    def open_update(self) -> str | None:
        """The sync id of the open update, if any."""
        with self._cond:
            return self._update.sync_id if self._update else None

    def expired(self) -> str | None:
        """The sync id of an open update whose lease has lapsed, if any."""
        with self._cond:
            if self._update is not None and self._clock() > self._update.deadline:
                return self._update.sync_id
            return None

    def _owned(self, sync_id: str, step: str) -> _Update:
        update = self._update
        if update is None and sync_id not in self._begun:
            # Its begin reached another process: the replica was restarted since (Ray's `max_restarts`), and this one
            # holds none of that update. Gone as a member of that sync, as a dead one is: the fleet drops it.
            raise EngineGoneError(
                f"{step}: sync {sync_id} never began an update on this replica's process: it restarted since (Ray's "
                "max_restarts), a new process with none of the update's state; once it has started, add it back with "
                "Syncer.add_replica: the next sync sends it every weight"
            )
        if update is None:
            raise LifecycleError(f"{step}: no update is open (it failed, was aborted or its lease lapsed); start a new sync")
        if update.sync_id != sync_id:
            raise LifecycleError(f"{step}: sync {sync_id} does not own the open update (sync {update.sync_id} does)")
        return update
