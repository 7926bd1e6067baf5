"""Writes a benchmark's current table into docs/performance.md, between its two markers.

Each benchmark that `make bench` runs owns one block of the page:

    <!-- bench_sync: written by make bench -->
    ...
    <!-- /bench_sync -->

`write_block` replaces what lies between them with a header line (the
machine: CPU model, cores, AVX-512 or AVX2, AMX, RAM; the date in UTC; the
command) and the table the benchmark printed, so the page always holds the
last run's numbers and says where and when they were measured. Benchmarks
write only when run with `--write-docs` (what the Makefile's bench target
passes); the tests that run them at smoke sizes do not, and leave the
committed page alone.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

__all__ = ["PAGE", "add_write_docs_argument", "block_bounds", "machine", "markers", "write_block"]

PAGE = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
FLAG = "--write-docs"


def add_write_docs_argument(parser: argparse.ArgumentParser, name: str) -> None:
    """`--write-docs`: also write this run's table into benchmark `name`'s block of docs/performance.md
    (`make bench` passes it). Checked when parsed: a page without the block refuses before minutes of measuring."""

    class WriteDocs(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None) -> None:
            try:
                block_bounds(PAGE.read_text(), name, PAGE)
            except ValueError as error:
                parser.error(str(error))
            setattr(namespace, self.dest, True)

    parser.add_argument(FLAG, action=WriteDocs, nargs=0, default=False,
                        help=f"also replace this benchmark's block in {PAGE.relative_to(PAGE.parents[1])} "
                             "with this run's table (make bench passes it)")


def markers(name: str) -> tuple[str, str]:
    """The opening and closing markers of benchmark `name`'s block."""
    return f"<!-- {name}: written by make bench -->", f"<!-- /{name} -->"


def machine() -> str:
    """This machine in a few words: CPU model, cores, AVX-512 or AVX2, AMX, RAM.

    AMX is named because vLLM then runs its own AMX FP8 kernels instead of refit's reference kernel (docs/cpu.md),
    so the same benchmark computes on other kernels there."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = " ".join(value.split())
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    vector += " with AMX" if "amx_tile" in flags else ""
    ram = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = f", {int(line.split()[1]) / 2**20:.0f} GiB RAM"
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {vector}{ram}"


def command(name: str, argv: list[str] | None = None) -> str:
    """The command line that reproduces this run (without `--write-docs`)."""
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a != FLAG]
    return shlex.join([".venv/bin/python", "-m", f"benchmarks.{name}", *args])


def block_bounds(text: str, name: str, page: Path = PAGE) -> tuple[int, int]:
    """Where benchmark `name`'s block lies in `text` (the page's): from its opening marker to the end of its
    closing one. ValueError naming both markers if the page lacks either, has one twice, or has them out of order:
    the page decides where each table goes, not the writer."""
    start, end = markers(name)
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"{page}: expected the marker {start!r} once, followed by {end!r} once; found them "
                         f"{text.count(start)} and {text.count(end)} time(s). Add the two markers, each on its own "
                         f"line, where {name}'s table belongs; nothing was written.")
    return text.index(start), text.index(end) + len(end)


def write_block(name: str, table: str, *, argv: list[str] | None = None, page: Path = PAGE) -> None:
    """Replace benchmark `name`'s block in `page` with a header line and `table` (text, as printed).

    Refuses (SystemExit naming the markers, the page unchanged) if the page
    lacks them, has one twice, or has them out of order.
    """
    start, end = markers(name)
    text = page.read_text()
    try:
        first, last = block_bounds(text, name, page)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    header = (f"Measured on {machine()}, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, "
              f"with `{command(name, argv)}`:")
    block = f"{start}\n{header}\n\n```text\n{table.strip(chr(10))}\n```\n{end}"
    page.write_text(text[:first] + block + text[last:])
    print(f"wrote {name}'s table into {page}")
