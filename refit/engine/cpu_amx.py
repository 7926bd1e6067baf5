"""AMX for vLLM's CPU kernels: every engine process asks Linux for the AMX tile state before its first request.

Why: Linux (5.16 and later) gives a process the AMX tile registers only
once it has asked for them (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); an AMX
instruction before that is an illegal instruction, and the process dies of
SIGILL. vLLM's CPU attention takes its AMX kernel whenever the CPU has AMX
(`torch.cpu._is_amx_tile_supported()`) and never asks: it works only where
something in the process asked first, as oneDNN does when it first runs a
bf16 GEMM on AMX. An FP8_BLOCK engine's linears run vLLM's own FP8 kernels,
not oneDNN, so on a Xeon with AMX its first attention call killed it, fresh
or synced (refit's test suite hid it: its reference kernel, which it puts
first, runs oneDNN before any attention). `register()`, a
`vllm.general_plugins` entry point, asks through torch's own helper in
every process that starts an engine, as oneDNN would.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["register"]

log = logging.getLogger("refit.engine")


def register() -> None:
    """Ask for AMX in this process if the CPU has it (a no-op elsewhere, and when asked again)."""
    if not torch.cpu._is_amx_tile_supported():
        return
    ask = getattr(torch._C._cpu, "_init_amx", None)
    if ask is None or not ask():
        log.warning("this CPU has AMX, but the process could not get its tile state (torch._C._cpu._init_amx %s): "
                    "vLLM's AMX kernels may die of SIGILL here", "is missing" if ask is None else "refused")
