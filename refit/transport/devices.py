"""Which torch.distributed backend moves tensors on this machine: the one place that picks gloo or NCCL.

Used by the trainer group of a sharded trainer (refit/sharding/) and by the
collective transport's group (refit/transport/collective.py), so a CPU job
and a GPU job run the same code with a different backend.
"""

from __future__ import annotations

import torch

__all__ = ["backend_for_this_machine"]


def backend_for_this_machine() -> tuple[str, str]:
    """(torch.distributed backend, device type): NCCL on CUDA, gloo on the CPU."""
    return ("nccl", "cuda") if torch.cuda.is_available() else ("gloo", "cpu")
