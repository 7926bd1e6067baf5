"""The main job: the GRPO-shaped RL loop of examples/rl_loop.py on a 3-node local Ray cluster.

A trainer (node 0) starts from random weights, takes a short supervised
warm-up on the counting task, then runs RL rounds; before each round
`refit.Syncer` streams its weights, FP8_BLOCK-quantized on the trainer, into
two vLLM engines on nodes 1 and 2. The engines were started the way the seed
bug needs: `load_format="dummy"` and an FP8 KV cache. Each round prints the
version, the sync's time by stage, its verification (the logprob probe's
outcome), where rollout 0's scales came from, the mean reward of the sampled
groups, and the greedy accuracy of the rollouts next to the trainer's. The
end prints the scale provenance table and writes a plot of accuracy and sync
time per round (`--plot`, default `refit-demo.png`).

Run: `make demo` (installs what it needs first).
"""

from __future__ import annotations

import argparse
import logging

import ray

from examples.rl_loop import run, start_actors
from fixtures.cluster import QUIET_ENV, local_cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=60)
    parser.add_argument("--plot", default="refit-demo.png", help="where to write the per-round plot (PNG)")
    parser.add_argument("--transport", default="ray", choices=["ray", "collective"],
                        help="how the weights travel: Ray's object store, or a broadcast group into vLLM's workers")
    args = parser.parse_args()

    # refit's own lines (one per sync, and any failure) on the driver and from the actors;
    # vLLM's start-up warnings, harmless on this CPU set-up, are kept out.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("refit").setLevel(logging.INFO)
    # FutureWarnings from inside vLLM's imports say nothing about this job.
    quiet = {**QUIET_ENV, "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore::FutureWarning"}
    with local_cluster(nodes=3, env=quiet):
        pin = [{"num_cpus": 0, "resources": {f"node{n}": 0.01}} for n in range(3)]
        trainer, rollouts = start_actors(2, pin[0], pin[1:])
        history = run(trainer, rollouts, rounds=args.rounds, prompts_per_round=16, group=8, warmup_steps=args.warmup_steps,
                      transport=args.transport)
        first, last = history[0], history[-1]
        gap = max(abs(r.rollout_accuracy - r.trainer_accuracy) for r in history)
        print(f"\n{len(history)} rounds, versions v{first.version}..v{last.version}; mean reward {first.mean_reward:.3f} -> "
              f"{last.mean_reward:.3f}; the FP8 rollouts' greedy accuracy stayed within {gap:.2f} of the trainer's")
        print("\nscale provenance of rollout 0 (where every scale came from):")
        print(ray.get(rollouts[0].scale_table.remote()))
        print(f"\nwrote {plot(history, args.plot)}")


def plot(history, path: str) -> str:
    """Accuracy (rollout and trainer) and sync seconds by stage, per round, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    rounds = [r.round for r in history]
    fig, (acc, secs) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    acc.plot(rounds, [r.trainer_accuracy for r in history], "o-", label="trainer (bf16)")
    acc.plot(rounds, [r.rollout_accuracy for r in history], "s--", label="rollout (FP8_BLOCK, FP8 KV)")
    acc.set_ylabel("greedy accuracy")
    acc.set_ylim(0, 1.05)
    acc.legend()
    bottom = [0.0] * len(history)
    for stage in ("plan", "begin", "stream", "finish"):
        values = [getattr(r.sync, f"{stage}_seconds") for r in history]
        secs.bar(rounds, values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values)]
    secs.set_ylabel("sync seconds")
    secs.set_xlabel("round (sync version = round + 1)")
    secs.legend()
    fig.suptitle("refit demo: FP8 rollouts track the trainer, every sync verified")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
