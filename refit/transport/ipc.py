"""The ipc transport: a colocated trainer and rollout share buckets through CUDA IPC handles.

Why: when the trainer and a vLLM worker sit on the same GPU (colocated RL),
any copy through the host or a network stack is waste. The trainer copies
each packed bucket into its GPU memory once and exports a CUDA IPC handle;
the worker opens it as a tensor over the same memory and loads from it. Only
the handle (a few hundred bytes) crosses Ray and vLLM's RPC.

CUDA only: `require_cuda` refuses it everywhere else, naming who lacks CUDA.
The handle records the GPU's UUID, so a worker on another GPU is refused
rather than handed another device's memory. It travels as JSON of plain
fields, never pickled: a worker rebuilds the tensor from numbers and bytes
it checked, with the classes and dtype fixed here (a bucket is a 1-D uint8
tensor), so no sender can make it construct anything else. The trainer keeps each bucket's
memory alive for `keep` buckets; a worker copies out what vLLM's reload
holds longer (`refit.engine.transfer_backend.copy_out_held`).
"""

from __future__ import annotations

import base64
import collections
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from refit.errors import TransportError
from refit.transport.buckets import BucketContents, WireBucket

__all__ = ["IpcSender", "IpcTransport", "encode_handle", "handle_args", "open_ipc_bucket", "require_cuda"]


@dataclass(frozen=True, slots=True)
class IpcTransport:
    """What a trainer's stream is told for `transport="ipc"`: how many buckets' GPU memory to keep alive.

    The trainer runs at most `max_buckets_in_flight` buckets ahead of the
    driver, which holds as many loads in flight and reads one bucket ahead:
    a bucket must outlive that many newer ones.
    """

    keep: int

    @classmethod
    def for_buckets_in_flight(cls, max_buckets_in_flight: int) -> IpcTransport:
        return cls(keep=2 * max_buckets_in_flight + 2)


def require_cuda(who: str) -> None:
    if not torch.cuda.is_available():
        raise TransportError(
            f"transport='ipc' needs CUDA, and {who} has no CUDA device (torch.cuda.is_available() is False); "
            "it shares GPU memory between a colocated trainer and rollout. Use transport='collective' "
            "(gloo on CPUs) or 'ray'"
        )


class IpcSender:
    """The trainer's end: each bucket copied to its GPU once, then its handle yielded."""

    def __init__(self, keep: int) -> None:
        require_cuda("the trainer")
        self._alive: collections.deque[torch.Tensor] = collections.deque(maxlen=keep)
        self._gpu = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)

    def send(self, buckets: Iterable[WireBucket]) -> Iterator[BucketContents]:
        from torch.multiprocessing.reductions import reduce_tensor

        for bucket in buckets:
            data = torch.from_numpy(bucket.buffer).to("cuda") if not isinstance(bucket.buffer, torch.Tensor) else bucket.buffer
            torch.cuda.current_stream().synchronize()  # the worker reads it on another stream, in another process
            self._alive.append(data)
            _, args = reduce_tensor(data)
            yield bucket.contents(ipc_handle=encode_handle(args, self._gpu))


def open_ipc_bucket(contents: BucketContents, device: torch.device) -> WireBucket:
    """The bucket as a tensor over the trainer's GPU memory, on this worker's `device`."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    require_cuda("this vLLM worker")
    shared_from, args = handle_args(contents.ipc_handle, contents.index, device.index)
    gpu = str(torch.cuda.get_device_properties(device.index).uuid)
    if shared_from != gpu:
        raise TransportError(
            f"bucket {contents.index} was shared from GPU {shared_from} but this worker runs on GPU {gpu}; "
            "transport='ipc' needs the trainer and the rollout on the same GPU (use 'collective' otherwise)"
        )
    return contents.with_bytes(rebuild_cuda_tensor(*args))


# `reduce_tensor`'s arguments for `rebuild_cuda_tensor`, as the handle names them; the tensor and storage classes,
# the dtype and `requires_grad` are not sent: a bucket is always a 1-D uint8 tensor (`_FIXED`).
_INTS = ("size", "stride", "tensor_offset", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset")
_BYTES = ("storage_handle", "ref_counter_handle", "event_handle")  # each may be None


def _fixed() -> dict[str, object]:
    return {"tensor_cls": torch.Tensor, "storage_cls": torch.storage.TypedStorage, "dtype": torch.uint8,
            "requires_grad": False}


def encode_handle(args: tuple, gpu: str) -> bytes:
    """`reduce_tensor(bucket)`'s arguments as the handle's JSON, with the UUID of the GPU they are on.

    Raises `TransportError` for anything but a 1-D uint8 tensor in a typed storage (what `open_ipc_bucket` rebuilds).
    """
    (tensor_cls, size, stride, tensor_offset, storage_cls, dtype, _device, storage_handle, storage_size_bytes,
     storage_offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args
    got = {"tensor_cls": tensor_cls, "storage_cls": storage_cls, "dtype": dtype, "requires_grad": requires_grad}
    if got != _fixed() or len(size) != 1 or len(stride) != 1:
        raise TransportError(f"transport='ipc' shares 1-D uint8 buckets only; reduce_tensor gave {got}, size {tuple(size)}")
    fields = {"gpu": gpu, "size": size[0], "stride": stride[0], "tensor_offset": tensor_offset,
              "storage_size_bytes": storage_size_bytes, "storage_offset_bytes": storage_offset_bytes,
              "ref_counter_offset": ref_counter_offset, "event_sync_required": event_sync_required}
    for name, raw in zip(_BYTES, (storage_handle, ref_counter_handle, event_handle)):
        fields[name] = None if raw is None else base64.b64encode(raw).decode("ascii")
    return json.dumps(fields).encode()


def handle_args(handle: bytes | None, index: int, device_index: int) -> tuple[str, tuple]:
    """The GPU a bucket's handle was shared from, and `rebuild_cuda_tensor`'s arguments on this worker's device.

    The handle is parsed as JSON and every field checked, never executed; anything else is refused naming the bucket.
    """
    def refuse(why: str) -> TransportError:
        return TransportError(f"bucket {index}: its CUDA IPC handle {why}; it is not one a refit trainer sent")

    try:
        fields = json.loads(handle) if isinstance(handle, bytes) else None
    except ValueError:
        fields = None
    expected = {"gpu", "event_sync_required", *_INTS, *_BYTES}
    if not isinstance(fields, dict) or set(fields) != expected:
        raise refuse(f"is not JSON with exactly the fields {sorted(expected)}")
    if not isinstance(fields["gpu"], str) or not isinstance(fields["event_sync_required"], bool):
        raise refuse("names no GPU, or no event flag")
    bad = [name for name in _INTS if type(fields[name]) is not int or fields[name] < 0]
    bad += [name for name in _BYTES if fields[name] is not None and not isinstance(fields[name], str)]
    if bad:
        raise refuse(f"holds no valid {', '.join(bad)}")
    try:
        raw = {name: None if fields[name] is None else base64.b64decode(fields[name], validate=True) for name in _BYTES}
    except ValueError:
        raise refuse("holds bytes that are not base64") from None
    fixed = _fixed()
    return fields["gpu"], (
        fixed["tensor_cls"], torch.Size([fields["size"]]), (fields["stride"],), fields["tensor_offset"],
        fixed["storage_cls"], fixed["dtype"], device_index, raw["storage_handle"], fields["storage_size_bytes"],
        fields["storage_offset_bytes"], fixed["requires_grad"], raw["ref_counter_handle"], fields["ref_counter_offset"],
        raw["event_handle"], fields["event_sync_required"],
    )
