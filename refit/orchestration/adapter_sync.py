"""An adapter sync: the trainer's LoRA adapter, and nothing else, into every replica, staged everywhere then served.

The whole flow (`Syncer.sync_adapter` runs it on the Syncer's fleet):

1. the source describes its adapter (`adapter_meta`: name, PEFT config,
   shapes, digest); it is checked against the rollout's base weights
   before anything is sent, so a wrong rank or a module the base lacks is
   refused by name with no replica touched;
2. the source puts the adapter in Ray's object store once
   (`adapter_weights`), and every replica fetches it from there (the
   driver never holds the bytes);
3. every replica *stages* it: installed in its engine beside the adapter
   it serves, serving no one yet, and reports the digest of the bytes its
   workers built it from, which must be the source's;
4. only when every replica has staged it does each one *serve* it: new
   requests run on it, running ones finish on the old one.

A failure before step 4 (a replica refused the adapter, a digest differs,
the driver was interrupted) unstages it everywhere: every replica keeps
serving the adapter it served. A failure during step 4 (a replica refused
the swap) can leave a mix: each replica serves the new adapter on its own,
and those that already do keep it. A replica that dies or misses the
deadline is dropped from the fleet, as in a weight sync. The base is never touched:
no reload opens, no request waits for one.
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

from refit.adapters import check_adapter
from refit.errors import ConfigError, SyncTimeoutError, VerificationError
from refit.orchestration.calls import Outcome, call_all, raise_first_error, submit_all
from refit.orchestration.fleet import Roll, replica_id
from refit.orchestration.report import AdapterSyncReport
from refit.plan.config import SyncConfig
from refit.plan.transfer_plan import RolloutModelInfo
from refit.protocols import has_method

__all__ = ["sync_adapter"]

log = logging.getLogger("refit.orchestration")


def sync_adapter(sources: Sequence[tuple[str, Any]], roll: Roll, rollout: RolloutModelInfo, config: SyncConfig,
                 last_version: int) -> AdapterSyncReport:
    """The flow of the module docstring on `roll`'s members; the version is above `last_version` and every one served."""
    start, timeout = time.perf_counter(), config.timeout_s
    if len(sources) != 1 or not has_method(sources[0][1], "adapter_weights"):
        raise ConfigError(
            "sync_adapter needs one weight source with adapter_meta() and adapter_weights() (a LoRA TrainerActor, or "
            "refit.TrainerWeights(..., adapter=...)); a sharded trainer's adapter sync is not built (docs/lora.md)"
        )
    sync_id = uuid.uuid4().hex[:12]
    (meta,) = raise_first_error(call_all(sources, "adapter_meta", timeout_s=timeout))
    if meta.digest is None:
        raise ConfigError(f"adapter_meta() of adapter {meta.name!r} carries no digest: the replicas' bytes are checked "
                          "against it (AdapterWeights.meta() computes it)")
    check_adapter(meta, rollout.weights, max_rank=sys.maxsize)  # each replica checks its engine's rank itself
    roll.stage = "begin"
    statuses = roll.settle(call_all(roll.members, "status", timeout_s=timeout), sync_id)
    version = 1 + max([last_version] + [s.adapter.version for s in statuses.values() if s.adapter is not None])
    adapter = _put_adapter(sources[0], timeout)
    roll.stage = "stage"
    # Until the stage round's answers are in, any member may hold it: a driver interrupted while it waits leaves
    # every replica staging it, and a staged adapter refuses other adapter syncs for `timeout_s`. Each unstage is
    # queued behind its stage, and a replica that did not stage it ignores it.
    staged_on: list[tuple[str, Any]] = list(roll.members)
    try:
        outcomes = call_all(roll.members, "stage_adapter", sync_id, version, adapter, timeout, timeout_s=timeout)
        staged_on = [m for m, o in zip(roll.members, outcomes) if o.ok]
        digests = roll.settle(outcomes, sync_id)
        wrong = {who: digest for who, digest in digests.items() if digest != meta.digest}
        if wrong:
            raise VerificationError(f"adapter {meta.name!r} v{version}: the bytes these replicas hold are not the "
                                    f"trainer's (digest {meta.digest[:12]}): {sorted(wrong)}")
    except BaseException:
        _unstage(staged_on, sync_id, version, timeout)
        raise
    stage_seconds = time.perf_counter() - start
    roll.stage = "serve"
    swaps = roll.settle(call_all(roll.members, "serve_adapter", sync_id, version, timeout_s=timeout), sync_id)
    log.info("adapter sync %s: %r v%d served by %d replica(s), %.1f KiB each", sync_id, meta.name, version, len(swaps),
             meta.nbytes / 1024)
    return AdapterSyncReport(
        name=meta.name, version=version, sync_id=sync_id, bytes_per_replica=meta.nbytes, digest=meta.digest,
        stage_seconds=stage_seconds, total_seconds=time.perf_counter() - start,
        replicas={replica_id(who): swap for who, swap in swaps.items()}, dropped=tuple(roll.dropped),
    )


def _put_adapter(source: tuple[str, Any], timeout_s: float) -> Any:
    """The adapter, or (from an actor) the ref of its one copy in the object store, ready within the deadline."""
    (who, pending), = submit_all([source], "adapter_weights")
    if isinstance(pending, Outcome):
        return raise_first_error([pending])[0]
    import ray

    ready, _ = ray.wait([pending], timeout=timeout_s)
    if not ready:
        raise SyncTimeoutError(f"{who}: adapter_weights did not answer within {timeout_s:.0f} s (SyncConfig.timeout_s)")
    return pending


def _unstage(members: list[tuple[str, Any]], sync_id: str, version: int, timeout_s: float) -> None:
    """Drop the staged version where it was staged; a member that cannot answer drops it at its next stage anyway."""
    for outcome in call_all(members, "unstage_adapter", sync_id, version, timeout_s=timeout_s):
        if not outcome.ok:
            log.warning("adapter sync %s: %s could not unstage v%d: %r", sync_id, outcome.who, version, outcome.error)

