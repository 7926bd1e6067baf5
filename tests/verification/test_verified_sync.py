"""Verified syncs on real Ray and vLLM: integrity tags, completeness, engine read-back and the logprob probe.

Each check must pass on a correct sync and fail, naming what is wrong, on a
deliberately broken one; a failed check leaves the replica refusing to
serve, as any failure after the first bucket does.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import ray

import refit
from actors import TrainerActor
from fixtures import model_dir
from refit.engine import Phase
from refit.plan.checkpoint_format import CheckpointView
from refit.plan.data_path import produce_buckets
from refit.transport.buckets import WireBucket
from refit.transport.integrity import new_sync_key
from tests.support.actors import double_weight_scale, run_in

FP8_DUMMY = {"load_format": "dummy", "kv_cache_dtype": "fp8_e4m3"}
PROBE = refit.SyncConfig(verify="probe", on_probe_breach="flag")
LAYER0_GATE = "model.layers.0.mlp.gate_proj.weight"


def probe_numbers(report) -> tuple[float, float]:
    match = re.search(r"mean \|dlogprob\| ([0-9.]+) .* max ([0-9.]+)", report.replicas[0].verification)
    return float(match.group(1)), float(match.group(2))


@pytest.mark.parametrize(
    "arch, tied, variant, engine",
    # One per precision's thresholds; the MoE with an FP8 KV cache showed the largest differences.
    [("qwen3", True, "bf16", {"load_format": "dummy"}), ("llama", False, "fp8_block", {"load_format": "dummy"}),
     ("qwen3_moe", False, "fp8_block", FP8_DUMMY)],
    ids=["qwen3-bf16", "llama-fp8", "moe-fp8-fp8kv"],
)
def test_a_correct_sync_passes_every_check_and_the_probe(actors_factory, arch, tied, variant, engine):
    trainer = actors_factory.trainer(model_dir(tied, "bf16", arch=arch))
    replica = actors_factory.rollout(model_dir(tied, variant, arch=arch), **engine)
    report = refit.Syncer(trainer, replica, PROBE).sync()
    verification = report.replicas[0].verification
    assert "integrity tags" in verification and "scales read back" in verification and "probe passed" in verification
    assert not report.probe_breached
    print(f"{arch}-{variant}-{engine.get('kv_cache_dtype', 'auto')}: {verification}")


@ray.remote
class TamperingTrainer(TrainerActor.__ray_actor_class__):
    """A trainer whose buckets go wrong in a chosen way, after the sender tagged them."""

    def set_fault(self, fault: str) -> None:
        self.fault = fault

    def stream_buckets(self, plan):
        view = CheckpointView(self.model)

        def lookup(name: str):
            if self.fault == "swap" and name.startswith("model.layers.0.mlp."):
                return view.tensor(name.replace("layers.0", "layers.1"))
            return view.tensor(name)

        for bucket in produce_buckets(plan, lookup):
            names = [t.name for t in bucket.tensors]
            if self.fault == "alter" and LAYER0_GATE in names:
                buffer = bucket.buffer.copy()
                entry = bucket.tensors[names.index(LAYER0_GATE)]
                buffer[entry.offset] ^= np.uint8(0x40)  # one bit of one FP8 code, in transit
                bucket = WireBucket(bucket.index, bucket.tensors, buffer)
            elif self.fault == "skip" and LAYER0_GATE in names:
                keep = [t for t in bucket.tensors if not t.name.startswith(LAYER0_GATE)]
                bucket = WireBucket(bucket.index, tuple(keep), bucket.buffer)
            yield bucket


@pytest.fixture(scope="module")
def broken(module_actors):
    """One tampering trainer and one FP8 replica for every broken sync below (a failed sync leaves it refusing,
    and the next sync repairs it, so they can be shared)."""
    trainer = module_actors.keep(TamperingTrainer.options(num_cpus=0, resources={"node0": 0.01}).remote(
        str(model_dir(False, "bf16"))))
    return trainer, module_actors.rollout(model_dir(False, "fp8_block"), **FP8_DUMMY)


def tampering(broken, fault: str):
    trainer, replica = broken
    ray.get(trainer.set_fault.remote(fault))
    return trainer, replica


def assert_refusing(replica) -> None:
    status = ray.get(replica.status.remote())
    assert status.phase is Phase.REFUSING, status


def test_a_bucket_altered_in_transit_fails_naming_the_tensor(broken):
    trainer, replica = tampering(broken, "none")
    refit.sync(trainer, replica)  # serving a whole version: the failure below must not half-load it
    ray.get(trainer.set_fault.remote("alter"))
    altered = rf"arrived altered \(its keyed integrity tag does not match\) in: {LAYER0_GATE}; nothing of it was loaded"
    with pytest.raises(refit.VerificationError, match=altered):
        refit.sync(trainer, replica)
    status = ray.get(replica.status.remote())
    assert status.phase is Phase.SERVING and status.served_version == 1  # bucket 0 was refused: nothing changed


def test_a_skipped_tensor_fails_naming_it(broken):
    trainer, replica = tampering(broken, "skip")
    with pytest.raises(refit.VerificationError, match=rf"did not deliver 2 tensor\(s\) of the plan: {LAYER0_GATE}, {LAYER0_GATE}_scale"):
        refit.sync(trainer, replica)
    assert_refusing(replica)


def test_a_scale_corrupted_in_the_engine_after_loading_fails_naming_the_layer(broken):
    """Driven step by step, as `Syncer` does, with the engine's scale doubled between the last bucket and finish."""
    trainer, replica = tampering(broken, "none")
    config = refit.SyncConfig(transport="ray")  # by hand, the transport a Syncer would pick (auto) is named
    plan = refit.Syncer(trainer, replica, config).plan().for_sync(new_sync_key())  # a key of its own, as a sync's
    version = ray.get(replica.begin_update.remote(plan, "manual", config))
    for ref in trainer.stream_buckets.options(num_returns="streaming").remote(plan):
        ray.get(replica.load_bucket.remote("manual", version, [ref]))
    run_in(replica, double_weight_scale, "model.layers.1.mlp.down_proj")
    wrong = r"differ from what the sync sent, in 1 place\(s\): model\.layers\.1\.mlp\.down_proj\.weight_scale"
    with pytest.raises(refit.VerificationError, match=wrong):
        ray.get(replica.finish_update.remote("manual", version))
    ray.get(replica.abort_update.remote("manual", "test"))
    assert_refusing(replica)


def test_the_probe_catches_what_integrity_tags_cannot_and_fails_or_flags_as_configured(broken):
    """A trainer that sends layer 1's MLP under layer 0's names: every byte arrives as sent, yet the model is wrong."""
    trainer, flagged = tampering(broken, "swap")
    report = refit.Syncer(trainer, flagged, PROBE).sync()
    assert report.probe_breached and "probe BREACHED" in report.replicas[0].verification
    assert "integrity tags" in report.replicas[0].verification  # the other checks passed: the bytes are what was sent
    assert ray.get(flagged.status.remote()).phase is Phase.SERVING  # flagged, not failed

    failing = flagged
    with pytest.raises(refit.VerificationError, match="the logprob probe after the refit failed: probe BREACHED"):
        refit.Syncer(trainer, failing, refit.SyncConfig(verify="probe")).sync()
    assert_refusing(failing)
