"""The replica update state machine, every transition, in milliseconds (no Ray, no vLLM).

Pins the lifecycle findings of the reliability probe: a failed update
before any bucket keeps the old version serving; after a bucket it refuses;
versions are never reused; a second sync is refused while the first is
alive; a lapsed lease is reported for closing; requests never see an update.
"""

from __future__ import annotations

import threading
import time

import pytest

from refit.engine.lifecycle import Phase, UpdateLifecycle
from refit.errors import EngineGoneError, LifecycleError, ReplicaRefusingError, SyncTimeoutError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def begin(life: UpdateLifecycle, sync_id: str = "a", lease_s: float = 10.0) -> int:
    return life.begin(sync_id, lease_s=lease_s, drain_timeout_s=1.0)


def test_a_successful_update_serves_its_version_and_versions_only_grow():
    life = UpdateLifecycle()
    assert life.status().phase is Phase.SERVING and life.status().served_version is None
    version = begin(life)
    assert version == 1 and life.status().phase is Phase.UPDATING
    life.loading("a", version)
    life.finished("a", version)
    assert (life.status().phase, life.status().served_version) == (Phase.SERVING, 1)
    assert begin(life, "b") == 2


def test_failure_before_any_bucket_returns_to_the_old_version_and_its_number_is_not_reused_for_serving():
    life = UpdateLifecycle()
    begin(life)
    life.finished("a", 1)
    assert begin(life, "b") == 2
    status = life.failed("b", "the trainer died")
    assert (status.phase, status.served_version) == (Phase.SERVING, 1)
    assert begin(life, "c") == 3  # 2 was proposed: never reused, even though nothing was served as 2


def test_failure_after_a_bucket_refuses_until_a_later_update_completes():
    life = UpdateLifecycle()
    begin(life)
    life.loading("a", 1)
    status = life.failed("a", "bucket 3 failed")
    assert status.phase is Phase.REFUSING and "bucket 3 failed" in status.reason
    with pytest.raises(ReplicaRefusingError, match="bucket 3 failed"), life.request():
        pass
    with life.request(allow_refusing=True):  # observation still works
        pass
    version = begin(life, "b")
    life.loading("b", version)
    life.finished("b", version)
    with life.request():
        assert life.status().served_version == 2


def test_a_failed_post_refit_stage_refuses_even_though_loading_had_finished():
    life = UpdateLifecycle()
    begin(life)
    status = life.failed("a", "KV stage refused", model_changed=True)
    assert status.phase is Phase.REFUSING and status.served_version is None


def test_a_replica_started_on_placeholders_refuses_until_its_first_update():
    life = UpdateLifecycle(refusal="dummy load: run a sync first")
    with pytest.raises(ReplicaRefusingError, match="run a sync first"), life.request():
        pass
    begin(life)
    assert life.failed("a", "whatever").reason == "dummy load: run a sync first"  # nothing loaded: still the old reason


def test_a_second_sync_is_refused_while_the_first_is_alive_and_cannot_touch_its_update():
    clock = Clock()
    life = UpdateLifecycle(clock=clock)
    begin(life, "a")
    with pytest.raises(LifecycleError, match=r"another sync \(a\) is updating this replica"):
        begin(life, "b")
    with pytest.raises(LifecycleError, match="sync b does not own the open update"):
        life.loading("b", 5)
    assert life.failed("b", "b gives up").phase is Phase.UPDATING  # b cannot close a's update
    assert life.open_update() == "a"


def test_a_lapsed_lease_is_reported_and_every_call_renews_it():
    clock = Clock()
    life = UpdateLifecycle(clock=clock)
    begin(life, "a", lease_s=10)
    clock.now = 9
    life.loading("a", 1)
    clock.now = 18
    assert life.expired() is None
    clock.now = 19.5
    assert life.expired() == "a"
    assert life.failed("a", "lease lapsed").phase is Phase.REFUSING  # one bucket was loaded


def test_a_bucket_below_the_proposed_version_is_refused():
    life = UpdateLifecycle()
    begin(life)
    life.finished("a", 7)
    begin(life, "b")
    with pytest.raises(LifecycleError, match="below 8"):
        life.loading("b", 7)


def test_steps_without_an_open_update_say_so():
    life = UpdateLifecycle()
    life.begin("a", lease_s=60, drain_timeout_s=1)
    life.failed("a", "aborted")
    with pytest.raises(LifecycleError, match="no update is open"):
        life.loading("a", 1)
    with pytest.raises(LifecycleError, match="no update is open"):
        life.finished("a", 1)


def test_a_step_of_a_sync_that_began_on_an_earlier_process_says_the_replica_restarted():
    """Found by review: a replica that Ray restarted between its begin and its next bucket answered that bucket with
    'no update is open', an error like any other, so the sync failed (every other replica left refusing) instead of
    dropping the restarted one as a dead one is dropped. Its new process never saw that sync begin."""
    life = UpdateLifecycle()  # the new process's
    for step in (lambda: life.loading("a", 1), lambda: life.finishing("a", 1)):
        with pytest.raises(EngineGoneError, match="sync a never began an update on this replica's process: it restarted"):
            step()


def test_an_update_waits_for_requests_in_flight_and_holds_new_ones():
    life = UpdateLifecycle()
    order: list[str] = []
    in_request = threading.Event()
    release = threading.Event()

    def long_request() -> None:
        with life.request():
            in_request.set()
            release.wait(5)
            order.append("old request done")

    def late_request() -> None:
        with life.request():
            order.append("late request ran")

    first = threading.Thread(target=long_request)
    first.start()
    in_request.wait(5)
    updater = threading.Thread(target=lambda: (begin(life), order.append("update began")))
    updater.start()
    time.sleep(0.05)
    assert order == []  # the update waits for the request
    late = threading.Thread(target=late_request)
    release.set()
    updater.join(5)
    late.start()
    time.sleep(0.05)
    assert order == ["old request done", "update began"]  # the late request is held
    life.finished("a", 1)
    late.join(5)
    first.join(5)
    assert order[-1] == "late request ran"


def test_requests_that_do_not_finish_in_time_fail_the_begin_and_keep_serving():
    life = UpdateLifecycle()
    entered = threading.Event()
    release = threading.Event()

    def stuck() -> None:
        with life.request():
            entered.set()
            release.wait(5)

    thread = threading.Thread(target=stuck)
    thread.start()
    entered.wait(5)
    with pytest.raises(SyncTimeoutError, match="still running"):
        life.begin("a", lease_s=10, drain_timeout_s=0.05)
    assert life.status().phase is Phase.SERVING and life.open_update() is None
    release.set()
    thread.join(5)


def test_only_the_sync_that_owns_the_update_may_move_the_workers_to_another_collective_group():
    """A rival sync joining the replicas to its group mid-update would strand the owner's broadcasts."""
    lifecycle = UpdateLifecycle()
    lifecycle.check_group_change(None)  # no update: any sync may
    lifecycle.begin("a", lease_s=60, drain_timeout_s=1)
    lifecycle.check_group_change("a")
    with pytest.raises(LifecycleError, match="cannot change collective groups during sync a's update"):
        lifecycle.check_group_change("b")
    with pytest.raises(LifecycleError):
        lifecycle.check_group_change(None)
