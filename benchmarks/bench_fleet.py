"""A replica killed mid-sync, in a fleet of three: how long the sync takes that goes on without it.

The measurement issue 22 started from (replica 0 killed 0.39 s into a sync
of a 124 MiB model failed the sync and left replica 1 refusing), now: the
same synthetic Qwen3 as bench_sync, three FP8_BLOCK dummy-loaded rollouts
(nodes 1, 2 and 0; the trainer on node 0), one sync to warm up, then one
sync during which one replica is killed `--kill-after` seconds in, over
each transport (a fresh victim for each). Prints each sync's time beside
an undisturbed sync's and their ratio (docs/performance.md quotes it), who
was dropped, and whether the survivors serve the sync's version. Run with `.venv/bin/python -m benchmarks.bench_fleet`.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import ray

import refit
from actors import RolloutActor, TrainerActor
from benchmarks.bench_sync import synthetic_checkpoints
from fixtures.cluster import local_cluster


def rollout(fp8: Path, node: int):
    return RolloutActor.options(num_cpus=0, resources={f"node{node}": 0.01}).remote(refit.EngineConfig(
        model=str(fp8), load_format="dummy", kv_cache_dtype="fp8_e4m3", max_model_len=256, kv_cache_bytes=64 << 20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--bucket-mib", type=float, default=16)
    parser.add_argument("--kill-after", type=float, default=0.39)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, local_cluster(nodes=3):
        bf16, fp8 = synthetic_checkpoints(Path(tmp), args.layers, args.hidden)
        trainer = TrainerActor.options(num_cpus=0, resources={"node0": 0.01}).remote(str(bf16))
        survivors = [rollout(fp8, 1), rollout(fp8, 2)]
        victims = {"ray": rollout(fp8, 0), "collective": rollout(fp8, 0)}
        ray.get([a.__ray_ready__.remote() for a in (trainer, *survivors, *victims.values())], timeout=1800)
        for transport, victim in victims.items():
            config = refit.SyncConfig(bucket_bytes=int(args.bucket_mib * 2**20), transport=transport, timeout_s=60,
                                      delta="off")  # whole syncs: the trainer does not change between them
            with refit.Syncer(trainer, [*survivors, victim], config) as syncer:
                syncer.sync()  # warm-up: plan, group, first-touch allocations
                undisturbed = syncer.sync()
                threading.Timer(args.kill_after, lambda v=victim: ray.kill(v)).start()
                start = time.perf_counter()
                report = syncer.sync()
                seconds = time.perf_counter() - start
                states = ray.get([r.status.remote() for r in survivors], timeout=60)
            print(f"{transport}: {report.bytes_on_wire / 2**20:.0f} MiB "
                  f"on the wire; undisturbed sync {undisturbed.total_seconds:.2f} s; with a replica killed "
                  f"{args.kill_after:g} s in: {seconds:.2f} s ({seconds / undisturbed.total_seconds:.2f}x undisturbed), "
                  f"{report.attempts} attempt(s), dropped: "
                  f"{'; '.join(map(str, report.dropped)) or 'none (the kill missed the sync)'}; survivors: "
                  f"{', '.join(str(s) for s in states)} (the sync's version: v{report.version})")


if __name__ == "__main__":
    main()
