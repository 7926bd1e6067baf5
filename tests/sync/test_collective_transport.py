"""The collective transport on real Ray and vLLM: the same model as the `ray` transport, into any engine layout.

Replica 0 runs vLLM's engine core in its own actor's process (as the `ray`
transport needs); replica 1 runs it in a process of its own
(VLLM_ENABLE_V1_MULTIPROCESSING=1), so only a transport that bypasses vLLM's
RPC for the bytes can reach it. Both are FP8_BLOCK, dummy-loaded, with an
FP8 KV cache, on two nodes, synced from a tied-embedding trainer on a third.
(Tensor-parallel workers in their own processes: the AsyncLLM rollout's
tests, in bf16, since the fixture's 128-row k/v cannot split into 128-row
FP8 blocks over two ranks.)
"""

from __future__ import annotations

import pytest
import ray

import refit
from fixtures import NEW_TOKENS, PROMPT_LEN, make_prompts, make_sequences, model_dir
from refit import Phase
from refit.transport.collective import Rendezvous
from tests.support.actors import hold_update_lock

PROMPTS = make_prompts(16, PROMPT_LEN, seed=13)
# Small buckets: ~10 per sync, so layers straddle buckets and the workers' two buffers are reused.
COLLECTIVE = refit.SyncConfig(transport="collective", bucket_bytes=128 << 10, timeout_s=60)


@pytest.fixture(scope="module")
def setup(module_actors):
    trainer = module_actors.trainer(model_dir(True, "bf16"), node=0, reinitialize=True, seed=5, lr=3e-3)
    for step in range(3):
        ray.get(trainer.train_step.remote(make_sequences(8, 16, seed=step).tolist()))
    fp8 = {"load_format": "dummy", "kv_cache_dtype": "fp8_e4m3"}
    in_process = module_actors.rollout(model_dir(True, "fp8_block"), node=1, **fp8)
    own_process = module_actors.rollout(
        model_dir(True, "fp8_block"), node=2, **fp8, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )
    return trainer, in_process, own_process


def served(replica):
    return ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS, prompt_logprobs=True), timeout=120)


def max_abs_diff(a, b) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b) if x is not None)


def test_collective_serves_what_the_ray_transport_serves_in_every_engine_layout(setup):
    trainer, in_process, own_process = setup
    refit.sync(trainer, in_process)
    expected = served(in_process)

    with refit.Syncer(trainer, [in_process, own_process], COLLECTIVE) as syncer:
        report = syncer.sync()
        assert report.buckets >= 8 and [r.served_version for r in report.replicas] == [2, 2]
        for replica in (in_process, own_process):
            got = served(replica)
            assert got.token_ids == expected.token_ids
            assert max_abs_diff(got.logprobs, expected.logprobs) < 1e-5
            assert max_abs_diff(got.prompt_logprobs, expected.prompt_logprobs) < 1e-5
        group = ray.get(in_process.transport_group.remote())
        assert group is not None and ray.get(own_process.transport_group.remote()) == group

        # The group is kept between syncs, and bf16 on the wire (quantized by the workers) gives the same bits.
        assert syncer.sync().version == 3 and ray.get(own_process.transport_group.remote()) == group
    rollout_side = refit.SyncConfig(transport="collective", quantize_on="rollout", timeout_s=60)
    refit.sync(trainer, [in_process, own_process], rollout_side)
    assert all(served(r).token_ids == expected.token_ids for r in (in_process, own_process))
    assert ray.get(own_process.transport_group.remote()) is None  # sync() closed its Syncer's group


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
        refit.sync(trainer, own_process)
    assert ray.get(own_process.status.remote()) == before


def test_an_unreachable_rendezvous_is_named_and_the_replica_keeps_serving(setup):
    _, in_process, _ = setup
    before = ray.get(in_process.status.remote())
    nowhere = Rendezvous("127.0.0.1", 1, "nowhere", ("the trainer", "rollout 0 worker 0"), timeout_s=2)
    with pytest.raises(refit.TransportError, match="cannot reach the rendezvous .* at 127.0.0.1:1"):
        ray.get(in_process.join_transport.remote(nowhere, 1), timeout=60)
    assert ray.get(in_process.status.remote()) == before
    assert before.phase is Phase.SERVING and served(in_process).token_ids


def test_a_worker_that_never_joins_fails_the_sync_in_time_naming_it(setup):
    trainer, in_process, own_process = setup
    before = [ray.get(r.status.remote()) for r in (in_process, own_process)]
    ray.get(own_process.__ray_call__.remote(hold_update_lock, 12))  # its join waits behind the lock
    quick = refit.SyncConfig(transport="collective", timeout_s=4)
    with pytest.raises(refit.SyncTimeoutError, match=r"rollout 1 worker 0 did not join within 4 s"):
        refit.sync(trainer, [in_process, own_process], quick)
    assert [ray.get(r.status.remote()) for r in (in_process, own_process)] == before
    # Nothing is left stuck: once the lock is free, a sync over a new group goes through.
    assert refit.sync(trainer, [in_process, own_process], COLLECTIVE).replicas[1].served_version > before[1].served_version


def test_ipc_on_cpu_machines_is_refused_and_the_replica_keeps_serving(setup):
    trainer, in_process, _ = setup
    before = ray.get(in_process.status.remote())
    with pytest.raises(refit.TransportError, match="transport='ipc' needs CUDA"):
        refit.sync(trainer, in_process, refit.SyncConfig(transport="ipc"))
    assert ray.get(in_process.status.remote()) == before
