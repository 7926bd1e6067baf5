"""The transport registry (refit/transport/kinds/): one object per `SyncConfig.transport` string, found by name or by handle."""

from __future__ import annotations

import pytest

from refit.errors import ConfigError, TransportError
from refit.plan.config import SyncConfig, Transport
from refit.transport.collective import Rendezvous
from refit.transport.ipc import IpcTransport
from refit.transport.kinds import AUTO_CANDIDATES, TRANSPORTS, choose_transport, kind_of_handle, transport_kind


def test_the_registry_names_every_public_transport_and_nothing_else() -> None:
    assert set(TRANSPORTS) == {t.value for t in Transport} - {"auto"}
    for transport in set(Transport) - {Transport.AUTO}:
        assert SyncConfig(transport=transport).transport_kind is transport_kind(transport.value)
        assert transport_kind(transport).name == transport.value
    assert set(AUTO_CANDIDATES) <= set(TRANSPORTS)
    with pytest.raises(ConfigError, match="transport='auto' names no transport until a Syncer picks one"):
        _ = SyncConfig().transport_kind


CPU = {"accepts": ["ray", "collective"], "device": "cpu"}
CORE_ELSEWHERE = {"accepts": ["collective"], "device": "cpu"}  # an AsyncLLM's, a vllm serve's
TRAINER = {"trainer": ["ray", "collective"]}


def test_auto_takes_the_object_store_wherever_every_member_takes_it() -> None:
    name, why = choose_transport(TRAINER, {"rollout 0": CPU, "rollout 1": CPU})
    assert name == "ray" and "on cpu" in why
    # On CUDA too: a trainer colocated with a replica on one GPU cannot form an NCCL group with it.
    cuda = {"accepts": ["ray", "collective"], "device": "cuda"}
    assert choose_transport(TRAINER, {"rollout 0": cuda, "rollout 1": cuda})[0] == "ray"


def test_auto_broadcasts_where_a_replica_cannot_take_the_object_store_and_names_it() -> None:
    name, why = choose_transport(TRAINER, {"rollout 0": CPU, "rollout 3": CORE_ELSEWHERE})
    assert name == "collective" and why.startswith("rollout 3 cannot take 'ray'")


def test_auto_refuses_a_fleet_no_transport_suits_naming_what_each_member_takes() -> None:
    with pytest.raises(ConfigError, match=r"no transport suits every member(.|\n)*trainer can send over \['ray'\]"
                                          r"(.|\n)*rollout 1 can take \['collective'\]"):
        choose_transport({"trainer": ["ray"]}, {"rollout 0": CPU, "rollout 1": CORE_ELSEWHERE})


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
