"""Both ends of a sync's data path: trainer tensors -> wire buckets -> engine tensors.

`produce_buckets` runs in the trainer's process (any weight-source actor can
call it), `loadable_tensors` in the rollout's. Where FP8_BLOCK quantization
happens is the plan's `quantize_on`: on the trainer by default, which halves
the bytes every replica fetches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from refit.errors import InvalidTensorError, PlanMismatchError
from refit.orchestration.config import QuantizeOn
from refit.orchestration.plan import TransferPlan
from refit.provenance import refuse_invalid_scales
from refit.quantizer.fp8_block import is_finite, loadable_form
from refit.transport.buckets import WireBucket, pack_bucket

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
        wire: list[tuple[str, torch.Tensor]] = []
        for planned in bucket:
            block = planned.block if plan.quantize_on is QuantizeOn.TRAINER else None
            wire += loadable_form(planned.target, tensor(planned.source).detach(), block)
        yield pack_bucket(index, wire)


def loadable_tensors(plan: TransferPlan, bucket: WireBucket) -> list[tuple[str, torch.Tensor]]:
    """The bucket as the tensors vLLM's loaders take (quantized here if the plan says so)."""
    tensors = bucket.unpack()
    if plan.quantize_on is QuantizeOn.TRAINER:
        return tensors
    planned = {t.target: t for t in plan.buckets[bucket.index]}
    out: list[tuple[str, torch.Tensor]] = []
    for name, value in tensors:
        out += loadable_form(name, value, planned[name].block)
    return out


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
