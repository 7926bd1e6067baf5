"""refit's lifecycle log lines carry the sync and its version, and an actor shows them (no Ray, no vLLM)."""

import logging

import pytest

from actors._logging import show_refit_logs
from refit import EngineError, SyncConfig, Syncer
from tests.support.fakes import setup


def test_each_lifecycle_message_names_the_sync_and_its_version(caplog):
    trainer, replicas = setup()
    with caplog.at_level(logging.DEBUG, logger="refit"):
        report = Syncer(trainer, replicas, SyncConfig(bucket_bytes=100_000, timeout_s=5)).sync()
    messages = [r.getMessage() for r in caplog.records if r.name == "refit.orchestration"]
    assert [m.split(": ", 1)[1].split(" ")[0] for m in messages] == ["began", "streamed", "every"]
    assert all(f" v{report.version}: " in m for m in messages)
    engine_lines = [r.getMessage() for r in caplog.records if r.name == "refit.engine"]
    assert sum(m.endswith(f"serving v{report.version}") for m in engine_lines) == 2  # one per replica


def test_a_failed_sync_logs_the_cause_and_every_replica_state(caplog):
    trainer, replicas = setup(at_bucket=2)
    with caplog.at_level(logging.INFO, logger="refit"), pytest.raises(EngineError):
        Syncer(trainer, replicas, SyncConfig(bucket_bytes=100_000, timeout_s=5)).sync()
    failure = next(r for r in caplog.records if r.name == "refit.orchestration" and r.levelno == logging.WARNING)
    assert "failed: EngineError: loader fault at bucket 1" in failure.getMessage()
    assert "rollout 0: refusing to serve" in failure.getMessage() and "rollout 1: refusing" in failure.getMessage()


def test_an_actor_shows_refits_lines_at_a_lowercase_level(monkeypatch):
    """REFIT_LOG_LEVEL=debug made every actor's constructor fail (logging knows only "DEBUG")."""
    monkeypatch.setenv("REFIT_LOG_LEVEL", "debug")
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    logger = logging.getLogger("refit")
    monkeypatch.setattr(logger, "handlers", [])  # as in a fresh actor process; the attributes are put back after
    monkeypatch.setattr(logger, "propagate", logger.propagate)
    level = logger.level
    try:
        show_refit_logs()
        assert logger.level == logging.DEBUG and len(logger.handlers) == 1
    finally:
        logger.setLevel(level)
