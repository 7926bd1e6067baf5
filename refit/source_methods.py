"""A weight source's methods, made once: what any trainer process answers a sync with.

Why: the Syncer calls up to seven methods on a trainer (`refit.protocols.
SOURCE_METHODS`): its metadata, the stream (through every transport, with
deltas), the collective group's join and leave, what it last sent. All but
the model's own forward pass are the same whatever the model is; only where
the tensors come from differs. A trainer actor holds one `TrainerWeights`
made from two functions of its model (the metadata, and a plan's buckets),
and `@delegate_to_weights` adds every source method the actor class does
not define as a call on it. `actors.TrainerActor`, the FSDP2 ranks and the
Megatron ranks are three such actors; a user's Megatron or FSDP2 rank is a
fourth (docs/sharded.md).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from refit.adapters.weights import AdapterMeta, AdapterWeights
from refit.errors import ConfigError, take_settlement
from refit.plan.tensors import TensorMeta
from refit.plan.transfer_plan import TransferPlan
from refit.protocols import SOURCE_METHODS, FullWeightSource, as_declared
from refit.transport.buckets import BucketContents, WireBucket, buffers_from
from refit.transport.collective import Rendezvous
from refit.transport.delta import DeltaMode
from refit.transport.kinds import kind_of_handle
from refit.transport.sender import TransportSender
from refit.transport.shm import host_identity

__all__ = ["TrainerWeights", "delegate_to_weights"]

_C = TypeVar("_C", bound=type)
_T = TypeVar("_T")


class TrainerWeights:
    """The source methods of one trainer process, over `metadata()` and `produce(plan)` (its buckets, or its parts)."""

    def __init__(self, metadata: Callable[[], list[TensorMeta]], produce: Callable[[TransferPlan], Iterator[WireBucket]],
                 stats: Callable[[], dict[str, float]] | None = None,
                 adapter: Callable[[], AdapterWeights] | None = None) -> None:
        """`stats`: what else the last stream cost, beside its seconds (a rank's gathered bytes, say); `adapter`: the
        LoRA adapter the model trains, for adapter-only syncs (`refit.adapters.peft_adapter` makes one of a peft model)."""
        self._metadata = metadata
        self._produce = produce
        self._stats = stats
        self._adapter = adapter
        self.sender = TransportSender()
        self._stream_seconds = 0.0

    def weight_metadata(self) -> list[TensorMeta]:
        return self._metadata()

    def stream_buckets(self, plan: TransferPlan, transport: Rendezvous | str = "ray",
                       delta: str = "off") -> Iterator[WireBucket | BucketContents]:
        """The plan's buckets (deltas where `delta` says), carried by `transport`; times the producing. A stream that
        fails owing its peers something (a sharded rank: the gathers they wait in) settles it, then raises."""
        yield from self._stream(plan, transport, delta)

    def _stream(self, plan: TransferPlan, transport: Rendezvous | str = "ray", delta: str = "off", *,
                errors_as_items: bool = False) -> Iterator[Any]:
        """`stream_buckets`; `errors_as_items` (the Ray-facing method's, `delegate_to_weights`): a failure that owes
        the peers is first yielded as an error item, one for each item a bucket takes, then settled.

        Why report it before settling: the settling waits for peers that the
        consumer frees only once it learns of the error (the relay takes the
        ranks' parts in turn, and a rank stops at its window). An error item
        reaches every reader of it as if raised here.
        """
        self._stream_seconds = 0.0
        allocate = self.sender.bucket_buffers(transport)
        if allocate is not None and DeltaMode(delta) is not DeltaMode.OFF:
            # The base would view the transport's memory, which later buckets and syncs rewrite under it.
            raise ConfigError(f"delta={delta!r} over a transport that writes each bucket into memory it reuses "
                              f"({kind_of_handle(transport).name}): no delta base can be kept; stream with delta='off'")
        buckets = self.sender.encode(self._produce(plan), delta)
        written = _timed(buckets, self._add_stream_seconds, allocate)
        try:
            yield from self.sender.send(written, transport)
        except Exception as error:
            settle = take_settlement(error)
            if settle is None:
                raise
            try:
                if errors_as_items:
                    reported = _as_task_error(error)
                    for _ in range(2 if DeltaMode(delta) is DeltaMode.BOTH else 1):
                        yield reported
            finally:
                settle()
            if not errors_as_items:
                raise

    def base_entries(self) -> list[tuple]:
        return self.sender.base_entries()

    def join_transport(self, rendezvous: Rendezvous, rank: int) -> None:
        self.sender.join(rendezvous, rank)

    def leave_transport(self, group_id: str | None = None) -> None:
        self.sender.leave(group_id)

    def transport_group(self) -> str | None:
        return self.sender.group_id()

    def transport_host(self) -> str:
        return host_identity()

    def adapter_meta(self) -> AdapterMeta:
        return self.adapter_weights().meta()

    def adapter_weights(self) -> AdapterWeights:
        if self._adapter is None:
            raise ConfigError("this trainer trains no LoRA adapter (TrainerActor(..., lora={...}) does); "
                              "sync its weights with Syncer.sync() instead")
        return self._adapter()

    def last_stream_stats(self) -> dict[str, float]:
        return {"seconds": self._stream_seconds, **(self._stats() if self._stats is not None else {})}

    def close(self) -> None:
        """Leave any collective group and forget the delta base (the model these weights came from is gone)."""
        sender, self.sender = self.sender, TransportSender()
        sender.leave()

    def _add_stream_seconds(self, seconds: float) -> None:
        self._stream_seconds += seconds


def delegate_to_weights(cls: _C) -> _C:
    """A class decorator: every method of `SOURCE_METHODS` that `cls` lacks, as the same call on `self.weights`.

    `reference_logprobs` runs the model, so only the class can define it. Each method made takes the protocol's
    signature and docstring (Ray and `refit.protocols.accepts` read them); `stream_buckets` stays a generator
    (Ray streams its buckets).
    """
    for name in SOURCE_METHODS:
        if not hasattr(cls, name) and hasattr(TrainerWeights, name):
            setattr(cls, name, _delegation(cls, name))
    return cls


def _delegation(cls: type, name: str) -> Callable[..., Any]:
    if name == "stream_buckets":
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            yield from self.weights._stream(*args, errors_as_items=True, **kwargs)
    else:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.weights, name)(*args, **kwargs)
    return as_declared(method, cls, name, getattr(FullWeightSource, name), getattr(TrainerWeights, name))


def _timed(items: Iterator[_T], add_seconds: Callable[[float], None],
           allocate: Callable[[int], np.ndarray] | None = None) -> Iterator[_T]:
    """Yield `items`, reporting the time spent producing each one (not the time the consumer holds it); each bucket
    written into `allocate`'s memory (`buffers_from`), where the transport sends from."""
    while True:
        start = time.perf_counter()
        with buffers_from(allocate):
            item = next(items, None)
        add_seconds(time.perf_counter() - start)
        if item is None:
            return
        yield item
        del item  # not held while the next item is made (a bucket buffer each)


def _as_task_error(error: Exception) -> Any:
    """`error` as Ray stores a task's exception: an object whose every `ray.get` raises it."""
    import ray

    return ray.exceptions.RayTaskError("stream_buckets", "".join(traceback.format_exception(error)), error)
