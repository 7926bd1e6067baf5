"""A replica's adapter swap bookkeeping: staged, served, retired once its last request ends (pure logic)."""

from __future__ import annotations

import threading
import time

import pytest

from refit.adapters import AdapterSlots
from refit.engine.lifecycle import UpdateLifecycle
from refit.errors import LifecycleError, SyncTimeoutError


def test_a_swap_serves_new_requests_the_new_adapter_while_running_ones_keep_the_old():
    slots = AdapterSlots()
    first, abandoned = slots.stage("s1", "policy", 1, stale_after_s=60)
    assert abandoned is None and slots.serving is None
    with slots.using() as adapter:
        assert adapter is None  # staged serves no one
    assert slots.serve("s1", 1) == first and slots.retiring is None
    with slots.using() as running:
        second, _ = slots.stage("s2", "policy", 2, stale_after_s=60)
        assert second.lora_id != first.lora_id and second.lora_name != first.lora_name
        slots.serve("s2", 2)
        with slots.using() as new:
            assert (running.version, new.version) == (1, 2)
        assert slots.retired(None) is None  # its request still runs
        with pytest.raises(SyncTimeoutError, match="request\\(s\\) on adapter policy v1 still running"):
            slots.retired(0.05)
    assert slots.retired(None) == first and slots.retiring is None


def test_retired_waits_for_the_last_request_then_hands_the_adapter_over():
    slots = AdapterSlots()
    slots.stage("s1", "policy", 1, stale_after_s=60)
    slots.serve("s1", 1)
    ended = threading.Event()

    def request():
        with slots.using():
            ended.wait(5)

    thread = threading.Thread(target=request)
    thread.start()
    time.sleep(0.05)
    slots.stage("s2", "policy", 2, stale_after_s=60)
    slots.serve("s2", 2)
    threading.Timer(0.1, ended.set).start()
    assert slots.retired(5).version == 1
    thread.join()


def test_versions_only_rise_and_one_sync_stages_at_a_time_until_its_stage_goes_stale():
    slots = AdapterSlots()
    slots.stage("s1", "policy", 3, stale_after_s=60)
    slots.serve("s1", 3)
    with pytest.raises(LifecycleError, match="version 3 is not above 3"):
        slots.stage("s2", "policy", 3, stale_after_s=60)
    slots.stage("s2", "policy", 4, stale_after_s=60)
    with pytest.raises(LifecycleError, match="sync s2 staged adapter policy v4"):
        slots.stage("s3", "policy", 5, stale_after_s=60)
    staged, abandoned = slots.stage("s3", "policy", 5, stale_after_s=0)  # s2 died between stage and serve
    assert abandoned.version == 4 and staged.version == 5
    with pytest.raises(LifecycleError, match="sync s2 staged no version 4"):
        slots.serve("s2", 4)
    assert slots.unstage("s2", 4) is None and slots.unstage("s3", 5) == staged
    assert slots.serving.version == 3


def test_quiesced_holds_new_requests_and_waits_for_running_ones_without_an_update():
    lifecycle = UpdateLifecycle()
    order: list[str] = []
    with lifecycle.request(), pytest.raises(SyncTimeoutError, match="1 request\\(s\\) still running"), lifecycle.quiesced(0.05):
        pass
    def request():
        with lifecycle.request():
            order.append("request")

    with lifecycle.quiesced(1):
        thread = threading.Thread(target=request)
        thread.start()
        time.sleep(0.05)
        order.append("quiet")
    thread.join(5)
    assert order == ["quiet", "request"] and lifecycle.status().served_version is None
