"""A rank that cannot read its part of a gathered tensor fails the gather on every holder at once, not at the timeout.

Real megatron-core ranks at TP=2 over gloo, each in a process of its own; the fault is one rank's read of its
columns of a row-parallel weight (what out of memory while casting it would be), raised inside the layout's gather.
"""

from __future__ import annotations

import multiprocessing

import torch

from refit.plan import RolloutModelInfo, SyncConfig, make_plan
from tests.support.fakes import FP8_BLOCK

FAILING = "model.layers.0.self_attn.o_proj.weight"  # row-parallel at TP=2: its columns are gathered


def _tp_rank_whose_peer_fails_a_gather(rank: int, store_path: str, outcomes) -> None:
    """Rank `rank` of TP=2 (gloo, 30 s group timeout) of the Qwen3 fixture; rank 1 cannot read its part of `FAILING`
    in the first stream. Streams twice, settling what a failed stream owes as `TrainerWeights` does."""
    import datetime
    import json
    import time
    from pathlib import Path

    from megatron.core import parallel_state

    from actors.megatron_group import MegatronParallel, _gpt_model, _quiet_megatron_imports
    from fixtures import model_dir
    from refit.errors import take_settlement
    from refit.provenance.tracker import checkpoint_tensor_names
    from refit.sharding.megatron import load_hf_checkpoint, megatron_source

    _quiet_megatron_imports()
    checkpoint = model_dir(False, "bf16")
    store = torch.distributed.FileStore(store_path, 2)
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        config = json.loads((Path(checkpoint) / "config.json").read_text())
        model = _gpt_model(config, checkpoint_tensor_names(checkpoint), MegatronParallel(tp=2))
        source = megatron_source(model, vocab_size=config["vocab_size"])
        load_hf_checkpoint(source.layout, checkpoint)
        metas: list = [None, None]
        torch.distributed.all_gather_object(metas, source.metadata())
        plan = make_plan(metas[0] + metas[1], RolloutModelInfo(FP8_BLOCK, False), SyncConfig(bucket_bytes=64 << 10))
        read = source.layout._part

        def failing_read(param, slot):
            if slot.target == FAILING:
                raise MemoryError("out of memory casting it (test)")
            return read(param, slot)

        for attempt in range(2):
            if rank == 1:
                source.layout._part = failing_read if attempt == 0 else read
            start = time.monotonic()
            try:
                list(source.stream(plan.for_sync(b"key", f"s{attempt}", 30.0)))
                outcomes.put((rank, attempt, "streamed", time.monotonic() - start))
            except Exception as error:  # noqa: BLE001 - what each rank saw is the test's result
                outcomes.put((rank, attempt, f"{type(error).__name__}: {error}", time.monotonic() - start))
                settle = take_settlement(error)
                if settle is not None:
                    settle()
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def test_a_rank_that_cannot_read_its_part_of_a_gather_fails_it_on_every_holder_at_once_and_the_group_streams_on(tmp_path):
    """Found by review: a rank whose gather raised before its first collective (its part could not be read) joined
    no more gathers, and its tensor-parallel peer waited in the all-gather until the group's timeout (30 s here),
    which breaks a gloo group for good, so the next stream failed too. Now both raise at once, the peer naming the
    failing rank and the tensor, the failing rank its cause, and the next stream runs on the same group."""
    context = multiprocessing.get_context("spawn")
    outcomes = context.Queue()
    ranks = [context.Process(target=_tp_rank_whose_peer_fails_a_gather, args=(rank, str(tmp_path / "store"), outcomes))
             for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        seen = sorted(outcomes.get(timeout=240) for _ in range(4))
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    assert [(rank, attempt) for rank, attempt, _, _ in seen] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    (_, _, peer, peer_s), (_, _, peer_next, _), (_, _, failing, failing_s), (_, _, failing_next, _) = seen
    assert peer.startswith(f"GatherFailedError: {FAILING}: trainer rank 1 could not read its part"), peer
    assert failing == (f"GatherFailedError: {FAILING}: trainer rank 1 could not read its part to gather it: "
                       "MemoryError: out of memory casting it (test)"), failing
    assert peer_s < 20 and failing_s < 20, (peer_s, failing_s)  # at once, not at the group's timeout
    assert (peer_next, failing_next) == ("streamed", "streamed")
