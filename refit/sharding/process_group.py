"""The trainer group's torch.distributed group (gloo or NCCL: `refit.transport.devices`).

Ranks rendezvous over TCP at rank 0's address. The group's timeout is the
sync deadline, so a rank that dies inside a collective makes the others fail
within it instead of hanging for gloo's and NCCL's default 30 minutes.
"""

from __future__ import annotations

import datetime
import socket

import torch

from refit.errors import ConfigError
from refit.transport.devices import backend_for_this_machine

__all__ = ["free_port", "init_trainer_group"]


def free_port() -> int:
    """A TCP port free on this host now (for rank 0's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def init_trainer_group(rank: int, world_size: int, address: str, port: int, timeout_s: float):
    """Join the group (blocks until every rank has joined, or `timeout_s`) and return its 1-D device mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside a group of {world_size}")
    backend, device = backend_for_this_machine()
    if device == "cuda":
        torch.cuda.set_device(torch.cuda.current_device())
    torch.distributed.init_process_group(
        backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return init_device_mesh(device, (world_size,))
