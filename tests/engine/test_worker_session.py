"""The worker extension's end of an update session (pure logic; the real workers: tests/engine, tests/sync)."""

from __future__ import annotations

import pytest

from refit.engine.worker_rpc import RefitWorkerExtension


def test_a_failed_abandon_still_ends_the_workers_update_session():
    """Found by review: when closing the reload raised, vLLM's session flag stayed set, so every later update's start
    was refused as "already active" and no sync could repair the replica."""

    class Backend:
        def abandon(self) -> None:
            raise RuntimeError("processing a layer failed")

    class Worker(RefitWorkerExtension):
        _weight_update_active = True

        def _refit(self):
            return Backend()

    worker = Worker()
    with pytest.raises(RuntimeError, match="processing a layer failed"):
        worker.refit_abandon_update()
    assert worker._weight_update_active is False
