"""The ipc transport: a colocated trainer and rollout share buckets through CUDA IPC handles.

Why: when the trainer and a vLLM worker sit on the same GPU (colocated RL),
any copy through the host or a network stack is waste. The trainer copies
each packed bucket into its GPU memory once and exports a CUDA IPC handle;
the worker opens it as a tensor over the same memory and loads from it. Only
the handle (a few hundred bytes) crosses Ray and vLLM's RPC.

CUDA only: `require_cuda` refuses it everywhere else, naming who lacks CUDA.
The handle records the GPU's UUID, so a worker on another GPU is refused
rather than handed another device's memory. The trainer keeps each bucket's
memory alive for `keep` buckets; a worker copies out what vLLM's reload
holds longer (`refit.engine.transfer_backend.copy_out_held`).
"""

from __future__ import annotations

import collections
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from refit.errors import TransportError
from refit.transport.buckets import BucketContents, WireBucket

__all__ = ["IpcSender", "IpcTransport", "open_ipc_bucket", "require_cuda"]


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
            yield bucket.contents(ipc_handle=pickle.dumps({self._gpu: args}))


def open_ipc_bucket(contents: BucketContents, device: torch.device) -> WireBucket:
    """The bucket as a tensor over the trainer's GPU memory, on this worker's `device`."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    require_cuda("this vLLM worker")
    handles = pickle.loads(contents.ipc_handle)
    gpu = str(torch.cuda.get_device_properties(device.index).uuid)
    if gpu not in handles:
        raise TransportError(
            f"bucket {contents.index} was shared from GPU {sorted(handles)} but this worker runs on GPU {gpu}; "
            "transport='ipc' needs the trainer and the rollout on the same GPU (use 'collective' otherwise)"
        )
    args = list(handles[gpu])
    args[6] = device.index  # reduce_tensor's device slot: the index as this process numbers its GPUs
    return contents.with_bytes(rebuild_cuda_tensor(*args))
