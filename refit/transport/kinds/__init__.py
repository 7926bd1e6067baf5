"""The transports by name: the one place that knows them (`SyncConfig.transport` selects one).

Adding a transport means a module here with one class satisfying `TransportKind`
(refit/transport/kinds/protocol.py), registered below, and its name added
to `refit.plan.config.Transport`, the public enum of the accepted strings
(tests/transport/test_kinds.py keeps the two equal).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from refit.errors import ConfigError, TransportError
from refit.transport.kinds.collective import CollectiveTransport
from refit.transport.kinds.ipc import CudaIpcTransport
from refit.transport.kinds.protocol import BucketSink, StreamHandle, TransportKind, TransportTraits
from refit.transport.kinds.ray import RayTransport
from refit.transport.kinds.shm import SharedMemoryTransport

__all__ = ["AUTO_CANDIDATES", "TRANSPORTS", "BucketSink", "StreamHandle", "TransportKind", "TransportTraits",
           "choose_transport", "kind_of_handle", "transport_kind"]

TRANSPORTS: dict[str, TransportKind] = {kind.name: kind for kind in (
    RayTransport(), CollectiveTransport(), CudaIpcTransport(), SharedMemoryTransport())}


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
    raise TransportError(f"transport={handle!r}: expected 'ray', an IpcTransport, a ShmHandle or a collective group's Rendezvous")


AUTO_CANDIDATES = ("shm", "ray", "collective")
"""What `transport="auto"` picks from, in its order of preference: `ipc` needs trainer and rollout on one GPU, which
only the user knows."""


def choose_transport(senders: Mapping[str, Mapping[str, Any]], replicas: Mapping[str, Mapping[str, Any]]) -> tuple[str, str]:
    """`transport="auto"`: the transport for a fleet, and why, from what each member can take.

    `senders`: per trainer rank, `{"sends": [names], "host": str}`; `replicas`: per replica, its `transports()`
    answer, `{"accepts": [names], "device": "cpu" | "cuda" | ..., "host": str}` (`host`: `refit.transport.shm.
    host_identity`, empty if unknown). In order:

    1. `shm` where every member takes it and all share one host: each bucket written once, into memory the
       workers map, where Ray copies each bucket into its object store, and again between two Ray nodes.
    2. `ray` wherever every member takes it: each replica fetches whole buckets or deltas as its own base needs,
       and a replica lost mid-stream is dropped while the others go on.
    3. `collective` (an AsyncLLM or `vllm serve` replica off the trainer's host, whose engine core runs in
       another process). Never by speed alone: on CPUs neither it nor `ray` wins everywhere (docs/performance.md),
       and on GPUs a trainer colocated with a replica on one device (a hybrid engine) cannot form an NCCL group
       with it, which no member's answer tells yet.

    Raises `ConfigError` naming what each member takes when no transport suits them all.
    """
    offers = {**{who: offer["sends"] for who, offer in senders.items()}, **{who: offer["accepts"] for who, offer in replicas.items()}}
    takers = {name: [who for who, names in offers.items() if name in names] for name in AUTO_CANDIDATES}
    host_of = {who: str(offer.get("host", "")) for who, offer in [*senders.items(), *replicas.items()]}
    hosts = set(host_of.values())
    possible = [name for name in AUTO_CANDIDATES if len(takers[name]) == len(offers)
                and (not transport_kind(name).traits.one_host or (len(hosts) == 1 and "" not in hosts))]
    if not possible:
        what = [f"{who} can send over {list(offer['sends']) or 'none'}" for who, offer in senders.items()]
        what += [f"{who} can take {list(offer['accepts']) or 'none'}" for who, offer in replicas.items()]
        raise ConfigError("transport='auto': no transport suits every member of this sync, so set one (and fit the "
                          "members to it):\n  " + "\n  ".join(what))
    devices = sorted({str(offer.get("device", "")) for offer in replicas.values()} - {""})
    on = f"the replicas' workers are on {', '.join(devices) or 'devices unsaid'}"
    if possible[0] == "shm":
        return "shm", f"every member runs on one host and can take it ({on})"
    no_shm = [who for who in offers if who not in takers["shm"]]
    # A member that did not say its host (no `transports()`, or no answer in time) is not on another host: say so.
    unsaid = [who for who, host in host_of.items() if not host]
    why_not_shm = (f"{', '.join(no_shm)} cannot take 'shm'" if no_shm else
                   f"{', '.join(unsaid)} did not say its host" if unsaid else "the members run on more than one host")
    if possible[0] == "ray":
        return "ray", f"every member can take it, and {why_not_shm} ({on})"
    refusing = [who for who in offers if who not in takers["ray"]]
    return "collective", (f"{', '.join(refusing)} cannot take 'ray' (its engine core runs in another process), "
                          f"and {why_not_shm}")
