"""What `record_sync` records for a report (no Ray: its metrics are replaced by recorders).

The export through Ray's metrics agent to Prometheus: tests/verification/test_metrics.py.
"""

from __future__ import annotations

import pytest

from refit.orchestration import metrics
from refit.orchestration.report import DroppedReplica, ReplicaReport, SyncReport

FULL = 1 << 20


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[float, dict]] = []

    def observe(self, value: float, tags: dict) -> None:
        self.calls.append((value, tags))

    set = observe

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self.calls.append((value, tags))


@pytest.fixture
def recorded(monkeypatch) -> dict[str, Recorder]:
    recorders = {name: Recorder() for name in ("seconds", "bytes", "version", "verification", "scale_writes", "syncs")}
    monkeypatch.setattr(metrics, "_enabled", lambda: True)
    monkeypatch.setattr(metrics, "_metrics", lambda: recorders)
    return recorders


def replica(rid: int, mode: str, bytes_received: int, version: int = 2) -> ReplicaReport:
    return ReplicaReport(replica=rid, node_id="n", served_version=version, load_seconds=0.1, finish_seconds=0.1,
                         kv_scales_written=(), mode=mode, bytes_received=bytes_received)


def report(*replicas: ReplicaReport, **kwargs) -> SyncReport:
    return SyncReport(**{"version": 2, "tensors": 3, "buckets": 1, "bytes_on_wire": FULL, "plan_seconds": 0.0,
                         "trainer_seconds": None, "total_seconds": 0.5, "replicas": replicas, **kwargs})


def test_bytes_count_what_each_replica_received_a_delta_at_its_size(recorded):
    """A replica synced by a delta was counted at the full sync's size."""
    metrics.record_sync(report(replica(0, "full", FULL), replica(1, "delta", 4096)), verified=True, syncer="s")
    assert recorded["bytes"].calls == [(FULL, {"syncer": "s", "replica": "0"}), (4096, {"syncer": "s", "replica": "1"})]


def test_the_plan_stage_is_observed_only_when_a_plan_was_made(recorded):
    """A reused plan's 0.0 was observed on every sync, pulling the plan histogram towards zero."""
    metrics.record_sync(report(replica(0, "full", FULL)), verified=True, syncer="s")
    metrics.record_sync(report(replica(0, "full", FULL), plan_seconds=0.25), verified=True, syncer="s")
    assert [value for value, tags in recorded["seconds"].calls if tags["stage"] == "plan"] == [0.25]


def test_a_dropped_replica_no_longer_shows_the_version_it_served(recorded):
    """A replica dropped by a sync kept its last version in the gauge, as if it still served it."""
    metrics.record_sync(report(replica(0, "full", FULL), replica(1, "full", FULL)), verified=True, syncer="s")
    dropped = DroppedReplica(replica=1, stage="stream", cause="died", error="ActorDiedError: killed")
    metrics.record_sync(report(replica(0, "delta", 4096, version=3), version=3, dropped=(dropped,)), verified=True, syncer="s")
    last = {tags["replica"]: value for value, tags in recorded["version"].calls}
    assert last == {"0": 3, "1": -1}  # -1: no version (the gauge's documented value)
