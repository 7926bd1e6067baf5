"""A rank whose weight source was made again between syncs (its model reloaded, say) streams with the others.

Two real gloo ranks, each in a process of its own, plain models read through `DTensorLayout`.
"""

from __future__ import annotations

import multiprocessing

import torch

from refit.plan import RolloutModelInfo, SyncConfig, make_plan
from tests.support.fakes import FP8_BLOCK


def _rank_whose_source_is_remade(rank: int, store_path: str, outcomes) -> None:
    """Rank `rank` of 2 (gloo, 20 s group timeout); after the first stream, rank 1 makes its `RankSource` again."""
    import datetime
    import time

    from refit.sharding import RankSource

    store = torch.distributed.FileStore(store_path, 2)
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256)).to(torch.bfloat16)
        source = RankSource(model)
        plan = make_plan(source.metadata(), RolloutModelInfo(FP8_BLOCK, False), SyncConfig())
        for attempt in range(2):
            if rank == 1 and attempt == 1:
                source = RankSource(model)
            start = time.monotonic()
            try:
                parts = list(source.stream(plan.for_sync(b"key", f"s{attempt}", 20.0)))
                outcomes.put((rank, attempt, f"streamed {len(parts)}", time.monotonic() - start))
            except Exception as error:  # noqa: BLE001 - what each rank saw is the test's result
                outcomes.put((rank, attempt, f"{type(error).__name__}: {error}", time.monotonic() - start))
    finally:
        torch.distributed.destroy_process_group()


def test_a_rank_whose_source_was_made_again_streams_with_ranks_that_kept_theirs(tmp_path):
    """Found by review: each source agrees the routes of a plan once, in a collective, and keeps them; a source made
    again (on one rank) agreed them anew while the others, keeping theirs, went on to the preflight's collective, so
    the two collectives paired across (each read the other's payload as its own) and the ranks failed or waited until
    the group's timeout. Now whether to agree again is decided by all ranks together."""
    context = multiprocessing.get_context("spawn")
    outcomes = context.Queue()
    ranks = [context.Process(target=_rank_whose_source_is_remade, args=(rank, str(tmp_path / "store"), outcomes))
             for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        seen = sorted(outcomes.get(timeout=120) for _ in range(4))
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    assert [outcome for _, _, outcome, _ in seen] == ["streamed 1"] * 4, seen
    assert all(seconds < 10 for _, _, _, seconds in seen), seen
