"""`SyncConfig(transport="auto")`: which transport a fleet's syncs take, asked of its members.

Why asked, not guessed: whether a replica can take `ray` depends on where its
engine core runs (in its actor's process, or in a process of its own as in
AsyncLLM and `vllm serve`), which only the replica knows (`transports()`,
which also says where its workers run, for the report). The rule itself is
`refit.transport.kinds.choose_transport`, beside the transports it names.
"""

from __future__ import annotations

from typing import Any

from refit.errors import ConfigError
from refit.orchestration.calls import call_all
from refit.plan.config import SyncConfig
from refit.protocols import has_method
from refit.transport.kinds import AUTO_CANDIDATES, choose_transport, transport_kind

__all__ = ["pick_transport"]


def pick_transport(sources: list[tuple[str, Any]], members: list[tuple[str, Any]], config: SyncConfig) -> tuple[str, str]:
    """The transport for `members` and the trainer's ranks `sources`, and why (one round of `transports()` calls)."""
    askable = [(who, r) for who, r in members if has_method(r, "transports")]
    # One that does not answer (dead, hung) is judged by its methods here; the sync's begin then drops it.
    answers = {o.who: o.value for o in call_all(askable, "transports", timeout_s=config.timeout_s) if o.ok}
    offers = {}
    for who, replica in members:
        can = _by_methods(replica, "replica_methods")
        answer = answers.get(who) or {"accepts": can, "device": ""}
        if not (isinstance(answer, dict) and isinstance(answer.get("accepts"), (list, tuple))
                and all(isinstance(name, str) for name in answer["accepts"]) and isinstance(answer.get("device"), str)):
            raise ConfigError(f"{who}: transports() answered {answer!r}; expected {{'accepts': [transport names], "
                              "'device': 'cpu' | 'cuda' | ...}")
        offers[who] = {"accepts": [name for name in answer["accepts"] if name in can], "device": answer["device"]}
    senders = {who: _by_methods(source, "sender_methods") for who, source in sources}
    return choose_transport(senders, offers)


def _by_methods(actor: Any, side: str) -> list[str]:
    """The candidates whose methods `actor` has (`TransportTraits.sender_methods` or `replica_methods`)."""
    return [name for name in AUTO_CANDIDATES if all(has_method(actor, m) for m in getattr(transport_kind(name).traits, side))]
