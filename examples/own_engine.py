"""Your own rollout actor, with your own vLLM engine, synced by refit.

RL stacks construct `vllm.LLM` (or `AsyncLLM`) inside their own Ray actors,
with their own arguments. Two things make such an engine a refit replica:
1. merge `refit.engine_kwargs()` into the engine's arguments (refit's
   worker extension and weight-transfer backend, a CPU memory default);
2. hold `refit.llm_replica(llm)` as `self.replica`, take the methods
   `refit.Syncer` calls from `refit.ReplicaMethods` (each hands the call to
   `self.replica`), and run your requests inside `self.replica.request()`,
   so an update waits for them and holds new ones.
(An `AsyncLLM` works the same in an async actor, with
`refit.async_llm_replica(llm)` and `refit.AsyncReplicaMethods`.)

Uses the tiny Qwen3 checkpoints this repository ships (fixtures/models);
pass your own: `python examples/own_engine.py TRAINER_CKPT FP8_BLOCK_CKPT`.
"""

import os
import sys
from pathlib import Path

import ray

import refit
from actors import TrainerActor


@ray.remote(concurrency_groups={"serve": 1})
class MyRollout(refit.ReplicaMethods):
    """A rollout actor as an RL framework writes it: its engine, its arguments, its generate.

    `refit.ReplicaMethods` adds the methods `refit.Syncer` calls, each handed to `self.replica`; they run in Ray's
    default concurrency group, and `generate` in a group of its own, so a request held during a sync never holds
    the thread the sync's next step needs.
    """

    def __init__(self, model_dir: str) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # core in this process: it can take "ray"
        from vllm import LLM

        self.llm = LLM(model=model_dir, load_format="dummy", kv_cache_dtype="fp8_e4m3", max_model_len=128,
                       enforce_eager=True, skip_tokenizer_init=True, **refit.engine_kwargs())
        self.replica = refit.llm_replica(self.llm)

    @ray.method(concurrency_group="serve")
    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams

        with self.replica.request():  # refuses while the dummy weights are all it has
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                        SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    def scale_table(self) -> str:
        from refit.provenance import format_table

        return format_table(self.scale_records())


if __name__ == "__main__":
    models = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3-tiny-tied"
    trainer_ckpt, rollout_ckpt = sys.argv[1:3] if len(sys.argv) > 2 else (models / "bf16", models / "fp8_block")

    ray.init()
    trainer = TrainerActor.remote(str(trainer_ckpt))
    rollout = MyRollout.remote(str(rollout_ckpt))

    counting = [[(start + 3 * i) % 512 for i in range(16)] for start in range(0, 512, 64)]
    print("loss", ray.get(trainer.train_step.remote(counting), timeout=600))  # one optimizer step

    with refit.Syncer(trainer, [rollout]) as syncer:
        print(syncer.sync().summary())  # my rollout now serves the trainer's weights

    prompts = [[7, 10, 13, 16, 19, 22, 25, 28]]
    print("trainer:", ray.get(trainer.generate.remote(prompts, 8), timeout=600)[0])
    print("my rollout:", ray.get(rollout.generate.remote(prompts, 8), timeout=600)[0])
    print(ray.get(rollout.scale_table.remote(), timeout=600))
    ray.shutdown()
