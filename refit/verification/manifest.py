"""Completeness in checkpoint form: every tensor of the plan reached the replica, each FP8 weight with its scale.

The engine's own completeness check (`RefitTransferBackend.finish_weight_update`)
works on vLLM's parameters, which fuse several checkpoint tensors (q, k and v
in `qkv_proj`; every expert of a layer in `w13_weight`): a parameter counts
as loaded as soon as one of its pieces is. This check names the piece.
"""

from __future__ import annotations

from collections.abc import Iterable

from refit.errors import VerificationError
from refit.plan.transfer_plan import TransferPlan
from refit.quantizer.fp8_block import scale_name

__all__ = ["expected_tensors", "missing_tensors", "refuse_partial"]


def expected_tensors(plan: TransferPlan) -> set[str]:
    """The checkpoint-form names a replica receives for `plan`: every target (copies too), and the scale of each FP8 one."""
    quantized = {t.target for t in plan.tensors if t.block is not None}
    return (set(plan.targets) | {scale_name(target) for target in quantized}
            | {scale_name(target) for target, of in plan.copies if of in quantized})


def missing_tensors(plan: TransferPlan, received: Iterable[str]) -> list[str]:
    return sorted(expected_tensors(plan) - set(received))


def refuse_partial(plan: TransferPlan, received: Iterable[str]) -> None:
    """Raise, naming what is missing, unless every tensor of `plan` was received: a replica never serves a partial update."""
    missing = missing_tensors(plan, received)
    if missing:
        raise VerificationError(
            f"the sync did not deliver {len(missing)} tensor(s) of the plan: {', '.join(missing[:8])}; "
            "this replica will not serve a partial update"
        )
