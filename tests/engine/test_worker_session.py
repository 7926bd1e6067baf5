"""The engine end of an update session: the worker extension's flag, an AsyncLLM engine's deadline (pure logic; the real
workers and engines: tests/engine, tests/sync)."""

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


@pytest.fixture
def silent_engine_adapter(monkeypatch):
    """An `AsyncLLMAdapter` with a deadline of 1 s over an engine whose calls never answer, its loop on a thread."""
    import asyncio
    import threading

    import refit.engine.async_llm as async_llm

    class SilentEngine:
        engine_core = None  # vLLM's client of its core, asked whether the core died: this one never does

        async def collective_rpc(self, *args, **kwargs):
            await asyncio.Event().wait()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(async_llm, "_RUN_MARGIN_S", 0.1)
    adapter = object.__new__(async_llm.AsyncLLMAdapter)  # its engine checks need a real vLLM config: not what is tested
    adapter.llm, adapter.loop, adapter.timeout_s = SilentEngine(), loop, 1.0
    adapter._gate = asyncio.Event()
    try:
        yield adapter
    finally:
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.01), loop).result(10)  # the cancelled call ends first
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_an_asyncllm_engine_that_never_answers_is_named_hung_within_the_syncs_deadline(silent_engine_adapter):
    """Found by review: the update's thread waited on the engine's loop without a deadline while holding the core's
    lock, which the lease watchdog needs to close the update, so the gate stayed shut and every request held."""
    from refit.errors import EngineHungError

    with pytest.raises(EngineHungError, match=r"the AsyncLLM's engine did not answer within 1 s"):
        silent_engine_adapter.call_workers("refit_streamed")


def test_an_asyncllm_call_between_updates_keeps_the_last_syncs_deadline(silent_engine_adapter):
    """Found by review: the update's release cleared the deadline, so calls between updates (adapter swaps, scale
    records), holding the core's lock as updates do, waited on a hung engine core for ever."""
    import threading

    from refit.errors import EngineHungError

    outcome: list[BaseException] = []

    def between_updates() -> None:
        silent_engine_adapter.release_requests()  # the last update's last call
        try:
            silent_engine_adapter.call_workers("refit_scale_records")
        except BaseException as error:
            outcome.append(error)

    caller = threading.Thread(target=between_updates, daemon=True)
    caller.start()
    caller.join(30)
    assert not caller.is_alive(), "the call waited on the silent engine without a deadline"
    assert isinstance(outcome[0], EngineHungError)
