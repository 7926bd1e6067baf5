"""Both ends of a sync's data path: trainer tensors -> wire buckets -> engine tensors.

`produce_buckets` runs in the trainer's process (any weight-source actor can
call it), `loadable_tensors` in the rollout's. Where FP8_BLOCK quantization
happens is the plan's `quantize_on`: on the trainer by default, which halves
the bytes every replica fetches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from refit.errors import InvalidTensorError, PlanMismatchError, VerificationError
from refit.plan.config import QuantizeOn
from refit.plan.transfer_plan import TransferPlan
from refit.provenance import refuse_invalid_scales
from refit.quantizer.fp8_block import is_finite, loadable_form, loadable_layout, quantize_fp8_block
from refit.transport.buckets import BucketWriter, WireBucket, WireTensor
from refit.transport.checksums import crc32
from refit.transport.delta import ReplicaBase

__all__ = ["loadable_tensors", "produce_buckets"]


def produce_buckets(plan: TransferPlan, tensor: Callable[[str], torch.Tensor]) -> Iterator[WireBucket]:
    """Yield the plan's buckets, each packed and (if `quantize_on` is the trainer) quantized.

    `tensor(name)` returns the trainer's current value of a parameter. Every
    tensor is checked against the plan (shape, dtype, NaN/Inf) before the
    first bucket is yielded: a refit either sends everything or nothing, so a
    replica is never left half-updated by bad trainer state.
    """
    _preflight(plan, tensor)
    for index, bucket in enumerate(plan.buckets):
        # Laid out from the plan first, so the quantizer writes its codes and
        # scales straight into the buffer they travel in.
        blocks = [planned.block if plan.quantize_on is QuantizeOn.TRAINER else None for planned in bucket]
        writer = BucketWriter(index, [entry for planned, block in zip(bucket, blocks) for entry in
                                      loadable_layout(planned.target, planned.shape, getattr(torch, planned.dtype), block)])
        slot = 0
        for planned, block in zip(bucket, blocks):
            value = tensor(planned.source).detach()
            if block is None:
                writer.slot(slot).copy_(value)
                writer.seal(slot)
                slot += 1
            else:
                quantize_fp8_block(value, block, name=planned.target, out=(writer.slot(slot), writer.slot(slot + 1)))
                writer.seal(slot)
                writer.seal(slot + 1)
                slot += 2
        bucket_out = writer.finish()
        del writer  # the consumer has the bucket: hold no second buffer while the next one is written
        yield bucket_out
        del bucket_out


def loadable_tensors(
    plan: TransferPlan, parts: WireBucket | Sequence[WireBucket], *, verify: bool = True, base: ReplicaBase | None = None
) -> list[tuple[str, torch.Tensor]]:
    """A bucket as the tensors vLLM's loaders take (quantized here if the plan says so).

    `parts`: the bucket from one trainer, or one part from each rank of a
    sharded trainer, whose row slices are put back together here. `verify`:
    check every tensor's bytes against the CRC-32 its sender computed.
    `base`: the replica's copy of what it serves, which rebuilds delta
    entries (and keeps every whole one) before anything else sees them.
    """
    parts = [parts] if isinstance(parts, WireBucket) else list(parts)
    index = {part.index for part in parts}
    if len(index) != 1:
        raise PlanMismatchError(f"parts of different buckets {sorted(index)} arrived as one; the ranks disagree on the plan")
    bucket = index.pop()
    planned = {t.target: t for t in plan.buckets[bucket]}
    rows = [row for part in parts for row in part.unpack_rows()]
    if verify:
        _check_checksums(bucket, rows)
    if base is not None:
        rows = base.rebuild(rows)
    elif deltas := [entry.name for entry, _ in rows if entry.changed is not None]:
        raise PlanMismatchError(f"bucket {bucket}: deltas arrived ({', '.join(deltas[:4])}), but this replica keeps no base for this sync")
    tensors = _assemble(rows)
    wrong = [f"{name}: {tuple(value.shape)} arrived, the plan has {planned[name].shape}"
             for name, value in tensors if name in planned and tuple(value.shape) != planned[name].shape]
    if wrong:
        raise InvalidTensorError("refusing a bucket whose tensors do not have the plan's shapes:\n  " + "\n  ".join(wrong))
    if plan.quantize_on is QuantizeOn.TRAINER:
        return tensors
    out: list[tuple[str, torch.Tensor]] = []
    for name, value in tensors:
        out += loadable_form(name, value, planned[name].block)
    return out


def _check_checksums(bucket: int, rows: list[tuple[WireTensor, torch.Tensor]]) -> None:
    """Whole entries' bytes against their sender's CRC-32 (a delta's is its rebuilt tensor's: checked when rebuilt)."""
    altered = [entry.name for entry, tensor in rows
               if entry.crc32 is not None and entry.changed is None and crc32(tensor) != entry.crc32]
    if altered:
        raise VerificationError(
            f"bucket {bucket} arrived altered (CRC-32 differs from the sender's) in: {', '.join(altered)}; "
            "nothing of it was loaded"
        )


def _assemble(rows: list[tuple[WireTensor, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor whole: row slices from several parts concatenated in row order, checked to tile its rows."""
    slices: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for entry, tensor in rows:
        slices.setdefault(entry.name, []).append((entry.row_offset, tensor))
    whole = []
    for name, pieces in slices.items():
        pieces.sort(key=lambda piece: piece[0])
        expected = 0
        for offset, tensor in pieces:
            if offset != expected:
                raise InvalidTensorError(f"{name}: rows {expected}..{offset} are missing or sent twice by the trainer's ranks")
            expected += tensor.shape[0] if tensor.dim() else 1
        whole.append((name, pieces[0][1] if len(pieces) == 1 else torch.cat([tensor for _, tensor in pieces])))
    return whole


def _preflight(plan: TransferPlan, tensor: Callable[[str], torch.Tensor]) -> None:
    """All problems of all tensors, reported together; mismatches before bad values."""
    mismatched: list[str] = []
    bad_values: list[str] = []
    for planned in plan.tensors:
        try:
            value = tensor(planned.source)
        except KeyError:
            mismatched.append(f"{planned.source}: in the plan but not in the trainer's model")
            continue
        if tuple(value.shape) != planned.shape or str(value.dtype).removeprefix("torch.") != planned.dtype:
            mismatched.append(
                f"{planned.source}: {tuple(value.shape)} {value.dtype} does not match the plan's "
                f"{planned.shape} {planned.dtype}; the model changed since the plan was made, so make a new one"
            )
        elif not is_finite(value):
            bad_values.append(f"{planned.source}: holds NaN or Inf")
        else:
            try:
                refuse_invalid_scales([(planned.target, value)])
            except InvalidTensorError as error:
                bad_values.append(str(error))
    if mismatched:
        raise PlanMismatchError("refusing to send any weight:\n  " + "\n  ".join(mismatched + bad_values))
    if bad_values:
        raise InvalidTensorError("refusing to send any weight:\n  " + "\n  ".join(bad_values))
