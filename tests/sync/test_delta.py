"""Delta syncs on real Ray and vLLM: only what changed travels, and the result is the full sync's, byte for byte.

The session's two FP8_BLOCK replicas (dummy-loaded, FP8 KV cache) and a
tied-embedding trainer with fp32 master weights at RL learning rates. The
reference for every delta sync is a full sync of the same trainer state
(`delta="off"`): the replicas must then serve the very same logprobs.
"""

from __future__ import annotations

import _thread
import signal
import threading
import time

import pytest
import ray

import refit
from fixtures import NEW_TOKENS, PROMPT_LEN, make_prompts, make_sequences, model_dir
from tests.support.actors import alter_delta_base, buckets_loaded, hold_update_lock, run_in, set_parameter

PROMPTS = make_prompts(16, PROMPT_LEN, seed=17)
# Over `ray`: on one host `transport="auto"` maps shared memory, which sends no deltas (it has no wire to save).
SMALL = refit.SyncConfig(transport="ray", bucket_bytes=256 << 10, timeout_s=60)  # several buckets: "both" interleaves


def serve(replica):
    return ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS, prompt_logprobs=True), timeout=120)


def same_output(a, b) -> bool:
    """Identical tokens and logprobs (difference 0.0): the engines hold the same bytes."""
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.prompt_logprobs == b.prompt_logprobs


def step(trainer, seed: int) -> None:
    ray.get(trainer.train_step.remote(make_sequences(8, 16, seed=seed).tolist()), timeout=120)


@pytest.fixture
def trainer(actors_factory):
    trainer = actors_factory.trainer(model_dir(True, "bf16"), node=0, reinitialize=True, seed=3, lr=1e-3)
    for seed in range(3):  # away from the random init, then RL's learning rate
        step(trainer, seed)
    ray.get(trainer.set_learning_rate.remote(1e-5))
    return trainer


def full_sync_of_the_same_state(trainer, replica):
    """What `replica` serves after a full sync of the trainer as it is (a separate Syncer: the fleet's stays as it was)."""
    report = refit.sync(trainer, replica, refit.SyncConfig(bucket_bytes=256 << 10, timeout_s=60, delta="off"))
    assert report.replicas[0].mode == "full" and report.replicas[0].digest is None
    return serve(replica)


def test_a_chain_of_delta_syncs_serves_what_a_full_sync_serves(trainer, shared_replicas):
    first, second = shared_replicas
    syncer = refit.Syncer(trainer, [first, second], SMALL)
    report = syncer.sync()  # neither holds the trainer's last version: whole buckets
    full_bytes = report.replicas[0].bytes_received
    assert [r.mode for r in report.replicas] == ["full", "full"] and report.digest is not None
    assert [r.digest for r in report.replicas] == [report.digest] * 2

    syncer.remove_replica(second)  # it misses the next version: its base goes stale
    for seed in (10, 11):
        step(trainer, seed)
        report = syncer.sync()
        (only,) = report.replicas
        assert only.mode == "delta" and only.digest == report.digest
        assert 0 < only.bytes_received < 0.3 * full_bytes, (only.bytes_received, full_bytes)

    step(trainer, 12)
    rejoined = syncer.add_replica(second)
    report = syncer.sync()  # one stream, whole buckets and deltas: each replica fetches the kind its base allows
    modes = {f"rollout {r.replica}": r.mode for r in report.replicas}
    assert modes == {"rollout 0": "delta", rejoined: "full"} and len({r.digest for r in report.replicas} | {report.digest}) == 1
    by_delta, by_full = serve(first), serve(second)
    assert same_output(by_delta, by_full)
    assert same_output(by_delta, full_sync_of_the_same_state(trainer, first))


def test_a_replica_whose_base_was_altered_is_caught_and_healed_by_a_full_sync_in_the_same_sync(trainer, shared_replicas):
    first, second = shared_replicas
    syncer = refit.Syncer(trainer, [first, second], SMALL)
    syncer.sync()
    step(trainer, 20)
    altered = run_in(first, alter_delta_base)  # tensors altered
    assert ray.get(first.base_digest.remote("ray")) == ray.get(second.base_digest.remote("ray"))  # the digest cannot see it

    report = syncer.sync()

    # The rebuilt tensor's CRC-32 differed from the trainer's: the attempt was abandoned, everyone began again in full.
    assert report.attempts == 2 and [r.mode for r in report.replicas] == ["full", "full"], report.summary()
    assert [r.digest for r in report.replicas] == [report.digest] * 2
    assert same_output(serve(first), serve(second))
    step(trainer, 21)
    assert [r.mode for r in syncer.sync().replicas] == ["delta", "delta"], altered


def test_every_base_that_is_not_the_senders_gets_a_full_sync(trainer, shared_replicas, actors_factory):
    first, _ = shared_replicas
    syncer = refit.Syncer(trainer, first, SMALL)
    syncer.sync()

    # A failed sync (a NaN refused before any byte moved): the replica keeps serving, but its next sync is full.
    name = "model.layers.0.mlp.down_proj.weight"
    good = run_in(trainer, lambda t: t.model.get_parameter(name).detach().clone())
    run_in(trainer, set_parameter, name, good * float("nan"))
    with pytest.raises(refit.InvalidTensorError, match=name):
        syncer.sync()
    run_in(trainer, set_parameter, name, good)
    assert syncer.sync().replicas[0].mode == "full"
    assert syncer.sync().replicas[0].mode == "delta"

    # Another trainer: its own first stream, whatever the replica holds.
    other = actors_factory.trainer(model_dir(True, "bf16"), node=0, reinitialize=True, seed=4)
    assert refit.sync(other, first, SMALL).replicas[0].mode == "full"
    # bf16 on the wire keeps no base on either side.
    config = refit.SyncConfig(transport="ray", bucket_bytes=256 << 10, quantize_on="rollout")
    assert [refit.sync(other, first, config).replicas[0].mode for _ in range(2)] == ["full", "full"]
    assert ray.get(first.base_digest.remote("ray")) is None


def test_over_the_collective_transport_each_worker_rebuilds_the_delta(trainer, shared_replicas):
    first, second = shared_replicas
    config = refit.SyncConfig(transport="collective", bucket_bytes=256 << 10, timeout_s=60)
    with refit.Syncer(trainer, [first, second], config) as syncer:
        full = syncer.sync()
        assert [r.mode for r in full.replicas] == ["full", "full"]
        step(trainer, 30)
        report = syncer.sync()
        assert [r.mode for r in report.replicas] == ["delta", "delta"]
        assert [r.digest for r in report.replicas] == [report.digest] * 2
        assert all(r.bytes_received < 0.3 * full.replicas[0].bytes_received for r in report.replicas)
    by_delta = serve(first)
    assert same_output(by_delta, serve(second))
    assert same_output(by_delta, full_sync_of_the_same_state(trainer, second))


def test_a_delta_sync_interrupted_mid_stream_leaves_no_base_that_could_mix_versions(trainer, shared_replicas):
    """The driver stops once a replica has patched part of its base: that base holds no version any more, so the next
    sync sends whole buckets, and the one after it a delta again, serving what a full sync serves."""
    first, second = shared_replicas
    syncer = refit.Syncer(trainer, [first, second], refit.SyncConfig(transport="ray", bucket_bytes=64 << 10, timeout_s=60))
    syncer.sync()
    step(trainer, 40)
    seen: list[int] = []

    def interrupt_mid_stream() -> None:
        deadline = time.monotonic() + 120
        while run_in(second, buckets_loaded) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        # Holding its update lock stalls the replica's next load and its finish: the sync cannot end before the interrupt.
        run_in(second, hold_update_lock, 3.0)
        seen.append(run_in(second, buckets_loaded))
        _thread.interrupt_main()

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # see test_faults: interrupt_main needs it
    threading.Thread(target=interrupt_mid_stream, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            syncer.sync()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen and seen[0] >= 3, seen  # interrupted with buckets loaded and the update open
    assert ray.get(second.base_digest.remote("ray"), timeout=60) is None

    report = syncer.sync()
    assert report.replicas[1].mode == "full", report.summary()
    step(trainer, 41)
    report = syncer.sync()
    assert [r.mode for r in report.replicas] == ["delta", "delta"], report.summary()
    assert same_output(serve(first), serve(second))
    assert same_output(serve(second), full_sync_of_the_same_state(trainer, first))
