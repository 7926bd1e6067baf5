"""The `collective` and `shm` transports on real Ray and vLLM: the model a fresh engine serves, into any engine layout.

Replica 0 runs vLLM's engine core in its own actor's process (as the `ray`
transport needs); replica 1 runs it in a process of its own
(VLLM_ENABLE_V1_MULTIPROCESSING=1), so only a transport that bypasses vLLM's
RPC for the bytes can reach it. Both are FP8_BLOCK, dummy-loaded, with an
FP8 KV cache, on two nodes, synced from a tied-embedding trainer on a third.
The two transports share the module's replicas: an engine whose core has a
process of its own is three processes on a CPU, each importing vLLM.

Two Ray nodes of this machine are one host (one kernel boot, PID namespace
and user), so `transport="auto"` maps the trainer's memory files into the
workers of both replicas (`shm`); a file rewritten before a worker read it
is refused by name, and every replica serves on, the one whose worker is in
another process too. (Two tensor-parallel workers in their own processes,
over both transports: test_kv_scales_e2e.py, in bf16, since the fixture's
128-row k/v cannot split into 128-row FP8 blocks over two ranks.)
"""

from __future__ import annotations

import threading
import time

import pytest
import ray

import refit
from fixtures import NEW_TOKENS, PROMPT_LEN, make_prompts, make_sequences, model_dir
from refit import Phase
from refit.orchestration.calls import first_claim
from refit.transport.collective import Rendezvous, RendezvousHost
from tests.support import serving
from tests.support.actors import buckets_loaded, engine_state, node_id, redraw, run_in, save, started
from tests.support.checkpoints import write_fp8_block_checkpoint, write_variant
from tests.support.faults import kill_during_syncs, slow_loading
from tests.support.shm_faults import rewrite_before_reading

PROMPTS = make_prompts(16, PROMPT_LEN, seed=13)
# Small buckets: ~10 per sync, so layers straddle buckets and the workers' two buffers are reused.
COLLECTIVE = refit.SyncConfig(transport="collective", bucket_bytes=128 << 10, timeout_s=60)
SHM_SMALL = {"bucket_bytes": 256 << 10, "timeout_s": 60}  # ~10 buckets a sync: the ring of 6 files wraps


@pytest.fixture(scope="module")
def setup(module_actors, shared_replicas):
    """Replica 0 is the session's shared replica on node 1 (the same engine layout): one engine start saved."""
    trainer = module_actors.trainer(model_dir(True, "bf16"), node=0, reinitialize=True, seed=5, lr=3e-3)
    for step in range(3):
        ray.get(trainer.train_step.remote(make_sequences(8, 16, seed=step).tolist()))
    own_process = module_actors.rollout(
        model_dir(True, "fp8_block"), node=2, load_format="dummy", kv_cache_dtype="fp8_e4m3",
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )
    return trainer, shared_replicas[0], own_process


def served(replica):
    return ray.get(started(replica).generate.remote(PROMPTS, NEW_TOKENS, prompt_logprobs=True), timeout=120)


def max_abs_diff(a, b) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b) if x is not None)


def test_both_transports_serve_what_a_fresh_engine_on_the_same_weights_serves_in_every_engine_layout(setup, actors_factory, tmp_path):
    """Tied embeddings, dummy load, FP8 KV cache: the seed's whole setup, healed by one sync, over either transport."""
    trainer, in_process, own_process = setup
    run_in(trainer, save, str(tmp_path / "bf16"))
    fresh_dir = write_fp8_block_checkpoint(tmp_path / "bf16", tmp_path / "fp8", like=model_dir(True, "fp8_block"))
    fresh = actors_factory.rollout(fresh_dir, node=1, kv_cache_dtype="fp8_e4m3")
    expected = served(fresh)

    report = refit.sync(trainer, in_process)  # the object store
    node_of = {i: n["NodeID"] for n in ray.nodes() if n["Alive"] for i in range(3) if f"node{i}" in n["Resources"]}
    assert len(set(node_of.values())) == 3 and run_in(trainer, node_id) == node_of[0]
    assert report.replicas[0].node_id == node_of[1]
    assert report.bytes_on_wire < 0.7 * sum(t.source_bytes for t in refit.Syncer(trainer, in_process).plan().tensors)
    assert_serves_as_fresh(in_process, expected)

    with refit.Syncer(trainer, [in_process, own_process], COLLECTIVE) as syncer:
        report = syncer.sync()
        assert report.buckets >= 8 and [r.served_version for r in report.replicas] == [report.version] * 2
        assert report.replicas[1].node_id == node_of[2]
        for replica in (in_process, own_process):
            assert_serves_as_fresh(replica, expected)
        group = ray.get(in_process.transport_group.remote())
        assert group is not None and ray.get(own_process.transport_group.remote()) == group
        assert syncer.sync().version == report.version + 1
        assert ray.get(own_process.transport_group.remote()) == group  # the group is kept

    # Quantizing in the rollout process instead (bf16 on the wire) delivers the same bits, over both transports.
    for replicas, transport in (([in_process], "ray"), ([in_process, own_process], "collective")):
        report = refit.sync(trainer, replicas, refit.SyncConfig(transport=transport, quantize_on="rollout", timeout_s=60))
        assert report.bytes_on_wire == sum(t.source_bytes for t in refit.Syncer(trainer, in_process).plan().tensors)
        for replica in replicas:
            assert_serves_as_fresh(replica, expected)
    assert ray.get(own_process.transport_group.remote()) is None  # sync() closed its Syncer's group


def assert_serves_as_fresh(replica, expected) -> None:
    got = served(replica)
    assert got.token_ids == expected.token_ids
    assert max_abs_diff(got.logprobs, expected.logprobs) < 1e-5
    assert max_abs_diff(got.prompt_logprobs, expected.prompt_logprobs) < 1e-5


def test_a_group_is_made_again_when_its_replicas_change(setup):
    trainer, in_process, own_process = setup
    both = refit.Syncer(trainer, [in_process, own_process], COLLECTIVE)
    both.sync()
    alone = refit.Syncer(trainer, [own_process], COLLECTIVE)
    alone.sync()  # own_process leaves the first group for this one
    assert both.sync().replicas[1].served_version == ray.get(own_process.status.remote()).served_version
    assert ray.get(in_process.transport_group.remote()) == ray.get(own_process.transport_group.remote())
    for syncer in (both, alone):
        syncer.close()


def test_the_ray_transport_into_a_separate_engine_core_is_refused_and_the_replica_keeps_serving(setup):
    trainer, _, own_process = setup
    before = ray.get(own_process.status.remote())
    with pytest.raises(refit.ConfigError, match=r"transport='ray' .*\(VLLM_ENABLE_V1_MULTIPROCESSING=1\).*transport='collective'"):
        refit.sync(trainer, own_process, refit.SyncConfig(transport="ray"))  # the default, "auto", picks collective
    assert ray.get(own_process.status.remote()) == before


def test_an_unreachable_rendezvous_is_named_and_the_replica_keeps_serving(setup):
    _, in_process, _ = setup
    before = ray.get(in_process.status.remote())
    nowhere = Rendezvous("127.0.0.1", 1, "nowhere", ("the trainer", "rollout 0 worker 0"), timeout_s=2)
    with pytest.raises(refit.TransportError, match="cannot reach the rendezvous .* at 127.0.0.1:1"):
        ray.get(in_process.join_transport.remote(nowhere, 1), timeout=60)
    assert ray.get(in_process.status.remote()) == before
    assert before.phase is Phase.SERVING and served(in_process).token_ids


def test_a_worker_that_never_joins_fails_the_others_in_time_naming_it(setup):
    trainer, in_process, _ = setup
    before = ray.get(in_process.status.remote())
    host = RendezvousHost(["the trainer", "rollout 0 worker 0", "rollout 1 worker 0"], timeout_s=4)
    joins = [trainer.join_transport.remote(host.rendezvous, 0), in_process.join_transport.remote(host.rendezvous, 1)]
    for join in joins:  # rollout 1 never comes
        with pytest.raises(refit.SyncTimeoutError, match=r"rollout 1 worker 0 did not join within 4 s"):
            ray.get(join, timeout=60)
    host.close()
    assert ray.get(in_process.status.remote()) == before and served(in_process).token_ids
    assert refit.sync(trainer, in_process, COLLECTIVE).replicas[0].served_version > before.served_version


def test_ipc_on_cpu_machines_is_refused_and_the_replica_keeps_serving(setup):
    trainer, in_process, _ = setup
    before = ray.get(in_process.status.remote())
    with pytest.raises(refit.TransportError, match="transport='ipc' needs CUDA"):
        refit.sync(trainer, in_process, refit.SyncConfig(transport="ipc"))
    assert ray.get(in_process.status.remote()) == before


def test_two_collective_syncers_at_once_one_wins_and_the_other_fails_by_name(setup):
    import threading

    trainer, in_process, own_process = setup
    quick = refit.SyncConfig(transport="collective", timeout_s=8)
    outcomes: list = []

    def run() -> None:
        try:
            outcomes.append(refit.sync(trainer, [in_process, own_process], quick).version)
        except refit.RefitError as error:
            outcomes.append(error)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    versions = [o for o in outcomes if isinstance(o, int)]
    assert len(outcomes) == 2 and len(versions) >= 1, outcomes
    assert len(set(versions)) == len(versions)  # never one version for two syncs
    for replica in (in_process, own_process):
        assert ray.get(replica.status.remote()).phase in (Phase.SERVING, Phase.REFUSING)
    assert refit.sync(trainer, [in_process, own_process], COLLECTIVE).replicas[0].served_version > max(versions)


def test_workers_told_to_leave_another_group_than_theirs_stay_in_theirs(setup):
    """Found by review: a `vllm serve` server's workers outlive the replica that joined them to a group, and the
    clean-up of a replica the server was taken over from took them out of whichever group they were in, the new
    replica's (the workers kept no group id), so its next sync found no receivers. A worker now leaves only the
    group it is told to (or any when told none)."""
    trainer, in_process, own_process = setup
    with refit.Syncer(trainer, [in_process, own_process], COLLECTIVE) as syncer:
        syncer.sync()
        group = ray.get(own_process.transport_group.remote())
        for replica in (in_process, own_process):  # what the clean-up of a replica taken over from sends
            run_in(replica, lambda actor: actor.replica.workers.leave_group("a group of an earlier replica"))
        report = syncer.sync()  # over the group the workers kept
        assert [r.served_version for r in report.replicas] == [report.version] * 2
        assert ray.get(own_process.transport_group.remote()) == group


def test_a_sync_refused_at_its_first_claim_leaves_the_group_another_syncer_formed_since_alone(setup):
    """Found: two Syncers racing on one fleet over `collective`; the loser's clean-up made the trainer and every
    worker leave whichever group they were in, the winner's, mid-sync, so the winner failed too ("this trainer is
    in no group"). A failed sync now leaves only the group its own Syncer formed."""
    trainer, in_process, own_process = setup
    replicas = [in_process, own_process]
    earlier, later = refit.Syncer(trainer, replicas, COLLECTIVE), refit.Syncer(trainer, replicas, COLLECTIVE)
    earlier.sync()
    later.sync()  # every member leaves the earlier Syncer's group for this one's
    members = [trainer, *replicas]
    group = ray.get(trainer.transport_group.remote())
    assert [ray.get(m.transport_group.remote()) for m in members] == [group] * 3
    # A rival holds the replica every Syncer claims first, as the later Syncer's next sync would while it streams.
    claimed = first_claim([(str(i), r) for i, r in enumerate(replicas)])[1]
    ray.get(claimed.begin_update.remote(later.plan(), "rival", COLLECTIVE), timeout=120)
    try:
        with pytest.raises(refit.LifecycleError, match=r"another sync \(rival\)"):
            earlier.sync()
        assert [ray.get(m.transport_group.remote()) for m in members] == [group] * 3
    finally:
        ray.get(claimed.abort_update.remote("rival", "the test's rival gives up"), timeout=120)
    report = later.sync()  # in its group still: nothing to form again
    assert [r.served_version for r in report.replicas] == [report.version] * 2
    assert [ray.get(m.transport_group.remote()) for m in members] == [group] * 3
    for syncer in (earlier, later):
        syncer.close()


def test_auto_maps_shared_memory_on_one_host_bit_for_bit_into_every_engine_layout(setup):
    trainer, in_process, own_process = setup
    with refit.Syncer(trainer, [in_process, own_process], refit.SyncConfig(**SHM_SMALL)) as syncer:
        report = syncer.sync()
    assert (report.transport, syncer.transport) == ("shm", "shm")
    assert report.transport_reason == "every member runs on one host and can take it (the replicas' workers are on cpu)"
    assert report.buckets >= 8 and [r.mode for r in report.replicas] == ["full", "full"]  # no deltas over shm
    assert [r.served_version for r in report.replicas] == [report.version] * 2
    serving.assert_serves([in_process, own_process], trainer, report.version)
    over_shm = run_in(in_process, engine_state)

    # The same trainer state over the object store: every FP8 code and scale the same.
    refit.sync(trainer, in_process, refit.SyncConfig(transport="ray", delta="off", **SHM_SMALL))
    assert run_in(in_process, engine_state) == over_shm

    # A second sync reuses the trainer's files (the workers keep their mappings) and still serves the trainer's model.
    ray.get(trainer.train_step.remote([[(7 * i + s) % 512 for i in range(16)] for s in range(4)]), timeout=120)
    with refit.Syncer(trainer, [in_process, own_process], refit.SyncConfig(**SHM_SMALL)) as syncer:
        again = syncer.sync()
    assert again.transport == "shm" and [r.served_version for r in again.replicas] == [again.version] * 2
    serving.assert_serves([in_process, own_process], trainer, again.version)


def test_a_file_rewritten_before_a_worker_read_it_is_refused_by_name_and_the_next_sync_heals(setup):
    trainer, in_process, own_process = setup
    replicas = [in_process, own_process]
    with refit.Syncer(trainer, replicas, refit.SyncConfig(transport="shm", **SHM_SMALL)) as syncer:
        first = syncer.sync()
        before = serving.tokens(in_process, serving.PROMPTS[:8])
        run_in(trainer, rewrite_before_reading)
        with pytest.raises(refit.RefitError, match=r"shared memory was rewritten \(it holds the trainer's bucket #\d+"):
            syncer.sync()
        # Refused before a byte was loaded, so both replicas serve on: the one whose worker runs in another process
        # too, whose error crossed vLLM's RPC as data with its type (`refit_typed_call`).
        for replica in replicas:
            kept = serving.status(replica)
            assert (kept.phase, kept.served_version) == (Phase.SERVING, first.version)
        assert serving.tokens(in_process, serving.PROMPTS[:8]) == before
        serving.assert_serves([own_process], trainer, first.version)
        healed = syncer.sync()  # the next, honest stream
    assert [r.served_version for r in healed.replicas] == [healed.version] * 2
    serving.assert_serves(replicas, trainer, healed.version)


def test_a_padded_vocabulary_held_until_finalize_is_copied_out_of_buffers_the_transport_reuses(actors_factory, tmp_path):
    """vLLM pads a vocabulary of 509 to 512 rows, so the reload keeps the embedding's tensor until `finalize`, long
    after its bucket's file (or collective buffer) took later buckets: it must have been copied out."""
    bf16, fp8 = write_variant(model_dir(False, "bf16"), tmp_path, seed=3, vocab_size=509)
    trainer = actors_factory.trainer(bf16, node=0)
    replica = actors_factory.rollout(fp8, node=1, load_format="dummy", kv_cache_dtype="fp8_e4m3")
    run_in(trainer, redraw, 3)
    refit.sync(trainer, replica, refit.SyncConfig(transport="ray", delta="off", **SHM_SMALL))
    expected = run_in(replica, engine_state)
    for transport in ("shm", "collective"):
        run_in(trainer, redraw, 5)  # another model, so that a stale embedding could not pass for the right one
        refit.sync(trainer, replica, refit.SyncConfig(transport="ray", delta="off", **SHM_SMALL))
        changed = run_in(replica, engine_state)
        assert changed["model.embed_tokens.weight"] != expected["model.embed_tokens.weight"]
        run_in(trainer, redraw, 3)
        report = refit.sync(trainer, replica, refit.SyncConfig(transport=transport, delta="off", **SHM_SMALL))
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
    serving.assert_serves([slow, fast], trainer)


def kill_mid_broadcast(sync_trainer, replicas, victim, match: str) -> None:
    """Kill `victim` during back-to-back collective syncs of small buckets; the sync fails naming `match`."""
    ray.get([r.status.remote() for r in replicas], timeout=120)  # started: the deadline below is short
    small = refit.SyncConfig(transport="collective", bucket_bytes=32 << 10, max_buckets_in_flight=1, timeout_s=10,
                             min_replicas=len(replicas))  # any loss fails the sync (a fleet's drops: tests/sync/test_fleet.py)
    syncer = refit.Syncer(sync_trainer, replicas, small)
    syncer.sync()
    kill_during_syncs(syncer, victim, after_s=0.2, error=refit.ActorDiedError, match=match)


def assert_recovers(trainer, replicas) -> None:
    """Whole or refusing after the failure, never half-served; the next sync makes a new group and serves."""
    for replica in replicas:
        assert ray.get(replica.status.remote(), timeout=60).phase in (Phase.SERVING, Phase.REFUSING)
    report = refit.sync(trainer, replicas, COLLECTIVE)
    assert [r.served_version for r in report.replicas] == [report.version] * len(replicas)
    assert len({tuple(map(tuple, served(r).token_ids)) for r in replicas}) == 1


def test_a_trainer_killed_mid_broadcast_fails_the_sync_by_name_and_a_new_group_recovers(setup, actors_factory):
    trainer, in_process, own_process = setup
    doomed = actors_factory.trainer(model_dir(True, "bf16"), node=0, reinitialize=True, seed=9)
    kill_mid_broadcast(doomed, [in_process, own_process], doomed, "the trainer died or is unreachable")
    assert_recovers(trainer, [in_process, own_process])


def test_a_replica_killed_mid_broadcast_fails_the_sync_by_name_and_the_others_recover(setup, actors_factory):
    """The survivors see the broken group first; the error names the replica that died, not the echo."""
    trainer, in_process, own_process = setup
    doomed = actors_factory.rollout(model_dir(True, "fp8_block"), node=1, load_format="dummy", kv_cache_dtype="fp8_e4m3")
    kill_mid_broadcast(trainer, [in_process, own_process, doomed], doomed, "rollout 2 died or is unreachable")
    assert_recovers(trainer, [in_process, own_process])
