"""A sharded trainer streams one sync at a time: its ranks agree which through their group's store.

Why: ranks meet in collectives inside a stream (the plan's routes, gathered
tensors: `RankSource`), so every rank must run the syncs' streams in one
order. One driver submits each sync's rank streams as one set
(`refit.orchestration.calls.submitting_together`), and Ray runs one caller's
calls to an actor in the order it submitted them; two callers (two drivers,
or a driver and a task it started) have no common order. Their calls can
reach rank 0 as A, B and rank 1 as B, A: rank 0 then runs A's stream and
rank 1 B's, each waiting for the other in a gather until the group's
timeout, which breaks the process group for good (training's collectives
run on it too). A rank runs one call at a time, so it cannot wait for the
other sync's turn either: the sync that comes second is refused, on every
rank, before any collective.

How, without a collective: every rank rendezvoused through one key-value
store, whose compare-and-set is atomic. The first rank to start a sync's
stream decides for all of them: the sync runs if it could take the group
(no other sync holds it), else it is refused; the decision is recorded
under the sync's id, and every other rank of that sync follows it. The last
rank to end a running sync's stream frees the group.

Why a rank waits for a holder it has itself ended: one caller's next sync
(after an interrupted one, say) reaches a rank that is done with the last
sync while another rank still ends it. The sync is queued behind that one
on every rank, so no order crossed; refusing it would fail a sync for
nothing. A holder this rank has not ended may be queued behind this sync
here (the crossed case), so there the rank decides at once.

Why a lease: a rank might never start a sync's stream (its driver was
interrupted between submitting to the ranks) and the group would be held
for ever. A holder that is not freed within twice its sync's deadline is
taken over by the next sync, and its decision revoked first; a rank that
starts a sync only after its lease lapsed refuses it, whether or not
another sync took over yet, rather than run it beside the next one. Ranks
compare leases with their own clocks, so hosts' clocks must agree to well
within a lease (minutes), as NTP keeps them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

import torch

from refit.errors import LifecycleError
from refit.plan.transfer_plan import TransferPlan

__all__ = ["StreamTurn", "take_turn", "turn_in"]

log = logging.getLogger(__name__)

_PREFIX = "refit/stream_turns/"
_HOLDER = "holder"  # the id of the sync whose stream holds the group, or "" while none does
_RUN = "run"
_LEASE_DEADLINES = 2  # a turn's lease, in its sync's deadlines
_POLL_S = 0.005  # while the other ranks end a sync this rank has ended
_NO_LEASE = "none"  # what reading a lease that is not written answers


class StreamTurn:
    """One rank's part in a running sync's turn: `end` it when the rank's stream ends, however it ends."""

    def __init__(self, store: torch.distributed.Store, sync_id: str, world_size: int) -> None:
        self._store, self._sync_id, self._world_size = store, sync_id, world_size

    def end(self) -> None:
        """Count this rank out; the last rank of the sync frees the group.

        Never raises: it runs as the stream ends, whatever ended it, and a store that cannot be reached (its
        host, rank 0, is gone) leaves a group that streams no more anyway; the stream's own error tells why."""
        try:
            if self._store.add(f"ended/{self._sync_id}", 1) == self._world_size:
                _free(self._store, self._sync_id)
                self._store.delete_key(f"ended/{self._sync_id}")
        except RuntimeError as error:  # torch.distributed's store errors
            log.warning("sync %s: this rank could not count its stream's end in the group's store: %s", self._sync_id, error)


def take_turn(group: torch.distributed.ProcessGroup | None, plan: TransferPlan, rank: int,
              ended_here: Collection[str] = ()) -> StreamTurn | None:
    """This rank's turn to stream `plan`'s sync, or `LifecycleError` (the same on every rank) if another sync's
    stream holds the group. None where no turn is needed: a group of one, or a plan no sync was handed.

    `ended_here`: the syncs whose streams this rank has ended (the latest ones): a holder among them is waited
    for, within its lease (the module docstring)."""
    if plan.sync_id is None or not torch.distributed.is_initialized():
        return None
    world_size = torch.distributed.get_world_size(group)
    if world_size == 1:
        return None
    return turn_in(_group_store(group), world_size, plan, rank, ended_here)


def turn_in(store: torch.distributed.Store, world_size: int, plan: TransferPlan, rank: int,
            ended_here: Collection[str] = ()) -> StreamTurn:
    """`take_turn` through `store`, the key-value store of a group of `world_size` ranks."""
    store = torch.distributed.PrefixStore(_PREFIX, store)
    decision = _decide(store, plan.sync_id, plan.timeout_s, ended_here)
    if store.add(f"seen/{plan.sync_id}", 1) == world_size:  # every rank has read the decision: it is needed no more
        store.delete_key(f"decision/{plan.sync_id}")
        store.delete_key(f"seen/{plan.sync_id}")
    if decision != _RUN:
        raise LifecycleError(f"trainer rank {rank}: sync {plan.sync_id} was refused: {decision}")
    return StreamTurn(store, plan.sync_id, world_size)


def _decide(store: torch.distributed.Store, sync_id: str, timeout_s: float, ended_here: Collection[str]) -> str:
    """The sync's decision, `_RUN` or why it is refused: the first rank's, which every rank of the sync follows."""
    while True:
        now = time.time()
        holder = store.compare_set(_HOLDER, "", sync_id).decode()
        if holder == sync_id:
            # Held for this sync (by this rank's claim, or another rank's): its lease runs from the first claim.
            lease_end = float(store.compare_set(f"lease/{sync_id}", "", f"{now + _LEASE_DEADLINES * timeout_s:.3f}"))
            proposal = _RUN if lease_end >= now else _lapsed(sync_id)
            if proposal != _RUN:  # a rank this late could run it beside the sync that takes the group over
                store.compare_set(f"decision/{sync_id}", _RUN, proposal)
            break
        if _lease_end(store, holder) < now:
            # The holder outlived its lease: revoke its decision first, so that no rank starts it after this one.
            store.compare_set(f"decision/{holder}", _RUN, _lapsed(holder))
            if store.compare_set(_HOLDER, holder, sync_id).decode() == sync_id:
                store.delete_key(f"lease/{holder}")
            continue  # taken over, or changed meanwhile: look again
        if holder not in ended_here or store.check([f"decision/{sync_id}"]):
            # The holder may be queued behind this sync here (orders crossed), or another rank decided this sync.
            proposal = (f"this trainer's ranks are streaming sync {holder} (another caller's: a second driver, or a "
                        "task that syncs the same trainer); a sharded trainer streams one sync at a time, in one order on "
                        "every rank, so a sync that reaches its ranks while another streams is refused on all of them. "
                        "Sync again once that one has ended")
            break
        time.sleep(_POLL_S)  # this rank ended the holder; its other ranks are ending it, and this sync comes next
    decision = store.compare_set(f"decision/{sync_id}", "", proposal).decode()  # the first rank's decision stands
    if decision != _RUN:
        _free(store, sync_id)  # if this sync holds the group (claimed by a rank before the refusal was known)
    return decision


def _lapsed(sync_id: str) -> str:
    return f"sync {sync_id}'s turn lapsed before this rank started it"


def _lease_end(store: torch.distributed.Store, sync_id: str) -> float:
    """When `sync_id`'s hold on the group lapses; not yet, while its claimer has yet to write the lease.

    Read with one compare-and-set that never writes (a missing key answers with the expected value): a `get`
    after a `check` would wait out the store's timeout for a lease freed in between."""
    value = store.compare_set(f"lease/{sync_id}", _NO_LEASE, _NO_LEASE)
    return float("inf") if value == _NO_LEASE.encode() else float(value)


def _free(store: torch.distributed.Store, sync_id: str) -> None:
    """The group is no longer held by `sync_id` (nothing changes if another sync holds it)."""
    if store.compare_set(_HOLDER, sync_id, "").decode() == "":
        store.delete_key(f"lease/{sync_id}")


def _group_store(group: torch.distributed.ProcessGroup | None) -> torch.distributed.Store:
    """The store `group`'s ranks rendezvoused through (torch keeps it beside the group, unexported)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_process_group_store(group or distributed_c10d._get_default_group())
