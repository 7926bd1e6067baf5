"""A rank that cannot read its part of a gathered tensor fails the gather on every holder at once, not at the timeout.

Real megatron-core ranks at TP=2, and FSDP2 ranks, over gloo, each in a process of its own; the fault is one rank's
read of its part (what out of memory while casting it would be), or its allocation of the gather's buffers, raised
inside the layout's gather.
"""

from __future__ import annotations

import pytest

from refit.plan import RolloutModelInfo, SyncConfig, make_plan
from tests.support.fakes import FP8_BLOCK
from tests.support.gloo_ranks import megatron_fixture_rank, report_stream, run_two_ranks

FAILING = "model.layers.0.self_attn.o_proj.weight"  # row-parallel at TP=2: its columns are gathered


def _tp_rank_whose_peer_fails_a_gather(rank: int, store_path: str, outcomes, step: str) -> None:
    """Rank `rank` of TP=2 (gloo, 30 s group timeout) of the Qwen3 fixture; in the first stream rank 1 cannot do
    `step` for `FAILING`: read its part, or make room for the gather's buffers."""
    with megatron_fixture_rank(rank, store_path, tp=2) as (_, source, metas):
        plan = make_plan(metas, RolloutModelInfo(FP8_BLOCK, False), SyncConfig(bucket_bytes=64 << 10))
        layout = source.layout
        method = {"read": "_part", "make room": "_gather_buffers"}[step]
        works = getattr(layout, method)

        def failing(part_or_param, slot, *rest):
            if slot.target == FAILING:
                raise MemoryError("out of memory casting it (test)")
            return works(part_or_param, slot, *rest)

        def fail(failing_now: bool) -> None:
            setattr(layout, method, failing if failing_now else works)

        _stream_twice_rank_1_failing_first(rank, outcomes, source, plan, fail)


def _stream_twice_rank_1_failing_first(rank: int, outcomes, source, plan, fail) -> None:
    """Stream twice, rank 1 failing its part (`fail(True)`) in the first stream only; settle what a failed stream
    owes as `TrainerWeights` does."""
    from refit.errors import take_settlement

    for attempt in range(2):
        if rank == 1:
            fail(attempt == 0)
        error = report_stream(outcomes, rank, attempt, source.stream, plan.for_sync(b"key", f"s{attempt}", 30.0))
        settle = None if error is None else take_settlement(error)
        if settle is not None:
            settle()


def _assert_both_failed_at_once_and_streamed_on(seen: list[tuple], name: str) -> None:
    assert [(rank, attempt) for rank, attempt, _, _ in seen] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    (_, _, peer, peer_s), (_, _, peer_next, _), (_, _, failing, failing_s), (_, _, failing_next, _) = seen
    assert peer.startswith(f"GatherFailedError: {name}: trainer rank 1 could not read its part or make room"), peer
    assert failing == (f"GatherFailedError: {name}: trainer rank 1 could not read its part or make room to gather it: "
                       "MemoryError: out of memory casting it (test)"), failing
    assert peer_s < 25 and failing_s < 25, (peer_s, failing_s)  # at once, not at the group's timeout (30 s)
    assert peer_next.startswith("streamed") and failing_next.startswith("streamed"), (peer_next, failing_next)


@pytest.mark.parametrize("step", ["read", "make room"])
def test_a_rank_that_cannot_read_its_part_of_a_gather_fails_it_on_every_holder_at_once_and_the_group_streams_on(
        tmp_path, step):
    """Found by review: a rank whose gather raised before its first collective (its part could not be read) joined
    no more gathers, and its tensor-parallel peer waited in the all-gather until the group's timeout (30 s here),
    which breaks a gloo group for good, so the next stream failed too; so did a rank that could not allocate the
    gather's buffers, after the exchange of spans. Now both raise at once, the peer naming the failing rank and the
    tensor, the failing rank its cause, and the next stream runs on the same group."""
    _assert_both_failed_at_once_and_streamed_on(
        run_two_ranks(_tp_rank_whose_peer_fails_a_gather, tmp_path, step, reports=4), FAILING)


FSDP2_GATHERED = "0.weight"  # 128 rows, 64 a rank: half an FP8 block, so all-gathered whole (DTensor.full_tensor)


def _fsdp2_rank_whose_peer_fails_a_gather(rank: int, store_path: str, outcomes, mesh_shape: tuple[int, ...]) -> None:
    """Rank `rank` of an FSDP2 mesh of two (`mesh_shape`; gloo, 30 s group timeout); rank 1 cannot cast its shard
    of `FSDP2_GATHERED` to the wire dtype in the first stream."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from refit.sharding import RankSource
    from tests.support.gloo_ranks import gloo_rank

    with gloo_rank(rank, store_path, timeout_s=30):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False), torch.nn.Linear(128, 256, bias=False))
        names = ("replicate", "shard")[-len(mesh_shape):]  # 2-D: HSDP, replicated over dim 0, sharded over dim 1
        fully_shard(model, mesh=init_device_mesh("cpu", mesh_shape, mesh_dim_names=names))
        source = RankSource(model, wire_dtype=torch.bfloat16)
        plan = make_plan(source.metadata(), RolloutModelInfo(FP8_BLOCK, False), SyncConfig())
        cast = source.layout._wire_shard

        def failing_cast(param, dtype):
            if param is dict(model.named_parameters())[FSDP2_GATHERED]:
                raise MemoryError("out of memory casting it (test)")
            return cast(param, dtype)

        def fail(failing: bool) -> None:
            source.layout._wire_shard = failing_cast if failing else cast

        _stream_twice_rank_1_failing_first(rank, outcomes, source, plan, fail)


@pytest.mark.parametrize("mesh_shape", [(2,), (1, 2)])
def test_an_fsdp2_rank_that_cannot_cast_its_shard_of_a_gathered_tensor_fails_it_on_every_rank_at_once(tmp_path, mesh_shape):
    """Found by review: FSDP2's gathers had no such agreement; the failing rank raised alone while its peer waited in
    `full_tensor`'s all-gather until the group's timeout (30 s here), which breaks a gloo group for good. Now both
    raise at once and the next stream runs on the same group."""
    _assert_both_failed_at_once_and_streamed_on(
        run_two_ranks(_fsdp2_rank_whose_peer_fails_a_gather, tmp_path, mesh_shape, reports=4, timeout_s=120), FSDP2_GATHERED)
