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
from tests.support.actors import greedy_gaps, keep_vllm_warnings, kept_vllm_warnings, prompt_logprobs, run_in, snapshot_weights

PROMPTS = make_prompts(16, PROMPT_LEN, seed=11)
TIE_NATS = 0.05
"""How far below the trainer's best token a rollout's greedy token may be: HF and vLLM round bf16 differently, and
these barely trained models (random weights plus a few steps) repeat tokens with near-tied logits."""


def changed_trainer(actors_factory, tied: bool, *, node: int = 0, steps: int = 3):
    trainer = actors_factory.trainer(model_dir(tied, "bf16"), node=node, reinitialize=True, seed=5, lr=3e-3)
    for step in range(steps):
        ray.get(trainer.train_step.remote(make_sequences(8, 16, seed=step).tolist()))
    return trainer


def assert_greedy_under_the_trainer(trainer, version: int, token_ids: list[list[int]]) -> None:
    """Every token the rollout generated is the trainer's greedy choice at its step, up to a bf16 tie."""
    run_in(trainer, snapshot_weights, version)
    sequences = [list(prompt) + list(tokens) for prompt, tokens in zip(PROMPTS, token_ids)]
    gaps = run_in(trainer, greedy_gaps, version, sequences, PROMPT_LEN)
    assert max(gaps) < TIE_NATS, gaps


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
    # transport="auto" (the default): the trainer and a replica on one host (two Ray nodes of this machine) map memory.
    assert (report.transport, report.transport_reason) == ("shm", "every member runs on one host and can take it "
                                                           "(the replicas' workers are on cpu)")
    out = ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, prompt_logprobs=True))
    assert_greedy_under_the_trainer(trainer, report.version, out.token_ids)
    reference = run_in(trainer, prompt_logprobs, PROMPTS)
    assert max_abs_diff([row[1:] for row in out.prompt_logprobs], reference) < 1e-2


# FP8_BLOCK replicas on two nodes against a fresh engine on the same weights, over
# both transports: tests/sync/test_transports.py. Tensor parallelism 2, each worker a process of its
# own, over both transports: tests/provenance/test_kv_scales_e2e.py.


def test_a_sync_prints_none_of_vllms_benign_warnings(actors_factory, shared_replicas):
    """Each layerwise reload used to log "RotaryEmbedding: Failed to load weights" (and a first generate the EOS id
    notice) through Ray into the driver; refit's rollout actors drop those and let every other warning through."""
    trainer = changed_trainer(actors_factory, True, steps=1)
    rollout = shared_replicas[0]
    run_in(rollout, keep_vllm_warnings)
    for _ in range(2):
        refit.sync(trainer, rollout)
    ray.get(rollout.generate.remote(PROMPTS[:1], 2))
    kept = run_in(rollout, kept_vllm_warnings, "QKVParallelLinear")
    assert kept[-1] == "QKVParallelLinear: Failed to load weights", kept  # a real layer's failure still shows
    assert not [m for m in kept if "RotaryEmbedding" in m or "EOS token id" in m or "Triton" in m
                or "set_num_threads" in m], kept
