"""A sharded trainer's ranks stream one sync at a time, agreeing which through a real TCPStore (no processes: each
rank's calls are played in the order Ray would run them on that rank).

The engine tier's `test_sharded_trainer.py` runs the same race on real ranks.
"""

import datetime
import threading
import time

import pytest
import torch.distributed

from refit.errors import LifecycleError
from refit.plan import RolloutModelInfo, SyncConfig, TensorMeta, make_plan
from refit.sharding.stream_turns import take_turn, turn_in

PLAN = make_plan([TensorMeta("model.norm.weight", (128,), "bfloat16", ("Qwen3RMSNorm",))], RolloutModelInfo(None, False), SyncConfig())


@pytest.fixture
def store():
    return torch.distributed.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)


def sync(sync_id: str, timeout_s: float = 60):
    return PLAN.for_sync(None, sync_id, timeout_s)


def refused(store, plan, rank: int) -> str:
    with pytest.raises(LifecycleError) as error:
        turn_in(store, 2, plan, rank)
    return str(error.value)


def test_two_syncs_that_reach_the_ranks_in_crossed_orders_run_one_and_refuse_the_other_on_every_rank(store):
    a, b = sync("A"), sync("B")
    a_on_0 = turn_in(store, 2, a, 0)  # rank 0 runs A, B; rank 1 got B first
    message = refused(store, b, 1)
    assert message.startswith("trainer rank 1: sync B was refused: this trainer's ranks are streaming sync A")
    a_on_1 = turn_in(store, 2, a, 1)
    a_on_0.end()
    a_on_1.end()
    assert "streaming sync A" in refused(store, b, 0)  # A has ended, but rank 1 refused B: so does rank 0
    for rank in (0, 1):  # the group is free again, and no key of A or B is left behind
        turn_in(store, 2, sync("C"), rank).end()
    prefixed = torch.distributed.PrefixStore("refit/stream_turns/", store)
    assert not prefixed.check([f"{kind}/{s}" for kind in ("decision", "seen", "ended") for s in "ABC"])


def test_a_sync_that_reaches_its_ranks_while_another_streams_is_refused_even_by_a_rank_that_sees_it_first(store):
    a = turn_in(store, 2, sync("A"), 0)
    assert "streaming sync A" in refused(store, sync("B"), 0)
    a.end()
    turn_in(store, 2, sync("A"), 1).end()
    assert "streaming sync A" in refused(store, sync("B"), 1)  # decided by rank 0 while A streamed


def test_a_sync_queued_behind_one_that_another_rank_still_ends_waits_for_it_instead_of_being_refused(store):
    """One caller's next sync (after an interrupted one) reaches rank 0, done with the last sync, while rank 1 still
    ends it: no order crossed, so rank 0 waits for the group rather than refuse."""
    a = [turn_in(store, 2, sync("A"), rank) for rank in (0, 1)]
    a[0].end()
    taken: list = []
    waiting = threading.Thread(target=lambda: taken.append(turn_in(store, 2, sync("B"), 0, ended_here=["A"])))
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive() and not taken
    a[1].end()
    waiting.join(10)
    turn_in(store, 2, sync("B"), 1, ended_here=["A"]).end()
    taken[0].end()
    turn_in(store, 2, sync("C"), 0).end()


def test_a_turn_that_some_rank_never_started_lapses_after_twice_its_deadline_and_that_rank_then_refuses_it(store):
    turn_in(store, 2, sync("A", timeout_s=0.1), 0).end()  # rank 1 never got A's stream (its driver was interrupted)
    assert "streaming sync A" in refused(store, sync("B"), 0)
    time.sleep(0.25)
    c = [turn_in(store, 2, sync("C"), rank) for rank in (0, 1)]
    assert "sync A's turn lapsed before this rank started it" in refused(store, sync("A", timeout_s=0.1), 1)
    for turn in c:
        turn.end()
    turn_in(store, 2, sync("D"), 0).end()


def test_a_rank_that_starts_a_sync_after_its_lease_lapsed_refuses_it_even_before_another_sync_takes_over(store):
    turn_in(store, 2, sync("A", timeout_s=0.1), 0).end()
    time.sleep(0.25)
    assert "sync A's turn lapsed before this rank started it" in refused(store, sync("A", timeout_s=0.1), 1)
    turns = [turn_in(store, 2, sync("C"), rank) for rank in (0, 1)]  # A no longer holds the group
    for turn in turns:
        turn.end()


class Interleaved:
    """The group's store as `turn_in` sees it, running `then()` once, around this rank's `nth` call of `op` on a key
    holding `key`: the other rank's step that lands between two of this rank's."""

    def __init__(self, store, op: str, key: str, nth: int, then, after: bool) -> None:
        self.store, self.op, self.key, self.nth, self.then, self.after, self.calls = store, op, key, nth, then, after, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(*args):
            hit = name == self.op and self.key in str(args[0])
            self.calls += hit
            then, self.then = (self.then, None) if hit and self.calls == self.nth else (None, self.then)
            if then and not self.after:
                then()
            value = method(*args)
            if then and self.after:
                then()
            return value

        return call


def interleaved(monkeypatch, op: str, key: str, nth: int, then, *, after: bool) -> None:
    """The next `turn_in`'s store runs `then()` around its `nth` call of `op` on a key holding `key`."""
    prefix_store = torch.distributed.PrefixStore

    def prefixed(prefix, inner):
        monkeypatch.setattr(torch.distributed, "PrefixStore", prefix_store)  # the next turn_in only
        return Interleaved(prefix_store(prefix, inner), op, key, nth, then, after)

    monkeypatch.setattr(torch.distributed, "PrefixStore", prefixed)


def test_a_rank_that_follows_another_ranks_decision_frees_the_group_with_it(store, monkeypatch):
    """Regression: rank 0 read the last sync A as holder, rank 1 then freed A and took the group for S; rank 0
    followed S's decision but kept A as the holder to free, so the group stayed held after both ranks ended S."""
    a = [turn_in(store, 2, sync("A"), rank) for rank in (0, 1)]
    a[0].end()
    s_on_1: list = []
    interleaved(monkeypatch, "compare_set", "holder", 1,
                lambda: (a[1].end(), s_on_1.append(turn_in(store, 2, sync("S"), 1, ended_here=["A"]))), after=True)
    s_on_0 = turn_in(store, 2, sync("S"), 0, ended_here=["A"])
    s_on_1[0].end()
    s_on_0.end()  # the last to end S frees the group
    turns = [turn_in(store, 2, sync("T"), rank) for rank in (0, 1)]  # the group is free: not refused, no waiting
    for turn in turns:
        turn.end()


def test_a_takeover_that_meets_a_holder_freed_meanwhile_takes_the_group_instead_of_refusing(store, monkeypatch):
    """Regression: A lapsed while rank 1 still ended it; rank 0's takeover found the group freed by then and refused
    S, naming no sync."""
    a = [turn_in(store, 2, sync("A", timeout_s=0.1), rank) for rank in (0, 1)]
    a[0].end()
    time.sleep(0.25)
    interleaved(monkeypatch, "compare_set", "holder", 2, a[1].end, after=False)  # between reading the lapsed A and taking over
    s_on_0 = turn_in(store, 2, sync("S"), 0, ended_here=["A"])
    turn_in(store, 2, sync("S"), 1, ended_here=["A"]).end()
    s_on_0.end()


def test_a_lease_freed_while_a_waiting_rank_reads_it_neither_blocks_nor_fails_that_rank(store, monkeypatch):
    """Regression: rank 0, waiting for A's end, checked A's lease was there, rank 1 then ended A (freeing its
    lease), and rank 0's read of it waited out the store's timeout, then failed with a store error."""
    a = [turn_in(store, 2, sync("A"), rank) for rank in (0, 1)]
    a[0].end()
    interleaved(monkeypatch, "check", "lease/A", 1, a[1].end, after=True)
    interleaved(monkeypatch, "compare_set", "lease/A", 1, a[1].end, after=True)  # whichever way it is read
    start = time.monotonic()
    turns = [turn_in(store, 2, sync("S"), 0, ended_here=["A"]), turn_in(store, 2, sync("S"), 1, ended_here=["A"])]
    assert time.monotonic() - start < 5
    for turn in turns:
        turn.end()


def test_no_turn_is_taken_for_a_plan_no_sync_was_handed_or_outside_a_process_group():
    assert not torch.distributed.is_initialized()
    assert take_turn(None, sync("A"), 0) is None
    assert take_turn(None, PLAN, 0) is None
