"""Step 5 of a sync: gather what it did into a `SyncReport`, once every remaining replica serves the new version.

Why apart from `report`: that module is the report's plain data, which a
trainer image may read without a driver; this one asks the members for
what the report says of them (where each runs, how long the trainer's
ranks took), after the sync is done, so a member that no longer answers
leaves a blank rather than failing a sync that succeeded.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from refit.engine.lifecycle import FinishedUpdate
from refit.errors import EngineError
from refit.orchestration.calls import Outcome
from refit.orchestration.fleet import Roll, replica_id
from refit.orchestration.report import ReplicaReport, SyncReport
from refit.plan.transfer_plan import TransferPlan
from refit.protocols import has_method

__all__ = ["Attempt", "check_finished", "report_questions", "sync_report"]


class Attempt(NamedTuple):
    """What one attempt that every member finished left: its sync id, the version, and per replica what it did."""

    sync_id: str
    number: int  # 1 for the first; each one after it lost a member (or a delta base)
    version: int
    load_seconds: dict[str, float]
    finished: dict[str, FinishedUpdate]
    modes: dict[str, str]
    answers: list[list[Outcome]]  # to the questions asked beside finish: the trainer's `base_entries`, then `report_questions`


def check_finished(finished: dict[str, Any]) -> None:
    """Every replica's `finish_update` returned a `FinishedUpdate` (a custom replica may not)."""
    wrong = [f"{who}: {f!r}" for who, f in finished.items() if not isinstance(f, FinishedUpdate)]
    if wrong:
        raise EngineError("finish_update must return a refit.engine.lifecycle.FinishedUpdate:\n  " + "\n  ".join(wrong))


def report_questions(roll: Roll, sources: list[tuple[str, Any]], known_nodes: dict[str, str]) -> list[tuple]:
    """What the report asks the members, as `call_groups` groups: where each replica runs (if not known from an earlier
    sync: a replica's actor never moves), and what the trainer's ranks say their stream cost (optional: custom
    trainers may not measure themselves)."""
    measured = sources if all(has_method(source, "last_stream_stats") for _, source in sources) else []
    return [([m for m in roll.members if m[0] not in known_nodes], "node_id", ()), (measured, "last_stream_stats", ())]


def sync_report(plan: TransferPlan, done: Attempt, roll: Roll, stages: dict[str, float], answers: list[list[Outcome]],
                known_nodes: dict[str, str], *, start: float, startup_seconds: float, plan_seconds: float,
                digest: str | None, transport: tuple[str, str]) -> SyncReport:
    """What the sync did, per stage (`stages`, seconds) and per replica; `answers`: to `report_questions`, whose node
    ids join `known_nodes`; `start`: when the sync began (`time.perf_counter`); `transport`: its name, and why."""
    node_answers, stats = answers
    # "" for a replica that no longer answers: the sync is done, that is no reason to fail it (and it is asked again).
    known_nodes.update({o.who: o.value for o in node_answers if o.ok})
    nodes = {who: known_nodes.get(who, "") for who in done.finished}
    return SyncReport(
        version=done.version,
        tensors=len(plan.tensors),
        buckets=len(plan.buckets),
        bytes_on_wire=plan.wire_bytes,
        plan_seconds=plan_seconds,
        **_trainer_stats(stats),
        total_seconds=time.perf_counter() - start,
        replicas=tuple(
            ReplicaReport(replica_id(who), nodes[who], done.version, done.load_seconds.get(who, 0.0), f.seconds,
                          f.kv_scales_written, f.verification, done.modes.get(who, "full"), f.bytes_received, f.digest,
                          f.draft_acceptance)
            for who, f in done.finished.items()
        ),
        begin_seconds=stages["begin"],
        stream_seconds=stages["stream"],
        finish_seconds=stages["finish"],
        probe_breached=any(f.probe_passed is False for f in done.finished.values()),
        startup_seconds=startup_seconds,
        dropped=tuple(roll.dropped),
        attempts=done.number,
        digest=digest,
        transport=transport[0],
        transport_reason=transport[1],
    )


def _trainer_stats(outcomes: list[Outcome]) -> dict[str, Any]:
    """The slowest rank's producing time and the bytes all ranks gathered; None where the ranks did not say."""
    unknown = {"trainer_seconds": None, "gathered_bytes": None}
    if not outcomes or not all(o.ok and isinstance(o.value, dict) and "seconds" in o.value for o in outcomes):
        return unknown
    gathered = [o.value.get("gathered_bytes") for o in outcomes]
    return {"trainer_seconds": max(float(o.value["seconds"]) for o in outcomes),
            "gathered_bytes": None if None in gathered else int(sum(gathered))}
