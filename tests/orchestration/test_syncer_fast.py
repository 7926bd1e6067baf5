"""`Syncer` against plain-Python replicas: aborts, versions, errors, streams (no Ray, no vLLM).

The fake replica keeps the real `UpdateLifecycle` and loads into a dict, so
what is tested is `Syncer`'s own flow; the same findings are tested on real
Ray and vLLM in tests/sync/test_faults.py.
"""

from __future__ import annotations

import pytest
import torch

from refit import ConfigError, EngineError, LifecycleError, Phase, SyncConfig, Syncer
from refit.orchestration.calls import first_claim
from tests.support.fakes import CONFIG, FakeReplica, FakeTrainer, expected_names, setup, tiny_decoder


def test_a_sync_delivers_every_tensor_in_loadable_form_and_names_one_version():
    trainer, replicas = setup()
    report = Syncer(trainer, replicas, CONFIG).sync()
    assert report.version == 1 and report.buckets > 2
    for replica in replicas:
        assert replica.status().phase is Phase.SERVING and replica.status().served_version == 1
        assert replica.weights["model.layers.2.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(replica.weights["model.norm.weight"], trainer.model.model.norm.weight)
    assert trainer.streams_closed == 1


def test_a_failed_begin_on_one_replica_leaves_the_others_serving_their_old_version():
    """Finding 1: the replicas that did begin were left paused, blocking every call."""
    trainer, replicas = setup(begin=EngineError("replica 0 is dead"))
    Syncer(trainer, replicas[1:], CONFIG).sync()  # replica 1 now serves v1
    with pytest.raises(EngineError, match="replica 0 is dead") as error:
        Syncer(trainer, replicas, CONFIG).sync()
    assert replicas[1].status().phase is Phase.SERVING and replicas[1].status().served_version == 1
    assert "rollout 1: serving v1" in error.value.__notes__
    assert trainer.streams_closed == 1  # the failed sync never opened a stream


def test_an_interrupt_during_begin_aborts_the_replicas_that_began():
    trainer, replicas = setup()
    replicas[1].fail["begin"] = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        Syncer(trainer, replicas, CONFIG).sync()
    assert replicas[0].status().phase is Phase.SERVING and replicas[0].lifecycle.open_update() is None


def test_an_interrupt_mid_stream_leaves_each_replica_refusing_with_a_reason_that_names_it():
    trainer, replicas = setup(at_bucket=2, bucket_error=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        Syncer(trainer, replicas, CONFIG).sync()
    reasons = [r.status().reason for r in replicas]
    assert all(r.status().phase is Phase.REFUSING for r in replicas)
    assert reasons[1].startswith("sync ") and reasons[1].endswith(" failed: KeyboardInterrupt"), reasons  # no dangling colon


def test_a_failure_mid_stream_refuses_everywhere_closes_the_stream_and_the_next_sync_repairs():
    trainer, replicas = setup(at_bucket=2)
    with pytest.raises(EngineError, match="loader fault at bucket 1") as error:
        Syncer(trainer, replicas, CONFIG).sync()
    assert all(r.status().phase is Phase.REFUSING for r in replicas)
    assert any(note.startswith("rollout 0: refusing to serve: sync") for note in error.value.__notes__)
    assert trainer.streams_closed == 1
    replicas[0].fail.clear()
    report = Syncer(trainer, replicas, CONFIG).sync()
    assert report.version == 2  # version 1 was proposed by the failed sync: never reused
    assert all(r.status().served_version == 2 for r in replicas)


def test_a_trainer_fault_mid_stream_is_the_error_raised():
    model = tiny_decoder()
    trainer = FakeTrainer(model, fail_at_bucket=1)
    replicas = [FakeReplica(expected_names(model)) for _ in range(2)]
    with pytest.raises(RuntimeError, match="trainer fault at bucket 1"):
        Syncer(trainer, replicas, CONFIG).sync()
    assert all(r.status().phase is Phase.REFUSING for r in replicas)


def test_a_trainer_with_fewer_tensors_is_refused_and_never_served():
    """Finding 3: a one-layer trainer into a three-layer rollout 'succeeded' with a half-old model."""
    big = tiny_decoder(layers=3)
    replicas = [FakeReplica(expected_names(big)) for _ in range(2)]
    with pytest.raises(EngineError, match=r"model\.layers\.2\.mlp\.down_proj\.weight"):
        Syncer(FakeTrainer(tiny_decoder(layers=2)), replicas, CONFIG).sync()
    assert all(r.status().phase is Phase.REFUSING for r in replicas)


def test_two_syncers_on_the_same_replicas_never_repeat_a_version():
    trainer, replicas = setup()
    first, second = Syncer(trainer, replicas, CONFIG), Syncer(trainer, replicas, CONFIG)
    versions = [s.sync().version for s in (first, second, first, second)]
    assert versions == [1, 2, 3, 4]


def test_a_sync_refused_by_the_replica_every_syncer_claims_first_begins_no_other():
    """Found: two syncs started at once on two replicas each began one, and both were refused."""
    trainer, replicas = setup(3)
    _, first = first_claim([(str(i), r) for i, r in enumerate(replicas)])
    first.lifecycle.begin("rival", lease_s=60, drain_timeout_s=1)
    with pytest.raises(LifecycleError, match=r"another sync \(rival\)"):
        Syncer(trainer, replicas, CONFIG).sync()
    assert [r.begins for r in replicas if r is not first] == [0, 0]
    first.lifecycle.failed("rival", "the rival gives up")
    report = Syncer(trainer, replicas, CONFIG).sync()
    assert [r.status().served_version for r in replicas] == [report.version] * 3


def test_the_trainer_starts_streaming_once_the_first_claim_is_won_and_before_the_others_begin():
    """Why: the first bucket is then made while the other replicas begin, not after (a small model's sync is its
    fixed cost). Never before the first claim: a sync refused there must not take the trainer."""
    events = []

    class RecordingTrainer(FakeTrainer):
        def stream_buckets(self, plan):
            events.append("stream")
            return super().stream_buckets(plan)

    model = tiny_decoder()
    trainer, replicas = RecordingTrainer(model), [FakeReplica(expected_names(model)) for _ in range(3)]
    for replica in replicas:
        begin = replica.begin_update
        replica.begin_update = lambda *args, _begin=begin, _who=replica: (events.append(_who), _begin(*args))[1]
    _, first = first_claim([(str(i), r) for i, r in enumerate(replicas)])
    Syncer(trainer, replicas, CONFIG).sync()
    assert events[:2] == [first, "stream"]
    assert sorted(map(id, events[2:])) == sorted(id(r) for r in replicas if r is not first)

    events.clear()
    first.lifecycle.begin("rival", lease_s=60, drain_timeout_s=1)
    with pytest.raises(LifecycleError, match=r"another sync \(rival\)"):
        Syncer(trainer, replicas, CONFIG).sync()
    assert events == [first]  # refused at the first claim: no stream, no other begin


def test_calls_that_wait_for_each_other_are_submitted_as_one_set_per_thread(monkeypatch):
    """Two syncs of one process on one sharded trainer: each submits its set of calls to the ranks whole (Ray then runs
    them in that order on every rank), never one call between another thread's; interleaved, the ranks' streams would
    each wait for the other's in a gather. The handles here stand in for Ray's: `.remote` submits."""
    import threading
    import time

    from refit.orchestration import calls

    submitted: list[tuple[str, str]] = []

    class Handle:
        def __init__(self, rank: str) -> None:
            self.rank = rank

        def __getattr__(self, method: str):
            rank = self.rank

            class Method:
                @staticmethod
                def remote(sync: str) -> None:
                    submitted.append((sync, rank))
                    time.sleep(0.05 if rank == "rank 0" else 0)  # room for the other thread to slip a call in

            return Method

    monkeypatch.setattr(calls, "is_actor", lambda target: isinstance(target, Handle))
    ranks = [(f"rank {r}", Handle(f"rank {r}")) for r in range(2)]
    threads = [threading.Thread(target=calls.submit_all, args=(ranks, "stream_buckets", sync)) for sync in ("A", "B")]
    for thread in threads:
        thread.start()
        time.sleep(0.01)
    for thread in threads:
        thread.join()
    assert submitted in ([("A", "rank 0"), ("A", "rank 1"), ("B", "rank 0"), ("B", "rank 1")],
                         [("B", "rank 0"), ("B", "rank 1"), ("A", "rank 0"), ("A", "rank 1")])


def test_objects_without_the_protocol_methods_are_refused_by_name():
    trainer, replicas = setup()
    with pytest.raises(ConfigError, match=r"rollout 1 lacks begin_update\(\)"):
        Syncer(trainer, [replicas[0], object()])
    with pytest.raises(ConfigError, match=r"the trainer lacks stream_buckets\(\)"):
        Syncer(object(), replicas)
    with pytest.raises(ConfigError, match="at least one"):
        Syncer(trainer, [])


def test_a_progress_bar_over_buckets_when_asked_and_none_by_default_off_a_terminal(capsys):
    from dataclasses import replace

    trainer, replicas = setup()
    report = Syncer(trainer, replicas, replace(CONFIG, progress=True)).sync()
    bar = capsys.readouterr().err
    assert "refit sync v1" in bar and f"/{report.buckets} [" in bar and "bucket" in bar
    Syncer(trainer, replicas, CONFIG).sync()  # progress=None: stderr is not a terminal under pytest
    assert "refit sync" not in capsys.readouterr().err


def test_verify_probe_needs_a_trainer_that_can_score_prompts():
    from dataclasses import replace

    trainer, replicas = setup()
    with pytest.raises(ConfigError, match=r"the trainer lacks reference_logprobs\(\), which verify='probe' needs"):
        Syncer(trainer, replicas, replace(CONFIG, verify="probe"))


def test_a_probe_that_cannot_be_made_fails_the_sync_before_any_replica_begins():
    """Found by review: the probe was asked for after every bucket loaded, so a rollout model without vocab_size
    (or a trainer that failed to score) left every replica refusing, at every sync."""
    from dataclasses import replace

    class ScoringTrainer(FakeTrainer):
        def reference_logprobs(self, prompts):
            return [[0.0] * (len(prompt) - 1) for prompt in prompts]

    model = tiny_decoder()
    trainer, replicas = ScoringTrainer(model), [FakeReplica(expected_names(model)) for _ in range(2)]
    Syncer(trainer, replicas, CONFIG).sync()
    with pytest.raises(ConfigError, match="verify='probe' needs the rollout model's vocab_size"):
        Syncer(trainer, replicas, replace(CONFIG, verify="probe")).sync()
    assert [(r.begins, r.status().phase, r.status().served_version) for r in replicas] == [(1, Phase.SERVING, 1)] * 2


def test_the_report_times_every_stage():
    trainer, replicas = setup()
    report = Syncer(trainer, replicas, CONFIG).sync()
    stages = report.plan_seconds + report.begin_seconds + report.stream_seconds + report.finish_seconds
    assert 0 < stages <= report.total_seconds
    assert "stream" in report.summary()


def test_a_transport_the_actors_cannot_use_is_refused_before_anything_runs():
    trainer, replicas = setup()
    with pytest.raises(ConfigError, match=r"the trainer lacks join_transport\(\), which transport='collective' needs"):
        Syncer(trainer, replicas, SyncConfig(transport="collective"))

    class Sharded:
        ranks = [trainer, trainer]

    with pytest.raises(ConfigError, match=r"trainer rank 1 lacks join_transport\(\)") as error:
        Syncer(Sharded(), replicas, SyncConfig(transport="collective"))
    assert "rollout 1 lacks transport_ranks()" in str(error.value)  # every problem, reported together


class CoreElsewhere(FakeReplica):
    """Says what an AsyncLLM replica says: it takes only `collective` (which these fakes cannot join)."""

    def transports(self) -> dict:
        return {"accepts": ["collective"], "device": "cpu"}


class Silent(FakeReplica):
    def transports(self) -> dict:
        raise EngineError("no answer")


def test_auto_picks_the_object_store_for_fakes_and_says_why_in_the_report():
    trainer, replicas = setup()
    syncer = Syncer(trainer, [*replicas, Silent(expected_names(tiny_decoder()))], SyncConfig(bucket_bytes=100_000, timeout_s=5))
    assert syncer.transport is None  # picked at the first sync, when every member can be asked
    report = syncer.sync()
    assert syncer.transport == report.transport == "ray" and "every member can take it" in report.transport_reason
    assert "over ray: every member can take it" in report.summary()  # one that does not answer is judged by its methods


def test_auto_refuses_a_fleet_no_transport_suits_before_anything_runs():
    trainer, replicas = setup()
    syncer = Syncer(trainer, [replicas[0], CoreElsewhere(expected_names(tiny_decoder()))], SyncConfig(timeout_s=5))
    with pytest.raises(ConfigError, match=r"no transport suits every member(.|\n)*rollout 1 can take none"):
        syncer.sync()
    assert all(r.lifecycle.status().phase is Phase.SERVING for r in replicas[:1])  # nothing began


def test_auto_refuses_a_replica_whose_answer_is_not_an_offer_naming_it():
    class Garbled(FakeReplica):
        def transports(self):
            return {"accepts": "ray", "device": "cpu"}

    trainer, replicas = setup()
    with pytest.raises(ConfigError, match=r"rollout 1: transports\(\) answered \{'accepts': 'ray'"):
        Syncer(trainer, [replicas[0], Garbled(expected_names(tiny_decoder()))], SyncConfig(timeout_s=5)).sync()


def test_mixing_transports_within_one_syncer_is_refused():
    with pytest.raises(ConfigError, match=r"mixing transports \(collective, ray\) within one Syncer is not supported"):
        SyncConfig(transport=("collective", "ray"))
    assert SyncConfig(transport=["collective", "collective"]).transport == "collective"


def test_ipc_on_a_machine_without_cuda_is_refused_naming_who_lacks_it():
    from refit import TransportError
    from refit.transport.ipc import IpcSender

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(TransportError, match=r"transport='ipc' needs CUDA, and the trainer has no CUDA device"):
        IpcSender(keep=2)


def test_a_class_passed_for_an_actor_is_refused_naming_it():
    from actors import RolloutActor, TrainerActor

    with pytest.raises(ConfigError, match=r"trainer is the class TrainerActor, not an actor: pass the handle TrainerActor\.remote"):
        Syncer(TrainerActor, RolloutActor)
    trainer, replicas = setup()
    with pytest.raises(ConfigError, match=r"rollout 1 is the class RolloutActor") as error:
        Syncer(trainer, [replicas[0], RolloutActor])
    assert "rollout 0" not in str(error.value)


def test_the_death_of_a_member_is_raised_whichever_of_its_echoes_came_first():
    """A broken gloo pair, a lost object or a missed deadline, each an echo of one dead rank: the rank is named."""
    from refit.errors import ActorDiedError, SyncTimeoutError
    from refit.orchestration.failures import named_cause as _named_cause

    for echo in (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"),
                 SyncTimeoutError("rollout 0: load_bucket did not answer within 20 s"),
                 ActorDiedError("trainer rank 0 died or is unreachable (stream_buckets): ObjectLostError: ...", "trainer rank 0")):
        echo.add_note("rollout 0: refusing to serve")
        dead = ActorDiedError("trainer rank 1 died or is unreachable (__ray_ready__): ActorDiedError: killed", "trainer rank 1")
        cause = _named_cause(echo, [dead])
        assert cause is dead and cause.who == "trainer rank 1"
        assert f"echo of it: {type(echo).__name__}: {str(echo).splitlines()[0]}" in cause.__notes__
        assert "rollout 0: refusing to serve" in cause.__notes__
    # An error that already names a dead member stays; other dead members are notes.
    named = ActorDiedError("rollout 2 died or is unreachable (load_bucket): ActorDiedError: killed", "rollout 2")
    also = ActorDiedError("rollout 1 died or is unreachable (__ray_ready__): ActorDiedError: killed", "rollout 1")
    assert _named_cause(named, [also, ActorDiedError("rollout 2 died", "rollout 2")]) is named
    assert any(note.startswith("also dead: ActorDiedError: rollout 1 died") for note in named.__notes__)
    plain = ValueError("nothing died")
    assert _named_cause(plain, []) is plain
    # Relayed by a replica (Ray wraps it, keeping the original as `cause`): the original, unwrapped, with the notes.
    fetched = ActorDiedError("trainer rank 1 died or is unreachable (stream_buckets): ActorDiedError: ...", "trainer rank 1")
    relayed = RuntimeError("ray::RolloutActor.load_bucket() ...")
    relayed.cause = fetched
    relayed.add_note("rollout 1: refusing to serve")
    cause = _named_cause(relayed, [ActorDiedError("trainer rank 1 died", "trainer rank 1")])
    assert cause is fetched and cause.__notes__ == ["rollout 1: refusing to serve"]


def test_only_verification_failures_count_as_failed_verifications(monkeypatch):
    """A dead replica is an EngineError, not a failed check."""
    import refit.orchestration.failures as failures_module
    from refit.errors import VerificationError

    recorded = []
    monkeypatch.setattr(failures_module, "record_failure", lambda verification_failed, syncer: recorded.append(verification_failed))
    for failure, counted in ((EngineError("rollout 0 died"), False), (VerificationError("bucket 1 arrived altered"), True)):
        trainer, replicas = setup(finish=failure)
        with pytest.raises(type(failure)):
            Syncer(trainer, replicas, CONFIG).sync()
        assert recorded.pop() is counted


def test_an_interrupt_while_replicas_stage_an_adapter_unstages_it_everywhere_and_the_next_adapter_sync_succeeds():
    """Found by review: `sync_adapter` unstaged only the replicas whose stage had answered, so a driver interrupted
    while it waited for the stage round (the replicas staging it regardless) left the adapter staged, and every adapter
    sync for the next `timeout_s` was refused by those replicas ("sync ... staged adapter ... has not served it yet")."""
    from tests.support.fakes import LoraEngine, LoraTrainer, lora_replica

    trainer = LoraTrainer(tiny_decoder())
    engines = [LoraEngine(), LoraEngine()]
    replicas = [lora_replica(engine) for engine in engines]
    syncer = Syncer(trainer, replicas, CONFIG)
    assert syncer.sync_adapter().version == 1
    trainer.train_adapter()
    engines[1].interrupt_at_stage = True  # replica 0 has staged v2 when the interrupt arrives
    with pytest.raises(KeyboardInterrupt):
        syncer.sync_adapter()
    for replica, engine in zip(replicas, engines):
        assert str(replica.status().adapter) == "policy v1"
        assert replica.adapters._staged is None, replica.adapters._staged
        assert len(engine.loaded) == 1  # the served adapter alone: the interrupted sync's is unloaded
    report = syncer.sync_adapter()  # at once, not after timeout_s
    assert report.version == 2 and all(str(r.status().adapter) == "policy v2" for r in replicas)


def test_an_adapter_one_replica_refuses_is_refused_naming_that_replica():
    """Found by review: a replica's refusal reached the driver of an adapter sync as the replica's bare error, so in a
    fleet nobody could tell which replica refused."""
    from tests.support.fakes import LoraEngine, LoraTrainer, lora_replica

    small = LoraEngine()
    small.lora_rank = 4  # below the trainer's rank 8
    replicas = [lora_replica(LoraEngine()), lora_replica(small)]
    with pytest.raises(ConfigError, match="rank") as error:
        Syncer(LoraTrainer(tiny_decoder()), replicas, CONFIG).sync_adapter()
    assert "raised by rollout 1" in error.value.__notes__
    assert all(r.status().adapter is None for r in replicas)


def test_a_cpu_replica_with_lora_on_refuses_verify_probe_before_its_update_opens():
    """Found: vLLM's CPU LoRA path fails on prompt logprobs (add_lora_logits: "einsum(): subscript b has size 4 ..."),
    so with verify='probe' every weight sync of a CPU replica with LoRA on failed after all its weights had loaded,
    and left it refusing to serve."""
    from dataclasses import replace

    from tests.support.fakes import LoraEngine, LoraTrainer, lora_replica

    class ScoringLoraTrainer(LoraTrainer):
        def reference_logprobs(self, prompts):
            return [[0.0] * (len(prompt) - 1) for prompt in prompts]

    engine = LoraEngine()
    engine.facts = replace(engine.facts, model_info=replace(engine.facts.model_info, vocab_size=64, serves_lora=True))
    replica = lora_replica(engine)
    with pytest.raises(ConfigError, match=r"verify='probe' on a CPU replica with LoRA on \(EngineConfig\.lora_rank"):
        Syncer(ScoringLoraTrainer(tiny_decoder()), [replica], replace(CONFIG, verify="probe")).sync()
    assert replica.status().phase is Phase.SERVING and replica.lifecycle.open_update() is None


def test_the_probe_of_a_rollout_that_serves_lora_is_the_trainers_base_alone():
    """A rollout that serves LoRA is sent the base alone and scores the probe on it: compared with the trainer's
    adapted model, every sync after training would breach."""
    from dataclasses import replace

    class LoraRollout(FakeReplica):
        def describe(self):
            return replace(super().describe(), vocab_size=64, serves_lora=True)

        def finish_update(self, sync_id, version, probe=None):
            self.probe = probe
            return super().finish_update(sync_id, version)

    class AdaptedTrainer(FakeTrainer):
        def reference_logprobs(self, prompts):
            return [[-1.0] * (len(prompt) - 1) for prompt in prompts]

        def base_reference_logprobs(self, prompts):
            return [[-2.0] * (len(prompt) - 1) for prompt in prompts]

    model = tiny_decoder()
    replicas = [LoraRollout(expected_names(model))]
    Syncer(AdaptedTrainer(model), replicas, replace(CONFIG, verify="probe")).sync()
    assert {value for row in replicas[0].probe.reference for value in row} == {-2.0}


def test_a_cpu_replica_that_applies_lora_but_installs_none_refuses_verify_probe_too():
    """Found by review: the refusal asked the engine adapter's `lora_rank`, which a `vllm serve` replica leaves None (it
    installs no adapter), though a server started with --enable-lora applies LoRA and fails the probe the same way."""
    from dataclasses import replace

    from tests.support.fakes import LoraEngine, LoraTrainer, lora_replica

    class ScoringLoraTrainer(LoraTrainer):
        def reference_logprobs(self, prompts):
            return [[0.0] * (len(prompt) - 1) for prompt in prompts]

    engine = LoraEngine()
    engine.lora_rank = None  # as `ServerAdapter` has it
    engine.facts = replace(engine.facts, model_info=replace(engine.facts.model_info, vocab_size=64, serves_lora=True))
    replica = lora_replica(engine)
    with pytest.raises(ConfigError, match=r"verify='probe' on a CPU replica with LoRA on"):
        Syncer(ScoringLoraTrainer(tiny_decoder()), [replica], replace(CONFIG, verify="probe")).sync()
    assert replica.status().phase is Phase.SERVING and replica.lifecycle.open_update() is None
