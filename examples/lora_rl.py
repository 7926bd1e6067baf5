"""RL on a LoRA adapter: the policy learns through adapter-only syncs into FP8_BLOCK rollouts.

The trainer holds the tiny Qwen3 (bf16), frozen, and trains a rank-8 LoRA
adapter over it; the rollouts serve the same model's FP8_BLOCK checkpoint,
loaded from disk once, with LoRA on (`EngineConfig(lora_rank=8)`). Each
round, `syncer.sync_adapter()` sends the adapter alone (a few hundred KiB,
where the base is MiB; on a real model, MiB where it is GiB), staged on
every rollout and then served; the base is never reloaded. Then the same
GRPO round as examples/rl_loop.py: sample groups at temperature 1.0 from
the rollouts (on the served adapter), score each token, take clipped
policy-gradient steps with truncated importance weights against the
rollout's logprobs.

The task is new to the base. It continues a progression with the
prompt's own step (the repository's counting task); here it must go on in
steps of one, whatever the prompt's step. It gets a third of the prompts
right as it is (those whose step is one), and from the others every
sampled token scores 0, so a short supervised warm-up of the adapter comes
first; RL rounds then raise the reward and the greedy accuracy on the fixed
dataset, through the FP8 rollouts.

    python examples/lora_rl.py                      # starts a local Ray instance
    python examples/lora_rl.py --address HOST:6379  # an existing cluster
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

import ray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the toy task and tiny models this repository ships (fixtures/)

import refit  # noqa: E402
from actors import RolloutActor, TrainerActor  # noqa: E402
from examples.rl_loop import loop_arguments, sample_batch, train_on_batch  # noqa: E402
from fixtures import NEW_TOKENS, PROMPT_LEN, VOCAB_SIZE, make_prompts, model_dir  # noqa: E402

LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"]}


def by_ones(prompt: Sequence[int], n_tokens: int) -> list[int]:
    """What the task wants after `prompt`: its last token plus 1, 2, ... (mod the vocabulary)."""
    return [(prompt[-1] + i) % VOCAB_SIZE for i in range(1, n_tokens + 1)]


def reward(prompt: Sequence[int], completion: Sequence[int]) -> list[float]:
    """Per generated token: 1.0 where it is the token before it plus one."""
    before = [prompt[-1], *completion[:-1]]
    return [float(token == (previous + 1) % VOCAB_SIZE) for previous, token in zip(before, completion)]


def accuracy(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> float:
    """Share of prompts whose greedy continuation is right throughout."""
    return sum(list(out) == by_ones(p, len(out)) for p, out in zip(prompts, outputs)) / len(prompts)


def warmup_sequences(n: int, seed: int) -> list[list[int]]:
    """Progressions of the counting task, each continued in steps of one: what the warm-up trains on."""
    return [list(p) + by_ones(p, NEW_TOKENS) for p in make_prompts(n, PROMPT_LEN, seed=seed)]


def run(trainer, rollouts, *, rounds: int, prompts: int, group: int, warmup_steps: int, rl_lr: float = 1e-2,
        steps_per_batch: int = 4, log=print) -> list[tuple[float, float, float]]:
    """The rounds of the module docstring; returns (mean reward, rollout accuracy, trainer accuracy) per round."""
    syncer = refit.Syncer(trainer, rollouts)
    for step in range(warmup_steps):
        ray.get(trainer.train_step.remote(warmup_sequences(32, seed=step)), timeout=600)
    ray.get(trainer.set_learning_rate.remote(rl_lr), timeout=600)
    syncer.wait_until_started()
    dataset = make_prompts(prompts, PROMPT_LEN, seed=20_000)
    history = []
    for index in range(rounds):
        report = syncer.sync_adapter()  # every rollout now serves the trainer's current adapter
        serving = syncer.rollouts  # without any the sync dropped (dead or hung): `rollouts` may still name them
        served = ray.get([r.generate.remote(dataset, NEW_TOKENS) for r in serving], timeout=600)
        trained = ray.get(trainer.generate.remote(dataset, NEW_TOKENS), timeout=600)
        batch = sample_batch(serving, dataset, group, seed=index, score=reward)
        train_on_batch(trainer, batch, steps_per_batch)
        rollout_accuracy = min(accuracy(dataset, g.token_ids) for g in served)
        history.append((batch.mean_reward, rollout_accuracy, accuracy(dataset, trained)))
        log(f"round {index}: adapter {report.name} v{report.version} synced in {report.total_seconds * 1e3:.0f} ms, "
            f"{report.bytes_per_replica / 2**10:.0f} KiB per replica, served by "
            f"{', '.join(sorted({str(g.adapter) for g in served}))} (base untouched)\n"
            f"  mean reward {batch.mean_reward:.3f}, greedy accuracy rollout {rollout_accuracy:.2f} "
            f"trainer {history[-1][2]:.2f}")
    return history


def start_actors(rollouts: int, options: dict | None = None):
    trainer = TrainerActor.options(**(options or {})).remote(str(model_dir(False, "bf16")), lora=LORA, lr=1e-2, seed=0)
    engine = refit.EngineConfig(model=str(model_dir(False, "fp8_block")), lora_rank=LORA["r"])
    return trainer, [RolloutActor.options(**(options or {})).remote(engine) for _ in range(rollouts)]


def main(argv: Sequence[str] | None = None) -> None:
    args = loop_arguments(__doc__, rounds=6, prompts=32, warmup_steps=4).parse_args(argv)
    ray.init(address=args.address or "local")
    try:
        start = time.perf_counter()
        trainer, rollouts = start_actors(2, {"num_cpus": 0})
        history = run(trainer, rollouts, rounds=args.rounds, prompts=args.prompts, group=args.group,
                      warmup_steps=args.warmup_steps)
        (first, *_), (last, accuracy_now, trainer_now) = history[0], history[-1]
        print(f"reward {first:.3f} -> {last:.3f}; rollout greedy accuracy {accuracy_now:.2f}, trainer {trainer_now:.2f}; "
              f"{time.perf_counter() - start:.0f} s")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
