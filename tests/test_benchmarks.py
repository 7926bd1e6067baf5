"""`make bench`'s comparison with the alternatives and its delta benchmark run end to end at a smoke size (no
timing assertions: on a shared machine only the ratios of one full-size run mean anything, and
docs/performance.md shows the last one), without touching the committed docs page; and every benchmark
`make bench` runs writes its table into its own block of that page."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from benchmarks import _docs_table
from benchmarks.bench_alternatives import CLONE, DEFAULT, LOAD_ALONE, ONE_NODE, PRODUCE_ALONE, ROUND_TRIP, refit_paths
from tests.support.scripts import REPO, run_python

PAGE = """# Performance

intro

<!-- bench_sync: written by make bench -->
old table
<!-- /bench_sync -->

between

<!-- bench_delta: written by make bench -->
the delta table
<!-- /bench_delta -->
"""


def make_bench_commands() -> list[list[str]]:
    """The benchmark command lines of the Makefile's bench target, as arguments after `$(PY)`."""
    target = re.search(r"^bench:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), flags=re.MULTILINE)
    assert target, "the Makefile has no bench target"
    return [line.split()[1:] for line in target.group(1).splitlines() if line.strip().startswith("$(PY)")]


def test_a_block_is_replaced_whole_under_a_line_naming_machine_date_and_command(tmp_path):
    page = tmp_path / "performance.md"
    page.write_text(PAGE)
    _docs_table.write_block("bench_sync", "\nmodel: 8 layers\n  in flight 1   median 0.2 s\n", argv=["--repeats", "2", "--write-docs"],
                            page=page)
    text = page.read_text()
    assert "old table" not in text and text.count("<!-- bench_sync: written") == text.count("<!-- /bench_sync -->") == 1
    assert text.startswith("# Performance\n\nintro\n\n<!-- bench_sync: written by make bench -->\n")
    assert text.endswith("<!-- /bench_sync -->\n\nbetween\n\n<!-- bench_delta: written by make bench -->\n"
                         "the delta table\n<!-- /bench_delta -->\n")  # the rest of the page as it was
    header = text.splitlines()[5]
    assert re.fullmatch(r"Measured on .+, \d+ cores, (AVX-512|AVX2|no AVX2)( with AMX)?(, \d+ GiB RAM)?, "
                        r"\d{4}-\d\d-\d\d \d\d:\d\d UTC, with `\.venv/bin/python -m benchmarks\.bench_sync --repeats 2`:",
                        header), header
    assert "```text\nmodel: 8 layers\n  in flight 1   median 0.2 s\n```\n<!-- /bench_sync -->" in text
    _docs_table.write_block("bench_sync", "second run", argv=[], page=page)  # the page holds one table, the latest
    assert "in flight 1" not in page.read_text() and page.read_text().count("```text") == 1


@pytest.mark.parametrize("page_text", ["# no markers\n", PAGE.replace("<!-- /bench_sync -->", ""), PAGE + PAGE,
                                       PAGE.replace("<!-- bench_sync: written by make bench -->", "<!-- x -->")
                                       + "<!-- bench_sync: written by make bench -->\n"])
def test_a_page_without_its_two_markers_once_and_in_order_is_refused_naming_them_and_left_unchanged(tmp_path, page_text):
    page = tmp_path / "performance.md"
    page.write_text(page_text)
    with pytest.raises(SystemExit, match=re.escape("'<!-- bench_sync: written by make bench -->'")):
        _docs_table.write_block("bench_sync", "table", page=page)
    assert page.read_text() == page_text


def test_write_docs_refuses_when_parsed_if_the_page_has_no_block_for_the_benchmark(capsys):
    parser = argparse.ArgumentParser(prog="bench_nowhere")
    _docs_table.add_write_docs_argument(parser, "bench_nowhere")
    assert parser.parse_args([]).write_docs is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--write-docs"])
    assert "<!-- bench_nowhere: written by make bench -->" in capsys.readouterr().err


def test_every_benchmark_make_bench_runs_writes_its_block_of_the_committed_page():
    commands = make_bench_commands()
    assert len(commands) >= 6, commands
    page = _docs_table.PAGE.read_text()
    for command in commands:
        assert command[0] == "-m" and command[1].startswith("benchmarks.") and "--write-docs" in command, command
        name = command[1].removeprefix("benchmarks.")
        _docs_table.block_bounds(page, name)  # its two markers, once each, in order
        assert f'"{name}"' in (REPO / "benchmarks" / f"{name}.py").read_text(), f"{name} does not write its own block"
        parser = argparse.ArgumentParser()
        _docs_table.add_write_docs_argument(parser, name)
        assert parser.parse_args(["--write-docs"]).write_docs is True


@pytest.mark.engine
def test_the_comparison_runs_every_path_and_writes_its_table_json_and_plot(ray_cluster, tmp_path):
    committed = _docs_table.PAGE.read_text(), (_docs_table.PAGE.parent / "bench.png").read_bytes()
    out = run_python(["-m", "benchmarks.bench_alternatives", "--sizes", "2x256", "--repeats", "1", "--out", str(tmp_path)],
                     ray_address=ray_cluster.address)
    paths = [*refit_paths(1 << 20), ONE_NODE, ROUND_TRIP, CLONE, LOAD_ALONE, PRODUCE_ALONE]
    for name in paths:
        assert f"  {name}" in out, out
    summary = json.loads((tmp_path / "bench.json").read_text())
    (size,) = summary["sizes"]
    assert set(size["paths"]) == set(paths)
    assert all(p["median"] > 0 for p in size["paths"].values())
    assert size["fp8_wire_bytes"] < size["bf16_bytes"]  # FP8 codes and scales: about half of bf16
    assert {"stream", "load"} <= set(size["paths"][DEFAULT]["stages"])
    # The default here is shm: the trainer writes into its files, the workers map, verify and load in the receive.
    assert {"preflight", "quantize", "integrity tag"} <= set(size["stage_detail"]["trainer"])
    assert {"map", "verify", "receive (shm: map, verify, load)"} <= set(size["stage_detail"]["rollout"])
    assert set(size["peak_extra_bytes"]) == {"trainer", "rollout"} and "peak extra private memory" in out
    assert size["shared_file_bytes"] > 0 and "the trainer's shared memory files (shm), kept between syncs" in out
    # The floor: each side alone, and the default sync against the slower one and against the round trip.
    assert re.search(r"floor: max\(rollout load alone [\d.]+ s, trainer production alone [\d.]+ s\) = [\d.]+ s; "
                     r"default sync / floor [\d.]+x", out), out
    assert re.search(r"round trip / default sync: [\d.]+x", out), out
    assert re.search(r"path +median s +vs round trip +over floor +of clone bw", out), out
    assert size["floor_s"] == max(size["paths"][LOAD_ALONE]["median"], size["paths"][PRODUCE_ALONE]["median"]) > 0
    assert size["default_over_floor"] > 0 and size["round_trip_over_default"] > 0
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert (_docs_table.PAGE.read_text(), (_docs_table.PAGE.parent / "bench.png").read_bytes()) == committed  # no --write-docs


@pytest.mark.engine
def test_the_delta_benchmark_measures_delta_and_full_syncs_of_one_state_and_writes_its_json(ray_cluster, tmp_path):
    committed = _docs_table.PAGE.read_text()
    out = run_python(["-m", "benchmarks.bench_delta", "--layers", "2", "--hidden", "256", "--repeats", "1", "--lrs", "1e-5",
                      "--out", str(tmp_path)], ray_address=ray_cluster.address)
    assert "model 25 Gbit/s" in out and "bases kept between syncs" in out, out
    summary = json.loads((tmp_path / "delta.json").read_text())
    result = summary["by_lr"]["1e-05"]
    assert 0 < result["delta"]["bytes"] < result["full"]["bytes"]
    assert 0 < summary["base_bytes"]["trainer"] <= summary["base_bound_bytes"]
    assert _docs_table.PAGE.read_text() == committed  # no --write-docs: the committed page is left alone


@pytest.mark.engine
def test_the_latency_benchmark_syncs_the_fixture_to_two_replicas_and_prints_each_stages_median(ray_cluster):
    committed = _docs_table.PAGE.read_text()
    out = run_python(["-m", "benchmarks.bench_latency", "--syncs", "2"], ray_address=ray_cluster.address)
    # The default on one host: shared memory, whole buckets (deltas are for a wire: `--transport ray`).
    assert re.search(r"tiny Qwen3 fixture, 1\.63 MiB full, to 2 replicas, 2 syncs \(shm, full\); medians:", out), out
    for stage in ("total", "begin", "stream", "finish", "report and the rest", "first sync", "each sync after"):
        assert re.search(rf"^  {stage} +[\d.]+ ms", out, re.MULTILINE), out
    assert "18771 tensors" in out, out
    assert _docs_table.PAGE.read_text() == committed


def test_the_quantizer_benchmark_compares_refit_with_compressed_tensors_and_a_clone():
    committed = _docs_table.PAGE.read_text()
    out = run_python(["-m", "benchmarks.bench_quantizer", "--size", "256", "--layers", "1", "--repeats", "1"])
    for line in ("bf16 matrix 256x256", "synthetic decoder, 1 layers", "refit / compressed-tensors", "refit / clone"):
        assert line in out, out
    assert _docs_table.PAGE.read_text() == committed
