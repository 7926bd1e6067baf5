"""A stream first finishes its layout's parameter updates still in flight: Megatron's distributed optimizer with
`overlap_param_gather` leaves the all-gather of updated parameters to the next forward pass, so a sync right after
`optimizer.step()` would read a mix of two steps. megatron-core's DistributedDataParallel needs CUDA, so the
wrapper here is a stand-in with its attributes (`ddp_config`, `module`, `start_param_sync(force_sync=...)`, as in
megatron-core 0.16); the stream is real (a world of one)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from refit.plan import RolloutModelInfo, SyncConfig, make_plan
from refit.sharding import RankSource
from refit.sharding.dtensor_layout import DTensorLayout
from refit.sharding.megatron.layout import _overlapped_param_gathers
from tests.support.fakes import FP8_BLOCK


class _Ddp(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, *, distributed_optimizer: bool, overlap: bool) -> None:
        super().__init__()
        self.module = module
        self.ddp_config = SimpleNamespace(use_distributed_optimizer=distributed_optimizer, overlap_param_gather=overlap)
        self.forced: list[bool] = []

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False) -> None:
        self.forced.append(force_sync)


class _Gpt(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder, self.config = torch.nn.Linear(2, 2), object()


@pytest.mark.parametrize("distributed_optimizer, overlap, finished", [(True, True, True), (True, False, False),
                                                                      (False, False, False)])
def test_only_an_overlapped_gather_of_a_distributed_optimizer_is_finished(distributed_optimizer, overlap, finished):
    ddp = _Ddp(SimpleNamespace(module=_Gpt()), distributed_optimizer=distributed_optimizer, overlap=overlap)
    assert _overlapped_param_gathers(ddp) == ([ddp] if finished else [])


def test_a_stream_finishes_the_layouts_updates_before_it_reads_a_weight():
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        events: list[str] = []

        class Layout(DTensorLayout):
            def finish_parameter_updates(self) -> None:
                events.append("finish")

            def rows(self, name, start, stop):
                events.append("read")
                return super().rows(name, start, stop)

        model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False)).to(torch.bfloat16)
        layout = Layout(model)
        plan = make_plan(layout.metadata(), RolloutModelInfo(FP8_BLOCK, False), SyncConfig())
        assert len(list(RankSource(layout).stream(plan))) == len(plan.buckets)
        assert events[0] == "finish" and events.count("finish") == 1 and "read" in events
    finally:
        torch.distributed.destroy_process_group()
