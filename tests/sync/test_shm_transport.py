"""The shm transport on real Ray and vLLM: picked by default on one host, into every engine layout, bit for bit.

Two Ray nodes of this machine are one host (one kernel boot, PID namespace
and user), so `transport="auto"` maps the trainer's memory files into the
workers: in the rollout actor's process (replica 0) and in an engine core's
process of its own (replica 1, VLLM_ENABLE_V1_MULTIPROCESSING=1, which the
object store cannot reach). A file rewritten before a worker read it is
refused by name, and every replica serves on, the one whose worker is in
another process too.
"""

from __future__ import annotations

import threading
import time

import pytest
import ray

import refit
from fixtures import model_dir
from refit import Phase
from tests.support.actors import buckets_loaded, engine_state, redraw, run_in
from tests.support.checkpoints import write_variant
from tests.support.faults import slow_loading
from tests.support.serving import PROMPTS, assert_serves, status, tokens
from tests.support.shm_faults import rewrite_before_reading

SMALL = {"bucket_bytes": 256 << 10, "timeout_s": 60}  # ~10 buckets a sync: the ring of 6 files wraps


@pytest.fixture(scope="module")
def setup(module_actors, shared_replicas):
    trainer = module_actors.trainer(model_dir(True, "bf16"), node=0, reinitialize=True, seed=17)
    own_process = module_actors.rollout(model_dir(True, "fp8_block"), node=2, load_format="dummy",
                                        kv_cache_dtype="fp8_e4m3", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    return trainer, shared_replicas[0], own_process


def test_auto_maps_shared_memory_on_one_host_bit_for_bit_into_every_engine_layout(setup):
    trainer, in_process, own_process = setup
    with refit.Syncer(trainer, [in_process, own_process], refit.SyncConfig(**SMALL)) as syncer:
        report = syncer.sync()
    assert (report.transport, syncer.transport) == ("shm", "shm")
    assert report.transport_reason == "every member runs on one host and can take it (the replicas' workers are on cpu)"
    assert report.buckets >= 8 and [r.mode for r in report.replicas] == ["full", "full"]  # no deltas over shm
    assert [r.served_version for r in report.replicas] == [report.version] * 2
    assert_serves([in_process, own_process], trainer, report.version)
    over_shm = run_in(in_process, engine_state)

    # The same trainer state over the object store: every FP8 code and scale the same.
    refit.sync(trainer, in_process, refit.SyncConfig(transport="ray", delta="off", **SMALL))
    assert run_in(in_process, engine_state) == over_shm

    # A second sync reuses the trainer's files (the workers keep their mappings) and still serves the trainer's model.
    ray.get(trainer.train_step.remote([[(7 * i + s) % 512 for i in range(16)] for s in range(4)]), timeout=120)
    with refit.Syncer(trainer, [in_process, own_process], refit.SyncConfig(**SMALL)) as syncer:
        again = syncer.sync()
    assert again.transport == "shm" and [r.served_version for r in again.replicas] == [again.version] * 2
    assert_serves([in_process, own_process], trainer, again.version)


def test_a_file_rewritten_before_a_worker_read_it_is_refused_by_name_and_the_next_sync_heals(setup):
    trainer, in_process, own_process = setup
    replicas = [in_process, own_process]
    with refit.Syncer(trainer, replicas, refit.SyncConfig(transport="shm", **SMALL)) as syncer:
        served = syncer.sync()
        before = tokens(in_process, PROMPTS[:8])
        run_in(trainer, rewrite_before_reading)
        with pytest.raises(refit.RefitError, match=r"shared memory was rewritten \(it holds the trainer's bucket #\d+"):
            syncer.sync()
        # Refused before a byte was loaded, so both replicas serve on: the one whose worker runs in another process
        # too, whose error crossed vLLM's RPC as data with its type (`refit_typed_call`).
        for replica in replicas:
            kept = status(replica)
            assert (kept.phase, kept.served_version) == (Phase.SERVING, served.version)
        assert tokens(in_process, PROMPTS[:8]) == before
        assert_serves([own_process], trainer, served.version)
        healed = syncer.sync()  # the next, honest stream
    assert [r.served_version for r in healed.replicas] == [healed.version] * 2
    assert_serves(replicas, trainer, healed.version)


def test_a_padded_vocabulary_held_until_finalize_is_copied_out_of_buffers_the_transport_reuses(actors_factory, tmp_path):
    """vLLM pads a vocabulary of 509 to 512 rows, so the reload keeps the embedding's tensor until `finalize`, long
    after its bucket's file (or collective buffer) took later buckets: it must have been copied out."""
    bf16, fp8 = write_variant(model_dir(False, "bf16"), tmp_path, seed=3, vocab_size=509)
    trainer = actors_factory.trainer(bf16, node=0)
    replica = actors_factory.rollout(fp8, node=1, load_format="dummy", kv_cache_dtype="fp8_e4m3")
    run_in(trainer, redraw, 3)
    refit.sync(trainer, replica, refit.SyncConfig(transport="ray", delta="off", **SMALL))
    expected = run_in(replica, engine_state)
    for transport in ("shm", "collective"):
        run_in(trainer, redraw, 5)  # another model, so that a stale embedding could not pass for the right one
        refit.sync(trainer, replica, refit.SyncConfig(transport="ray", delta="off", **SMALL))
        changed = run_in(replica, engine_state)
        assert changed["model.embed_tokens.weight"] != expected["model.embed_tokens.weight"]
        run_in(trainer, redraw, 3)
        report = refit.sync(trainer, replica, refit.SyncConfig(transport=transport, delta="off", **SMALL))
        assert report.transport == transport and report.buckets > 6  # more buckets than the ring of files
        assert run_in(replica, engine_state) == expected, transport


def test_two_syncers_streaming_from_one_trainer_at_once_each_serve_their_sync(actors_factory, shared_replicas):
    """Found by two Syncers of one trainer, one replica each, syncing at once: the trainer streams one sync after the
    other, and the second stream began as soon as the first had handed out its last bucket, while the first sync's
    slower replica still loaded its last buckets; the second stream's buckets went round the ring into their files,
    so that replica refused bucket 18 ("shared memory was rewritten (it holds the trainer's bucket #73, not #57)")
    and was left refusing. A stream over shm now ends only once its sync has loaded every bucket."""
    trainer = actors_factory.trainer(model_dir(True, "bf16"), node=0, reinitialize=True, seed=29)
    slow, fast = shared_replicas
    config = refit.SyncConfig(bucket_bytes=16 << 10, max_buckets_in_flight=1, timeout_s=60)  # ~20 buckets, 4 files
    syncers = [refit.Syncer(trainer, [replica], config) for replica in (slow, fast)]
    for syncer in syncers:
        syncer.sync()
    run_in(trainer, redraw, 30)
    outcomes: list = [None, None]

    def run(i: int) -> None:
        try:
            outcomes[i] = syncers[i].sync()
        except refit.RefitError as error:
            outcomes[i] = error

    run_in(slow, slow_loading, 0.5)
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        threads[0].start()
        while run_in(slow, buckets_loaded) < 1 and threads[0].is_alive():  # the slow replica's sync streams first
            time.sleep(0.02)
        threads[1].start()
        for thread in threads:
            thread.join(300)
    finally:
        run_in(slow, slow_loading, None)
    assert all(isinstance(o, refit.SyncReport) for o in outcomes), outcomes
    assert [o.transport for o in outcomes] == ["shm", "shm"]
    assert_serves([slow, fast], trainer)
