"""`make bench`'s comparison with the alternatives runs end to end at a smoke size (no timing assertions:
on a shared machine only the ratios of one full-size run mean anything, and the README quotes one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_alternatives import CLONE, DEFAULT, ROUND_TRIP, refit_paths

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.engine
def test_the_comparison_runs_every_path_and_writes_its_table_json_and_plot(ray_cluster, tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.address, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_alternatives", "--sizes", "2x256", "--repeats", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    paths = [*refit_paths(1 << 20), ROUND_TRIP, CLONE]
    for name in paths:
        assert f"  {name}" in result.stdout, result.stdout
    summary = json.loads((tmp_path / "bench.json").read_text())
    (size,) = summary["sizes"]
    assert set(size["paths"]) == set(paths)
    assert all(p["median"] > 0 for p in size["paths"].values())
    assert size["fp8_wire_bytes"] < size["bf16_bytes"]  # FP8 codes and scales: about half of bf16
    assert {"stream", "load"} <= set(size["paths"][DEFAULT]["stages"])
    assert (tmp_path / "bench.png").stat().st_size > 10_000
