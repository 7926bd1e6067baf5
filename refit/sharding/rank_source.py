"""One rank of a sharded trainer as a weight source: the rows it holds, quantized where it holds them.

Every rank of the group runs `RankSource.stream(plan)` at the same time, on
the same plan. Each yields one part per bucket (possibly empty): the rows of
that bucket's tensors the routes (`refit.sharding.routes`) give it. Ranks
meet in collectives only to agree on the routes (once per plan) and for
tensors routed `GATHER`, in plan order, so every rank calls them in the same
order.

Works on parameters that are `DTensor`s sharded by rows on a 1-D mesh
(`Shard(0)`, FSDP2's layout) or replicated, and on plain tensors (held
whole). Anything else is gathered.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from refit.errors import InvalidTensorError, PlanMismatchError
from refit.orchestration.checkpoint_format import CheckpointView
from refit.orchestration.config import QuantizeOn
from refit.orchestration.plan import TransferPlan
from refit.quantizer.fp8_block import is_finite, loadable_form
from refit.sharding.routes import Route, RowRange, TensorRoute, route_tensors
from refit.transport.buckets import WireBucket, pack_bucket

__all__ = ["RankSource"]


class RankSource:
    """The weight source of one rank; `model` holds this rank's shards, `group` is the trainer's process group."""

    def __init__(self, model: torch.nn.Module, group: torch.distributed.ProcessGroup | None = None) -> None:
        self.view = CheckpointView(model)
        self.group = group
        self.rank = torch.distributed.get_rank(group)
        self.gathered_bytes = 0  # BF16 bytes this rank received from all-gathers in the last stream
        self.sent: dict[str, int] = {}  # in the last stream: tensors sent per route, "quantized_rows", "bytes"
        self._routes: tuple[tuple, dict[str, TensorRoute]] | None = None

    def routes(self, plan: TransferPlan) -> dict[str, TensorRoute]:
        """The plan's routes, agreed by all ranks once per plan (a collective)."""
        key = (plan.quantize_on, tuple((t.target, t.shape, t.block) for t in plan.tensors))
        if self._routes is None or self._routes[0] != key:
            mine = {t.target: rows for t in plan.tensors if (rows := self._held(t.target)) is not _ABSENT}
            held: list = [None] * torch.distributed.get_world_size(self.group)
            torch.distributed.all_gather_object(held, mine, group=self.group)
            self._routes = (key, route_tensors(plan, held))
        return self._routes[1]

    def stream(self, plan: TransferPlan) -> Iterator[WireBucket]:
        """This rank's part of every bucket, in plan order; every tensor it will send is checked first."""
        routes = self.routes(plan)
        self._preflight(plan, routes)
        self.gathered_bytes = 0
        self.sent = {route.value: 0 for route in Route} | {"quantized_rows": 0, "bytes": 0}
        for index, bucket in enumerate(plan.buckets):
            parts: list[tuple[str, torch.Tensor]] = []
            row_offsets: dict[str, int] = {}
            for planned in bucket:
                route = routes[planned.target]
                if route.route is Route.GATHER:
                    value = self._gathered(planned.source)  # every rank joins, in plan order
                    self.gathered_bytes += value.numel() * value.element_size()
                if self.rank not in route.senders:
                    continue
                start, stop = route.rows[self.rank]
                if route.route is not Route.GATHER:
                    value = self._rows(planned.source, start, stop)
                block = planned.block if plan.quantize_on is QuantizeOn.TRAINER else None
                self.sent[route.route.value] += 1
                self.sent["quantized_rows"] += route.route is Route.ROWS and block is not None
                for name, tensor in loadable_form(planned.target, value.detach(), block):
                    parts.append((name, tensor))
                    row_offsets[name] = start if name == planned.target else start // planned.block[0]
            part = pack_bucket(index, parts, row_offsets=row_offsets)
            self.sent["bytes"] += part.nbytes
            yield part

    # -- where this rank's rows are ----------------------------------------------------------------------------------
    def _held(self, name: str) -> RowRange | None | object:
        """The rows of checkpoint tensor `name` this rank holds as rows; None: part, not as rows; `_ABSENT`: none."""
        param, piece = self.view.location(name)
        shape, offset = (tuple(piece.shape), piece.offset) if piece else (tuple(param.shape), 0)
        rows = shape[0] if shape else 1
        local = _local_rows(param)
        if local is None:
            return None
        if piece and tuple(piece.stride) != _contiguous_strides(shape):
            return None
        row_numel = math.prod(shape[1:])
        first, last = local[0] * math.prod(param.shape[1:]), local[1] * math.prod(param.shape[1:])
        lo, hi = max(offset, first), min(offset + rows * row_numel, last)
        if lo >= hi:
            return _ABSENT
        if (lo - offset) % max(row_numel, 1) or (hi - offset) % max(row_numel, 1):
            return None
        return ((lo - offset) // max(row_numel, 1), (hi - offset) // max(row_numel, 1))

    def _rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows `[start, stop)` of checkpoint tensor `name`, as a view of this rank's shard."""
        param, piece = self.view.location(name)
        shape, offset = (tuple(piece.shape), piece.offset) if piece else (tuple(param.shape), 0)
        local_first = _local_rows(param)[0] * math.prod(param.shape[1:])
        flat = _local(param).detach().reshape(-1)
        row_numel = math.prod(shape[1:])
        begin = offset + start * row_numel - local_first
        return flat[begin : begin + (stop - start) * row_numel].view(stop - start, *shape[1:])

    def _gathered(self, name: str) -> torch.Tensor:
        """Checkpoint tensor `name` whole, from an all-gather of its parameter (a collective: every rank calls it)."""
        param, piece = self.view.location(name)
        full = param.full_tensor() if _is_dtensor(param) else param.detach()
        return full if piece is None else full.as_strided(piece.shape, piece.stride, piece.offset)

    def _preflight(self, plan: TransferPlan, routes: dict[str, TensorRoute]) -> None:
        """Global shapes against the plan, and this rank's shards finite, before any part is sent."""
        shapes = {m.name: m.shape for m in self.view.metadata()}
        problems = [
            f"{t.target}: shape {shapes.get(t.target)} in the trainer, {t.shape} in the plan; make a new plan"
            for t in plan.tensors if shapes.get(t.target) != t.shape
        ]
        if problems:
            raise PlanMismatchError("refusing to send any weight:\n  " + "\n  ".join(problems))
        checked: set[str] = set()
        for planned in plan.tensors:
            param, _ = self.view.location(planned.source)
            source = id(param)
            if source in checked:
                continue
            checked.add(source)
            if not is_finite(_local(param).detach()):
                raise InvalidTensorError(f"refusing to send any weight: {planned.source} holds NaN or Inf on rank {self.rank}")


_ABSENT = object()


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if _is_dtensor(param) else param


def _local_rows(param: torch.Tensor) -> RowRange | None:
    """The rows of `param` this rank holds, or None if it holds it some other way than whole rows."""
    rows = param.shape[0] if param.dim() else 1
    if not _is_dtensor(param):
        return (0, rows)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if param.device_mesh.ndim != 1:
        return None
    placement = param.placements[0]
    if placement.is_replicate():
        return (0, rows)
    if not (placement.is_shard() and placement.dim == 0):
        return None
    local_shape, global_offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return (global_offset[0], global_offset[0] + local_shape[0])


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
