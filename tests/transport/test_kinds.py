"""The transport registry (refit/transport/kinds/): one object per `SyncConfig.transport` string, found by name or by handle."""

from __future__ import annotations

import pytest

from refit.errors import ConfigError, TransportError
from refit.plan.config import SyncConfig, Transport
from refit.transport.collective import Rendezvous
from refit.transport.ipc import IpcTransport
from refit.transport.kinds import TRANSPORTS, kind_of_handle, transport_kind


def test_the_registry_names_every_public_transport_and_nothing_else() -> None:
    assert set(TRANSPORTS) == {t.value for t in Transport}
    for transport in Transport:
        assert SyncConfig(transport=transport).transport_kind is transport_kind(transport.value)
        assert transport_kind(transport).name == transport.value


def test_each_stream_handle_names_its_own_transport() -> None:
    formed = []
    for kind in TRANSPORTS.values():
        handle = kind.stream_handle(2, lambda: formed.append(1) or Rendezvous.__new__(Rendezvous))
        assert kind_of_handle(handle) is kind
    assert formed == [1]  # only the collective transport connects a group
    assert kind_of_handle(IpcTransport.for_buckets_in_flight(2)).name == "ipc"
    with pytest.raises(TransportError, match="expected 'ray'"):
        kind_of_handle("carrier pigeon")
    with pytest.raises(ConfigError, match="expected one of"):
        transport_kind("carrier pigeon")


def test_deltas_are_kept_exactly_where_they_were() -> None:
    assert {name for name, kind in TRANSPORTS.items() if kind.traits.delta_base_in is not None} == {"ray", "collective"}
    assert [SyncConfig(transport=t).keeps_delta_base for t in ("ray", "collective", "ipc")] == [True, True, False]
