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
from refit.plan.transfer_plan import PlannedTensor, TransferPlan
from refit.provenance import refuse_invalid_scales
from refit.quantizer.fp8_block import is_finite, is_valid_scale, loadable_form, loadable_layout, quantize_fp8_block, scale_name
from refit.transport.buckets import BucketWriter, WireBucket, WireTensor
from refit.transport.delta import ReplicaBase
from refit.transport.integrity import tag_matches

__all__ = ["loadable_tensors", "produce_buckets"]


def produce_buckets(plan: TransferPlan, tensor: Callable[[str], torch.Tensor]) -> Iterator[WireBucket]:
    """Yield the plan's buckets, each packed and (if `quantize_on` is the trainer) quantized.

    `tensor(name)` returns the trainer's current value of a parameter. Every
    tensor is checked against the plan (shape, dtype, NaN/Inf) before the
    first bucket is yielded: a refit either sends everything or nothing, so a
    replica is never left half-updated by bad trainer state. Every entry is
    tagged with the plan's `integrity_key` (untagged if it has none).
    """
    _preflight(plan, tensor)
    for index, bucket in enumerate(plan.buckets):
        # Laid out from the plan first, so the quantizer writes its codes and
        # scales straight into the buffer they travel in.
        layouts = [_wire_layout(plan, planned) for planned in bucket]
        writer = BucketWriter(index, [entry for _, layout in layouts for entry in layout], key=plan.integrity_key)
        slot = 0
        for planned, (block, _) in zip(bucket, layouts):
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
    check every entry's bytes against its keyed tag (the plan's
    `integrity_key`); an entry without one is refused. `base`: the replica's
    copy of what it serves, which rebuilds delta entries (and keeps every
    whole one) before anything else sees them.

    Whatever `verify` says, a bucket is refused, naming the tensor, before
    any byte of it reaches the base or the engine, when it holds a name
    outside the plan's bucket, a dtype or shape other than the plan's, or
    an FP8 weight scale that is not finite and positive.
    """
    parts = [parts] if isinstance(parts, WireBucket) else list(parts)
    index = {part.index for part in parts}
    if len(index) != 1:
        raise PlanMismatchError(f"parts of different buckets {sorted(index)} arrived as one; the ranks disagree on the plan")
    bucket = index.pop()
    if not 0 <= bucket < len(plan.buckets):
        raise PlanMismatchError(f"bucket {bucket} arrived; the plan has buckets 0..{len(plan.buckets) - 1}")
    planned = {t.target: t for t in plan.buckets[bucket]}
    expected = _expected_entries(plan, bucket)
    rows = [row for part in parts for row in part.unpack_rows()]
    if verify:
        _check_tags(bucket, rows, plan.integrity_key)
    _check_names_and_dtypes(bucket, rows, expected)
    if base is not None:
        rows = base.rebuild(rows, key=plan.integrity_key if verify else None)
    elif deltas := [entry.name for entry, _ in rows if entry.changed is not None]:
        raise PlanMismatchError(f"bucket {bucket}: deltas arrived ({', '.join(deltas[:4])}), but this replica keeps no base for this sync")
    tensors = _assemble(rows)
    _check_shapes_and_scales(bucket, tensors, expected)
    if plan.quantize_on is not QuantizeOn.TRAINER:
        tensors = [pair for name, value in tensors for pair in loadable_form(name, value, planned[name].block)]
    return tensors + _copies(plan, planned, tensors)


def _copies(
    plan: TransferPlan, planned: dict[str, PlannedTensor], tensors: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """The plan's copies of this bucket's targets: the same tensors (a weight with its scale) under the copy's
    names, so the engine's loaders copy one arrived tensor into both parameters."""
    by_name = dict(tensors)
    out = []
    for target, of in plan.copies:
        if of in planned:
            pairs = ((of, target), (scale_name(of), scale_name(target)))
            out += [(new, by_name[old]) for old, new in pairs if old in by_name]
    return out


def _wire_layout(
    plan: TransferPlan, planned: PlannedTensor
) -> tuple[tuple[int, int] | None, list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """How `planned` travels: its FP8 block (None: as it is) and its wire entries `(name, dtype, shape)`; one answer
    for the sender that lays a bucket out and the receiver that checks it."""
    block = planned.block if plan.quantize_on is QuantizeOn.TRAINER else None
    return block, loadable_layout(planned.target, planned.shape, getattr(torch, planned.dtype), block)


def _expected_entries(plan: TransferPlan, bucket: int) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """What bucket `bucket` may hold, by wire name: (dtype, whole shape, whether it is an FP8 weight scale)."""
    expected = {}
    for planned in plan.buckets[bucket]:
        for name, dtype, shape in _wire_layout(plan, planned)[1]:
            expected[name] = (str(dtype).removeprefix("torch."), tuple(shape), name != planned.target)
    return expected


def _check_tags(bucket: int, rows: list[tuple[WireTensor, torch.Tensor]], key: bytes | None) -> None:
    """Every entry carries a tag; whole entries' bytes match theirs (a delta's is its rebuilt tensor's: checked when
    rebuilt). Nothing of the bucket is loaded otherwise."""
    if key is None:
        raise VerificationError(
            f"bucket {bucket} arrived for a sync whose plan carries no integrity key; a Syncer hands every verified "
            "sync's plan a key (TransferPlan.for_sync), so this plan did not come from one"
        )
    untagged = [entry.name for entry, _ in rows if entry.tag is None]
    if untagged:
        raise VerificationError(
            f"bucket {bucket} arrived with entries that carry no integrity tag: {', '.join(untagged[:8])}; nothing of it "
            "was loaded. A weight source tags its buckets by packing them with the plan's key "
            "(refit.produce_buckets, or pack_bucket(..., key=plan.integrity_key))"
        )
    altered = [entry.name for entry, tensor in rows if entry.changed is None and not tag_matches(key, entry.identity, tensor, entry.tag)]
    if altered:
        raise VerificationError(
            f"bucket {bucket} arrived altered (its keyed integrity tag does not match) in: {', '.join(altered[:8])}; "
            "nothing of it was loaded"
        )


def _check_names_and_dtypes(bucket: int, rows: list[tuple[WireTensor, torch.Tensor]],
                            expected: dict[str, tuple[str, tuple[int, ...], bool]]) -> None:
    problems = [f"{entry.name}: not in the plan's bucket {bucket}" for entry, _ in rows if entry.name not in expected]
    problems += [f"{entry.name}: {entry.dtype} arrived, the plan has {expected[entry.name][0]}"
                 for entry, _ in rows if entry.name in expected and entry.dtype != expected[entry.name][0]]
    if problems:
        raise InvalidTensorError("refusing a bucket that does not match the plan; nothing of it was loaded:\n  " + "\n  ".join(problems))


def _check_shapes_and_scales(bucket: int, tensors: list[tuple[str, torch.Tensor]],
                             expected: dict[str, tuple[str, tuple[int, ...], bool]]) -> None:
    """Whole tensors have the plan's shapes; FP8 weight scales are finite and positive (a zero, negative or NaN
    scale would dequantize every weight of its block to garbage, silently)."""
    problems = [f"{name}: {tuple(value.shape)} arrived, the plan has {expected[name][1]}"
                for name, value in tensors if tuple(value.shape) != expected[name][1]]
    scales = [(name, value) for name, value in tensors if expected[name][2] and tuple(value.shape) == expected[name][1]]
    # One pass over all of the bucket's scales (a MoE bucket holds hundreds); each is named only if the pass fails.
    if scales and not is_valid_scale(torch.cat([value.reshape(-1).float() for _, value in scales])):
        for name, value in scales:
            if not is_valid_scale(value):
                problems.append(f"{name}: FP8 weight scale holds zero, negative or non-finite values "
                                f"(min {float(value.float().min()):.4g})")
    if problems:
        raise InvalidTensorError(f"refusing bucket {bucket}; nothing of it was loaded:\n  " + "\n  ".join(problems))


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
        if (problem := _not_data(planned.source, value)) is not None:
            mismatched.append(problem)
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


def _not_data(name: str, value: object) -> str | None:
    """Why `value` holds no values a bucket can carry (torch's own errors for these name no tensor), or None."""
    if not isinstance(value, torch.Tensor):
        return f"{name}: a {type(value).__name__}, not a torch.Tensor"
    if value.is_meta:
        return (f"{name}: on the meta device, so it holds no values (a model built or offloaded there); materialize it "
                "before a sync")
    if value.layout is not torch.strided:
        return f"{name}: a {str(value.layout).removeprefix('torch.')} tensor; refit sends dense tensors"
    return None
