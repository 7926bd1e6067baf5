"""A `Syncer`'s fleet against plain-Python replicas: names, joining, leaving, drops and the quorum (no Ray, no vLLM).

Only what is the Syncer's own logic. A plain object cannot die or hang, so a
death is an `ActorDiedError` naming the replica itself (what the driver sees
from a dead actor); real deaths, deadlines and the collective group are in
tests/sync/test_fleet.py.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch

from refit import ActorDiedError, ConfigError, EngineError, EngineHungError, LifecycleError, Phase, SyncConfig, Syncer
from refit.orchestration.fleet import Roll
from refit.orchestration.report import DroppedReplica
from tests.support.fakes import CONFIG, FakeReplica, expected_names, setup


def death(who: str) -> ActorDiedError:
    return ActorDiedError(f"{who} died or is unreachable (load_bucket): ActorDiedError: killed", who)


def test_names_stay_with_their_replicas_as_the_fleet_changes_and_a_newcomer_gets_every_weight():
    trainer, replicas = setup(3)
    syncer = Syncer(trainer, replicas, CONFIG)
    syncer.sync()
    assert syncer.remove_replica(1) == "rollout 1"
    newcomer = FakeReplica(expected_names(trainer.model))
    assert syncer.add_replica(newcomer) == "rollout 3"  # never "rollout 1" again
    assert syncer.replica_names == ["rollout 0", "rollout 2", "rollout 3"]
    assert syncer.rollouts == [replicas[0], replicas[2], newcomer]
    report = syncer.sync()
    assert [r.replica for r in report.replicas] == [0, 2, 3] and report.dropped == ()
    assert newcomer.status().served_version == report.version == 2
    assert newcomer.weights.keys() == replicas[0].weights.keys()
    assert all(torch.equal(newcomer.weights[k].view(torch.uint8), replicas[0].weights[k].view(torch.uint8))
               for k in newcomer.weights)
    assert replicas[1].status().served_version == 1  # left alone once removed
    assert syncer.remove_replica(newcomer) == "rollout 3" and syncer.remove_replica("rollout 0") == "rollout 0"
    assert syncer.replica_names == ["rollout 2"]


def test_joining_and_leaving_are_checked():
    trainer, replicas = setup(2)
    syncer = Syncer(trainer, replicas, CONFIG)
    with pytest.raises(ConfigError, match="already rollout 1 of this Syncer"):
        syncer.add_replica(replicas[1])
    with pytest.raises(ConfigError, match=r"rollout 2 lacks begin_update\(\)"):
        syncer.add_replica(object())
    with pytest.raises(ConfigError, match=r"'rollout 7' is not a replica of this Syncer; its replicas: rollout 0, rollout 1"):
        syncer.remove_replica(7)
    syncer.sync()

    class OtherModel(FakeReplica):
        def describe(self):
            return dataclasses.replace(super().describe(), tie_word_embeddings=True)

    with pytest.raises(ConfigError, match="rollout 2 runs a differently configured model than the fleet's rollout model"):
        syncer.add_replica(OtherModel(expected_names(trainer.model)))
    assert syncer.replica_names == ["rollout 0", "rollout 1"]  # the refused one never joined (and its id is free)


def test_a_replica_of_another_model_is_refused_once_the_fleet_was_described_even_without_a_plan():
    """Found by review: only a made plan armed the check, so after a plan that failed (or an adapter sync) a replica
    of another model joined unchecked."""

    class OtherModel(FakeReplica):
        def describe(self):
            return dataclasses.replace(super().describe(), tie_word_embeddings=True)

    trainer, replicas = setup(2)
    syncer = Syncer(trainer, replicas, CONFIG)
    syncer._describe_rollouts()  # what a plan that then failed, or an adapter sync, asks first
    with pytest.raises(ConfigError, match="rollout 2 runs a differently configured model than the fleet's rollout model"):
        syncer.add_replica(OtherModel(expected_names(trainer.model)))


def test_after_auto_picked_a_transport_a_newcomer_is_checked_for_auto_not_for_the_pick(monkeypatch):
    """Found by review: the pick replaced the fleet's own setting, so a replica that only the object store suits was
    refused as lacking what the picked transport needs, although the next sync would have picked again."""
    import refit.orchestration.syncer as syncer_module

    trainer, replicas = setup(2)
    syncer = Syncer(trainer, replicas, dataclasses.replace(CONFIG, transport="auto"))
    monkeypatch.setattr(syncer_module, "pick_transport", lambda *_: ("collective", "every member can join a group"))
    syncer._pick_transport(Roll(syncer._fleet.members, 1))  # as a sync does first
    assert syncer.transport == "collective"
    assert syncer.add_replica(FakeReplica(expected_names(trainer.model))) == "rollout 2"


def test_a_replica_passed_twice_or_a_value_where_an_actor_belongs_is_refused_by_name():
    trainer, replicas = setup(2)
    with pytest.raises(ConfigError, match=r"rollout 2 is rollout 0 again \(the same actor\); pass each replica once"):
        Syncer(trainer, [replicas[0], replicas[1], replicas[0]], CONFIG)
    with pytest.raises(ConfigError, match=r"rollout 0 is None \(NoneType\), not an actor"):
        Syncer(trainer, None, CONFIG)
    with pytest.raises(ConfigError, match=r"rollout 1 is 'rollout 1' \(str\), not an actor"):
        Syncer(trainer, [replicas[0], "rollout 1"], CONFIG)
    with pytest.raises(ConfigError, match=r"the trainer is None \(NoneType\), not an actor"):
        Syncer(None, replicas, CONFIG)
    with pytest.raises(ConfigError, match=r"rollout 2 is 3 \(int\), not an actor"):
        Syncer(trainer, replicas, CONFIG).add_replica(3)


def test_the_fleet_changes_only_between_syncs():
    trainer, replicas = setup(2)
    refused: list[BaseException] = []

    class Meddling(FakeReplica):
        def begin_update(self, plan, sync_id, config):
            for change in (lambda: syncer.remove_replica(0), lambda: syncer.add_replica(FakeReplica(set())), syncer.sync):
                try:
                    change()
                except LifecycleError as error:
                    refused.append(error)
            return super().begin_update(plan, sync_id, config)

    meddling = Meddling(expected_names(trainer.model))
    syncer = Syncer(trainer, [*replicas, meddling], CONFIG)
    assert len(syncer.sync().replicas) == 3
    assert [str(e).split("(")[0] for e in refused] == ["remove_replica", "add_replica", "sync"]
    assert "the fleet changes only between syncs" in str(refused[0])


def test_a_syncer_shared_by_threads_runs_one_sync_at_a_time_and_refuses_the_rest_at_once():
    trainer, replicas = setup(2)
    began, tried = threading.Event(), threading.Event()

    class Holding(FakeReplica):
        def begin_update(self, plan, sync_id, config):
            began.set()
            assert tried.wait(60)
            return super().begin_update(plan, sync_id, config)

    syncer = Syncer(trainer, [replicas[0], Holding(expected_names(trainer.model))], CONFIG)
    reports = []
    thread = threading.Thread(target=lambda: reports.append(syncer.sync()))
    thread.start()
    try:
        assert began.wait(60)
        refused = []
        for call in (syncer.sync, syncer.sync_adapter, syncer.close, lambda: syncer.remove_replica(0)):
            with pytest.raises(LifecycleError) as error:
                call()
            refused.append(str(error.value))
    finally:
        tried.set()
        thread.join(60)
    assert [r.version for r in reports] == [1]
    assert refused[0] == ("sync() during this Syncer's sync(): a Syncer runs one sync at a time; call it after that "
                          "returns, or use a Syncer per thread")
    assert [m.split(" during")[0] for m in refused] == ["sync()", "sync_adapter()", "close()", "remove_replica()"]
    assert "the fleet changes only between syncs" in refused[3]
    assert syncer.sync().version == 2 and syncer.replica_names == ["rollout 0", "rollout 1"]  # free again


@pytest.mark.parametrize("step", ["begin", "bucket", "finish"])
def test_a_replica_that_dies_is_dropped_and_the_others_serve_the_sync(step):
    trainer, replicas = setup(3)
    victim = replicas[1]
    if step == "bucket":
        victim.fail.update(at_bucket=2, bucket_error=death("rollout 1"))
    else:
        victim.fail[step] = death("rollout 1")
    syncer = Syncer(trainer, replicas, CONFIG)
    report = syncer.sync()
    stage = {"bucket": "stream"}.get(step, step)
    assert report.dropped == (DroppedReplica(1, stage, "died", "ActorDiedError: rollout 1 died or is unreachable "
                                             "(load_bucket): ActorDiedError: killed"),)
    assert f"dropped rollout 1 died at {stage}" in report.summary()
    assert json.loads(json.dumps(report.to_dict()))["dropped"] == [dataclasses.asdict(report.dropped[0])]  # plain data
    assert [r.replica for r in report.replicas] == [0, 2]
    for survivor in (replicas[0], replicas[2]):
        assert survivor.status().phase is Phase.SERVING and survivor.status().served_version == report.version
    assert syncer.replica_names == ["rollout 0", "rollout 2"]  # the next sync does not wait on it
    assert [r.replica for r in syncer.sync().replicas] == [0, 2]


def test_a_replica_whose_engine_missed_the_deadline_is_dropped_as_a_hung_one():
    """A `vllm serve` replica's own HTTP deadline may fire before the driver's: the same loss either way."""
    trainer, replicas = setup(3)
    replicas[1].fail["begin"] = EngineHungError("the server at http://127.0.0.1:1 did not answer POST /pause within 5 s")
    report = Syncer(trainer, replicas, CONFIG).sync()
    assert [(d.replica, d.stage, d.cause) for d in report.dropped] == [(1, "begin", "missed the deadline")]
    assert [r.replica for r in report.replicas] == [0, 2]


def test_below_min_replicas_a_loss_fails_the_sync_by_name_and_leaves_the_fleet_as_it_was():
    trainer, replicas = setup(3)
    replicas[2].fail.update(at_bucket=2, bucket_error=death("rollout 2"))
    syncer = Syncer(trainer, replicas, dataclasses.replace(CONFIG, min_replicas=3))
    with pytest.raises(ActorDiedError, match="^rollout 2 died") as error:
        syncer.sync()
    notes = "\n".join(error.value.__notes__)
    assert "only 2 replica(s) remain, fewer than SyncConfig.min_replicas=3" in notes
    assert "rollout 0: refusing to serve: sync" in notes and "rollout 1: refusing to serve: sync" in notes  # aborted
    assert all(r.lifecycle.open_update() is None for r in replicas[:2])
    assert syncer.replica_names == ["rollout 0", "rollout 1", "rollout 2"]


def test_a_replica_that_raises_is_not_dropped_it_fails_the_sync():
    """Only deaths and missed deadlines drop a member: a refused check dropped silently would hide a bug."""
    trainer, replicas = setup(3, finish=EngineError("the update left weights unloaded"))
    syncer = Syncer(trainer, replicas, CONFIG)
    with pytest.raises(EngineError, match="left weights unloaded"):
        syncer.sync()
    assert replicas[0].status().phase is Phase.REFUSING
    assert syncer.replica_names == ["rollout 0", "rollout 1", "rollout 2"]


def test_min_replicas_is_checked():
    with pytest.raises(ConfigError, match="min_replicas=0: expected a positive int"):
        SyncConfig(min_replicas=0)
    trainer, replicas = setup(2)
    with pytest.raises(ConfigError, match=r"the Syncer has 2 replica\(s\) and SyncConfig.min_replicas=3"):
        Syncer(trainer, replicas, dataclasses.replace(CONFIG, min_replicas=3)).sync()
    assert all(r.status().served_version is None for r in replicas)


def test_a_syncer_leaving_its_collective_group_names_it_to_members_that_take_the_id_and_not_to_others():
    """A failed sync's clean-up (or `close`) leaves its own Syncer's group only: a member that has joined another
    Syncer's group since stays there. A member whose `leave_transport` takes no id is called without one."""
    from refit.orchestration.collective_group import CollectiveGroupLifecycle
    from refit.transport.collective import RendezvousHost

    class Scoped:
        def __init__(self, group: str) -> None:
            self.group: str | None = group

        def leave_transport(self, group_id: str | None = None) -> None:
            if group_id in (None, self.group):
                self.group = None

    class Unscoped:
        left = False

        def leave_transport(self) -> None:
            self.left = True

    lifecycle = CollectiveGroupLifecycle([("the trainer", Scoped("mine"))], SyncConfig(transport="collective", timeout_s=5))
    lifecycle._host = host = RendezvousHost(["the trainer", "rollout 0 worker 0"], timeout_s=5)
    trainer = lifecycle.sources[0][1]
    trainer.group = host.rendezvous.group_id
    moved_on, old = Scoped("another Syncer's"), Unscoped()
    lifecycle.disconnect([("rollout 0", moved_on), ("rollout 1", old)])
    assert (trainer.group, moved_on.group, old.left) == (None, "another Syncer's", True)


def test_a_fleet_of_replicas_that_differ_in_their_draft_or_weights_is_refused_naming_the_difference():
    """Found by attack: the refusal said "quantization_config or tie_word_embeddings differ" whatever differed, so a
    replica with a speculative draft beside one without (or with another draft) was refused for a reason it did not
    have."""
    from refit.plan.expected_weights import ExpectedWeight
    from refit.plan.transfer_plan import RolloutModelInfo

    draft = RolloutModelInfo(None, True, (ExpectedWeight("model.embed_tokens.weight", (512, 64), False),))

    class WithDraft(FakeReplica):
        def __init__(self, names, draft_info):
            super().__init__(names)
            self.draft_info = draft_info

        def describe(self):
            return super().describe().with_draft(self.draft_info)

    trainer, replicas = setup(1)
    syncer = Syncer(trainer, replicas, CONFIG)
    syncer._describe_rollouts()
    with pytest.raises(ConfigError, match=r"rollout 1 runs a differently configured model than the fleet's rollout "
                                          r"model \(a speculative draft model: one has one, the other none\)"):
        syncer.add_replica(WithDraft(expected_names(trainer.model), draft))

    trainer, replicas = setup(0)
    replicas = [WithDraft(expected_names(trainer.model), draft),
                WithDraft(expected_names(trainer.model), dataclasses.replace(draft, tie_word_embeddings=False))]
    with pytest.raises(ConfigError, match=r"rollout 1 runs a differently configured model than rollout 0 "
                                          r"\(the draft model's tie_word_embeddings\)"):
        Syncer(trainer, replicas, CONFIG).plan()


class AskedReplica(FakeReplica):
    """A replica that says which transports it accepts (`transport="auto"` asks), or fails to."""

    def __init__(self, expected, transports_error: BaseException | None = None) -> None:
        super().__init__(expected)
        self.transports_error = transports_error

    def transports(self):
        if self.transports_error is not None:
            raise self.transports_error
        return {"accepts": ["ray"], "device": "cpu"}


@pytest.mark.parametrize(("error", "cause"), [
    (EngineHungError("the server did not answer GET /refit/transports within 5 s"), "missed the deadline"),
    (death("rollout 1"), "died"),
])
def test_a_replica_lost_while_auto_picks_the_transport_is_dropped_there_not_asked_again_at_begin(error, cause):
    """Found by review: a hung replica was judged by its methods at the pick, and then waited for again at begin: two
    deadlines for one loss."""
    trainer, _ = setup(0)
    expected = expected_names(trainer.model)
    replicas = [AskedReplica(expected), AskedReplica(expected, error), AskedReplica(expected)]
    syncer = Syncer(trainer, replicas, dataclasses.replace(CONFIG, transport="auto"))
    report = syncer.sync()
    assert [(d.replica, d.stage, d.cause) for d in report.dropped] == [(1, "pick", cause)]
    assert replicas[1].begins == 0 and [r.replica for r in report.replicas] == [0, 2]
    assert syncer.replica_names == ["rollout 0", "rollout 2"] and syncer.transport == "ray"


def test_a_loss_at_the_transport_pick_below_min_replicas_fails_the_sync_by_name_with_every_replica_untouched():
    trainer, _ = setup(0)
    expected = expected_names(trainer.model)
    replicas = [AskedReplica(expected), AskedReplica(expected, EngineHungError("no answer within 5 s"))]
    syncer = Syncer(trainer, replicas, dataclasses.replace(CONFIG, transport="auto", min_replicas=2))
    with pytest.raises(EngineHungError, match="no answer") as raised:
        syncer.sync()
    assert "fewer than SyncConfig.min_replicas=2" in "\n".join(raised.value.__notes__)
    assert [r.begins for r in replicas] == [0, 0] and syncer.replica_names == ["rollout 0", "rollout 1"]


class OnceFailingReplica(AskedReplica):
    """An `AskedReplica` whose first `transports()` or first `begin_update` raises `error` (a loss), and counts asks."""

    def __init__(self, expected, *, transports_error=None, begin_error=None) -> None:
        super().__init__(expected)
        self.asked, self.first_transports_error, self.first_begin_error = 0, transports_error, begin_error

    def transports(self):
        self.asked += 1
        error, self.first_transports_error = self.first_transports_error, None
        if error is not None:
            raise error
        return super().transports()

    def begin_update(self, plan, sync_id, config):
        error, self.first_begin_error = self.first_begin_error, None
        if error is not None:
            self.begins += 1
            raise error
        return super().begin_update(plan, sync_id, config)


def test_a_replica_dropped_at_the_pick_of_a_sync_that_failed_is_asked_again_at_the_next_pick():
    """Found by review: the pick was cached for the whole fleet, the replica it dropped (and never heard) included, so
    once the sync failed later and the fleet kept it, the next sync took a transport picked without it."""
    trainer, _ = setup(0)
    expected = expected_names(trainer.model)
    replicas = [OnceFailingReplica(expected),
                OnceFailingReplica(expected, transports_error=EngineHungError("no answer within 5 s")),
                OnceFailingReplica(expected, begin_error=EngineHungError("begin: no answer within 5 s"))]
    syncer = Syncer(trainer, replicas, dataclasses.replace(CONFIG, transport="auto", min_replicas=2))
    with pytest.raises(EngineHungError, match="begin: no answer"):
        syncer.sync()  # rollout 1 lost at the pick, rollout 2 at begin: below quorum, the fleet is kept
    assert syncer.replica_names == ["rollout 0", "rollout 1", "rollout 2"]
    report = syncer.sync()
    assert replicas[1].asked == 2 and not report.dropped and [r.replica for r in report.replicas] == [0, 1, 2]


def test_a_replica_the_pick_dropped_is_not_waited_for_again_when_the_fleet_leaves_its_collective_group(monkeypatch):
    """Found by review: a new pick that left `collective` asked every member of the fleet to leave the group, the
    hung one the pick had just dropped included: a second deadline for one loss."""
    import refit.orchestration.syncer as syncer_module

    trainer, replicas = setup(3)
    syncer = Syncer(trainer, replicas, dataclasses.replace(CONFIG, transport="auto"))
    monkeypatch.setattr(syncer_module, "pick_transport", lambda *_: ("collective", "every member can join a group"))
    syncer._pick_transport(Roll(syncer._fleet.members, 1))
    left: list = []
    monkeypatch.setattr(syncer._group, "disconnect", lambda members: left.append([who for who, _ in members]))

    def dropping_pick(sources, roll, config):
        roll.drop([("rollout 1", "missed the deadline", EngineHungError("no answer within 5 s"))], "(picking)")
        return "ray", "rollout 2 takes only the object store"

    monkeypatch.setattr(syncer_module, "pick_transport", dropping_pick)
    syncer._picked_for = None  # the fleet changed
    roll = Roll(syncer._fleet.members, 1)
    syncer._pick_transport(roll)
    assert syncer.transport == "ray" and left == [["rollout 0", "rollout 2"]]
