"""A rank that leaves its group leaves torch.distributed's default group whatever else fails, or it could never join
another (`setup` refuses a rank still in a group)."""

import pytest
import torch

from actors._ranks import RankProcess


def test_a_rank_whose_transport_fails_to_close_still_leaves_its_torch_group():
    rank = RankProcess(0, 1)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        def broken_close():
            raise RuntimeError("the collective group's peers are gone")

        rank.weights.close = broken_close
        rank.model = torch.nn.Linear(2, 2)
        with pytest.raises(RuntimeError, match="peers are gone"):
            rank.leave_group()
        assert not torch.distributed.is_initialized() and "model" not in rank.__dict__
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
