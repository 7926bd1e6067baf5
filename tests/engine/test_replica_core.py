"""`ReplicaCore`, the one replica side of a sync, against a recording engine adapter (no Ray, no vLLM).

Pins the order in which an update touches its engine (hold, pause, start,
load, finish, resume, KV stage, release), that every failure inside a step
closes the update on the replica itself (regression: the batch actor used
to leave a failed completeness check open for the driver to abort, while
the async actor closed it), that a rival sync's begin never releases the
requests the open update holds, and the lease watchdog.
"""

from __future__ import annotations

import threading
import time

import pytest

from refit.engine.lifecycle import Phase
from refit.engine.replica import EngineFacts, Generation, ReplicaCore
from refit.errors import LifecycleError, VerificationError
from refit.plan import RolloutModelInfo, SyncConfig, checkpoint_tensors, describe_weights, make_plan, produce_buckets
from refit.transport.integrity import new_sync_key
from tests.support.fakes import FP8_BLOCK, tiny_decoder

ENGINE_CALLS = {"hold_requests", "pause", "resume", "mark_version", "release_requests", "reset_prefix_cache", "generate"}


class RecordingEngine:
    """An engine adapter whose workers load into a set of names; every call is recorded in order."""

    def __init__(self, *, drop: str | None = None) -> None:
        self.facts = EngineFacts(RolloutModelInfo(FP8_BLOCK, False), vocab_size=64, workers=1, fp8_kv_cache=False,
                                 initial_refusal=None)
        self.calls: list[str] = []
        self.loaded: set[str] = set()
        self.drop = drop  # a tensor the workers "lose": the completeness check must catch it

    def transport_refusal(self, kind) -> None:
        return None

    def check(self, config: SyncConfig) -> None:
        pass

    def call_workers(self, method: str, *args):
        self.calls.append(method)
        if method == "update_weights":
            self.loaded |= {name for name, _ in args[0]["tensors"] if name != self.drop}
        answers = {"refit_streamed": sorted(self.loaded), "refit_apply_kv_policy": ["model.layers.0.self_attn.attn.k_scale"],
                   "refit_stop_amax": [("model.layers.0.self_attn.attn", "k_scale", 2.0)], "refit_scale_records": []}
        return [answers.get(method)]

    def generate(self, prompts, max_tokens, *, prompt_logprobs=False) -> Generation:
        self.calls.append("generate")
        return Generation([[0]] * len(prompts), [[0.0]] * len(prompts), None)

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def hold_requests(self, timeout_s) -> None:
        self.calls.append("hold_requests")

    def pause(self, mode, timeout_s) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")

    def mark_version(self, version: int) -> None:
        self.calls.append("mark_version")

    def release_requests(self, refusal: str | None = None) -> None:
        self.calls.append("release_requests")

    def gone(self) -> str | None:
        return None


def _setup(engine: RecordingEngine, **config):
    model = tiny_decoder()
    config = SyncConfig(bucket_bytes=100_000, timeout_s=5, **{"transport": "ray", **config})  # as a Syncer hands it
    plan = make_plan(describe_weights(model), RolloutModelInfo(FP8_BLOCK, False), config).for_sync(new_sync_key())
    return ReplicaCore(engine), plan, config, list(produce_buckets(plan, checkpoint_tensors(model)))


def _sync(core, plan, config, buckets, sync_id="s1"):
    version = core.begin_update(plan, sync_id, config)
    for bucket in buckets:
        core.load_bucket(sync_id, version, bucket)
    return version, core.finish_update(sync_id, version)


def test_an_update_touches_its_engine_in_one_order_and_serves_its_version():
    engine = RecordingEngine()
    core, plan, config, buckets = _setup(engine)
    version, finished = _sync(core, plan, config, buckets)
    assert core.status().phase is Phase.SERVING and core.status().served_version == version
    assert finished.kv_scales_written == ("model.layers.0.self_attn.attn.k_scale",)
    assert engine.calls == (["hold_requests", "pause", "refit_start_update"] + ["update_weights"] * len(buckets)
                            + ["refit_streamed", "refit_finish_update", "resume", "refit_apply_kv_policy",
                               "reset_prefix_cache", "mark_version", "release_requests"])
    assert core.last_update()["buckets"] == len(buckets) and core.last_update()["outcome"] == "served"


def test_the_kv_recompute_sequence_makes_placeholders_valid_empties_the_prefix_cache_then_measures_then_writes():
    """Found by review: the calibration pass ran with the prefix cache of the old weights, so the blocks of a prompt
    users had just served were skipped, unmeasured (an amax over the rest: a scale too small, saturating FP8)."""
    engine = RecordingEngine()
    core, plan, config, buckets = _setup(engine, kv_scales="recompute", calibration_prompts=[[1, 2, 3]])
    _sync(core, plan, config, buckets)
    stage = engine.calls[engine.calls.index("resume") + 1:]
    assert stage == ["refit_apply_kv_policy", "reset_prefix_cache", "refit_start_amax", "generate", "refit_stop_amax",
                     "refit_apply_kv_policy", "reset_prefix_cache", "mark_version", "release_requests"]


def test_a_failed_completeness_check_closes_the_update_on_the_replica_itself():
    """Regression: the batch actor left this update open for the driver's abort (the async one closed it)."""
    engine = RecordingEngine(drop="model.layers.1.mlp.down_proj.weight")
    core, plan, config, buckets = _setup(engine)
    version = core.begin_update(plan, "s1", config)
    for bucket in buckets:
        core.load_bucket("s1", version, bucket)
    with pytest.raises(VerificationError, match="down_proj"):
        core.finish_update("s1", version)
    status = core.status()
    assert status.phase is Phase.REFUSING and "finishing the reload failed" in status.reason
    assert engine.calls[-3:] == ["refit_abandon_update", "resume", "release_requests"]
    assert core.abort_update("s1", "the driver's abort, after the fact") == status  # nothing left open
    assert core.last_update()["outcome"].startswith("failed: finishing the reload failed")


def test_a_rival_sync_is_refused_without_releasing_the_requests_the_open_update_holds():
    engine = RecordingEngine()
    core, plan, config, _ = _setup(engine)
    core.begin_update(plan, "s1", config)
    before = list(engine.calls)
    with pytest.raises(LifecycleError, match="another sync"):
        core.begin_update(plan, "s2", config)
    assert engine.calls == before  # neither held nor released again
    assert core.status().phase is Phase.UPDATING and core.status().sync_id == "s1"


def test_an_update_whose_sync_stopped_calling_is_closed_by_the_watchdog():
    engine = RecordingEngine()
    core, plan, config, _ = _setup(engine)
    core.begin_update(plan, "s1", SyncConfig(bucket_bytes=100_000, timeout_s=0.2, transport="ray"))
    deadline = time.monotonic() + 10
    while core.status().phase is Phase.UPDATING and time.monotonic() < deadline:
        time.sleep(0.05)
    status = core.status()
    assert status.phase is Phase.SERVING and "release_requests" in engine.calls  # nothing loaded: back to serving
    assert "stopped calling" in core.last_update()["outcome"]
    core.close()


class UnreleasingEngine(RecordingEngine):
    """A server's gate that cannot be reached, `failures` times, when the held requests are released."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def release_requests(self, refusal: str | None = None) -> None:
        super().release_requests(refusal)
        if self.failures:
            self.failures -= 1
            raise ConnectionError("the gate did not answer")


def test_a_failed_release_neither_stops_the_watchdog_nor_hides_the_failure_that_closed_the_update():
    """Found by review: a release that raised escaped the watchdog's thread, which ended, so every later update whose
    driver died stayed open for ever; on a driver's failing call it replaced the failure the driver should see."""
    engine = UnreleasingEngine(failures=3)
    core, plan, config, _ = _setup(engine)
    short = SyncConfig(bucket_bytes=100_000, timeout_s=0.2, transport="ray")
    for sync_id in ("s1", "s2"):  # s1's release fails inside the watchdog; s2 is still closed by it
        core.begin_update(plan, sync_id, short)
        deadline = time.monotonic() + 10
        while core.status().phase is Phase.UPDATING and time.monotonic() < deadline:
            time.sleep(0.05)
        assert core.status().phase is Phase.SERVING, sync_id
        assert f"sync {sync_id} stopped calling" in core.last_update()["outcome"]
    engine.drop = "model.layers.1.mlp.down_proj.weight"
    version = core.begin_update(plan, "s3", config)
    for bucket in produce_buckets(plan, checkpoint_tensors(tiny_decoder())):
        core.load_bucket("s3", version, bucket)
    with pytest.raises(VerificationError, match="down_proj"):  # the failure itself, not the release's echo of it
        core.finish_update("s3", version)
    core.close()


def test_a_failed_calibration_pass_takes_its_measuring_hooks_out_and_fails_the_update():
    """Found by review: a calibration pass whose generate raised left the workers' amax hooks in, so every later
    forward pass measured every attention layer (a device sync each), one more set per failed recompute."""

    class FailingCalibration(RecordingEngine):
        def generate(self, prompts, max_tokens, *, prompt_logprobs=False) -> Generation:
            super().generate(prompts, max_tokens, prompt_logprobs=prompt_logprobs)
            raise RuntimeError("the engine core died")

    engine = FailingCalibration()
    core, plan, config, buckets = _setup(engine, kv_scales="recompute", calibration_prompts=[[1, 2, 3]])
    with pytest.raises(RuntimeError, match="the engine core died"):
        _sync(core, plan, config, buckets)
    stage = engine.calls[engine.calls.index("refit_start_amax"):]
    assert stage[:3] == ["refit_start_amax", "generate", "refit_stop_amax"]
    assert core.status().phase is Phase.REFUSING


def test_a_replica_whose_engine_is_gone_between_syncs_is_shown_refusing_with_why():
    engine = RecordingEngine()
    core, plan, config, buckets = _setup(engine)
    version, _ = _sync(core, plan, config, buckets)
    assert core.status().phase is Phase.SERVING
    engine.gone = lambda: "the server at http://127.0.0.1:1 restarted since this replica connected to it"
    status = core.status()
    assert status.phase is Phase.REFUSING and status.served_version == version and "restarted" in status.reason
    core.close()


def test_an_update_whose_release_fails_is_not_reported_served():
    """Found by review: the release came after the lifecycle said serving, so a server gate that never heard it kept
    its users held (then refused) while the replica reported the new version served."""
    engine = UnreleasingEngine(failures=1)
    core, plan, config, buckets = _setup(engine)
    with pytest.raises(ConnectionError, match="the gate did not answer"):
        _sync(core, plan, config, buckets)
    status = core.status()
    assert status.phase is Phase.REFUSING and "releasing the requests held for the update failed" in status.reason
    assert engine.calls.count("release_requests") == 2 and engine.calls[-1] == "release_requests"  # now as refusing
    core.close()


class ReceivingEngine(RecordingEngine):
    """Workers that receive each bucket over the transport (as over `collective`): records the indexes in turn."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[int] = []

    def call_workers(self, method: str, *args):
        if method == "update_weights" and "contents" in args[0]:
            self.received += [part[0] for part in args[0]["contents"]]  # `BucketContents.to_plain`: the index first
            return [None]
        return super().call_workers(method, *args)


def test_buckets_of_a_transport_that_reads_ahead_reach_the_workers_in_order_whatever_order_the_calls_start_in():
    """Found attacking a user's own actor: with `max_concurrency` > 1 (nothing in docs/own-engine.md forbids it) Ray
    ran a sync's two load_bucket calls in flight in either order; over `collective` a worker then received bucket 2's
    broadcast into bucket 3's receive: a refused tag, then gloo aborting the actor's process on the size mismatch."""
    engine = ReceivingEngine()
    core, plan, config, buckets = _setup(engine, transport="collective", delta="off")
    assert len(buckets) >= 2
    version = core.begin_update(plan, "s1", config)
    second = threading.Thread(target=core.load_bucket, args=("s1", version, [buckets[1].contents()], [None]))
    second.start()  # first, as Ray may start it
    second.join(timeout=1)  # on its own it would load at once
    core.load_bucket("s1", version, [buckets[0].contents()], [buckets[1].nbytes])
    second.join(timeout=30)
    assert not second.is_alive()
    assert engine.received == [0, 1]
    core.close()
