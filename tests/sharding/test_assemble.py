"""Replicas put the row slices of a sharded trainer's ranks back together, and refuse what does not tile."""

from __future__ import annotations

import pytest
import torch

from refit.errors import InvalidTensorError, PlanMismatchError
from refit.plan import QuantizeOn, loadable_tensors
from refit.plan.transfer_plan import PlannedTensor, TransferPlan
from refit.quantizer.fp8_block import loadable_form
from refit.transport.buckets import pack_bucket
from refit.transport.integrity import new_sync_key

NAME = "model.layers.0.mlp.down_proj.weight"
WEIGHT = torch.randn(256, 384, dtype=torch.bfloat16)
KEY = new_sync_key()


def plan(quantize_on: QuantizeOn = QuantizeOn.TRAINER) -> TransferPlan:
    return TransferPlan(((PlannedTensor(NAME, NAME, (256, 384), "bfloat16", (128, 128)),),), quantize_on, KEY)


def rank_part(rows: tuple[int, int], *, index: int = 0, quantize: bool = True):
    start, stop = rows
    tensors = loadable_form(NAME, WEIGHT[start:stop], (128, 128) if quantize else None)
    offsets = {name: start if name == NAME else start // 128 for name, _ in tensors}
    return pack_bucket(index, tensors, row_offsets=offsets, key=KEY)


@pytest.mark.parametrize("quantize_on", list(QuantizeOn))
def test_row_slices_from_two_ranks_equal_the_whole_tensor_bit_for_bit(quantize_on):
    quantize = quantize_on is QuantizeOn.TRAINER
    parts = [rank_part((128, 256), quantize=quantize), rank_part((0, 128), quantize=quantize)]  # any arrival order
    got = dict(loadable_tensors(plan(quantize_on), parts))
    whole = dict(loadable_form(NAME, WEIGHT, (128, 128)))
    assert got.keys() == whole.keys()
    for name in whole:
        assert torch.equal(got[name].view(torch.uint8), whole[name].view(torch.uint8)), name


def test_missing_or_doubled_rows_are_refused_naming_the_tensor():
    with pytest.raises(InvalidTensorError, match=rf"{NAME}: rows 128\.\.0 are missing or sent twice"):
        loadable_tensors(plan(), [rank_part((0, 128)), rank_part((0, 128))])
    with pytest.raises(InvalidTensorError, match=r"\(128, 384\) arrived, the plan has \(256, 384\)"):
        loadable_tensors(plan(), [rank_part((0, 128))])


def test_parts_of_different_buckets_are_refused():
    with pytest.raises(PlanMismatchError, match=r"parts of different buckets \[0, 1\]"):
        loadable_tensors(plan(), [rank_part((0, 128)), rank_part((128, 256), index=1)])
