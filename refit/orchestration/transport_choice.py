"""`SyncConfig(transport="auto")`: which transport a fleet's syncs take, asked of its members.

Why asked, not guessed: whether a replica can take `ray` depends on where its
engine core runs (in its actor's process, or in a process of its own as in
AsyncLLM and `vllm serve`), and whether trainer and replicas share a host,
which only they know (`transports()`, which also says where the workers
run, for the report; the trainer's `transport_host()`). The rule itself is
`refit.transport.kinds.choose_transport`, beside the transports it names.
"""

from __future__ import annotations

from typing import Any

from refit.errors import ConfigError
from refit.orchestration.calls import call_groups
from refit.orchestration.fleet import Roll, losses
from refit.plan.config import SyncConfig
from refit.protocols import accepts, has_method
from refit.transport.kinds import AUTO_CANDIDATES, choose_transport, transport_kind

__all__ = ["pick_transport"]


def pick_transport(sources: list[tuple[str, Any]], roll: Roll, config: SyncConfig) -> tuple[str, str]:
    """The transport for the roll's members and the trainer's ranks `sources`, and why (one round: the replicas'
    `transports()`, the ranks' `transport_host()`).

    A replica lost in that round (dead, or no answer within the deadline) is dropped from the roll here, so a hung
    one costs the sync one deadline, not this one and then begin's; the rest are picked for without it.
    """
    members = roll.members
    askable = [(who, r) for who, r in members if has_method(r, "transports")]
    hosted = [(who, s) for who, s in sources if has_method(s, "transport_host")]
    replies, hosts = call_groups([(askable, "transports", ()), (hosted, "transport_host", ())], timeout_s=config.timeout_s)
    roll.stage = "pick"
    roll.drop(losses(replies), "(picking a transport)")
    roll.check_quorum()
    members = roll.members
    answers = {o.who: o.value for o in replies if o.ok}
    offers = {}
    for who, replica in members:
        can = _by_methods(replica, "replica_methods")
        answer = answers.get(who) or {"accepts": can, "device": ""}
        if not (isinstance(answer, dict) and isinstance(answer.get("accepts"), (list, tuple))
                and all(isinstance(name, str) for name in answer["accepts"]) and isinstance(answer.get("device"), str)
                and isinstance(answer.get("host", ""), str)):
            raise ConfigError(f"{who}: transports() answered {answer!r}; expected {{'accepts': [transport names], "
                              "'device': 'cpu' | 'cuda' | ..., 'host': str}")
        offers[who] = {"accepts": [name for name in answer["accepts"] if name in can], "device": answer["device"],
                       "host": answer.get("host", "")}
    host_of = {o.who: o.value for o in hosts if o.ok and isinstance(o.value, str)}
    # A source's `stream_buckets(plan)` without a `transport` argument sends the object store's way only.
    senders = {who: {"sends": [name for name in _by_methods(source, "sender_methods")
                               if name == "ray" or accepts(source, "stream_buckets", "transport")],
                     "host": host_of.get(who, "")} for who, source in sources}
    return choose_transport(senders, offers)


def _by_methods(actor: Any, side: str) -> list[str]:
    """The candidates whose methods `actor` has (`TransportTraits.sender_methods` or `replica_methods`)."""
    return [name for name in AUTO_CANDIDATES if all(has_method(actor, m) for m in getattr(transport_kind(name).traits, side))]
