"""What the Syncer makes of the trainer's answers about its delta base (pure logic; real deltas: tests/sync/test_delta.py)."""

from __future__ import annotations

import logging

from refit import SyncConfig
from refit.engine.lifecycle import FinishedUpdate
from refit.errors import SyncTimeoutError
from refit.orchestration.calls import Outcome
from refit.orchestration.delta_negotiation import DeltaNegotiation


def test_a_trainer_silent_after_every_replica_finished_leaves_the_digest_unknown_not_the_sync_failed(caplog):
    """Found by review: `base_entries` is asked in finish's round, after every replica serves the new version; its
    failure (a trainer killed just after its stream) raised out of `sync()`, which reported a served sync as failed."""
    negotiation = DeltaNegotiation(sources=[], config=SyncConfig(transport="ray"))
    silent = [Outcome("the trainer", error=SyncTimeoutError("the trainer: base_entries did not answer within 60 s"))]
    with caplog.at_level(logging.WARNING, logger="refit.orchestration"):
        digest = negotiation.settled("s1", 3, {"rollout 0": FinishedUpdate(0.1, digest="abc")}, silent)
    assert digest is None
    assert "every replica serves it, but the trainer did not say what it streamed" in caplog.text
    assert "base_entries did not answer within 60 s" in caplog.text
