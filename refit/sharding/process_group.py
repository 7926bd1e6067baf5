"""The trainer group's torch.distributed group (gloo or NCCL: `refit.transport.devices`).

Ranks rendezvous over TCP at rank 0's address. The group's timeout is the
sync deadline, so a rank that dies inside a collective makes the others fail
within it instead of hanging for gloo's and NCCL's default 30 minutes.
"""

from __future__ import annotations

import datetime
import secrets
import socket
from pathlib import Path

import torch

from refit.errors import ConfigError
from refit.transport.devices import backend_for_this_machine

__all__ = ["free_port", "init_trainer_group"]


# Ray's worker processes listen on 10002-19999 by default; ports above these and below the kernel's ephemeral range
# are taken only by a process that asks for one by number.
_PORTS_ABOVE = 20000


def free_port() -> int:
    """A TCP port free on this host now (rank 0's rendezvous, a test's `vllm serve`) that nothing takes unasked
    before its owner binds it.

    Not one that `bind(("", 0))` hands out: those come from the ephemeral range, from which every outgoing
    connection (Ray's, vLLM's) also takes its local port. On a busy machine a `vllm serve` binds its port minutes
    after the pick, and one of those connections had taken it in between.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:  # not Linux: the kernel's pick
        low = 0
    for _ in range(200):
        # A host whose ephemeral range starts low leaves no such ports: there, the kernel's pick, as before.
        port = _PORTS_ABOVE + secrets.randbelow(low - _PORTS_ABOVE) if low > _PORTS_ABOVE + 1000 else 0
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError(f"no free port between {_PORTS_ABOVE} and the ephemeral range's start, {low}")


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
