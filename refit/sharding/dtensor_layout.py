"""FSDP2's layout: parameters that are `DTensor`s sharded by rows on a 1-D mesh (`Shard(0)`), replicated, or plain.

A checkpoint tensor is found inside its parameter through `CheckpointView`
(a fused MoE parameter holds many); a rank can send the rows of it that lie
in its shard, and anything held some other way is all-gathered by every
rank of the mesh (`DTensor.full_tensor`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from refit.errors import InvalidTensorError
from refit.plan.checkpoint_format import CheckpointView
from refit.plan.tensors import TensorMeta
from refit.plan.transfer_plan import TransferPlan
from refit.quantizer.fp8_block import is_finite
from refit.sharding.layout import ABSENT, attempt_part, raise_if_a_part_failed
from refit.sharding.routes import RowRange

__all__ = ["DTensorLayout"]


class DTensorLayout:
    """`RankLayout` of a model whose parameters are row-sharded DTensors (FSDP2), replicated, or plain."""

    def __init__(self, model: torch.nn.Module, *, wire_dtype: torch.dtype | None = None) -> None:
        """`wire_dtype`: send floating-point weights in this dtype (bf16 from fp32 master weights); each
        rank casts its own rows, and all-gathers are made in it (half the bytes of fp32)."""
        self.model = model
        self._wire_dtype = wire_dtype
        _reshard(model)
        self.view = CheckpointView(model, wire_dtype=wire_dtype)

    def metadata(self) -> list[TensorMeta]:
        self._read_current_parameters()
        return self.view.metadata()

    def finish_parameter_updates(self) -> None:
        """Read the model's sharded parameters as it holds them now (every rank runs it as its stream starts).

        Why: the view reads the parameter objects it captured. FSDP2 registers
        other objects in their place while a module is unsharded (after a
        forward with `reshard_after_forward=False`: bf16 copies under mixed
        precision, which an optimizer step leaves stale and a reshard frees,
        so that reading them sent old weights or crashed the process), and a
        parameter can be replaced outright (`load_state_dict(..., assign=True)`,
        which FSDP2 adopts), leaving the view to send the old one. So every
        FSDP2 module is resharded first (as its `state_dict()` does; no
        collective, a later forward gathers again), and the view made again
        when the model holds other objects than it read."""
        self._read_current_parameters()

    def _read_current_parameters(self) -> None:
        _reshard(self.model)
        if self.view.outdated():
            self.view = CheckpointView(self.model, wire_dtype=self._wire_dtype)

    def held(self, name: str) -> RowRange | None | object:
        _, extent = self._extent(name)
        if extent.shard is None or not extent.row_major:
            return None
        rows = extent.shape[0] if extent.shape else 1
        lo, hi = max(extent.offset, extent.shard[0]), min(extent.offset + rows * extent.row_numel, extent.shard[1])
        if lo >= hi:
            return ABSENT
        if (lo - extent.offset) % extent.row_numel or (hi - extent.offset) % extent.row_numel:
            return None
        return ((lo - extent.offset) // extent.row_numel, (hi - extent.offset) // extent.row_numel)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        param, extent = self._extent(name)
        flat = _local(param).detach().reshape(-1)
        begin = extent.offset + start * extent.row_numel - extent.shard[0]
        rows = flat[begin : begin + (stop - start) * extent.row_numel].view(stop - start, *extent.shape[1:])
        if not extent.shape:  # a 0-d tensor (a scalar buffer) is one row here, and goes out as it is held
            rows = rows.view(())
        return rows.to(self.view.wire_dtype(param))  # no copy unless the wire dtype differs

    def joins_gather(self, name: str) -> bool:
        return True  # `full_tensor` is a collective over the whole mesh

    def gathered(self, name: str) -> torch.Tensor:
        """`name` whole, all-gathered over the mesh in the wire dtype.

        Each rank casts its shard before `full_tensor`'s all-gathers and tells the mesh in small all-gathers first
        whether it could, so that every rank raises alike if one could not (`raise_if_a_part_failed`)."""
        param, piece = self.view.location(name)
        dtype = self.view.wire_dtype(param)
        if not _is_dtensor(param):
            full = param.detach().to(dtype)
        else:
            wire, failure = attempt_part(lambda: self._wire_shard(param, dtype))
            failed = _a_failed_rank(param.device_mesh, failure is not None, param.device)
            raise_if_a_part_failed(name, failure, [] if failed is None else [failed])
            full = wire.full_tensor()
        return full if piece is None else full.as_strided(piece.shape, piece.stride, piece.offset)

    @staticmethod
    def _wire_shard(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`param` (a DTensor) in `dtype`, its local shard cast (the gather then moves wire bytes), once this rank
        has shown it can allocate the whole tensor: `full_tensor` allocates as much, and failing there, after its
        peers entered the all-gather, would leave them waiting."""
        wire = param.detach().to(dtype)
        torch.empty(param.shape, dtype=dtype, device=param.device)
        return wire

    def check_finite(self, plan: TransferPlan, rank: int) -> None:
        """Each local shard once, whole; one that holds NaN or Inf is searched for the planned tensors whose rows here
        hold it (a fused parameter holds many: every expert's). A tensor whose part here does not start and end on
        its rows cannot be searched without a gather: then the message names every such candidate."""
        held: dict[int, tuple[torch.Tensor, list[str]]] = {}
        for planned in plan.tensors:
            param, _ = self.view.location(planned.source)
            held.setdefault(id(param), (param, []))[1].append(planned.source)
        for param, names in held.values():
            if is_finite(_local(param).detach()):
                continue
            rows = {name: self.held(name) for name in names}
            bad = [name for name, span in rows.items() if isinstance(span, tuple) and not is_finite(self.rows(name, *span))]
            unsure = [name for name, span in rows.items() if span is None]
            if bad or unsure:
                what = f"{', '.join(bad)} {'holds' if len(bad) == 1 else 'hold'}" if bad else f"one of {', '.join(unsure)} holds"
                raise InvalidTensorError(f"refusing to send any weight: {what} NaN or Inf on rank {rank}")

    def shard_bytes(self) -> int:
        return sum(_local(t).numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))

    def _extent(self, name: str) -> tuple[torch.Tensor, _Extent]:
        """Checkpoint tensor `name`'s parameter, and where the tensor and this rank's shard lie in it (flat elements)."""
        param, piece = self.view.location(name)
        shape, offset = (tuple(piece.shape), piece.offset) if piece else (tuple(param.shape), 0)
        local = _local_rows(param)
        param_row = math.prod(param.shape[1:])
        shard = None if local is None else (local[0] * param_row, local[1] * param_row)
        return param, _Extent(shape, offset, max(math.prod(shape[1:]), 1), shard,
                              piece is None or tuple(piece.stride) == torch.empty(shape, device="meta").stride())


class _Extent(NamedTuple):
    """A checkpoint tensor inside its parameter, in the parameter's flat element order."""

    shape: tuple[int, ...]
    offset: int  # of its first element
    row_numel: int  # elements per row of the tensor
    shard: tuple[int, int] | None  # [first, last) element of this rank's shard; None: not held as whole rows
    row_major: bool  # its rows lie one after another (so a run of the parameter's elements is a run of its rows)


def _reshard(model: torch.nn.Module) -> None:
    """Register FSDP2's sharded parameters on every module it shards (freeing unsharded ones); local, no collective."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if _is_dtensor(param) else param


def _a_failed_rank(mesh, failed_here: bool, device: torch.device) -> int | None:
    """The global rank of a rank of `mesh` that failed (the highest), or None: each rank's own (if `failed_here`)
    all-gathered along each of the mesh's dimensions in turn, so that every rank learns of any."""
    failed = torch.tensor([torch.distributed.get_rank() if failed_here else -1], dtype=torch.int64, device=device)
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        seen = [torch.empty_like(failed) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(seen, failed, group=group)
        failed = torch.stack(seen).max(dim=0).values
    highest = int(failed.item())
    return None if highest < 0 else highest


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
