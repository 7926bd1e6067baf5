"""The `shm`, `ray` and `collective` transports on the same model and rollout, measured in one run.

Same synthetic Qwen3 as bench_sync (trainer on node 0, one FP8_BLOCK dummy-
loaded rollout with its engine core in the actor's process on node 1, so
every transport can reach it; the two nodes are one host, as `shm` needs).
Syncs alternate between the transports, which share the plan, the quantizer
and the checks; only the road the bytes take differs: a memory file of the
trainer's that the worker maps, the object store (a put, a fetch between
raylets, then vLLM's RPC), or one broadcast over a gloo group into the
worker's preallocated buffers. Prints the medians and their ratios to `ray`. On GPUs the collective group runs NCCL
(scripts/gpu_check.sh). Run with `.venv/bin/python -m benchmarks.bench_transport`.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import refit
from benchmarks import _docs_table
from benchmarks.bench_sync import model_arguments, start_trainer_and_rollout, synthetic_checkpoints
from fixtures.cluster import local_cluster


def main() -> None:
    args = model_arguments(__doc__, "bench_transport")
    with tempfile.TemporaryDirectory() as tmp, local_cluster(nodes=2):
        trainer, rollout = start_trainer_and_rollout(*synthetic_checkpoints(Path(tmp), args.layers, args.hidden))
        bucket = int(args.bucket_mib * 2**20)
        syncers = {name: refit.Syncer(trainer, rollout, refit.SyncConfig(bucket_bytes=bucket, transport=name, delta="off"))
                   for name in ("shm", "ray", "collective")}
        for syncer in syncers.values():
            syncer.sync()  # warm-up: plan, group, kernel build, first-touch allocations
        seconds: dict[str, list[float]] = {name: [] for name in syncers}
        stream: dict[str, list[float]] = {name: [] for name in syncers}
        for _ in range(args.repeats):
            for name, syncer in syncers.items():
                report = syncer.sync()
                seconds[name].append(report.total_seconds)
                stream[name].append(report.stream_seconds)
        for syncer in syncers.values():
            syncer.close()

        plan = syncers["ray"].plan()
        lines = [f"model: {args.layers} layers, hidden {args.hidden}, {plan.source_bytes / 2**20:.0f} MiB bf16; "
                 f"{plan.wire_bytes / 2**20:.0f} MiB on the wire in {len(plan.buckets)} buckets of <= {args.bucket_mib:g} MiB"]
        medians = {name: statistics.median(s) for name, s in seconds.items()}
        for name, median in medians.items():
            lines.append(f"  {name:<11} median {median:.3f} s per sync (stream stage {statistics.median(stream[name]):.3f} s), "
                         f"{plan.wire_bytes / 2**20 / median:.0f} MiB/s on the wire")
        for name in ("shm", "collective"):
            lines.append(f"  {name} / ray time ratio: {medians[name] / medians['ray']:.2f} (below 1: {name} is faster)")
        print("\n".join(lines))
    if args.write_docs:
        _docs_table.write_block("bench_transport", "\n".join(lines))


if __name__ == "__main__":
    main()
