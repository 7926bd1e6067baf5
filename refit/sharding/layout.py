"""What `RankSource` asks of a rank's model, whatever parallelism laid it out.

A layout answers, for a checkpoint tensor (by the plan's `source` name):
which of its rows this rank can send as they are, those rows, and the whole
tensor by a collective among the ranks that hold parts of it. FSDP2's
row-sharded DTensors (`refit.sharding.dtensor_layout`) and megatron-core's
tensor, pipeline and expert parallel layers (`refit.sharding.megatron`) are
the two layouts; `RankSource` streams either the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from refit.errors import GatherFailedError
from refit.plan.tensors import TensorMeta
from refit.plan.transfer_plan import TransferPlan
from refit.sharding.routes import RowRange

__all__ = ["ABSENT", "RankLayout", "attempt_part", "raise_if_a_part_failed"]

_T = TypeVar("_T")

ABSENT = object()
"""`RankLayout.held`'s answer for a tensor of which this rank holds nothing (or nothing it should send)."""


def attempt_part(step: Callable[[], _T]) -> tuple[_T | None, Exception | None]:
    """`step()`'s result, or its error: a holder's step of a gather (reading its part, making room), whose failure is
    told to every holder first, then raised on each (`raise_if_a_part_failed`)."""
    try:
        return step(), None
    except Exception as error:  # noqa: BLE001 - raised after the holders agreed, on every holder alike
        return None, error


def raise_if_a_part_failed(name: str, failure: BaseException | None, failed_ranks: list[int]) -> None:
    """After the holders of `name`'s parts told each other whether they could read theirs and make room for the
    whole (`failed_ranks`, global ranks): raise `GatherFailedError` on every holder alike, this rank's own `failure` first.

    Why every holder: one that raised alone would leave the others waiting in the gather's all-gather until the
    group's timeout, which breaks the group for good; raised everywhere after the same collectives, the holders'
    later gathers stay paired."""
    if failure is not None:
        raise GatherFailedError(f"{name}: trainer rank {torch.distributed.get_rank()} could not read its part or make "
                                f"room to gather it: {type(failure).__name__}: {failure}") from failure
    if failed_ranks:
        raise GatherFailedError(f"{name}: trainer rank {failed_ranks[0]} could not read its part or make room to gather "
                                "it, so no rank gathers it (that rank's error says why)")


class RankLayout(Protocol):
    # Optional: `finish_parameter_updates()`, called on every rank as its stream starts (a collective if it needs
    # one), completes an update of the parameters still in flight (`MegatronLayout`'s overlapped all-gather).

    def metadata(self) -> list[TensorMeta]:
        """The checkpoint tensors this rank holds (part of), with global shapes and the wire dtype."""
        ...

    def held(self, name: str) -> RowRange | None | object:
        """The rows of `name` this rank can send without a collective; None: it holds part, not as rows; `ABSENT`."""
        ...

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows `[start, stop)` of `name`, in the wire dtype (rows this rank holds)."""
        ...

    def joins_gather(self, name: str) -> bool:
        """Whether this rank takes part in `gathered(name)` (every rank calls it in plan order)."""
        ...

    def gathered(self, name: str) -> torch.Tensor:
        """`name` whole, in the wire dtype: a collective among the ranks that `joins_gather` it."""
        ...

    def check_finite(self, plan: TransferPlan, rank: int) -> None:
        """Raise `InvalidTensorError` naming the planned tensors whose values on this rank hold NaN or Inf (values that
        no planned tensor sends, such as padding, are not refused)."""
        ...

    def shard_bytes(self) -> int:
        """Bytes of this rank's own tensors: its parameters and buffers."""
        ...
