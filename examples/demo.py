"""The main job: an RL-style loop that refits two FP8 rollout engines every step.

A trainer (node 0) starts from random weights and learns the counting task;
after every few optimizer steps `refit.Syncer` streams its weights, FP8_BLOCK-
quantized on the trainer, into two vLLM engines on nodes 1 and 2. The engines
were started the way the seed bug needs: `load_format="dummy"` and an FP8 KV
cache. Each round prints the sync report and the rollouts' accuracy, which
must track the trainer's own; the end prints the scale provenance table.

Run: `make demo` (installs what it needs first).
"""

from __future__ import annotations

import argparse
import time

import ray

import refit
from actors import RolloutActor, TrainerActor
from fixtures import NEW_TOKENS, PROMPT_LEN, accuracy, make_prompts, make_sequences, model_dir
from fixtures.cluster import local_cluster
from refit.engine.rollout_engine import EngineConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=30)
    args = parser.parse_args()

    with local_cluster(nodes=3):
        trainer = TrainerActor.options(num_cpus=0, resources={"node0": 0.01}).remote(
            str(model_dir(True, "bf16")), reinitialize=True, seed=0, lr=3e-3
        )
        engine = EngineConfig(model=str(model_dir(True, "fp8_block")), load_format="dummy",
                              kv_cache_dtype="fp8_e4m3", max_model_len=128)
        rollouts = [
            RolloutActor.options(num_cpus=0, resources={f"node{n}": 0.01}).remote(engine) for n in (1, 2)
        ]
        syncer = refit.Syncer(trainer, rollouts, refit.SyncConfig(bucket_bytes=512 << 10))
        prompts = make_prompts(64, PROMPT_LEN, seed=1234)

        print(f"plan: {len(syncer.plan().tensors)} tensors, {len(syncer.plan().buckets)} buckets, "
              f"{syncer.plan().wire_bytes / 2**20:.2f} MiB per sync on the wire")
        step = 0
        for round_ in range(args.rounds + 1):
            if round_:
                start = time.perf_counter()
                for _ in range(args.steps_per_round):
                    loss = ray.get(trainer.train_step.remote(make_sequences(32, 24, seed=step).tolist()))
                    step += 1
                print(f"\nround {round_}: {args.steps_per_round} optimizer steps "
                      f"({time.perf_counter() - start:.1f} s), loss {loss:.3f}")
            report = syncer.sync()
            print(report.summary())
            trained = accuracy(prompts, ray.get(trainer.generate.remote(prompts, NEW_TOKENS)))
            served = [accuracy(prompts, ray.get(r.generate.remote(prompts, NEW_TOKENS)).token_ids) for r in rollouts]
            print(f"  accuracy on the counting task: trainer {trained:.2f}, rollouts "
                  + ", ".join(f"{a:.2f}" for a in served))

        print("\nscale provenance of rollout 0 (where every scale came from):")
        print(ray.get(rollouts[0].scale_table.remote()))


if __name__ == "__main__":
    main()
