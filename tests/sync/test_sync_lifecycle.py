"""Repeated syncs on one engine, and what happens when a sync goes wrong.

Pins three failure classes: memory growing across refits; bad trainer state
half-applied (a NaN found after some layers were loaded); a replica serving
a half-updated model after a failed sync.
"""

from __future__ import annotations

import pytest
import ray
import torch

import refit
from fixtures import NEW_TOKENS, PROMPT_LEN, make_prompts, make_sequences, model_dir
from refit.errors import InvalidTensorError, PlanMismatchError, ReplicaRefusingError
from refit.transport.integrity import new_sync_key
from tests.support.actors import prompt_logprobs, rss_bytes, run_in, set_parameter

PROMPTS = make_prompts(4, PROMPT_LEN, seed=21)
SYNCS = 20


@pytest.fixture(scope="module")
def rollout(module_actors):
    return module_actors.rollout(model_dir(False, "bf16"))


@pytest.fixture(scope="module")
def trainer(module_actors):
    # Random weights, trained fast: every step's model differs from the last
    # and from the rollout's checkpoint, so a sync that delivered nothing fails.
    return module_actors.trainer(model_dir(False, "bf16"), reinitialize=True, seed=7, lr=3e-3)


def served_logprobs(rollout) -> list[list[float]]:
    return [row[1:] for row in ray.get(rollout.generate.remote(PROMPTS, 1, prompt_logprobs=True)).prompt_logprobs]


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


def mean_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    diffs = [abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b)]
    return sum(diffs) / len(diffs)


def test_twenty_syncs_each_correct_with_flat_memory(trainer, rollout):
    syncer = refit.Syncer(trainer, rollout, refit.SyncConfig(bucket_bytes=1 << 20))
    previous = served_logprobs(rollout)
    for step in range(SYNCS):
        ray.get(trainer.train_step.remote(make_sequences(8, 16, seed=100 + step).tolist()))
        report = syncer.sync()
        assert report.replicas[0].served_version == report.version == step + 1
        served, expected = served_logprobs(rollout), run_in(trainer, prompt_logprobs, PROMPTS)
        # Teacher-forced log-probs: bf16 engine vs bf16 trainer differ by 0.001-0.002
        # on average (measured over 20 syncs); one optimizer step moves them by
        # 0.11-0.39, so each check tells versions apart.
        assert mean_abs_diff(served, expected) < 0.01, f"sync {step + 1} served something else than the trainer's model"
        assert mean_abs_diff(served, previous) > 0.05, f"sync {step + 1} changed nothing"
        previous = served
    assert report.buckets > 1  # several buckets per sync, so a per-bucket leak would add up

    # Memory across syncs alone (generation has its own caches, which grow for
    # ~12 calls with prompt log-probs and then stay flat): after 5 warm-up
    # syncs, 20 more may grow the rollout process by at most 4 syncs' worth of
    # wire bytes (~11 MiB). Keeping one 1 MiB bucket per sync alive would add
    # 20 MiB, keeping a whole sync's tensors 55 MiB.
    rss = []
    for _ in range(25):
        syncer.sync()
        rss.append(run_in(rollout, rss_bytes))
    growth = rss[-1] - rss[4]
    bound = 4 * report.bytes_on_wire
    print(f"rollout RSS over 20 syncs: {[round(r / 2**20, 1) for r in rss[4:]]} MiB")
    assert growth < bound, f"rollout RSS grew {growth / 2**20:.1f} MiB over 20 syncs (bound {bound / 2**20:.1f})"


def test_nan_in_a_weight_is_refused_and_the_served_model_is_untouched(trainer, rollout):
    ray.get(trainer.train_step.remote(make_sequences(8, 16, seed=999).tolist()))  # the trainer moves on ...
    before = served_logprobs(rollout)
    version = ray.get(rollout.status.remote()).served_version
    name = "model.layers.1.mlp.down_proj.weight"
    poisoned = torch.zeros(256, 512, dtype=torch.bfloat16)
    poisoned[3, 7] = float("nan")
    bad = refit.Syncer(trainer, rollout)
    bad.plan()
    run_in(trainer, set_parameter, name, poisoned)

    with pytest.raises(InvalidTensorError, match=name.replace(".", r"\.") + ": holds NaN or Inf"):
        bad.sync()

    assert ray.get(rollout.status.remote()).served_version == version
    assert served_logprobs(rollout) == before  # ... but nothing of it reached the rollout


def test_an_abandoned_update_is_never_served_and_the_next_sync_repairs_it(actors_factory, rollout):
    trainer = actors_factory.trainer(model_dir(False, "bf16"), reinitialize=True, seed=9)
    syncer = refit.Syncer(trainer, rollout, refit.SyncConfig(bucket_bytes=1 << 20))
    plan = syncer.plan().for_sync(new_sync_key())  # a sync by hand makes its own key, as `Syncer` does for each
    first_bucket = next(iter(trainer.stream_buckets.options(num_returns="streaming").remote(plan)))
    version = ray.get(rollout.begin_update.remote(plan, "by-hand", refit.SyncConfig(transport="ray")))
    ray.get(rollout.load_bucket.remote("by-hand", version, [first_bucket]))
    status = ray.get(rollout.abort_update.remote("by-hand", "the test abandons it"))  # what Syncer does on a failure
    assert status.phase is refit.Phase.REFUSING and status.reason == "the test abandons it"

    with pytest.raises(ray.exceptions.RayTaskError, match="refuses to serve: the test abandons it") as error:
        ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS))
    assert isinstance(error.value.as_instanceof_cause(), ReplicaRefusingError)

    syncer.sync()
    assert ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS)).token_ids == ray.get(
        trainer.generate.remote(PROMPTS, NEW_TOKENS)
    )


@ray.remote
class MinimalTrainer:
    """A user's own trainer: only the two documented weight-source methods (plus a reference)."""

    def __init__(self, checkpoint: str) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(4)
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint)).to(torch.bfloat16)

    def weight_metadata(self):
        return refit.describe_weights(self.model)

    def stream_buckets(self, plan):
        yield from refit.produce_buckets(plan, dict(self.model.named_parameters()).__getitem__)

    def reference(self, prompts, n):
        from fixtures import greedy_continuations

        return greedy_continuations(self.model, prompts, n)


def test_any_actor_with_the_weight_source_methods_can_be_synced(actors_factory, rollout):
    trainer = actors_factory.keep(
        MinimalTrainer.options(num_cpus=0, resources={"node0": 0.01}).remote(str(model_dir(False, "bf16")))
    )
    report = refit.sync(trainer, rollout)
    assert report.trainer_seconds is None  # it does not time itself; that is optional
    assert ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS)).token_ids == ray.get(
        trainer.reference.remote(PROMPTS, NEW_TOKENS)
    )


def test_a_trainer_whose_model_differs_from_the_rollouts_is_refused_before_any_byte(actors_factory, rollout, tmp_path):
    """Every reshaped tensor is named by the plan check; the engine never sees a byte and keeps serving."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir(False, "bf16"))
    config.intermediate_size = 384
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "other")
    wrong = actors_factory.trainer(tmp_path / "other")
    before = ray.get(rollout.status.remote())
    served = served_logprobs(rollout)
    with pytest.raises(PlanMismatchError) as error:
        refit.sync(wrong, rollout, refit.SyncConfig(bucket_bytes=1 << 20))
    for layer in range(2):
        for proj, shape in (("gate_proj", "(384, 256)"), ("up_proj", "(384, 256)"), ("down_proj", "(256, 384)")):
            assert f"model.layers.{layer}.mlp.{proj}.weight: shape {shape} from the trainer" in str(error.value)
    assert ray.get(rollout.status.remote()) == before
    assert served_logprobs(rollout) == served

    good = actors_factory.trainer(model_dir(False, "bf16"), reinitialize=True, seed=12)
    refit.sync(good, rollout)
    assert max_abs_diff(served_logprobs(rollout), run_in(good, prompt_logprobs, PROMPTS)) < 1e-2


def test_requests_in_flight_finish_on_the_old_model_and_requests_during_an_update_wait_for_the_new(
    actors_factory, rollout
):
    old = actors_factory.trainer(model_dir(False, "bf16"), reinitialize=True, seed=21)
    new = actors_factory.trainer(model_dir(False, "bf16"), reinitialize=True, seed=22)
    refit.sync(old, rollout)
    long_prompts = make_prompts(48, PROMPT_LEN, seed=5)
    # The engine's own output on the old weights (48 greedy tokens of a random
    # model drift from transformers' through near-ties; the engine is deterministic).
    expected_old = ray.get(rollout.generate.remote(long_prompts, 48)).token_ids
    old_short = ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS)).token_ids

    in_flight = rollout.generate.remote(long_prompts, 48)
    syncer = refit.Syncer(new, rollout)
    syncer.plan()
    ray.wait([in_flight], timeout=0.5)  # let the request start before the update is asked for
    report = syncer.sync()
    during = rollout.generate.remote(PROMPTS, NEW_TOKENS)

    assert ray.get(in_flight).token_ids == expected_old  # never mixed with the new weights
    # `during` ran on what the replica serves after the sync (the engine is deterministic), which is the new
    # trainer's model. Not its greedy tokens: a random model's near-ties flip between CPU kernels (AVX2, AVX-512).
    during_tokens = ray.get(during).token_ids
    assert during_tokens == ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS)).token_ids != old_short
    assert max_abs_diff(served_logprobs(rollout), run_in(new, prompt_logprobs, PROMPTS)) < 1e-2
    assert report.replicas[0].served_version == report.version
