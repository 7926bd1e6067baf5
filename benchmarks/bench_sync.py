"""Sync throughput and the effect of overlapping stages, measured in one run.

Builds a synthetic Qwen3 (random weights, default ~120M parameters) on the
fly, starts one FP8_BLOCK rollout (dummy load, FP8 KV cache) and a trainer
on a 2-node loopback Ray cluster, then times repeated syncs with
`max_buckets_in_flight=1` (trainer and rollout strictly alternate) and with
the default 2 (the trainer quantizes bucket i+1 while the rollout loads
bucket i). Prints medians and their ratio, plus the rollout's RSS growth
over the run. Run with `.venv/bin/python -m benchmarks.bench_sync` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

import refit
from actors import RolloutActor, TrainerActor
from benchmarks import _docs_table
from fixtures import model_dir
from fixtures.cluster import local_cluster
from refit import EngineConfig
from tests.support.actors import rss_bytes, run_in


def synthetic_checkpoints(root: Path, layers: int, hidden: int) -> tuple[Path, Path]:
    """A bf16 checkpoint for the trainer and a config-only FP8_BLOCK one for the dummy-loaded rollout."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=16384, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(2, hidden // 256), head_dim=64,
        max_position_embeddings=512, tie_word_embeddings=True, dtype="bfloat16", architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(0)
    bf16 = root / "bf16"
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(bf16)
    fp8 = root / "fp8"
    fp8.mkdir()
    quant = json.loads((model_dir(True, "fp8_block") / "config.json").read_text())["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps({**json.loads((bf16 / "config.json").read_text()), "quantization_config": quant}))
    return bf16, fp8


def start_trainer_and_rollout(bf16: Path, fp8: Path) -> tuple:
    """A trainer on node 0 and one FP8_BLOCK dummy-loaded rollout (FP8 KV cache) on node 1."""
    trainer = TrainerActor.options(num_cpus=0, resources={"node0": 0.01}).remote(str(bf16))
    rollout = RolloutActor.options(num_cpus=0, resources={"node1": 0.01}).remote(
        EngineConfig(model=str(fp8), load_format="dummy", kv_cache_dtype="fp8_e4m3", max_model_len=256)
    )
    return trainer, rollout


def model_arguments(description: str | None, name: str) -> argparse.Namespace:
    """The command line every sync benchmark shares: the synthetic model, bucket size, repeats and `--write-docs`
    (into benchmark `name`'s block)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--bucket-mib", type=float, default=16)
    parser.add_argument("--repeats", type=int, default=4)
    _docs_table.add_write_docs_argument(parser, name)
    return parser.parse_args()


def main() -> None:
    args = model_arguments(__doc__, "bench_sync")

    with tempfile.TemporaryDirectory() as tmp, local_cluster(nodes=2):
        trainer, rollout = start_trainer_and_rollout(*synthetic_checkpoints(Path(tmp), args.layers, args.hidden))
        bucket = int(args.bucket_mib * 2**20)
        whole = {"bucket_bytes": bucket, "delta": "off"}  # full syncs: the trainer does not change between them
        syncers = {
            "in flight 1 (no overlap)": refit.Syncer(trainer, rollout, refit.SyncConfig(**whole, max_buckets_in_flight=1)),
            "in flight 2 (overlap)": refit.Syncer(trainer, rollout, refit.SyncConfig(**whole, max_buckets_in_flight=2)),
        }
        for syncer in syncers.values():
            syncer.sync()  # warm-up: plan, kernel build, first-touch allocations
        rss_before = run_in(rollout, rss_bytes)
        seconds: dict[str, list[float]] = {name: [] for name in syncers}
        for _ in range(args.repeats):
            for name, syncer in syncers.items():
                seconds[name].append(syncer.sync().total_seconds)
        rss_growth = run_in(rollout, rss_bytes) - rss_before
        report = syncers["in flight 2 (overlap)"].sync()

        plan = syncers["in flight 2 (overlap)"].plan()
        source_mib = plan.source_bytes / 2**20
        lines = [f"model: {args.layers} layers, hidden {args.hidden}, {source_mib:.0f} MiB bf16; "
                 f"{report.bytes_on_wire / 2**20:.0f} MiB on the wire in {report.buckets} buckets",
                 report.summary()]
        medians = {name: statistics.median(s) for name, s in seconds.items()}
        for name, median in medians.items():
            lines.append(f"  {name:<26} median {median:.3f} s  ({source_mib / median:.0f} MiB/s of bf16 weights)")
        no_overlap, overlap = medians.values()
        lines.append(f"  overlap speed-up           {no_overlap / overlap:.2f}x")
        lines.append(f"  rollout RSS growth over {2 * args.repeats} syncs: {rss_growth / 2**20:.1f} MiB "
                     f"({rss_growth / report.bytes_on_wire:.2f} x one sync's wire bytes)")
        print("\n".join(lines))
    if args.write_docs:
        _docs_table.write_block("bench_sync", "\n".join(lines))


if __name__ == "__main__":
    main()
