"""Fused FP8_BLOCK kernel for bf16 weights on the CPU (C, built on first use).

Why it exists: the torch-op version walks the whole weight once per op (abs,
amax, divide, clamp, cast, transpose copies), so on a CPU it runs at a
fraction of memory bandwidth. The kernel in `_fused_cpu.c` reads each block
from memory once, keeps it in cache for the second pass, and writes the FP8
codes directly (numba was tried first and ran at half this speed).

Why it is still bit-identical to compressed-tensors: every rounding step is
the one torch performs. bf16 -> fp32 is exact (a 16-bit shift); the division
is an IEEE fp32 division (no fast-math), or a product by the block's
reciprocal scale where that gives every value the division's code, which
a test checks for every pair of scale and value; fp32 -> bf16 is round-to-nearest-
even, as in c10::BFloat16; bf16 -> FP8 (after compressed-tensors' zero point
and clamp) is integer round-to-nearest-even, checked against torch for all
65536 bf16 bit patterns by the tests.

Why it is compiled here rather than shipped: `-march=native` code for the
machine that runs it, built in about a second by the system C compiler and
cached by source hash under $XDG_CACHE_HOME (else ~/.cache). Where no
compiler is available, or the kernel cannot be built or loaded, the torch
path is used (same bits, slower) and a warning says so once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = [
    "all_finite", "apply_bitmap", "apply_delta", "apply_steps", "bf16_to_fp8_codes", "encode_bitmap", "encode_delta",
    "encode_steps", "handles", "quantize",
]

_SOURCE = Path(__file__).with_suffix(".c")
# 512-bit vectors where the CPU has them: GCC's tuning for several AVX-512 CPUs prefers 256-bit ones, and the kernel's
# 32-bit lane arithmetic runs faster with twice the lanes (docs/performance.md; the bits are the same; no effect
# without AVX-512).
_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_log = logging.getLogger(__name__)


def handles(weight: torch.Tensor) -> bool:
    """True where this kernel applies: bf16 on the CPU, with a C compiler at hand."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and _library() is not None


def quantize(
    weight: torch.Tensor, block: tuple[int, int], out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D bf16 CPU tensor; NaN/Inf blocks get a NaN scale.

    `out`: contiguous (codes, scale) tensors to write into, e.g. views of a
    bucket's buffer, so the codes are written once, where they travel from.
    """
    rows, cols = weight.shape
    bh, bw = block
    weight = weight.contiguous()
    if out is None:
        out = (torch.empty((rows, cols), dtype=torch.float8_e4m3fn), torch.empty((-(-rows // bh), -(-cols // bw)), dtype=torch.bfloat16))
    codes, scale = out
    if not (codes.is_contiguous() and scale.is_contiguous() and codes.numel() == rows * cols
            and scale.numel() == -(-rows // bh) * -(-cols // bw) and codes.element_size() == 1 and scale.element_size() == 2):
        raise ValueError(f"quantize: out tensors {tuple(codes.shape)}, {tuple(scale.shape)} do not fit a {rows}x{cols} weight")
    _library().refit_fp8_block_bf16(
        weight.data_ptr(), codes.data_ptr(), scale.data_ptr(), rows, cols, bh, bw, torch.get_num_threads()
    )
    return codes.view(torch.float8_e4m3fn), scale.view(torch.bfloat16)


def encode_delta(
    new: torch.Tensor, old: torch.Tensor, width: int, cap: int, chunks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None | bool:
    """A delta's (counts per chunk int32, values uint8, low 16 bits int16) from two contiguous CPU byte tensors;
    None if more than `cap` elements differ; False where this kernel does not apply."""
    library = _library()
    if library is None or new.device.type != "cpu" or not (new.is_contiguous() and old.is_contiguous()):
        return False
    cap = min(cap, new.numel() // width)
    counts = torch.zeros(chunks, dtype=torch.int32)
    values, low = torch.empty(cap * width, dtype=torch.uint8), torch.empty(cap, dtype=torch.int16)
    n = library.refit_diff_encode(new.data_ptr(), old.data_ptr(), new.numel(), width, cap, counts.data_ptr(),
                                  values.data_ptr(), low.data_ptr())
    return None if n < 0 else (counts, values[: n * width], low[:n])


def apply_delta(stored: torch.Tensor, width: int, counts: torch.Tensor, values: torch.Tensor, low: torch.Tensor) -> bool | None:
    """Write a delta into `stored` (contiguous CPU bytes) in place: True, False if its counts or indices do not
    fit, None where this kernel does not apply."""
    library = _library()
    if library is None or stored.device.type != "cpu" or not stored.is_contiguous():
        return None
    counts, values, low = counts.contiguous(), values.contiguous(), low.contiguous()
    return library.refit_delta_apply(stored.data_ptr(), stored.numel() // width, width, counts.data_ptr(), counts.numel(),
                                     values.data_ptr(), low.data_ptr(), low.numel()) == 0


def encode_steps(
    new: torch.Tensor, old: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | bool:
    """A steps delta's (bitmap uint8, steps int8, escaped elements' bytes uint8) from two contiguous CPU byte tensors
    of `width`-byte elements (refit.transport.delta); False where this kernel does not apply."""
    library = _library()
    if library is None or new.device.type != "cpu" or not (new.is_contiguous() and old.is_contiguous()):
        return False
    numel = new.numel() // width
    bitmap, steps = torch.zeros(-(-numel // 8), dtype=torch.uint8), torch.empty(numel, dtype=torch.int8)
    escaped, n_escaped = torch.empty(new.numel(), dtype=torch.uint8), ctypes.c_long(0)
    n = library.refit_steps_encode(new.data_ptr(), old.data_ptr(), numel, width, bitmap.data_ptr(), steps.data_ptr(),
                                   escaped.data_ptr(), ctypes.byref(n_escaped))
    return bitmap, steps[:n], escaped[: n_escaped.value * width]


def apply_steps(stored: torch.Tensor, width: int, bitmap: torch.Tensor, steps: torch.Tensor, escaped: torch.Tensor) -> bool | None:
    """Apply a steps delta to `stored` (contiguous CPU bytes) in place: True, False (nothing written) if its bitmap
    or escapes do not fit its steps, None where this kernel does not apply."""
    library = _library()
    if library is None or stored.device.type != "cpu" or not stored.is_contiguous():
        return None
    bitmap, steps, escaped = bitmap.contiguous(), steps.contiguous(), escaped.contiguous()
    return library.refit_steps_apply(stored.data_ptr(), stored.numel() // width, width, bitmap.data_ptr(), steps.data_ptr(),
                                     steps.numel(), escaped.data_ptr(), escaped.numel() // width) == 0


def encode_bitmap(new: torch.Tensor, old: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor] | bool:
    """A bitmap delta's (bitmap uint8, changed elements' bytes uint8) from two contiguous CPU byte tensors of
    `width`-byte elements (refit.transport.delta); False where this kernel does not apply."""
    library = _library()
    if library is None or new.device.type != "cpu" or not (new.is_contiguous() and old.is_contiguous()):
        return False
    numel = new.numel() // width
    bitmap, values = torch.zeros(-(-numel // 8), dtype=torch.uint8), torch.empty(new.numel(), dtype=torch.uint8)
    n = library.refit_bitmap_encode(new.data_ptr(), old.data_ptr(), numel, width, bitmap.data_ptr(), values.data_ptr())
    return bitmap, values[: n * width]


def apply_bitmap(stored: torch.Tensor, width: int, bitmap: torch.Tensor, values: torch.Tensor) -> bool | None:
    """Write a bitmap delta into `stored` (contiguous CPU bytes) in place: True, False (nothing written) if its bitmap
    does not mark exactly its values' elements, None where this kernel does not apply."""
    library = _library()
    if library is None or stored.device.type != "cpu" or not stored.is_contiguous():
        return None
    bitmap, values = bitmap.contiguous(), values.contiguous()
    return library.refit_bitmap_apply(stored.data_ptr(), stored.numel() // width, width, bitmap.data_ptr(),
                                      values.data_ptr(), values.numel() // width) == 0


def all_finite(tensor: torch.Tensor) -> bool | None:
    """Whether a CPU bf16 tensor holds no NaN/Inf, or None where this kernel does not apply."""
    if not (handles(tensor) and tensor.is_contiguous()):
        return None
    return bool(_library().refit_bf16_all_finite(tensor.data_ptr(), tensor.numel(), torch.get_num_threads()))


def bf16_to_fp8_codes(values: torch.Tensor) -> torch.Tensor:
    """The kernel's bf16 -> FP8 conversion alone (for tests): uint8 codes of a bf16 tensor."""
    values = values.contiguous()
    codes = torch.empty(values.shape, dtype=torch.uint8)
    _library().refit_bf16_to_fp8_e4m3(values.data_ptr(), codes.data_ptr(), values.numel())
    return codes


def reciprocal_mismatches() -> int:
    """How many (scale, value) pairs the kernel's multiply by a block's reciprocal scale codes otherwise than the
    division it stands for (for tests: it must be 0; see `refit_reciprocal_mismatches` in the C source)."""
    return int(_library().refit_reciprocal_mismatches())


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc")]  # CC may hold arguments
    if compiler[0] is None:
        _log.warning("refit: no C compiler found; FP8_BLOCK quantization falls back to torch ops (slower).")
        return None
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + platform.node().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "refit" / "kernels"  # empty: unset
    target = cache / f"fp8_block_bf16-{key}.so"
    # A cache directory that cannot be made, a CC that is not there, a library that does not load: the torch
    # path gives the same bits, so none of them may fail a quantization.
    try:
        if not target.exists():
            cache.mkdir(parents=True, exist_ok=True)
            # Build beside the target and rename: several Ray actors may start
            # at once, and none may load a half-written library.
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                built = Path(tmp) / target.name
                result = subprocess.run([*compiler, *_FLAGS, str(_SOURCE), "-o", str(built)], capture_output=True,
                                        text=True)
                if result.returncode != 0:
                    _log.warning("refit: building %s failed, using torch ops instead:\n%s", _SOURCE.name, result.stderr)
                    return None
                os.replace(built, target)
        library = ctypes.CDLL(str(target))
    except OSError as error:
        _log.warning("refit: cannot build or load %s (compiler %s, cache %s: %s); FP8_BLOCK quantization falls back to "
                     "torch ops (slower).", _SOURCE.name, shlex.join(compiler), cache, error)
        return None
    library.refit_fp8_block_bf16.restype = None
    library.refit_fp8_block_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 4 + [ctypes.c_int]
    library.refit_bf16_to_fp8_e4m3.restype = None
    library.refit_bf16_to_fp8_e4m3.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    library.refit_reciprocal_mismatches.restype = ctypes.c_long
    library.refit_reciprocal_mismatches.argtypes = []
    library.refit_bf16_all_finite.restype = ctypes.c_int
    library.refit_bf16_all_finite.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    library.refit_diff_encode.restype = ctypes.c_long
    library.refit_diff_encode.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_long,
                                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    library.refit_delta_apply.restype = ctypes.c_int
    library.refit_delta_apply.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_long,
                                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    library.refit_steps_encode.restype = ctypes.c_long
    library.refit_steps_encode.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_long)]
    library.refit_steps_apply.restype = ctypes.c_int
    library.refit_steps_apply.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_long, ctypes.c_void_p, ctypes.c_long]
    library.refit_bitmap_encode.restype = ctypes.c_long
    library.refit_bitmap_encode.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p,
                                            ctypes.c_void_p]
    library.refit_bitmap_apply.restype = ctypes.c_int
    library.refit_bitmap_apply.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_long]
    return library
