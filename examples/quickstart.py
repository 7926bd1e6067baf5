"""Quickstart: start Ray, a trainer and two FP8 rollouts, train a step, sync, generate.

Uses the tiny Qwen3 checkpoints this repository ships (fixtures/models);
pass your own: `python examples/quickstart.py TRAINER_CKPT FP8_BLOCK_CKPT`.
"""

import sys
from pathlib import Path

import ray

import refit
from actors import RolloutActor, TrainerActor

models = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3-tiny-tied"
trainer_ckpt, rollout_ckpt = sys.argv[1:3] if len(sys.argv) > 2 else (models / "bf16", models / "fp8_block")

ray.init()
trainer = TrainerActor.remote(str(trainer_ckpt))
engine = refit.EngineConfig(model=str(rollout_ckpt), load_format="dummy", kv_cache_dtype="fp8_e4m3")
rollouts = [RolloutActor.remote(engine) for _ in range(2)]

counting = [[(start + 3 * i) % 512 for i in range(16)] for start in range(0, 512, 64)]
print("loss", ray.get(trainer.train_step.remote(counting), timeout=600))  # one optimizer step

report = refit.sync(trainer, rollouts)  # the rollouts now serve the trainer's weights
print(report.summary())

prompts = [[7, 10, 13, 16, 19, 22, 25, 28]]
print("trainer:", ray.get(trainer.generate.remote(prompts, 8), timeout=600)[0])
for i, rollout in enumerate(rollouts):
    print(f"rollout {i}:", ray.get(rollout.generate.remote(prompts, 8), timeout=600).token_ids[0])
ray.shutdown()
