"""`refit` on the command line: see what a sync would send, without starting anything.

    refit plan TRAINER_CHECKPOINT ROLLOUT_CHECKPOINT [--bucket-mib N] [--quantize-on trainer|rollout]

reads both config.json files (the trainer's model is built on the meta
device, for names, shapes and module classes) and the rollout checkpoint's
safetensors headers, checks the plan against the rollout's weights as a
sync would, and prints every tensor the rollout would receive: its source,
shape, whether it is FP8_BLOCK-quantized, its bucket, and the bytes on the
wire. Bad input, or a mismatch, is an error message naming every tensor and
exit status 1, never a traceback.
"""

from __future__ import annotations

import argparse
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

    from refit.errors import RefitError

    try:
        return _print_plan(args.trainer, args.rollout, int(args.bucket_mib * 2**20), args.quantize_on)
    except RefitError as error:
        print(f"refit: {error}", file=sys.stderr)
        return 1


def _print_plan(trainer: Path, rollout: Path, bucket_bytes: int, quantize_on: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from refit.errors import ConfigError
    from refit.orchestration import RolloutModelInfo, SyncConfig, describe_weights, make_plan

    for role, path in (("trainer", trainer), ("rollout", rollout)):
        if not (path / "config.json").is_file():
            raise ConfigError(f"{role} checkpoint {str(path)!r} has no config.json (is the path right?)")
    config = SyncConfig(bucket_bytes=bucket_bytes, quantize_on=quantize_on)
    rollout_model = RolloutModelInfo.from_checkpoint(rollout, from_files=True)
    try:
        with torch.device("meta"):  # names, shapes and classes only: no weights are read
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(trainer), dtype=torch.bfloat16)
    except (ValueError, OSError, KeyError) as error:
        raise ConfigError(f"trainer checkpoint {str(trainer)!r}: transformers cannot build its model ({error})") from error
    plan = make_plan(describe_weights(model), rollout_model, config)
    print(f"{'bucket':>6}  {'target':<48} {'source':<32} {'shape':<14} {'form':<10} {'bytes':>10}")
    for index, bucket in enumerate(plan.buckets):
        for t in bucket:
            form = "fp8_block" if t.is_quantized else t.dtype
            source = "" if t.source == t.target else t.source
            print(
                f"{index:>6}  {t.target:<48} {source:<32} {str(list(t.shape)):<14} {form:<10} "
                f"{t.wire_bytes(config.quantize_on):>10}"
            )
    print(f"\n{len(plan.tensors)} tensors in {len(plan.buckets)} buckets, {plan.wire_bytes / 2**20:.2f} MiB per sync")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
