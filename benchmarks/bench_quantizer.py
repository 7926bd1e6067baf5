"""FP8_BLOCK quantizer throughput against compressed-tensors and clone().

Prints, from one run (this machine is shared and noisy, so only ratios
measured side by side mean anything):
- GB/s of bf16 bytes in for refit's quantizer, for compressed-tensors'
  reference path, and for a plain clone() of the same bytes (what the
  memory system can do);
- refit / compressed-tensors (target >= 5x) and refit / clone (target >= 0.5).

Two workloads: one large bf16 matrix, and a whole synthetic decoder (every
Linear of N layers, as a refit quantizes them). Each timing is the median
of interleaved repetitions. Run with `make bench`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from compressed_tensors.quantization.utils.helpers import maybe_pad_tensor_for_block_quant

from benchmarks import _docs_table
from refit.quantizer import quantize_fp8_block

_ARGS = preset_name_to_scheme("FP8_BLOCK", ["Linear"]).weights


def compressed_tensors_path(weight: torch.Tensor) -> None:
    """What llmcompressor runs per weight: block min/max, qparams, quantize."""
    padded = maybe_pad_tensor_for_block_quant(weight, (128, 128))
    blocks = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128).transpose(1, 2)
    scale, zero_point = calculate_qparams(blocks.amin(dim=(2, 3)), blocks.amax(dim=(2, 3)), _ARGS)
    ct_quantize(weight, scale, zero_point, _ARGS, dtype=torch.float8_e4m3fn)


def synthetic_decoder(layers: int, hidden: int, intermediate: int, kv: int) -> list[torch.Tensor]:
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
              (intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for _ in range(layers) for s in shapes]


def measure(workload: list[torch.Tensor], candidates: dict[str, Callable[[torch.Tensor], object]], repeats: int) -> dict[str, float]:
    """Median GB/s (bf16 bytes in) per candidate, repetitions interleaved."""
    nbytes = sum(t.numel() * t.element_size() for t in workload)
    seconds: dict[str, list[float]] = {name: [] for name in candidates}
    for fn in candidates.values():  # warm-up: kernel build, allocator, threads
        fn(workload[0])
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            for t in workload:
                fn(t)
            seconds[name].append(time.perf_counter() - start)
    return {name: nbytes / statistics.median(s) / 1e9 for name, s in seconds.items()}


def report(title: str, gbps: dict[str, float]) -> str:
    """The table of one workload, printed; returned for the docs block."""
    lines = [f"\n{title}", *(f"  {name:<28} {value:6.2f} GB/s" for name, value in gbps.items()),
             f"  refit / compressed-tensors   {gbps['refit'] / gbps['compressed-tensors']:6.2f}x  (target >= 5)",
             f"  refit / clone                {gbps['refit'] / gbps['clone']:6.2f}   (target >= 0.5)"]
    print("\n".join(lines))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=8192, help="side of the large square matrix")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the synthetic model")
    parser.add_argument("--repeats", type=int, default=5)
    _docs_table.add_write_docs_argument(parser, "bench_quantizer")
    args = parser.parse_args()
    printed = [f"torch {torch.__version__}, {torch.get_num_threads()} threads"]
    print(printed[0])

    candidates = {
        "refit": lambda t: quantize_fp8_block(t),
        "compressed-tensors": compressed_tensors_path,
        "clone": lambda t: t.clone(),
    }
    matrix = [(torch.randn(args.size, args.size) * 0.02).to(torch.bfloat16)]
    printed.append(report(f"bf16 matrix {args.size}x{args.size} ({matrix[0].numel() * 2 / 2**20:.0f} MiB)",
                          measure(matrix, candidates, args.repeats)))
    del matrix
    model = synthetic_decoder(args.layers, hidden=2048, intermediate=6144, kv=512)
    mib = sum(t.numel() * 2 for t in model) / 2**20
    printed.append(report(f"synthetic decoder, {args.layers} layers, hidden 2048 ({len(model)} Linears, {mib:.0f} MiB)",
                          measure(model, candidates, args.repeats)))
    if args.write_docs:
        _docs_table.write_block("bench_quantizer", "\n".join(printed))


if __name__ == "__main__":
    main()
