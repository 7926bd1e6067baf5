"""A GRPO-shaped RL loop around refit, written to be copied into a trainer.

Each round: `syncer.sync()` puts the trainer's weights into the FP8 rollouts;
the rollouts sample a group of completions per prompt at temperature 1.0;
each completion gets a reward; advantages are the rewards normalized within
their group; the trainer takes a policy-gradient step on them. The task is
this repository's toy counting task (continue an arithmetic progression of
token ids); the reward is the fraction of generated tokens that continue it.
A supervised warm-up comes first, as SFT precedes RL in practice: from
random weights every reward is 0 and a group-normalized advantage carries
no signal. The loop shows the plumbing, not an RL recipe: on this toy task
and budget the policy-gradient steps (lr 1e-4) keep the policy where the
warm-up left it, within round-to-round noise; larger learning rates degrade
it (measured at 5e-4 and above, with Adam or SGD).

    python examples/rl_loop.py                      # starts a local Ray instance
    python examples/rl_loop.py --address HOST:6379  # an existing cluster

`make demo` runs this loop on a 3-node local cluster (examples/demo.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import ray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the toy task and tiny models this repository ships (fixtures/)

import refit  # noqa: E402
from actors import RolloutActor, TrainerActor  # noqa: E402
from fixtures import NEW_TOKENS, PROMPT_LEN, accuracy, expected_continuation, make_prompts, make_sequences, model_dir  # noqa: E402


@dataclass(frozen=True)
class Round:
    round: int
    version: int
    mean_reward: float
    rollout_accuracy: float  # greedy, on held-out prompts, through the FP8 rollouts
    trainer_accuracy: float  # greedy, the same prompts, on the trainer's bf16 model
    sync: refit.SyncReport
    provenance: str  # where rollout 0's scales came from, in one line


def provenance_summary(records) -> str:
    """Rollout 0's scales counted by source, e.g. "14 weight refit@v3, 4 attention default@v3"."""
    counts: dict[str, int] = {}
    for r in records:
        key = f"{r.kind} {r.source}" + (f"@v{r.version}" if r.version is not None else "")
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {key}" for key, n in sorted(counts.items()))


def reward(prompt: Sequence[int], completion: Sequence[int]) -> float:
    """Fraction of generated tokens that continue the prompt's progression (the user's reward function)."""
    expected = expected_continuation(prompt, len(completion))
    return sum(a == b for a, b in zip(completion, expected)) / max(len(completion), 1)


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """GRPO: each reward relative to its group's mean, over the group's spread."""
    mean, spread = statistics.fmean(rewards), statistics.pstdev(rewards)
    return [(r - mean) / (spread + 1e-4) for r in rewards]


def run(trainer, rollouts, *, rounds: int, prompts_per_round: int, group: int, warmup_steps: int,
        rl_lr: float = 1e-4, bucket_bytes: int = 512 << 10, transport: str = "ray") -> list[Round]:
    for step in range(warmup_steps):
        ray.get(trainer.train_step.remote(make_sequences(32, 24, seed=step).tolist()))
    ray.get(trainer.set_learning_rate.remote(rl_lr))
    # Every sync is verified (checksums, completeness, scales read back) and probed: each rollout's logprobs
    # on fixed prompts against the trainer's, before it serves; a breach is flagged in the report.
    # `transport`: "ray" (the object store) or "collective" (a broadcast group straight into vLLM's workers).
    config = refit.SyncConfig(bucket_bytes=bucket_bytes, verify="probe", on_probe_breach="flag", transport=transport)
    syncer = refit.Syncer(trainer, rollouts, config)
    # The engines started while the trainer warmed up; waiting for them here keeps every round's sync time its own.
    print(f"rollout engines up (waited {syncer.wait_until_started():.1f} s after the warm-up)", flush=True)
    held_out = make_prompts(64, PROMPT_LEN, seed=99_999)
    history = []
    for index in range(rounds):
        report = syncer.sync()  # every rollout now serves the trainer's current policy
        prompts = make_prompts(prompts_per_round, PROMPT_LEN, seed=10_000 + index)
        shards = [prompts[i :: len(rollouts)] for i in range(len(rollouts))]
        samples = ray.get([
            rollout.generate.remote(shard, NEW_TOKENS, temperature=1.0, n=group, seed=index)
            for rollout, shard in zip(rollouts, shards) if shard
        ])
        sequences, advantages, rewards = [], [], []
        for shard, generation in zip(shards, samples):
            for p, prompt in enumerate(shard):
                completions = generation.token_ids[p * group : (p + 1) * group]
                scores = [reward(prompt, c) for c in completions]
                rewards += scores
                for completion, advantage in zip(completions, group_advantages(scores)):
                    if len(completion) == NEW_TOKENS:  # equal lengths: one batch, no padding
                        sequences.append(list(prompt) + list(completion))
                        advantages.append(advantage)
        ray.get(trainer.policy_gradient_step.remote(sequences, PROMPT_LEN, advantages))

        greedy = ray.get(rollouts[0].generate.remote(held_out, NEW_TOKENS)).token_ids
        trained = ray.get(trainer.generate.remote(held_out, NEW_TOKENS))
        provenance = provenance_summary(ray.get(rollouts[0].scale_records.remote()))
        history.append(Round(index, report.version, statistics.fmean(rewards), accuracy(held_out, greedy),
                             accuracy(held_out, trained), report, provenance))
        probe = report.replicas[0].verification.rpartition("; ")[2]
        print(f"round {index}: v{report.version} synced in {report.total_seconds:.2f} s "
              f"(plan {report.plan_seconds:.2f}, begin {report.begin_seconds:.2f}, stream {report.stream_seconds:.2f}, "
              f"finish {report.finish_seconds:.2f}); "
              f"{'BREACHED ' if report.probe_breached else ''}{probe}; scales: {provenance}; mean reward "
              f"{history[-1].mean_reward:.3f}, greedy accuracy rollout {history[-1].rollout_accuracy:.2f} "
              f"trainer {history[-1].trainer_accuracy:.2f}", flush=True)
    return history


def start_actors(rollouts: int, trainer_options: dict | None = None, rollout_options: Sequence[dict] | None = None):
    trainer = TrainerActor.options(**(trainer_options or {})).remote(
        str(model_dir(True, "bf16")), reinitialize=True, seed=0, lr=3e-3
    )
    engine = refit.EngineConfig(model=str(model_dir(True, "fp8_block")), load_format="dummy", kv_cache_dtype="fp8_e4m3")
    options = rollout_options or [{}] * rollouts
    return trainer, [RolloutActor.options(**o).remote(engine) for o in options]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", help="an existing Ray cluster (default: start a local instance)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per round")
    parser.add_argument("--group", type=int, default=8, help="sampled completions per prompt")
    parser.add_argument("--warmup-steps", type=int, default=60)
    parser.add_argument("--transport", default="ray", choices=["ray", "collective"], help="how the weights travel")
    args = parser.parse_args(argv)
    ray.init(address=args.address)
    try:
        trainer, rollouts = start_actors(2, {"num_cpus": 0}, [{"num_cpus": 0}] * 2)
        run(trainer, rollouts, rounds=args.rounds, prompts_per_round=args.prompts, group=args.group,
            warmup_steps=args.warmup_steps, transport=args.transport)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
