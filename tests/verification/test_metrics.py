"""A sync's Ray metrics reach Prometheus: read back from the head node's export port after real syncs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from fixtures.cluster import QUIET_ENV

SCRIPT = textwrap.dedent("""
    import json, time, urllib.request
    import ray
    import refit
    from actors import RolloutActor, TrainerActor
    from fixtures import model_dir
    from fixtures.cluster import local_cluster
    from refit.sharding.process_group import free_port

    with local_cluster(2, metrics_port=free_port()):
        trainer = TrainerActor.options(num_cpus=0, resources={"node0": 0.01}).remote(str(model_dir(True, "bf16")))
        rollout = RolloutActor.options(num_cpus=0, resources={"node1": 0.01}).remote(refit.EngineConfig(
            model=str(model_dir(True, "fp8_block")), load_format="dummy", kv_cache_dtype="fp8_e4m3", max_model_len=128))
        syncer = refit.Syncer(trainer, rollout)
        report = syncer.sync()
        syncer.sync()
        head = next(n for n in ray.nodes() if "node0" in n["Resources"])
        url = f"http://{head['NodeManagerAddress']}:{head['MetricsExportPort']}/metrics"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # metrics are reported every second: wait for both syncs
            found = {}
            for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
                if line.startswith("ray_refit_"):
                    found.setdefault(line.split("{")[0], []).append(line)
            if any('outcome="served"' in line and line.endswith(" 2.0") for line in found.get("ray_refit_syncs_total", [])):
                break
            time.sleep(1)
        print(json.dumps({"found": found, "bytes": report.bytes_on_wire}))
""")


@pytest.mark.engine
def test_sync_metrics_are_exported_to_prometheus(tmp_path):
    """In a process of its own: the metrics port is set when the cluster starts."""
    import json
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2], env={**__import__("os").environ, **QUIET_ENV})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    found = result["found"]

    def value(line: str) -> float:
        return float(line.rsplit(" ", 1)[1])

    assert {"ray_refit_sync_seconds_bucket", "ray_refit_sync_bytes_total", "ray_refit_served_version",
            "ray_refit_verification_total", "ray_refit_syncs_total"} <= set(found), sorted(found)
    assert any('outcome="served"' in line and value(line) == 2 for line in found["ray_refit_syncs_total"])
    assert any('outcome="passed"' in line and value(line) == 2 for line in found["ray_refit_verification_total"])
    assert any(value(line) == 2 for line in found["ray_refit_served_version"])  # the second sync's version
    assert any(value(line) == 2 * result["bytes"] for line in found["ray_refit_sync_bytes_total"])
    assert any('stage="stream"' in line for line in found["ray_refit_sync_seconds_bucket"])
