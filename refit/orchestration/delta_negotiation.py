"""Which replicas of a sync get only what changed (deltas), and which get whole buckets (refit/transport/delta.py).

Why a negotiation: a delta rebuilds the trainer's new weights only on the
exact base it was computed against. So before streaming, each replica says
the digest of the version it holds, and only those holding the trainer's
last streamed version get deltas; every other replica (new, restarted, one
that missed a sync) gets everything. After the sync, a replica whose
finished digest differs from the trainer's is named: its next sync is a
full one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from refit.engine.lifecycle import FinishedUpdate
from refit.orchestration.calls import Outcome, raise_first_error
from refit.orchestration.fleet import Roll
from refit.plan.config import SyncConfig
from refit.protocols import accepts, has_method
from refit.transport.delta import DeltaMode, version_digest

__all__ = ["DeltaNegotiation"]

log = logging.getLogger("refit.orchestration")


@dataclass(frozen=True)
class DeltaNegotiation:
    """Asks the trainer's ranks what they last streamed and the replicas what they hold; decides each one's mode.

    It holds no state of its own: the bases live on the ranks and the replicas, so a restarted one is asked anew.
    """

    sources: list[tuple[str, Any]]  # (name, rank) of every trainer rank that streams
    config: SyncConfig

    def questions(self, roll: Roll) -> list[tuple[list[tuple[str, Any]], str, tuple]]:
        """What `modes` needs answered, as `call_groups` groups: the Syncer asks them in the same round as its
        first claim, so the trainer's stream can start while the other replicas begin (a base read a moment early is
        still checked: a delta against another base fails its tags, and the sync is sent whole)."""
        if not (self.sources_keep_bases() and self.config.keeps_delta_base):
            return []
        askable = [(who, r) for who, r in roll.members if has_method(r, "base_digest")]
        return [(self.sources, "base_entries", ()), (askable, "base_digest", (str(self.config.transport),))]

    def modes(self, roll: Roll, answers: list[list[Outcome]]) -> tuple[DeltaMode | None, dict[str, str]]:
        """What the trainer streams, and which replicas get deltas: those whose base digest is the trainer's.

        `answers`: to `questions`. A source without `base_entries` (a custom
        trainer) is streamed as before (None), and every replica gets
        everything. Over `collective` one broadcast reaches every replica, so
        a fleet that differs gets whole buckets; over `ray` each replica
        fetches the kind it needs.
        """
        if not self.sources_keep_bases():
            return None, {}
        if not self.config.keeps_delta_base:
            return DeltaMode.OFF, {}
        entries, held = answers
        digest = self.sender_digest(entries)
        held = {o.who: o.value for o in held if o.ok}
        modes = {who: "delta" if digest is not None and held.get(who) == digest else "full" for who, _ in roll.members}
        if all(mode == "full" for mode in modes.values()):
            return DeltaMode.FULL, modes
        if all(mode == "delta" for mode in modes.values()):
            return DeltaMode.DELTA, modes
        if not self.config.transport_kind.traits.one_group:  # each replica fetches the kind of bucket it needs
            return DeltaMode.BOTH, modes
        log.info("delta sync: %s hold(s) another version than the trainer's last; over one broadcast every replica "
                 "gets whole buckets", ", ".join(who for who, mode in modes.items() if mode == "full"))
        return DeltaMode.FULL, dict.fromkeys(modes, "full")

    def sources_keep_bases(self) -> bool:
        """Every rank keeps a delta base and streams deltas (see `refit.protocols.WeightSource`)."""
        return all(has_method(source, "base_entries") and accepts(source, "stream_buckets", "delta")
                   for _, source in self.sources)

    def entry_sources(self) -> list[tuple[str, Any]]:
        """The ranks to ask `base_entries` after a sync (none when deltas are off): `settled`'s question."""
        return self.sources if self.config.keeps_delta_base and self.sources_keep_bases() else []

    @staticmethod
    def sender_digest(outcomes: list[Outcome]) -> str | None:
        """The digest of what the trainer's ranks last streamed, from their `base_entries` (None before their first
        stream)."""
        entries = raise_first_error(outcomes)
        merged = [tuple(entry[:3]) + (tuple(entry[3]),) + tuple(entry[4:]) for rank in entries for entry in rank]
        return version_digest(merged) if merged else None

    def settled(self, sync_id: str, version: int, finished: dict[str, FinishedUpdate],
                entries: list[Outcome]) -> str | None:
        """After a sync: the trainer's digest from the ranks' `base_entries` (asked of `entry_sources`; None when deltas
        are off), naming the replicas that hold another one.

        Asked after every replica finished: a trainer that no longer answers leaves the digest unknown (None, as in
        the report), never a failed sync that every replica already serves."""
        unanswered = [f"{o.who}: {o.error}" for o in entries if not o.ok]
        if unanswered:
            log.warning("sync %s v%d: every replica serves it, but the trainer did not say what it streamed, so the "
                        "report has no digest (%s)", sync_id, version, "; ".join(unanswered))
            return None
        digest = self.sender_digest(entries) if entries else None
        unequal = [who for who, f in finished.items() if digest is not None and f.digest not in (None, digest)]
        if unequal:
            log.warning("sync %s v%d: %s hold(s) a version whose digest differs from the trainer's %s; their next sync is "
                        "a full one", sync_id, version, ", ".join(unequal), digest)
        return digest
