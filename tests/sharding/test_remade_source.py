"""A rank whose weight source was made again between syncs (its model reloaded, say) streams with the others.

Two real gloo ranks, each in a process of its own, plain models read through `DTensorLayout`.
"""

from __future__ import annotations

import torch

from refit.plan import RolloutModelInfo, SyncConfig, make_plan
from tests.support.fakes import FP8_BLOCK
from tests.support.gloo_ranks import gloo_rank, report_stream, run_two_ranks


def _rank_whose_source_is_remade(rank: int, store_path: str, outcomes) -> None:
    """Rank `rank` of 2 (gloo, 20 s group timeout); after the first stream, rank 1 makes its `RankSource` again."""
    from refit.sharding import RankSource

    with gloo_rank(rank, store_path, timeout_s=20):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256)).to(torch.bfloat16)
        source = RankSource(model)
        plan = make_plan(source.metadata(), RolloutModelInfo(FP8_BLOCK, False), SyncConfig())
        for attempt in range(2):
            if rank == 1 and attempt == 1:
                source = RankSource(model)
            this = plan.for_sync(b"key", f"s{attempt}", 20.0)
            if rank == 0 and attempt == 0:  # rank 1 starts the next sync, with its new source, before rank 0 ends this one
                report_stream(outcomes, rank, attempt, _ending_late, source.stream, this, 2.0)
            else:
                report_stream(outcomes, rank, attempt, source.stream, this)


def _ending_late(stream, plan, seconds: float) -> list:
    """`stream(plan)`'s parts, its end (which ends the rank's turn) `seconds` after its last part."""
    import time

    parts = stream(plan)
    taken = [next(parts) for _ in plan.buckets]
    time.sleep(seconds)
    return taken + list(parts)


def test_a_rank_whose_source_was_made_again_streams_with_ranks_that_kept_theirs(tmp_path):
    """Found by review: each source agrees the routes of a plan once, in a collective, and keeps them; a source made
    again (on one rank) agreed them anew while the others, keeping theirs, went on to the preflight's collective, so
    the two collectives paired across (each read the other's payload as its own) and the ranks failed or waited until
    the group's timeout. Now whether to agree again is decided by all ranks together. And a source made again
    remembers the syncs its rank ended (before, it refused its caller's next sync while a slower peer still ended the
    last one: `LifecycleError: ... this trainer's ranks are streaming sync s0`)."""
    seen = run_two_ranks(_rank_whose_source_is_remade, tmp_path, reports=4, timeout_s=120)
    assert [outcome for _, _, outcome, _ in seen] == ["streamed 1"] * 4, seen
    assert all(seconds < 15 for _, _, _, seconds in seen), seen  # none waited until the group's timeout (20 s)


def _megatron_rank_whose_source_is_remade(rank: int, store_path: str, outcomes) -> None:
    """Rank `rank` of a real megatron-core TP=2 (gloo, 20 s group timeout) of the Qwen3 fixture, whose row-parallel
    weights are all-gathered; after the first stream, rank 1 makes its source again over the same model."""
    from refit.sharding.megatron import megatron_source
    from tests.support.gloo_ranks import megatron_fixture_rank

    with megatron_fixture_rank(rank, store_path, tp=2, timeout_s=20) as (model, source, metas):
        plan = make_plan(metas, RolloutModelInfo(FP8_BLOCK, False), SyncConfig(bucket_bytes=64 << 10))
        for attempt in range(2):
            if rank == 1 and attempt == 1:
                source = megatron_source(model, vocab_size=source.layout.dims.vocab)
            report_stream(outcomes, rank, attempt, source.stream, plan.for_sync(b"key", f"s{attempt}", 20.0))


def test_a_megatron_rank_whose_source_was_made_again_gathers_with_ranks_that_kept_theirs(tmp_path):
    """What a Megatron layout learns at a gather and keeps (each holder's span) must not pair one rank's collective
    with another's: a source made again on one rank knows none of it."""
    seen = run_two_ranks(_megatron_rank_whose_source_is_remade, tmp_path, reports=4, timeout_s=120)
    assert [outcome for _, _, outcome, _ in seen] == [seen[0][2]] * 4 and seen[0][2].startswith("streamed"), seen
    assert all(seconds < 15 for _, _, _, seconds in seen), seen
