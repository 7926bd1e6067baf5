"""Which rank of a sharded trainer sends which rows of each planned tensor. Pure logic, no torch.distributed.

Why this exists: a sharded trainer (FSDP2, or a Megatron-style split) holds
each tensor as row slices spread over its ranks. When a rank's slice covers
whole 128x128 FP8 blocks, the blocks of the slice are exactly the blocks of
the full tensor, so that rank can quantize its rows itself (bit-identical to
quantizing the whole) and only FP8 codes and scales ever leave it: no rank
gathers BF16, none builds a full copy. The replicas put the rows back
together (`refit.plan.data_path.loadable_tensors`).

The decision, per planned tensor, from the row ranges every rank reported:

- `WHOLE`: some rank holds all of it (a replicated tensor, or an expert
  whose rows all lie in one rank's shard). One of those ranks sends it.
- `ROWS`: the ranks' slices tile its rows and, if it is quantized on the
  trainer, every slice starts and ends on a block boundary (or at the last
  row). Each of those ranks sends its own rows.
- `GATHER`: anything else (slices that split an FP8 block, column shards).
  The ranks holding parts of it join one all-gather (FSDP2: every rank)
  and one of them, the owner, quantizes and sends it.

Senders for `WHOLE` and `GATHER` are chosen greedily, in plan order, as the
eligible rank that has been given the fewest bytes so far, so the work and
the bytes spread over ranks instead of funnelling through rank 0. `ROWS`
bytes already spread with the shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from refit.plan.config import QuantizeOn
from refit.plan.transfer_plan import PlannedTensor, TransferPlan

__all__ = ["Route", "TensorRoute", "route_tensors"]

RowRange = tuple[int, int]  # [start, stop) rows of a planned tensor


class Route(Enum):
    WHOLE = "whole"
    ROWS = "rows"
    GATHER = "gather"


@dataclass(frozen=True, slots=True)
class TensorRoute:
    route: Route
    senders: tuple[int, ...]  # ROWS: each rank sending its rows; WHOLE, GATHER: the one owner
    rows: Mapping[int, RowRange]  # the rows each sender sends


def route_tensors(plan: TransferPlan, held: Sequence[Mapping[str, RowRange | None]]) -> dict[str, TensorRoute]:
    """Route every planned tensor; `held[rank][target]` is the rows that rank can send without a collective.

    A target a rank does not hold at all is absent from its mapping; `None`
    means it holds part of it, but not as whole rows (a column shard, say).
    Every rank computes the same routes from the same inputs.
    """
    sent = [0] * len(held)
    routes: dict[str, TensorRoute] = {}
    for tensor in plan.tensors:
        rows = tensor.shape[0] if tensor.shape else 1
        whole = [rank for rank, ranges in enumerate(held) if ranges.get(tensor.target) == (0, rows)]
        slices = _tiling(tensor, rows, held, plan.quantize_on)
        nbytes = tensor.wire_bytes(plan.quantize_on)
        if whole:
            routes[tensor.target] = _owned(Route.WHOLE, whole, rows, nbytes, sent)
        elif slices:
            routes[tensor.target] = TensorRoute(Route.ROWS, tuple(slices), slices)
            for rank, (start, stop) in slices.items():
                sent[rank] += nbytes * (stop - start) // rows
        else:  # owned by a rank holding part of it: only those join its gather where the layout limits it (megatron)
            holders = [rank for rank, ranges in enumerate(held) if tensor.target in ranges]
            routes[tensor.target] = _owned(Route.GATHER, holders or range(len(held)), rows, nbytes, sent)
    return routes


def _owned(route: Route, eligible: Sequence[int], rows: int, nbytes: int, sent: list[int]) -> TensorRoute:
    owner = min(eligible, key=lambda rank: (sent[rank], rank))
    sent[owner] += nbytes
    return TensorRoute(route, (owner,), {owner: (0, rows)})


def _tiling(
    tensor: PlannedTensor, rows: int, held: Sequence[Mapping[str, RowRange | None]], quantize_on: QuantizeOn
) -> dict[int, RowRange] | None:
    """The ranks' non-empty row slices if they tile `[0, rows)` on block boundaries where needed, else None."""
    slices = {}
    for rank, ranges in enumerate(held):
        if tensor.target in ranges and ranges[tensor.target] is None:
            return None  # part of it is held in a form that is not rows
        start, stop = ranges.get(tensor.target) or (0, 0)
        if stop > start:
            slices[rank] = (start, stop)
    ordered = sorted(slices.values())
    if not ordered or ordered[0][0] != 0 or ordered[-1][1] != rows:
        return None
    if any(a[1] != b[0] for a, b in zip(ordered, ordered[1:])):
        return None  # a gap or an overlap
    if tensor.block is not None and quantize_on is QuantizeOn.TRAINER:
        block_rows = tensor.block[0]
        if any(start % block_rows or (stop % block_rows and stop != rows) for start, stop in ordered):
            return None  # a slice would split an FP8 block
    return slices
