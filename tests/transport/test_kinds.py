"""The transport registry (refit/transport/kinds/): one object per `SyncConfig.transport` string, found by name or by handle."""

from __future__ import annotations

import pytest

from refit.errors import ConfigError, TransportError
from refit.plan.config import SyncConfig, Transport
from refit.transport.collective import Rendezvous
from refit.transport.ipc import IpcTransport
from refit.transport.kinds import AUTO_CANDIDATES, TRANSPORTS, choose_transport, kind_of_handle, transport_kind
from refit.transport.shm import ShmHandle


def test_the_registry_names_every_public_transport_and_nothing_else() -> None:
    assert set(TRANSPORTS) == {t.value for t in Transport} - {"auto"}
    for transport in set(Transport) - {Transport.AUTO}:
        assert SyncConfig(transport=transport).transport_kind is transport_kind(transport.value)
        assert transport_kind(transport).name == transport.value
    assert set(AUTO_CANDIDATES) <= set(TRANSPORTS)
    with pytest.raises(ConfigError, match="transport='auto' names no transport until a Syncer picks one"):
        _ = SyncConfig().transport_kind


HOST = "boot-1|pid:[1]|uid 1000"
CPU = {"accepts": ["shm", "ray", "collective"], "device": "cpu", "host": HOST}
CORE_ELSEWHERE = {"accepts": ["shm", "collective"], "device": "cpu", "host": HOST}  # an AsyncLLM's
SERVER = {"accepts": ["collective"], "device": "cpu", "host": HOST}  # a vllm serve's
TRAINER = {"trainer": {"sends": ["shm", "ray", "collective"], "host": HOST}}


def on(host: str, offer: dict) -> dict:
    return {**offer, "host": host}


def test_auto_maps_shared_memory_where_every_member_shares_the_trainers_host() -> None:
    name, why = choose_transport(TRAINER, {"rollout 0": CPU, "rollout 1": CORE_ELSEWHERE})
    assert name == "shm" and "one host" in why and "on cpu" in why


def test_auto_takes_the_object_store_where_members_span_hosts_or_cannot_map() -> None:
    name, why = choose_transport(TRAINER, {"rollout 0": CPU, "rollout 1": on("boot-2|pid:[1]|uid 1000", CPU)})
    assert name == "ray" and "more than one host" in why and "on cpu" in why
    # Unknown hosts never count as one, and a rank without `transport_host` cannot send over shm.
    assert choose_transport(TRAINER, {"rollout 0": on("", CPU)})[0] == "ray"
    name, why = choose_transport({"trainer": {"sends": ["ray", "collective"], "host": ""}}, {"rollout 0": CPU})
    assert name == "ray" and "trainer cannot take 'shm'" in why
    # On CUDA too: a trainer colocated with a replica on one GPU cannot form an NCCL group with it.
    cuda = {"accepts": ["ray", "collective"], "device": "cuda", "host": "elsewhere"}
    assert choose_transport(TRAINER, {"rollout 0": cuda, "rollout 1": cuda})[0] == "ray"


def test_auto_broadcasts_where_a_replica_cannot_take_the_object_store_and_names_it() -> None:
    name, why = choose_transport(TRAINER, {"rollout 0": CPU, "rollout 3": SERVER})
    assert name == "collective" and why.startswith("rollout 3 cannot take 'ray'")
    name, why = choose_transport(TRAINER, {"rollout 0": CPU, "rollout 3": on("boot-2", CORE_ELSEWHERE)})
    assert name == "collective" and why.startswith("rollout 3 cannot take 'ray'")


def test_auto_names_a_member_that_did_not_say_its_host_rather_than_claim_two_hosts() -> None:
    """Found by review: a replica without `transports()`, or one that did not answer it in time (hung, dying), has
    no host; the choice fell back from `shm` as it must, but the report said the members ran on more than one host,
    sending the user after a network layout that was not there."""
    name, why = choose_transport(TRAINER, {"rollout 0": CPU, "rollout 1": on("", CPU)})
    assert name == "ray" and "more than one host" not in why and "rollout 1 did not say its host" in why
    name, why = choose_transport(TRAINER, {"rollout 0": CORE_ELSEWHERE, "rollout 1": on("", CPU)})
    assert name == "collective" and why.startswith("rollout 0 cannot take 'ray'")
    assert why.endswith("and rollout 1 did not say its host")


def test_auto_refuses_a_fleet_no_transport_suits_naming_what_each_member_takes() -> None:
    with pytest.raises(ConfigError, match=r"no transport suits every member(.|\n)*trainer can send over \['ray'\]"
                                          r"(.|\n)*rollout 1 can take \['collective'\]"):
        choose_transport({"trainer": {"sends": ["ray"], "host": HOST}}, {"rollout 0": CPU, "rollout 1": SERVER})


def test_each_stream_handle_names_its_own_transport() -> None:
    formed = []
    for kind in TRANSPORTS.values():
        handle = kind.stream_handle(2, lambda: formed.append(1) or Rendezvous.__new__(Rendezvous))
        assert kind_of_handle(handle) is kind
    assert formed == [1]  # only the collective transport connects a group
    assert kind_of_handle(IpcTransport.for_buckets_in_flight(2)).name == "ipc"
    assert kind_of_handle(ShmHandle(6)).name == "shm"
    with pytest.raises(TransportError, match="expected 'ray'"):
        kind_of_handle("carrier pigeon")
    with pytest.raises(ConfigError, match="expected one of"):
        transport_kind("carrier pigeon")


def test_deltas_are_kept_exactly_where_they_were() -> None:
    assert {name for name, kind in TRANSPORTS.items() if kind.traits.delta_base_in is not None} == {"ray", "collective"}
    assert [SyncConfig(transport=t).keeps_delta_base for t in ("ray", "collective", "ipc", "shm")] == [True, True, False, False]


def test_a_trainer_asked_to_send_over_a_group_it_is_not_in_says_another_syncer_may_have_taken_it() -> None:
    """A second driver's Syncer sharing the trainer over collective moves it into its own group between this sync's
    join and its stream; the refusal says so rather than only that the sync should have joined."""
    rendezvous = Rendezvous("127.0.0.1", 1, "g1", ("the trainer", "rollout 0 worker 0"), timeout_s=5)
    with pytest.raises(TransportError, match=r"group g1, but this trainer is in no group; .* another Syncer .* one at a time"):
        kind_of_handle(rendezvous).send([], rendezvous, None)
