"""`refit` on the command line: see what a sync would send, without starting anything.

    refit plan TRAINER_CHECKPOINT ROLLOUT_CHECKPOINT [--bucket-mib N] [--quantize-on trainer|rollout]

reads both config.json files (the trainer's model is built on the meta device,
for names, shapes and module classes), and prints every tensor the rollout would receive: its source, shape, whether
it is FP8_BLOCK-quantized, its bucket, and the bytes on the wire.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="refit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="print the transfer plan from a trainer to a rollout checkpoint")
    plan.add_argument("trainer", type=Path, help="HF checkpoint directory of the trainer's model")
    plan.add_argument("rollout", type=Path, help="checkpoint directory the rollout engine was started from")
    plan.add_argument("--bucket-mib", type=float, default=64.0)
    plan.add_argument("--quantize-on", choices=("trainer", "rollout"), default="trainer")
    args = parser.parse_args(argv)
    return _print_plan(args.trainer, args.rollout, int(args.bucket_mib * 2**20), args.quantize_on)


def _print_plan(trainer: Path, rollout: Path, bucket_bytes: int, quantize_on: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from refit.engine.rollout_engine import EngineDescription
    from refit.errors import RefitError
    from refit.orchestration import describe_weights, make_plan

    config = json.loads((rollout / "config.json").read_text())
    text_config = config.get("text_config", config)
    engine = EngineDescription(config.get("quantization_config"), bool(text_config.get("tie_word_embeddings")))
    with torch.device("meta"):  # names, shapes and classes only: no weights are read
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(trainer), dtype=torch.bfloat16)
    try:
        plan = make_plan(describe_weights(model), engine, bucket_bytes=bucket_bytes, quantize_on=quantize_on)
    except RefitError as error:
        print(f"refit: {error}", file=sys.stderr)
        return 1
    print(f"{'bucket':>6}  {'target':<48} {'source':<32} {'shape':<14} {'form':<10} {'bytes':>10}")
    for index, bucket in enumerate(plan.buckets):
        for t in bucket:
            form = "fp8_block" if t.quantize else t.dtype
            source = "" if t.source == t.target else t.source
            nbytes = t.quantized_bytes if quantize_on == "trainer" else t.source_bytes
            print(f"{index:>6}  {t.target:<48} {source:<32} {str(list(t.shape)):<14} {form:<10} {nbytes:>10}")
    print(f"\n{len(plan.tensors)} tensors in {len(plan.buckets)} buckets, {plan.wire_bytes / 2**20:.2f} MiB per sync")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
