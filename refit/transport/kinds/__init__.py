"""The transports by name: the one place that knows them (`SyncConfig.transport` selects one).

Adding a transport means a module here with one class satisfying `TransportKind`
(refit/transport/kinds/protocol.py), registered below, and its name added
to `refit.plan.config.Transport`, the public enum of the accepted strings
(tests/transport/test_kinds.py keeps the two equal).
"""

from __future__ import annotations

from typing import Any

from refit.errors import ConfigError, TransportError
from refit.transport.kinds.collective import CollectiveTransport
from refit.transport.kinds.ipc import CudaIpcTransport
from refit.transport.kinds.protocol import BucketSink, StreamHandle, TransportKind, TransportTraits
from refit.transport.kinds.ray import RayTransport

__all__ = ["TRANSPORTS", "BucketSink", "StreamHandle", "TransportKind", "TransportTraits", "kind_of_handle", "transport_kind"]

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
