"""A sharded (2-rank FSDP2) trainer against a single-process one, on the same model, measured in one run.

Same synthetic Qwen3 and FP8_BLOCK rollout as `bench_sync` (dummy load, FP8
KV cache) on a 3-node loopback Ray cluster: the single-process trainer and
the group's rank 0 on node 0, rank 1 on node 1, the rollout on node 2.
Syncs from the two sources alternate. Prints the median seconds of each and
their ratio, the bytes each rank sent and all-gathered, and what gathering
the BF16 model onto one rank first (the way without shard-local
quantization) would have moved. Run with
`.venv/bin/python -m benchmarks.bench_sharded` from the repository root.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import refit
from actors import RolloutActor, TrainerActor, TrainerGroup
from benchmarks import _docs_table
from benchmarks.bench_sync import model_arguments, synthetic_checkpoints
from fixtures.cluster import local_cluster
from refit import EngineConfig


def main() -> None:
    args = model_arguments(__doc__, "bench_sharded")

    with tempfile.TemporaryDirectory() as tmp, local_cluster(nodes=3):
        bf16, fp8 = synthetic_checkpoints(Path(tmp), args.layers, args.hidden)
        single = TrainerActor.options(num_cpus=0, resources={"node0": 0.01}).remote(str(bf16))
        group = TrainerGroup(bf16, 2, resources=[{"node0": 0.01}, {"node1": 0.01}])
        rollout = RolloutActor.options(num_cpus=0, resources={"node2": 0.01}).remote(
            EngineConfig(model=str(fp8), load_format="dummy", kv_cache_dtype="fp8_e4m3", max_model_len=256)
        )
        config = refit.SyncConfig(bucket_bytes=int(args.bucket_mib * 2**20), delta="off")  # whole syncs (bench_delta: deltas)
        syncers = {"single process": refit.Syncer(single, rollout, config), "FSDP2, 2 ranks": refit.Syncer(group, rollout, config)}
        for syncer in syncers.values():
            syncer.sync()  # warm-up: plans, routes, first-touch allocations
        seconds: dict[str, list[float]] = {name: [] for name in syncers}
        for _ in range(args.repeats):
            for name, syncer in syncers.items():
                seconds[name].append(syncer.sync().total_seconds)

        plan = syncers["single process"].plan()
        bf16_bytes = sum(t.source_bytes for t in plan.tensors)  # what a gather would move: a tied copy is not gathered
        lines = [f"model: {args.layers} layers, hidden {args.hidden}, {plan.source_bytes / 2**20:.0f} MiB bf16, "
                 f"{plan.wire_bytes / 2**20:.0f} MiB FP8_BLOCK on the wire, {len(plan.buckets)} buckets"]
        medians = {name: statistics.median(s) for name, s in seconds.items()}
        for name, median in medians.items():
            lines.append(f"  {name:<16} median {median:.3f} s")
        lines.append(f"  sharded / single-process time: {medians['FSDP2, 2 ranks'] / medians['single process']:.2f}")
        for rank, stats in enumerate(group.stream_stats()):
            lines.append(f"  rank {rank}: sent {stats['bytes'] / 2**20:.1f} MiB ({stats['rows']} tensors as its own rows, "
                         f"{stats['whole']} whole, {stats['gather']} gathered), "
                         f"all-gathered {stats['gathered_bytes'] / 2**20:.1f} MiB")
        gathered = sum(s["gathered_bytes"] for s in group.stream_stats())
        lines.append(f"  gathering the BF16 model onto one rank first would move {bf16_bytes / 2 / 2**20:.0f} MiB between ranks; "
                     f"shard-local quantization moved {gathered / 2**20:.1f} MiB (ratio {gathered / (bf16_bytes / 2):.3f})")
        print("\n".join(lines))
        group.kill()
    if args.write_docs:
        _docs_table.write_block("bench_sharded", "\n".join(lines))


if __name__ == "__main__":
    main()
