"""Ray metrics of every sync (Prometheus-compatible, through Ray's metrics agent), exported by the driver.

Ray serves them with the rest of its metrics on each node's export port
(`ray start --metrics-export-port`, or `ray.init(_metrics_export_port=...)`),
prefixed `ray_`: `ray_refit_sync_seconds` (per stage; `plan` only when a plan was made), `ray_refit_sync_bytes`,
`ray_refit_served_version` (-1 for a replica a served sync dropped), `ray_refit_verification`,
`ray_refit_post_refit_scale_writes` and `ray_refit_syncs` (by outcome).
Each carries a `syncer` label, `SyncConfig.metrics_tag`. Every node serves
them; Ray picks a free export port unless given one, and lists it as
`ray.nodes()[i]["MetricsExportPort"]`.
Nothing is recorded without a Ray connection (a single-process sync).
"""

from __future__ import annotations

import functools
from typing import Any

from refit.orchestration.report import SyncReport

__all__ = ["record_failure", "record_sync"]

_STAGES = ("plan", "begin", "stream", "finish", "total")
_DROPPED = -1  # the served-version gauge of a replica a served sync dropped (a failed sync records no versions)


@functools.cache
def _metrics() -> dict[str, Any]:
    from ray.util import metrics

    return {
        "seconds": metrics.Histogram(
            "refit_sync_seconds", "Seconds a sync spent, per stage", tag_keys=("syncer", "stage"),
            boundaries=[0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300],
        ),
        "bytes": metrics.Counter("refit_sync_bytes", "Bytes each replica received", tag_keys=("syncer", "replica")),
        "version": metrics.Gauge(
            "refit_served_version", "Weight version each replica serves; -1 once a served sync dropped it", tag_keys=("syncer", "replica")),
        "verification": metrics.Counter("refit_verification", "Sync verification outcomes", tag_keys=("syncer", "outcome")),
        "scale_writes": metrics.Counter(
            "refit_post_refit_scale_writes", "KV-cache scales the post-refit stage wrote", tag_keys=("syncer", "replica")),
        "syncs": metrics.Counter("refit_syncs", "Syncs, by outcome", tag_keys=("syncer", "outcome")),
    }


def _enabled() -> bool:
    import ray

    return ray.is_initialized()


def record_sync(report: SyncReport, verified: bool, syncer: str) -> None:
    if not _enabled():
        return
    m = _metrics()
    seconds = (report.plan_seconds, report.begin_seconds, report.stream_seconds, report.finish_seconds, report.total_seconds)
    for stage, value in zip(_STAGES, seconds):
        if stage == "plan" and not value:
            continue  # the plan was reused: a 0.0 per sync would bury the plans actually made
        m["seconds"].observe(value, tags={"syncer": syncer, "stage": stage})
    for r in report.replicas:
        replica = {"syncer": syncer, "replica": str(r.replica)}
        if r.bytes_received:  # a counter takes no zero (a replica whose bytes came another way reports none)
            m["bytes"].inc(r.bytes_received, tags=replica)
        m["version"].set(r.served_version or 0, tags=replica)
        if r.kv_scales_written:
            m["scale_writes"].inc(len(r.kv_scales_written), tags=replica)
    for d in report.dropped:  # no longer this Syncer's: its last version would otherwise show as served for ever
        m["version"].set(_DROPPED, tags={"syncer": syncer, "replica": str(d.replica)})
    outcome = "off" if not verified else ("probe_breached" if report.probe_breached else "passed")
    m["verification"].inc(tags={"syncer": syncer, "outcome": outcome})
    m["syncs"].inc(tags={"syncer": syncer, "outcome": "served"})


def record_failure(verification_failed: bool, syncer: str) -> None:
    if not _enabled():
        return
    m, failed = _metrics(), {"syncer": syncer, "outcome": "failed"}
    if verification_failed:
        m["verification"].inc(tags=failed)
    m["syncs"].inc(tags=failed)
