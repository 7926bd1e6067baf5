"""`make bench`'s comparison with the alternatives runs end to end at a smoke size (no timing assertions:
on a shared machine only the ratios of one full-size run mean anything, and the README quotes one)."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_alternatives import CLONE, DEFAULT, ONE_NODE, ROUND_TRIP, refit_paths
from tests.support.scripts import run_python


@pytest.mark.engine
def test_the_comparison_runs_every_path_and_writes_its_table_json_and_plot(ray_cluster, tmp_path):
    out = run_python(["-m", "benchmarks.bench_alternatives", "--sizes", "2x256", "--repeats", "1", "--out", str(tmp_path)],
                     ray_address=ray_cluster.address)
    paths = [*refit_paths(1 << 20), ONE_NODE, ROUND_TRIP, CLONE]
    for name in paths:
        assert f"  {name}" in out, out
    summary = json.loads((tmp_path / "bench.json").read_text())
    (size,) = summary["sizes"]
    assert set(size["paths"]) == set(paths)
    assert all(p["median"] > 0 for p in size["paths"].values())
    assert size["fp8_wire_bytes"] < size["bf16_bytes"]  # FP8 codes and scales: about half of bf16
    assert {"stream", "load"} <= set(size["paths"][DEFAULT]["stages"])
    assert {"preflight", "quantize", "integrity tag"} <= set(size["stage_detail"]["trainer"])
    assert {"fetch", "verify", "load"} <= set(size["stage_detail"]["rollout"])
    assert set(size["peak_extra_bytes"]) == {"trainer", "rollout"} and "peak extra private memory" in out
    assert (tmp_path / "bench.png").stat().st_size > 10_000


@pytest.mark.engine
def test_the_delta_benchmark_measures_delta_and_full_syncs_of_one_state_and_writes_its_json(ray_cluster, tmp_path):
    out = run_python(["-m", "benchmarks.bench_delta", "--layers", "2", "--hidden", "256", "--repeats", "1", "--lrs", "1e-5",
                      "--out", str(tmp_path)], ray_address=ray_cluster.address)
    assert "model 25 Gbit/s" in out and "bases kept between syncs" in out, out
    summary = json.loads((tmp_path / "delta.json").read_text())
    result = summary["by_lr"]["1e-05"]
    assert 0 < result["delta"]["bytes"] < result["full"]["bytes"]
    assert 0 < summary["base_bytes"]["trainer"] <= summary["base_bound_bytes"]
