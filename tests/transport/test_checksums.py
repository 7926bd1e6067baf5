"""The C kernel's CRC-32 is zlib's, byte for byte, so a sender and a receiver agree whichever of the two each has.

Guards the fold constants and the tail handling of `refit_crc32`: a wrong
one would make every verified sync fail, or (worse, with a weak fallback)
let an altered bucket through.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from refit.quantizer import _fused_cpu
from refit.transport.checksums import crc32

needs_kernel = pytest.mark.skipif(_fused_cpu.crc32(torch.zeros(64, dtype=torch.uint8)) is None,
                                  reason="no C compiler or no carry-less multiply on this CPU")


@needs_kernel
def test_kernel_crc32_equals_zlib_at_every_length_and_alignment():
    data = np.random.default_rng(0).integers(0, 256, size=(1 << 16) + 300, dtype=np.uint8)
    flat = torch.from_numpy(data)
    lengths = [*range(0, 260), 1023, 1024, 1025, 4096 + 15, 1 << 16]
    for start in (0, 1, 7, 16, 33):
        for n in lengths:
            assert _fused_cpu.crc32(flat[start : start + n]) == zlib.crc32(data[start : start + n]), (start, n)


def test_crc32_of_tensors_of_any_dtype_and_layout_is_zlibs():
    w = torch.randn(130, 260, generator=torch.Generator().manual_seed(1))
    for tensor in (w, w.to(torch.bfloat16), w.to(torch.float8_e4m3fn), w[:, :3], torch.tensor(0.25)):
        expected = zlib.crc32(tensor.contiguous().view(-1).view(torch.uint8).numpy())
        assert crc32(tensor) == expected
