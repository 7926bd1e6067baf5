"""The deadlines of a sync's remote rounds, on real Ray actors (the rest of `calls`: every sync test)."""

from __future__ import annotations

import time

import ray

from refit.orchestration.calls import call_groups
from tests.support.actors import Unresponsive


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
