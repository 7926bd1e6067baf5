"""Per-tensor checksums of the bytes a sync moves.

CRC-32 (zlib, hardware-accelerated: ~6.5 GB/s on one core here, 20 ms for
the 124 MiB of an 8-layer hidden-1024 model) is made for exactly this:
catching corrupted, truncated or misplaced bytes, not tampering. It is
computed over the tensor's bytes as they lie in the bucket, so FP8 codes and
their scales are covered as such.
"""

from __future__ import annotations

import zlib

import torch

__all__ = ["crc32"]


def crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes in row-major order (copied to the host first if it is not there)."""
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return zlib.crc32(flat.numpy())
