"""Integrity tags and the receiver's checks on buckets whose bytes lie in GPU memory.

A collective receive over NCCL, or a CUDA IPC handle, hands the replica a
bucket whose buffer is a uint8 tensor on the GPU: its tags are checked (the
bytes are copied to the host for the MAC), and its scales are checked on
the device. Runs only where CUDA is (scripts/gpu_check.sh); skipped here.
"""

from __future__ import annotations

import pytest
import torch

from refit.errors import InvalidTensorError, VerificationError
from refit.plan import QuantizeOn, loadable_tensors
from refit.plan.transfer_plan import PlannedTensor, TransferPlan
from refit.quantizer.fp8_block import loadable_form
from refit.transport.buckets import pack_bucket
from refit.transport.integrity import new_sync_key, tag

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh on a GPU machine)")

NAME = "model.layers.0.mlp.down_proj.weight"
KEY = new_sync_key()
PLAN = TransferPlan(((PlannedTensor(NAME, NAME, (256, 384), "bfloat16", (128, 128)),),), QuantizeOn.TRAINER, KEY)


def on_gpu(tensors=None):
    """A bucket packed on the host, then its bytes moved to the GPU, as a receiver there holds them."""
    packed = pack_bucket(0, tensors or loadable_form(NAME, torch.randn(256, 384, dtype=torch.bfloat16), (128, 128)), key=KEY)
    return packed, packed.contents().with_bytes(torch.from_numpy(packed.buffer).cuda())


def test_a_tag_of_gpu_bytes_is_the_tag_of_the_same_bytes_on_the_host():
    data = torch.randn(1000, 300, device="cuda")
    assert tag(KEY, "x", data) == tag(KEY, "x", data.cpu())


def test_a_bucket_in_gpu_memory_loads_as_the_same_tensors_and_an_altered_byte_is_refused():
    host, gpu = on_gpu()
    loaded = loadable_tensors(PLAN, gpu)
    assert all(tensor.device.type == "cuda" for _, tensor in loaded)
    for (name, got), (_, want) in zip(loaded, loadable_tensors(PLAN, host)):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), name
    gpu.buffer[host.tensors[0].offset] ^= 1
    with pytest.raises(VerificationError, match=rf"arrived altered .* in: {NAME}; nothing of it was loaded"):
        loadable_tensors(PLAN, gpu)


def test_a_nan_scale_in_gpu_memory_is_refused_by_name():
    q, scale = loadable_form(NAME, torch.randn(256, 384, dtype=torch.bfloat16), (128, 128))
    bad = scale[1].clone()
    bad[0, 0] = float("nan")
    _, gpu = on_gpu([q, (scale[0], bad)])
    with pytest.raises(InvalidTensorError, match=rf"{NAME}_scale: FP8 weight scale holds zero, negative or non-finite"):
        loadable_tensors(PLAN, gpu)
