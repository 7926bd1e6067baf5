"""The transports by name: the one place that knows them (`SyncConfig.transport` selects one).

Adding a transport means a module here with one class satisfying `TransportKind`
(refit/transport/kinds/protocol.py), registered below, and its name added
to `refit.plan.config.Transport`, the public enum of the accepted strings
(tests/transport/test_kinds.py keeps the two equal).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from refit.errors import ConfigError, TransportError
from refit.transport.kinds.collective import CollectiveTransport
from refit.transport.kinds.ipc import CudaIpcTransport
from refit.transport.kinds.protocol import BucketSink, StreamHandle, TransportKind, TransportTraits
from refit.transport.kinds.ray import RayTransport

__all__ = ["AUTO_CANDIDATES", "TRANSPORTS", "BucketSink", "StreamHandle", "TransportKind", "TransportTraits",
           "choose_transport", "kind_of_handle", "transport_kind"]

TRANSPORTS: dict[str, TransportKind] = {kind.name: kind for kind in (RayTransport(), CollectiveTransport(), CudaIpcTransport())}


def transport_kind(name: str) -> TransportKind:
    """The transport `name` selects (a `Transport` member is its string)."""
    try:
        return TRANSPORTS[str(name)]
    except KeyError:
        raise ConfigError(f"transport={name!r}: expected one of {list(TRANSPORTS)}") from None


def kind_of_handle(handle: Any) -> TransportKind:
    """The transport a trainer's stream is told to send over (`TransportKind.stream_handle`'s answer)."""
    for kind in TRANSPORTS.values():
        if kind.handles(handle):
            return kind
    raise TransportError(f"transport={handle!r}: expected 'ray', an IpcTransport or a collective group's Rendezvous")


AUTO_CANDIDATES = ("ray", "collective")
"""What `transport="auto"` picks from: `ipc` needs trainer and rollout on one GPU, which only the user knows."""


def choose_transport(senders: Mapping[str, Sequence[str]], replicas: Mapping[str, Mapping[str, Any]]) -> tuple[str, str]:
    """`transport="auto"`: the transport for a fleet, and why, from what each member can take.

    `senders`: per trainer rank, the transports it can send over; `replicas`: per replica, its `transports()`
    answer, `{"accepts": [names], "device": "cpu" | "cuda" | ...}`. `ray` wherever every member takes it: it
    works wherever it is accepted, each replica fetches whole buckets or deltas as its own base needs, and a
    replica lost mid-stream is dropped while the others go on. Else `collective` (an AsyncLLM or `vllm serve`
    replica, whose engine core runs in another process). Never `collective` by speed alone: on CPUs neither
    road wins everywhere (docs/performance.md), and on GPUs a trainer colocated with a replica on one device
    (a hybrid engine) cannot form an NCCL group with it, which no member's answer tells yet. Raises
    `ConfigError` naming what each member takes when no transport suits them all.
    """
    takers = {name: [who for who in senders if name in senders[who]] + [who for who in replicas if name in replicas[who]["accepts"]]
              for name in AUTO_CANDIDATES}
    everyone = len(senders) + len(replicas)
    possible = [name for name in AUTO_CANDIDATES if len(takers[name]) == everyone]
    if not possible:
        what = [f"{who} can send over {list(names) or 'none'}" for who, names in senders.items()]
        what += [f"{who} can take {list(offer['accepts']) or 'none'}" for who, offer in replicas.items()]
        raise ConfigError("transport='auto': no transport suits every member of this sync, so set one (and fit the "
                          "members to it):\n  " + "\n  ".join(what))
    devices = sorted({str(offer.get("device", "")) for offer in replicas.values()} - {""})
    if "ray" in possible:
        return "ray", f"every member can take it (the replicas' workers are on {', '.join(devices) or 'devices unsaid'})"
    refusing = [who for who in list(senders) + list(replicas) if who not in takers["ray"]]
    return "collective", f"{', '.join(refusing)} cannot take 'ray' (its engine core runs in another process)"
