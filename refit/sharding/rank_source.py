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
from typing import NamedTuple

import torch

from refit.errors import InvalidTensorError, PlanMismatchError
from refit.plan.checkpoint_format import CheckpointView
from refit.plan.config import QuantizeOn
from refit.plan.transfer_plan import TransferPlan
from refit.quantizer.fp8_block import is_finite, loadable_form
from refit.sharding.routes import Route, RowRange, TensorRoute, route_tensors
from refit.transport.buckets import WireBucket, pack_bucket

__all__ = ["RankSource"]


class RankSource:
    """The weight source of one rank; `model` holds this rank's shards, `group` is the trainer's process group."""

    def __init__(self, model: torch.nn.Module, group: torch.distributed.ProcessGroup | None = None, *,
                 wire_dtype: torch.dtype | None = None) -> None:
        """`wire_dtype`: send floating-point weights in this dtype (bf16 from fp32 master weights); each
        rank casts its own rows, and all-gathers are made in it (half the bytes of fp32)."""
        self.model = model
        self.view = CheckpointView(model, wire_dtype=wire_dtype)
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
        self._preflight(plan)
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
            part = pack_bucket(index, parts, row_offsets=row_offsets, key=plan.integrity_key)
            self.sent["bytes"] += part.nbytes
            yield part

    def shard_bytes(self) -> int:
        """Bytes of this rank's own shards of the model."""
        return sum(_local(p).numel() * p.element_size() for p in self.model.parameters())

    # -- where this rank's rows are ----------------------------------------------------------------------------------
    def _extent(self, name: str) -> tuple[torch.Tensor, _Extent]:
        """Checkpoint tensor `name`'s parameter, and where the tensor and this rank's shard lie in it (flat elements)."""
        param, piece = self.view.location(name)
        shape, offset = (tuple(piece.shape), piece.offset) if piece else (tuple(param.shape), 0)
        local = _local_rows(param)
        param_row = math.prod(param.shape[1:])
        shard = None if local is None else (local[0] * param_row, local[1] * param_row)
        return param, _Extent(shape, offset, max(math.prod(shape[1:]), 1), shard,
                              piece is None or tuple(piece.stride) == torch.empty(shape, device="meta").stride())

    def _held(self, name: str) -> RowRange | None | object:
        """The rows of checkpoint tensor `name` this rank holds as rows; None: part, not as rows; `_ABSENT`: none."""
        _, extent = self._extent(name)
        if extent.shard is None or not extent.row_major:
            return None
        rows = extent.shape[0] if extent.shape else 1
        lo, hi = max(extent.offset, extent.shard[0]), min(extent.offset + rows * extent.row_numel, extent.shard[1])
        if lo >= hi:
            return _ABSENT
        if (lo - extent.offset) % extent.row_numel or (hi - extent.offset) % extent.row_numel:
            return None
        return ((lo - extent.offset) // extent.row_numel, (hi - extent.offset) // extent.row_numel)

    def _rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows `[start, stop)` of checkpoint tensor `name`, as a view of this rank's shard."""
        param, extent = self._extent(name)
        flat = _local(param).detach().reshape(-1)
        begin = extent.offset + start * extent.row_numel - extent.shard[0]
        rows = flat[begin : begin + (stop - start) * extent.row_numel].view(stop - start, *extent.shape[1:])
        return rows.to(self.view.wire_dtype(param))  # no copy unless the wire dtype differs

    def _gathered(self, name: str) -> torch.Tensor:
        """Checkpoint tensor `name` whole, from an all-gather of its parameter (a collective: every rank calls it)."""
        param, piece = self.view.location(name)
        wire = param.detach().to(self.view.wire_dtype(param))  # a DTensor casts its local shard: the gather moves wire bytes
        full = wire.full_tensor() if _is_dtensor(wire) else wire
        return full if piece is None else full.as_strided(piece.shape, piece.stride, piece.offset)

    def _preflight(self, plan: TransferPlan) -> None:
        """Global shapes against the plan, and this rank's shards finite, before any part is sent."""
        shapes = {m.name: m.shape for m in self.view.metadata()}
        problems = [
            f"{t.target}: shape {shapes.get(t.target)} in the trainer, {t.shape} in the plan; make a new plan"
            for t in plan.tensors if shapes.get(t.target) != t.shape
        ]
        if problems:
            raise PlanMismatchError("refusing to send any weight:\n  " + "\n  ".join(problems))
        checked: set[int] = set()  # parameters, by id: a fused one stands for many planned tensors
        for planned in plan.tensors:
            param, _ = self.view.location(planned.source)
            if id(param) in checked:
                continue
            checked.add(id(param))
            if not is_finite(_local(param).detach()):
                raise InvalidTensorError(f"refusing to send any weight: {planned.source} holds NaN or Inf on rank {self.rank}")


_ABSENT = object()


class _Extent(NamedTuple):
    """A checkpoint tensor inside its parameter, in the parameter's flat element order."""

    shape: tuple[int, ...]
    offset: int  # of its first element
    row_numel: int  # elements per row of the tensor
    shard: tuple[int, int] | None  # [first, last) element of this rank's shard; None: not held as whole rows
    row_major: bool  # its rows lie one after another (so a run of the parameter's elements is a run of its rows)


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
