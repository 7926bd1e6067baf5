"""The provenance record: where each scale of a rollout engine came from.

The schema (field names, source names) is frozen by a test: RL jobs log and
compare these records across runs, so changing it is a breaking change.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import StrEnum

__all__ = ["ScaleSource", "ScaleRecord", "format_table", "to_json"]


class ScaleSource(StrEnum):
    """Where a scale's current value came from; each is a fact, not a guess."""

    DUMMY = "dummy"  # random init of load_format="dummy": never a real value
    CHECKPOINT = "checkpoint"  # present in the checkpoint the engine loaded
    PLACEHOLDER = "placeholder"  # created by vLLM, never loaded from anywhere
    DEFAULT = "default"  # set to 1.0 by refit's post-refit stage
    REFIT = "refit"  # streamed by a sync (see `version`)
    CALIBRATED = "calibrated"  # recomputed by refit from activations (see `version`)


# Sources whose values carry no information and may be overwritten freely.
UNINFORMED = frozenset({ScaleSource.DUMMY, ScaleSource.PLACEHOLDER})


@dataclass(frozen=True, slots=True)
class ScaleRecord:
    """One scale of one module. `version` is the sync that set it, if any."""

    module: str
    scale: str
    kind: str  # "weight" (a quantized linear) or "attention" (q/k/v/prob)
    source: ScaleSource
    version: int | None
    value: float  # the scalar for attention scales, max |scale| for weight scales


def to_json(records: list[ScaleRecord]) -> str:
    return json.dumps([asdict(r) for r in records], indent=1)


def format_table(records: list[ScaleRecord], *, digest: str | None = None) -> str:
    """A fixed-width table, one row per scale, for logs and terminals; `digest`: the served version's, if known."""
    header = ("module", "scale", "source", "version", "value")
    rows = [(r.module, r.scale, str(r.source), "-" if r.version is None else str(r.version), f"{r.value:.6g}")
            for r in records]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    footer = [] if digest is None else [f"served version's digest: {digest}"]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:], *footer])
