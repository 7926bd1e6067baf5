"""A fleet that changes, on real Ray and vLLM: replicas join, leave, die mid-sync or hang, and the sync goes on.

The two session replicas (FP8_BLOCK, dummy load, FP8 KV cache, nodes 1 and 2)
are the fleet's survivors throughout; each kill takes a replica of its own,
started once for this module on node 0, so the module starts two engines.
The trainer's weights are re-drawn from a new seed before every sync that
must show a new version, so serving "the trainer's weights" tells versions
apart (two seeds agree on under 55% of first tokens, a synced replica on
over 80%: tests/support/serving.py).

Deadlines are measured once every actor is up (`all_started`), never from
construction; kills follow the victim's own progress (`kill_mid_stream`),
not a clock, so neither depends on how loaded the machine is.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import ray

import refit
from fixtures import model_dir
from refit import Phase
from tests.support.actors import all_started, hold_update_lock, process_id, redraw, release_update_lock, run_in
from tests.support.faults import kill_mid_stream
from tests.support.serving import assert_serves, status

# Small buckets (20 a sync of the fixture, one in flight): a stream with a middle to cut.
SMALL = refit.SyncConfig(bucket_bytes=32 << 10, max_buckets_in_flight=1, timeout_s=30)


@pytest.fixture(scope="module")
def trainer(module_actors):
    return module_actors.trainer(model_dir(True, "bf16"), reinitialize=True, seed=21)


@pytest.fixture(scope="module")
def victims(module_actors):
    """Two replicas like the session's, started together (their starts overlap the first tests), each killed by one test."""
    return [module_actors.rollout(model_dir(True, "fp8_block"), node=0, load_format="dummy", kv_cache_dtype="fp8_e4m3")
            for _ in range(2)]


def is_dead(actor) -> bool:
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        return True
    return False


def drop_mid_stream(syncer: refit.Syncer, victim) -> refit.SyncReport:
    """Kill `victim` a few buckets into a sync; that sync's report (it must complete)."""
    killer = kill_mid_stream(victim, after_buckets=5)
    start = time.monotonic()
    report = syncer.sync()
    killer.join(timeout=60)
    assert is_dead(victim), "the victim was not killed during the sync"
    print(f"\nsync with a replica killed mid-stream over {syncer.config.transport}: {time.monotonic() - start:.2f} s "
          f"({report.attempts} attempt(s))\n{report.summary()}")
    return report


@pytest.mark.parametrize("transport", ["ray", "collective"])
def test_a_replica_that_joins_serves_after_the_next_sync_and_one_killed_mid_sync_is_dropped(
    shared_replicas, victims, trainer, transport
):
    """Issue 22: one of three replicas killed mid-stream; the other two complete the sync and serve its version."""
    victim = victims[transport == "collective"]
    all_started(trainer, victim, *shared_replicas)
    config = dataclasses.replace(SMALL, transport=transport)
    with refit.Syncer(trainer, shared_replicas, config) as syncer:
        syncer.sync()  # planned, and the session replicas made whole
        assert syncer.add_replica(victim) == "rollout 2"
        run_in(trainer, redraw, 22)
        report = syncer.sync()
        assert [r.replica for r in report.replicas] == [0, 1, 2] and report.dropped == ()
        assert_serves([*shared_replicas, victim], trainer, report.version)  # the newcomer got every weight

        run_in(trainer, redraw, 23)
        report = drop_mid_stream(syncer, victim)
        assert [(d.replica, d.stage, d.cause) for d in report.dropped] == [(2, "stream", "died")]
        assert "rollout 2 died or is unreachable" in report.dropped[0].error
        assert [r.replica for r in report.replicas] == [0, 1]
        assert report.attempts == (2 if transport == "collective" else 1)  # the broken group made again without it
        assert_serves(shared_replicas, trainer, report.version)
        assert syncer.replica_names == ["rollout 0", "rollout 1"]  # the next sync does not wait on it

        run_in(trainer, redraw, 24)
        report = syncer.sync()
        assert report.dropped == () and report.attempts == 1
        assert_serves(shared_replicas, trainer, report.version)
        if transport == "collective":  # the new group, kept
            groups = ray.get([r.transport_group.remote() for r in shared_replicas], timeout=60)
            assert groups[0] is not None and groups[0] == groups[1]


def test_a_replica_hung_when_auto_asks_which_transports_it_takes_is_dropped_there(shared_replicas, trainer):
    """Its first deadline drops it: begin does not wait for it a second time."""
    all_started(trainer, *shared_replicas)
    pid = run_in(shared_replicas[0], process_id)
    syncer = refit.Syncer(trainer, shared_replicas, dataclasses.replace(SMALL, timeout_s=10, transport="auto"))
    run_in(trainer, redraw, 26)
    syncer.plan()  # started and described: the sync's first question is the pick's
    before = ray.get(shared_replicas[0].status.remote(), timeout=60)
    os.kill(pid, signal.SIGSTOP)  # every call to it, of any concurrency group, waits
    try:
        report = syncer.sync()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert [(d.replica, d.stage, d.cause) for d in report.dropped] == [(0, "pick", "missed the deadline")]
    assert "transports did not answer within 10 s" in report.dropped[0].error
    assert [r.replica for r in report.replicas] == [1] and syncer.replica_names == ["rollout 1"]
    assert_serves(shared_replicas[1:], trainer, report.version)
    assert ray.get(shared_replicas[0].status.remote(), timeout=60) == before  # it never began an update


@pytest.mark.parametrize("transport", ["ray", "collective"])
def test_a_hung_replica_is_dropped_at_the_deadline_and_the_other_serves(shared_replicas, trainer, transport):
    """Over `collective` the group is made again without it, and once more when it is back."""
    all_started(trainer, *shared_replicas)
    syncer = refit.Syncer(trainer, shared_replicas, dataclasses.replace(SMALL, timeout_s=10, transport=transport))
    served = syncer.sync().version
    run_in(shared_replicas[0], hold_update_lock, 25.0)  # its begin waits for the lock well past the deadline
    run_in(trainer, redraw, 25 if transport == "ray" else 27)
    start = time.monotonic()
    report = syncer.sync()
    assert time.monotonic() - start < 3 * 10 + 20
    assert [(d.replica, d.stage, d.cause) for d in report.dropped] == [(0, "begin", "missed the deadline")]
    assert "begin_update did not answer within 10 s" in report.dropped[0].error
    assert [r.replica for r in report.replicas] == [1] and syncer.replica_names == ["rollout 1"]
    assert_serves(shared_replicas[1:], trainer, report.version)
    run_in(shared_replicas[0], release_update_lock)
    # Once it answers, the abort sent after its late begin (and not waited for) closes the update that begin opened.
    # An update call queues behind both, so its answer says they ran.
    state = ray.get(shared_replicas[0].abort_update.remote("no-such-sync", "a barrier"), timeout=120)
    assert state == refit.ReplicaStatus(Phase.SERVING, served)
    assert "dropped it: SyncTimeoutError" in ray.get(shared_replicas[0].last_update.remote(), timeout=60)["outcome"]
    assert syncer.add_replica(shared_replicas[0]) == "rollout 2"  # back, under a new name
    report = syncer.sync()
    assert [r.replica for r in report.replicas] == [1, 2]
    assert_serves(shared_replicas, trainer, report.version)
    syncer.close()


def test_a_removed_replica_is_left_as_it_is_and_the_others_are_synced(shared_replicas, trainer):
    all_started(trainer, *shared_replicas)
    syncer = refit.Syncer(trainer, shared_replicas, SMALL)
    before = syncer.sync().version
    assert syncer.remove_replica(shared_replicas[1]) == "rollout 1"  # by handle (also by id or name)
    run_in(trainer, redraw, 26)
    report = syncer.sync()
    assert [r.replica for r in report.replicas] == [0]
    assert_serves(shared_replicas[:1], trainer, report.version)
    assert status(shared_replicas[1]) == refit.ReplicaStatus(Phase.SERVING, before)  # untouched
    with pytest.raises(refit.ConfigError, match="'rollout 1' is not a replica of this Syncer; its replicas: rollout 0"):
        syncer.remove_replica("rollout 1")


def test_a_replica_that_ray_restarts_is_dropped_as_restarting_and_rejoins_when_added_back(ray_cluster):
    """Ray's fault tolerance (`max_restarts`) brings a killed replica back as a new process with nothing synced:
    the sync that finds it restarting drops it saying so, and once up it takes the same handle back. Plain-Python
    trainer and replicas as Ray actors: the point is Ray's restart, not the engine (checked by hand on an engine)."""
    from tests.support.fakes import FakeReplica, FakeTrainer, SlowToRestartReplica, expected_names, tiny_decoder

    model = tiny_decoder()
    trainer = ray.remote(FakeTrainer).options(num_cpus=0).remote(model)
    steady = ray.remote(FakeReplica).options(num_cpus=0).remote(expected_names(model))
    phoenix = ray.remote(SlowToRestartReplica).options(num_cpus=0, max_restarts=1).remote(expected_names(model))
    config = refit.SyncConfig(bucket_bytes=100_000, timeout_s=30)
    with refit.Syncer(trainer, [steady, phoenix], config) as syncer:
        syncer.sync()
        with pytest.raises(ray.exceptions.RayActorError):  # its process crashes, and Ray starts a new one
            ray.get(phoenix.__ray_call__.remote(lambda _: os._exit(1)), timeout=60)
        report = syncer.sync()  # while its constructor runs again
        (dropped,) = report.dropped
        assert dropped.cause == "died" and "rollout 1 died and Ray restarts it (" in dropped.error, dropped
        assert "add it back with Syncer.add_replica" in dropped.error
        deadline = time.monotonic() + 120
        while True:  # up again: a new process, serving nothing synced
            try:
                assert ray.get(phoenix.status.remote(), timeout=30).served_version is None
                break
            except ray.exceptions.ActorUnavailableError:
                assert time.monotonic() < deadline, "Ray never restarted the replica"
                time.sleep(0.5)
        assert syncer.add_replica(phoenix) == "rollout 2"
        report = syncer.sync()
    assert [r.replica for r in report.replicas] == [0, 2] and not report.dropped
    assert ray.get(phoenix.status.remote(), timeout=30).served_version == report.version
    for handle in (steady, phoenix, trainer):
        ray.kill(handle)


def test_a_replica_that_ray_restarts_between_its_begin_and_its_next_bucket_is_dropped_and_the_other_serves(ray_cluster):
    """A replica killed between two of its calls, and restarted by Ray before the next one reaches it: that call
    finds a new process with no update open. Plain-Python trainer and replicas as Ray actors, as above; the trainer
    takes a few seconds per bucket, so the restart completes while the stream is on."""
    from tests.support.fakes import FakeReplica, SlowTrainer, expected_names, tiny_decoder

    model = tiny_decoder()
    trainer = ray.remote(SlowTrainer).options(num_cpus=0).remote(model, 0.0)
    steady = ray.remote(FakeReplica).options(num_cpus=0).remote(expected_names(model))
    phoenix = ray.remote(FakeReplica).options(num_cpus=0, max_restarts=1).remote(expected_names(model))
    config = refit.SyncConfig(bucket_bytes=100_000, timeout_s=60)
    restarted = []

    def kill_once_updating_and_wait_for_the_restart() -> None:
        while ray.get(phoenix.status.remote(), timeout=30).phase is not Phase.UPDATING:
            time.sleep(0.05)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(phoenix.__ray_call__.remote(lambda _: os._exit(1)), timeout=60)
        while True:
            try:
                restarted.append(ray.get(phoenix.status.remote(), timeout=30))
                return
            except ray.exceptions.ActorUnavailableError:
                time.sleep(0.1)

    import threading

    killer = threading.Thread(target=kill_once_updating_and_wait_for_the_restart, daemon=True)
    with refit.Syncer(trainer, [steady, phoenix], config) as syncer:
        syncer.sync()
        run_in(trainer, setattr, "delay_s", 4.0)  # the second sync's stream is slow, the first's not
        killer.start()
        report = syncer.sync()
        killer.join(timeout=60)
    assert restarted and restarted[0].served_version is None, "the replica was not restarted during the sync"
    (dropped,) = report.dropped
    assert dropped.replica == 1 and dropped.cause == "died", dropped
    assert ray.get(steady.status.remote(), timeout=30).served_version == report.version
    for handle in (steady, phoenix, trainer):
        ray.kill(handle)
