"""refit.sync end to end: real Ray (3-node local cluster), real vLLM, real fixtures.

Each test starts from a trainer whose weights differ from anything on disk
(random init, then optimizer steps), so a rollout can only produce the
expected tokens if the sync delivered every tensor.
"""

from __future__ import annotations

import pytest
import ray

import refit
from fixtures import NEW_TOKENS, PROMPT_LEN, make_prompts, make_sequences, model_dir
from tests.support.actors import node_id, prompt_logprobs, run_in, save
from tests.support.checkpoints import write_fp8_block_checkpoint

PROMPTS = make_prompts(16, PROMPT_LEN, seed=11)


def changed_trainer(actors_factory, tied: bool, *, node: int = 0, steps: int = 3):
    trainer = actors_factory.trainer(model_dir(tied, "bf16"), node=node, reinitialize=True, seed=5, lr=3e-3)
    for step in range(steps):
        ray.get(trainer.train_step.remote(make_sequences(8, 16, seed=step).tolist()))
    return trainer


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


@pytest.mark.parametrize(
    "tied, load_format", [(True, "dummy"), (False, "auto")], ids=["tied-dummy", "untied-checkpoint"]
)
def test_bf16_rollout_serves_the_trainers_model(actors_factory, tied, load_format):
    trainer = changed_trainer(actors_factory, tied)
    rollout = actors_factory.rollout(model_dir(tied, "bf16"), load_format=load_format)

    report = refit.sync(trainer, rollout)

    assert report.version == 1 and report.replicas[0].served_version == 1
    out = ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, prompt_logprobs=True))
    assert out.token_ids == ray.get(trainer.generate.remote(PROMPTS, NEW_TOKENS))
    reference = run_in(trainer, prompt_logprobs, PROMPTS)
    assert max_abs_diff([row[1:] for row in out.prompt_logprobs], reference) < 1e-2


def test_fp8_replicas_on_two_nodes_match_a_fresh_engine_on_the_same_weights(actors_factory, tmp_path):
    """Tied embeddings, dummy load, FP8 KV cache: the seed's whole setup, healed by one sync."""
    trainer = changed_trainer(actors_factory, tied=True, node=0)
    replicas = [
        actors_factory.rollout(model_dir(True, "fp8_block"), node=n, load_format="dummy", kv_cache_dtype="fp8_e4m3")
        for n in (1, 2)
    ]

    report = refit.Syncer(trainer, replicas).sync()

    node_of = {i: n["NodeID"] for n in ray.nodes() if n["Alive"] for i in range(3) if f"node{i}" in n["Resources"]}
    assert len(set(node_of.values())) == 3
    assert run_in(trainer, node_id) == node_of[0]
    assert [r.node_id for r in report.replicas] == [node_of[1], node_of[2]]
    assert all(r.served_version == 1 for r in report.replicas)
    assert report.bytes_on_wire < 0.7 * sum(t.source_bytes for t in refit.Syncer(trainer, replicas).plan().tensors)

    run_in(trainer, save, str(tmp_path / "bf16"))
    fresh_dir = write_fp8_block_checkpoint(tmp_path / "bf16", tmp_path / "fp8", like=model_dir(True, "fp8_block"))
    fresh = actors_factory.rollout(fresh_dir, node=1, kv_cache_dtype="fp8_e4m3")
    expected = ray.get(fresh.generate.remote(PROMPTS, NEW_TOKENS, prompt_logprobs=True))
    assert_serves(replicas, expected)

    # Quantizing in the rollout process instead (bf16 on the wire) delivers the same bits.
    report = refit.Syncer(trainer, replicas, refit.SyncConfig(quantize_on="rollout")).sync()
    assert report.version == 2
    assert report.bytes_on_wire == sum(t.source_bytes for t in refit.Syncer(trainer, replicas).plan().tensors)
    assert_serves(replicas, expected)


def assert_serves(replicas, expected) -> None:
    for replica in replicas:
        got = ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS, prompt_logprobs=True))
        assert got.token_ids == expected.token_ids
        assert max_abs_diff(got.logprobs, expected.logprobs) < 1e-5
        assert max_abs_diff([r[1:] for r in got.prompt_logprobs], [r[1:] for r in expected.prompt_logprobs]) < 1e-5


def test_tensor_parallel_engine_with_worker_processes(actors_factory):
    """TP=2: each worker is its own process, reached through the worker extension."""
    trainer = changed_trainer(actors_factory, tied=True)
    rollout = actors_factory.rollout(
        model_dir(True, "bf16"), load_format="dummy", tensor_parallel_size=2,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # one core per worker; vLLM cannot auto-bind 2 on 1 NUMA node
    )
    report = refit.sync(trainer, rollout)
    assert report.replicas[0].served_version == 1
    assert ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS)).token_ids == ray.get(
        trainer.generate.remote(PROMPTS, NEW_TOKENS)
    )
