"""Delta syncs against full syncs of the same trainer state, after AdamW steps at RL learning rates.

A synthetic tied Qwen3 (`--layers` x `--hidden`, default 8 x 2048: 864 MiB
bf16), a trainer with fp32 master weights on node 0 and one FP8_BLOCK
dummy-loaded rollout with an FP8 KV cache on node 1. Per learning rate, per
repeat: one AdamW step of the trainer's fp32 master weights with random
gradients (as the measurement in issue 24; a forward and backward pass of
this model takes minutes on 2 CPU cores, and what is measured here is what
the step changes, not the step), then a delta sync (the replica holds the
previous version), then a full sync of the same state (the replica's base
dropped first, as after a restart), both with the default configuration.

Prints, per learning rate, the medians: bytes each replica received, seconds
by stage, and the sync time *modelled* for a 25 and a 100 Gbit/s
trainer-to-rollout link: the seconds measured here (where the object store
moves bytes at memory speed) plus bytes over the link's bandwidth, so a
model of a multi-node job, not a measurement of one. Also the bases' sizes
in bytes per parameter. Writes `--out`/delta.json. Only ratios measured in
one run mean anything on a shared machine.

    .venv/bin/python -m benchmarks.bench_delta
    .venv/bin/python -m benchmarks.bench_delta --layers 2 --hidden 256 --repeats 1 --lrs 1e-5   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import ray

import refit
from benchmarks import _docs_table
from benchmarks import _instruments as instruments
from benchmarks.bench_alternatives import cluster, drop_replica_base
from benchmarks.bench_sync import start_trainer_and_rollout, synthetic_checkpoints
from tests.support.actors import run_in

LINKS_GBIT = (25, 100)


def adamw_step_with_random_gradients(trainer, seed: int) -> None:
    """In the trainer: one step of its own AdamW on its fp32 masters, then the bf16 copy it streams."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    for master in trainer._master:
        master.grad = torch.randn(master.shape, generator=generator)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for master, param in zip(trainer._master, trainer._params):
            param.copy_(master)


def instrumented_sync(syncer: refit.Syncer, trainer, rollout) -> dict[str, dict[str, float]]:
    """One more (untimed) delta sync with each side's stage clocks running (benchmarks/_instruments.py)."""
    sides = {"trainer": trainer, "rollout": rollout}
    for actor in sides.values():
        run_in(actor, instruments.stages_start)
    report = syncer.sync()
    assert report.replicas[0].mode == "delta", report.summary()
    return {side: run_in(actor, instruments.stages_stop) for side, actor in sides.items()}


def base_bytes(actor) -> int:
    """The delta base an actor keeps: a trainer's sender base, or a rollout's replica base."""
    base = actor.replica._base if hasattr(actor, "replica") else actor.weights.sender._base
    return base.nbytes()


def parameter_counts(trainer, plan_targets: list[tuple[str, bool]]) -> dict[str, int]:
    """Parameters that travel as FP8_BLOCK and as bf16 (a tied lm_head counts once: it is the embedding)."""
    from refit.plan.checkpoint_format import CheckpointView

    view = CheckpointView(trainer.model)
    counts = {"fp8": 0, "bf16": 0}
    for source, quantized in plan_targets:
        counts["fp8" if quantized else "bf16"] += view.tensor(source).numel()
    return counts


def record(report: refit.SyncReport) -> dict[str, float]:
    (replica,) = report.replicas
    row = {"seconds": report.total_seconds, "bytes": replica.bytes_received, "begin": report.begin_seconds,
           "stream": report.stream_seconds, "finish": report.finish_seconds, "load": replica.load_seconds,
           "trainer busy": report.trainer_seconds or 0.0}
    for gbit in LINKS_GBIT:
        row[f"model {gbit} Gbit/s"] = report.total_seconds + replica.bytes_received * 8 / (gbit * 1e9)
    return row


def median_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--bucket-mib", type=float, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lrs", type=lambda text: [float(x) for x in text.split(",")], default=[1e-6, 1e-5, 1e-4])
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    _docs_table.add_write_docs_argument(parser, "bench_delta")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    # Over `ray`: deltas are for a wire between hosts; on one host `transport="auto"` maps shared memory, whole.
    config = refit.SyncConfig(transport="ray", bucket_bytes=int(args.bucket_mib * 2**20))
    results = {}
    printed: list[str] = []  # what the docs block holds
    with tempfile.TemporaryDirectory() as scratch, cluster():
        trainer, rollout = start_trainer_and_rollout(*synthetic_checkpoints(Path(scratch), args.layers, args.hidden))
        try:
            syncer = refit.Syncer(trainer, rollout, config)
            plan = syncer.plan()
            counts = run_in(trainer, parameter_counts, [(t.source, t.block is not None) for t in plan.tensors])
            syncer.sync()  # warm-up, and the first base on both sides
            for lr in args.lrs:
                ray.get(trainer.set_learning_rate.remote(lr))
                delta_rows, full_rows = [], []
                for _ in range(args.repeats):
                    run_in(trainer, adamw_step_with_random_gradients, len(delta_rows) + 10 * len(results), timeout=600)
                    delta = syncer.sync()
                    assert delta.replicas[0].mode == "delta", delta.summary()
                    delta_rows.append(record(delta))
                    run_in(rollout, drop_replica_base)
                    full = syncer.sync()
                    assert full.replicas[0].mode == "full", full.summary()
                    full_rows.append(record(full))
                run_in(trainer, adamw_step_with_random_gradients, 10 * len(results) + 9, timeout=600)
                results[lr] = {"delta": median_rows(delta_rows), "full": median_rows(full_rows),
                               "delta stages": instrumented_sync(syncer, trainer, rollout)}
                printed.append(table(lr, results[lr]))
                print(printed[-1], flush=True)
            memory = {"trainer": run_in(trainer, base_bytes), "rollout": run_in(rollout, base_bytes)}
        finally:
            for actor in (trainer, rollout):
                ray.kill(actor)
    per_parameter = {side: nbytes / (counts["fp8"] + counts["bf16"]) for side, nbytes in memory.items()}
    bound = counts["fp8"] * (1 + 4 / 128**2) + 2 * counts["bf16"]  # codes, one fp32 scale per block, bf16 tensors
    printed.append(f"\nbases kept between syncs: trainer {memory['trainer'] / 2**20:.1f} MiB, rollout {memory['rollout'] / 2**20:.1f} MiB "
                   f"({per_parameter['trainer']:.3f} and {per_parameter['rollout']:.3f} bytes per parameter; "
                   f"{counts['fp8'] / 1e6:.1f} M FP8_BLOCK and {counts['bf16'] / 1e6:.1f} M bf16 parameters; "
                   f"the stated bound, 1 byte per FP8 parameter plus its scales and 2 per bf16 one, is {bound / 2**20:.1f} MiB)")
    print(printed[-1])
    summary = {"model": f"{args.layers}x{args.hidden}", "parameters": counts, "base_bytes": memory, "base_bound_bytes": bound,
               "by_lr": {str(lr): result for lr, result in results.items()}}
    (args.out / "delta.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out / 'delta.json'}")
    if args.write_docs:
        _docs_table.write_block("bench_delta", "\n".join(printed), argv=argv)


def table(lr: float, result: dict[str, dict[str, float]]) -> str:
    delta, full = result["delta"], result["full"]
    keys = ["bytes", "seconds", "begin", "stream", "finish", "trainer busy", "load", *(f"model {g} Gbit/s" for g in LINKS_GBIT)]
    lines = [f"\nlr {lr:g}: delta against full, medians",
             f"  {'':<22} {'delta':>12} {'full':>12} {'delta / full':>13}"]
    for key in keys:
        if key == "bytes":
            lines.append(f"  {'MiB received':<22} {delta[key] / 2**20:>12.2f} {full[key] / 2**20:>12.2f} {delta[key] / full[key]:>12.1%}")
        else:
            ratio = f"{full[key] / delta[key]:.2f}x faster" if key == "seconds" or key.startswith("model") else ""
            lines.append(f"  {key + ' s':<22} {delta[key]:>12.3f} {full[key]:>12.3f} {ratio:>13}")
    for side, stages in result.get("delta stages", {}).items():
        lines.append(f"  delta sync by stage, {side}: " + ", ".join(f"{k} {v:.3f}" for k, v in stages.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
