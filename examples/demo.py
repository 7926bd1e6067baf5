"""The main job: the GRPO loop of examples/rl_loop.py on a 3-node local Ray cluster, beside the seed bug.

A trainer (node 0) starts from random weights, takes a short supervised
warm-up on the counting task, then runs RL rounds; before each round
`refit.Syncer` streams its weights, FP8_BLOCK-quantized on the trainer, into
two vLLM engines on nodes 1 and 2. The engines were started the way the seed
bug needs: `load_format="dummy"` and an FP8 KV cache. The demo waits for
them before round 0 (the trainer's warm-up runs while they start) and
prints when they were up, so every round's sync time is the sync alone.

The contrast: a third engine (node 0), started the same way, is synced to
the same weights every round by a `Syncer` of its own with
`kv_scales="keep"`, so its placeholder KV scales stay in place after each
refit, as upstream vLLM leaves them. It is only evaluated, never sampled
from. Its placeholders are vLLM's dummy value, -0.000942 on this machine.
A kernel that stores K and V in FP8 as x / scale (clamped to +-448) and
reads them back as q x scale cancels the sign and is left with a scale
about 1000x too small: every K and V saturates at 448 x 0.000942 = 0.42
(the seed saw garbage outputs on a GPU; this mechanism is our reading of
it, not measured on one). The CPU attention path refuses a negative
scale outright (`k_scale must be positive for FP8 path`), and refit
refuses to serve a dummy load's value under every policy, so this
replica's engine (`SeedBugRollout` below) replaces each dummy placeholder
by its magnitude once it has started (through vLLM's `collective_rpc`) and
records it as a `placeholder`, a value vLLM made and nothing informed,
which is what upstream vLLM takes it for; every sync keeps them: the same
saturation, served.

Each round prints the version, the sync's milliseconds by stage, the bytes
each replica received (on one host `--transport auto` picks `shm`, which
sends every sync whole; with `--transport ray` or `collective`, a full sync
first, then deltas: only what changed since the version it served,
docs/delta.md), the logprob probe's outcome, the mean reward of the sampled
groups, the greedy accuracy of the trainer, the refit rollouts (the worse
of the two) and the seed-bug replica, and one line per replica saying where
its scales came from. The end prints one summary line and writes
`refit-demo.png` (`--plot`).

Run: `make demo` (installs what it needs first). `--address` runs it on a
cluster that is up already, whose nodes carry the custom resources `node0`,
`node1` and `node2` (as `fixtures.cluster.local_cluster` gives them).
"""

from __future__ import annotations

import argparse
import logging
import time

import ray

import refit
from actors import RolloutActor
from examples.rl_loop import received_mib, rollout_engine, run, start_actors
from fixtures.cluster import QUIET_ENV, joined_cluster, local_cluster


def _dummy_scale_magnitudes(worker) -> list[str]:
    """Runs in the vLLM worker: every `dummy` attention scale becomes its magnitude, recorded as a placeholder, which
    is what upstream vLLM takes it for (see the docstring)."""
    from refit.engine.transfer_backend import backend_of
    from refit.provenance import ScaleSource
    from refit.provenance.kv_stage import write_attention_scale

    backend = backend_of(worker)
    modules = dict(backend.model.named_modules())
    changed = []
    for r in backend.provenance.records():
        if r.kind == "attention" and r.source == ScaleSource.DUMMY:
            write_attention_scale(modules[r.module], r.scale, abs(r.value))
            backend.provenance.record_set(r.module, r.scale, ScaleSource.PLACEHOLDER, None)
            changed.append(f"{r.module}.{r.scale}")
    return changed


class _SeedBugRollout(RolloutActor.__ray_actor_class__):
    """A RolloutActor that serves its placeholder KV scales as a GPU kernel sees them (sync it with kv_scales="keep").

    Once, when its engine has started: a sync streams no KV scales, so the
    layerwise reload puts these attention tensors back as they were, and
    `kv_scales="keep"` leaves them so.
    """

    def __init__(self, config: refit.EngineConfig) -> None:
        super().__init__(config)
        self.engine.llm.collective_rpc(_dummy_scale_magnitudes)


SeedBugRollout = ray.remote(concurrency_groups={"update": 1, "serve": 1, "observe": 1})(_SeedBugRollout)

SEED_BUG = "seed-bug"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=64, help="prompts in the dataset, each sampled 8 times a round")
    parser.add_argument("--rl-lr", type=float, default=3e-3)
    parser.add_argument("--steps-per-batch", type=int, default=4)
    parser.add_argument("--address", help="a running Ray cluster with nodes node0-node2 (default: start a local one)")
    parser.add_argument("--plot", default="refit-demo.png", help="where to write the per-round plot (PNG)")
    parser.add_argument("--transport", default="auto", choices=["auto", "ray", "collective"],
                        help="how the weights travel: picked for the fleet (auto), Ray's object store, or a broadcast "
                             "group into vLLM's workers")
    args = parser.parse_args()

    # refit's own lines (one per sync, and any failure) on the driver and from the actors;
    # vLLM's start-up warnings, harmless on this CPU set-up, are kept out.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("refit").setLevel(logging.WARNING)
    # FutureWarnings from inside vLLM's imports say nothing about this job.
    quiet = {**QUIET_ENV, "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore::FutureWarning", "REFIT_LOG_LEVEL": "WARNING",
             "TORCH_CPP_LOG_LEVEL": "ERROR"}
    start = time.monotonic()
    with joined_cluster(args.address, quiet) if args.address else local_cluster(nodes=3, env=quiet):
        pin = [{"num_cpus": 0, "resources": {f"node{n}": 0.01}} for n in range(3)]
        trainer, rollouts = start_actors(2, pin[0], pin[1:])
        seed_bug = SeedBugRollout.options(**pin[0]).remote(rollout_engine())
        keep = refit.SyncConfig(bucket_bytes=512 << 10, kv_scales="keep", verify="probe", on_probe_breach="flag",
                                transport=args.transport)
        history = run(trainer, rollouts, rounds=args.rounds, prompts=args.prompts, group=8,
                      warmup_steps=args.warmup_steps, rl_lr=args.rl_lr, steps_per_batch=args.steps_per_batch,
                      transport=args.transport, watch={SEED_BUG: (seed_bug, keep)})
        first, last = history[0], history[-1]
        gap = max(abs(r.rollout_accuracy - r.trainer_accuracy) for r in history)
        print(f"\n{len(history)} rounds, versions v{first.version}..v{last.version}, {time.monotonic() - start:.0f} s")
        print(f"reward {first.mean_reward:.2f} -> {last.mean_reward:.2f}; refit rollouts within {gap:.2f} of the trainer; "
              f"seed-bug replica accuracy {last.watched[SEED_BUG].accuracy:.2f}")
        print(f"wrote {plot(history, args.plot)}")


def plot(history, path: str) -> str:
    """Reward and greedy accuracy, sync milliseconds by stage, and bytes each replica received, per round, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    rounds = [r.round for r in history]
    fig, (acc, ms, wire) = plt.subplots(3, 1, figsize=(7, 8), sharex=True, gridspec_kw={"height_ratios": [2, 1, 1]})
    acc.plot(rounds, [r.mean_reward for r in history], "^-", color="tab:green", label="mean reward of the sampled groups")
    acc.plot(rounds, [r.trainer_accuracy for r in history], "o-", color="tab:blue", label="greedy accuracy: trainer (bf16)")
    acc.plot(rounds, [r.rollout_accuracy for r in history], "s--", color="tab:orange",
             label="greedy accuracy: refit rollouts (FP8_BLOCK, FP8 KV)")
    acc.plot(rounds, [r.watched[SEED_BUG].accuracy for r in history], "x:", color="tab:red",
             label="greedy accuracy: seed-bug replica (placeholder KV scales kept)")
    acc.set_ylabel("reward / accuracy (0-1)")
    acc.set_ylim(-0.02, 1.05)
    acc.legend(fontsize=8, loc="lower right", bbox_to_anchor=(1, 0.14))  # below the accuracy lines, above the seed bug's
    bottom = [0.0] * len(history)
    for stage in ("plan", "begin", "stream", "finish"):
        values = [getattr(r.sync, f"{stage}_seconds") * 1e3 for r in history]
        ms.bar(rounds, values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values)]
    ms.set_ylabel("sync time (ms)")
    # The first sync also plans and runs each engine's first forward pass (in the probe): a bar of its own
    # scale would flatten every other; it is cut at the axis and its total written on it.
    later = sorted(bottom[1:]) or bottom
    top = max(later[-1] * 1.5, 1.0)
    if bottom[0] > top:
        ms.set_ylim(0, top)
        ms.annotate(f"{bottom[0]:.0f} ms (plan + first forward)", (rounds[0], top), xytext=(4, -12),
                    textcoords="offset points", fontsize=8)
    ms.legend(fontsize=8, ncol=4, loc="upper right")
    wire.bar(rounds, [received_mib(r.sync) for r in history], color="tab:gray", label="received (below the line: a delta)")
    wire.axhline(history[0].sync.bytes_on_wire / 2**20, color="black", linestyle="--", linewidth=0.8, label="a full sync")
    wire.set_ylabel("received per\nreplica (MiB)")
    wire.legend(fontsize=8, loc="lower right")
    wire.set_xlabel("RL round (the trainer's weights synced before it)")
    wire.set_xticks(rounds)
    fig.suptitle("refit demo: FP8 rollouts synced by refit track the trainer;\n"
                 "a replica that keeps its placeholder KV scales (the seed bug) does not", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
