"""Per-tensor checksums of the bytes a sync moves.

CRC-32 is made for exactly this: catching corrupted, truncated or misplaced
bytes, not tampering. It is computed over the tensor's bytes as they lie in
the bucket, so FP8 codes and their scales are covered as such. The value is
zlib's CRC-32 everywhere; on the CPU it is computed by refit's C kernel
(`refit/quantizer/_fused_cpu.c`, carry-less-multiply folding: ~10 GB/s on one
core here against zlib 1.2.13's 2-4 GB/s, which made checksums ~10% of a
sync), and by zlib where that kernel is not available, so a sender and a
receiver agree whichever of the two each has.
"""

from __future__ import annotations

import zlib

import torch

from refit.quantizer import _fused_cpu

__all__ = ["crc32"]


def crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes in row-major order (copied to the host first if it is not there)."""
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    fast = _fused_cpu.crc32(flat)
    return fast if fast is not None else zlib.crc32(flat.numpy())
