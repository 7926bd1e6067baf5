"""The deadlines of a sync's remote rounds, on real Ray actors (the rest of `calls`: every sync test)."""

from __future__ import annotations

import time

import pytest
import ray

from refit.errors import SyncTimeoutError
from refit.orchestration.calls import BucketStream, call_groups
from tests.support.actors import SlowSource, Unresponsive


def test_a_round_of_several_questions_has_one_deadline_however_many_members_hang(ray_cluster):
    """Found by review: each question of a round waited its own full deadline, one after the other, so a hung replica
    and a hung trainer in one round (finish's) cost twice `SyncConfig.timeout_s`."""
    hung = [Unresponsive.options(num_cpus=0).remote() for _ in range(3)]
    ray.get([actor.ping.remote() for actor in hung], timeout=120)  # the deadline counts from their readiness
    timeout_s = 4.0
    try:
        start = time.monotonic()
        answers = call_groups([([(f"member {i}", a)], "answer", ()) for i, a in enumerate(hung)], timeout_s=timeout_s)
        elapsed = time.monotonic() - start
    finally:
        for actor in hung:
            ray.kill(actor)
    assert [[o.unanswered for o in group] for group in answers] == [[True]] * 3
    assert all("did not answer within 4 s" in str(group[0].error) for group in answers)
    assert elapsed < 2 * timeout_s, elapsed  # three waits in a row took three deadlines


def test_a_stream_that_misses_its_deadline_behind_another_sync_of_this_process_on_its_trainer_says_so(ray_cluster):
    """Found by review: two Syncers of one driver on one trainer actor (each with its own fleet) stream one after the
    other, since the actor runs one call at a time; the second's deadline then said the trainer "is hung"."""
    source = SlowSource.options(num_cpus=0).remote(every_s=3.0)
    ray.get(source.ping.remote(), timeout=120)  # deadlines count from its readiness
    first = BucketStream(source, None, 1)
    try:
        assert first.next(timeout_s=60) is not None
        second = BucketStream(source, None, 1)
        try:
            with pytest.raises(SyncTimeoutError, match=r"produced no bucket within 1 s .*another sync of this process "
                                                       r"is streaming from the same actor \(1 more stream\(s\) open\)"):
                second.next(timeout_s=1)
        finally:
            second.close()
    finally:
        first.close()
    alone = BucketStream(source, None, 1)  # the others ended: a missed deadline is the trainer's own again
    try:
        with pytest.raises(SyncTimeoutError, match="it is hung, overloaded"):
            alone.next(timeout_s=0.5)
    finally:
        alone.close()
        ray.kill(source)
