"""A sync's Ray metrics reach Prometheus: read back from the head node's export port after real syncs.

On the session's cluster: Ray gives every node an export port when it
starts (`MetricsExportPort` in `ray.nodes()`). Other tests sync on the same
cluster at the same time, so this one reads only the series of its own
`syncer` label (`SyncConfig.metrics_tag`).
"""

from __future__ import annotations

import time
import urllib.request
import uuid

import ray

import refit
from fixtures import model_dir

REPORT_WAIT_S = 60
"""Ray's core workers report metrics every 10 s; the export shows them after that, on a loaded machine later."""


def exported(tag: str) -> dict[str, list[str]]:
    """The head node's `ray_refit_*` lines labelled `syncer="<tag>"`, by metric."""
    head = next(node for node in ray.nodes() if node["Alive"] and "node0" in node["Resources"])
    url = f"http://{head['NodeManagerAddress']}:{head['MetricsExportPort']}/metrics"
    found: dict[str, list[str]] = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line.startswith("ray_refit_") and f'syncer="{tag}"' in line:
            found.setdefault(line.split("{")[0], []).append(line)
    return found


def value(line: str) -> float:
    return float(line.rsplit(" ", 1)[1])


def test_sync_metrics_are_exported_to_prometheus(actors_factory):
    trainer = actors_factory.trainer(model_dir(True, "bf16"), node=0)
    rollout = actors_factory.rollout(model_dir(True, "fp8_block"), node=1, load_format="dummy", kv_cache_dtype="fp8_e4m3")
    tag = f"metrics-test-{uuid.uuid4().hex[:8]}"
    syncer = refit.Syncer(trainer, rollout, refit.SyncConfig(metrics_tag=tag))
    report = syncer.sync()
    second = syncer.sync()

    deadline = time.monotonic() + REPORT_WAIT_S
    while True:  # wait for both syncs
        found = exported(tag)
        if any('outcome="served"' in line and value(line) == 2 for line in found.get("ray_refit_syncs_total", [])):
            break
        assert time.monotonic() < deadline, found
        time.sleep(1)

    assert {"ray_refit_sync_seconds_bucket", "ray_refit_sync_bytes_total", "ray_refit_served_version",
            "ray_refit_verification_total", "ray_refit_syncs_total"} <= set(found), sorted(found)
    assert any('outcome="passed"' in line and value(line) == 2 for line in found["ray_refit_verification_total"])
    assert [value(line) for line in found["ray_refit_served_version"]] == [second.version]
    received = sum(r.bytes_received for r in (*report.replicas, *second.replicas))  # a delta counts what it sent
    assert any(value(line) == received for line in found["ray_refit_sync_bytes_total"])
    assert any('stage="stream"' in line for line in found["ray_refit_sync_seconds_bucket"])
