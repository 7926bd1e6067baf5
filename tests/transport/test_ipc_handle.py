"""The ipc transport's CUDA IPC handle as data, pure logic (no CUDA): what `reduce_tensor` gives the trainer comes back
to a worker as the same arguments of `rebuild_cuda_tensor`, and anything else is refused naming the bucket. The handle
opened on a GPU is scripts/gpu_check.sh's."""

from __future__ import annotations

import base64
import json
import pickle

import pytest
import torch

from refit.errors import TransportError
from refit.transport.ipc import encode_handle, handle_args

GPU = "GPU-3f2a"


def reduced(**change) -> tuple:
    """`reduce_tensor`'s arguments for a 1-D uint8 CUDA bucket of 4096 bytes, as torch lays them out."""
    args = {"tensor_cls": torch.Tensor, "size": torch.Size([4096]), "stride": (1,), "tensor_offset": 0,
            "storage_cls": torch.storage.TypedStorage, "dtype": torch.uint8, "device": 0, "storage_handle": b"\x00\xffhandle",
            "storage_size_bytes": 8192, "storage_offset_bytes": 512, "requires_grad": False, "ref_counter_handle": b"/ref",
            "ref_counter_offset": 3, "event_handle": None, "event_sync_required": True}
    return tuple((args | change).values())


@pytest.mark.parametrize("event", [None, b"\x01event"])
def test_the_handle_rebuilds_the_trainers_arguments_on_the_workers_device(event):
    args = reduced(event_handle=event)
    gpu, rebuilt = handle_args(encode_handle(args, GPU), 7, device_index=2)
    assert gpu == GPU
    assert rebuilt == args[:6] + (2,) + args[7:]  # only the device: the index as the worker's process numbers it


@pytest.mark.parametrize("change", [{"dtype": torch.float32}, {"size": torch.Size([64, 64]), "stride": (64, 1)},
                                    {"tensor_cls": torch.nn.Parameter}, {"requires_grad": True}])
def test_the_trainer_shares_nothing_but_a_1d_uint8_bucket(change):
    with pytest.raises(TransportError, match="shares 1-D uint8 buckets only"):
        encode_handle(reduced(**change), GPU)


def _edited(**fields) -> bytes:
    return json.dumps(json.loads(encode_handle(reduced(), GPU)) | fields).encode()


@pytest.mark.parametrize(("handle", "why"), [
    (pickle.dumps({GPU: reduced()}), "is not JSON with exactly the fields"),  # the old form: never unpickled
    (b"[1, 2]", "is not JSON with exactly the fields"),
    (None, "is not JSON with exactly the fields"),
    (_edited(extra=1), "is not JSON with exactly the fields"),
    (_edited(gpu=0), "names no GPU, or no event flag"),
    (_edited(size=-1), "holds no valid size"),
    (_edited(storage_size_bytes=1.5, ref_counter_offset=True), "holds no valid storage_size_bytes, ref_counter_offset"),
    (_edited(storage_handle=5), "holds no valid storage_handle"),
    (_edited(event_handle="not base64!"), "holds bytes that are not base64"),
])
def test_a_handle_that_is_not_a_refit_trainers_is_refused_naming_the_bucket(handle, why):
    with pytest.raises(TransportError, match=rf"^bucket 7: its CUDA IPC handle {why}"):
        handle_args(handle, 7, device_index=0)


def test_the_handle_is_plain_json():
    fields = json.loads(encode_handle(reduced(), GPU))
    assert fields["gpu"] == GPU and base64.b64decode(fields["storage_handle"]) == b"\x00\xffhandle"
