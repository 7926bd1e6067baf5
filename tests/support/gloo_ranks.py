"""Two real trainer ranks over gloo, each in a process of its own: for the sharded tests whose fault needs a peer.

A rank function runs in a spawned process as `target(rank, store_path, outcomes, *args)`, joins the world with
`gloo_rank` (or `megatron_fixture_rank`), and says what each of its streams did with `report_stream`;
`run_two_ranks` starts both and returns what they said. Each report carries its seconds, so a test can tell a
refusal at once from a wait until the group's timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["gloo_rank", "megatron_fixture_rank", "report_stream", "run_two_ranks"]


def run_two_ranks(target: Callable[..., None], tmp_path: Path, *args: Any, reports: int,
                  timeout_s: float = 240) -> list[tuple]:
    """`target(rank, store_path, outcomes, *args)` in two spawned processes; the `reports` tuples they put, sorted."""
    context = multiprocessing.get_context("spawn")
    outcomes = context.Queue()
    ranks = [context.Process(target=target, args=(rank, str(tmp_path / "store"), outcomes, *args)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        return sorted(outcomes.get(timeout=timeout_s) for _ in range(reports))
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()


@contextlib.contextmanager
def gloo_rank(rank: int, store_path: str, timeout_s: float) -> Iterator[None]:
    """This process as rank `rank` of a world of two over gloo, whose collectives wait at most `timeout_s`."""
    store = torch.distributed.FileStore(store_path, 2)
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=2,
                                         timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def megatron_fixture_rank(rank: int, store_path: str, *, tp: int = 1, pp: int = 1,
                          timeout_s: float = 30) -> Iterator[tuple[torch.nn.Module, Any, list]]:
    """Rank `rank` of a real megatron-core `GPTModel` of the untied Qwen3 fixture split `tp` x `pp` (one of them 2),
    loaded with the fixture's weights: the model, its `megatron_source`, and both ranks' metadata (to plan with)."""
    import json

    from megatron.core import parallel_state

    from actors.megatron_group import MegatronParallel, _gpt_model, _quiet_megatron_imports
    from fixtures import model_dir
    from refit.provenance.tracker import checkpoint_tensor_names
    from refit.sharding.megatron import load_hf_checkpoint, megatron_source

    _quiet_megatron_imports()
    checkpoint = model_dir(False, "bf16")
    with gloo_rank(rank, store_path, timeout_s):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        try:
            config = json.loads((Path(checkpoint) / "config.json").read_text())
            model = _gpt_model(config, checkpoint_tensor_names(checkpoint), MegatronParallel(tp=tp, pp=pp))
            source = megatron_source(model, vocab_size=config["vocab_size"])
            load_hf_checkpoint(source.layout, checkpoint)
            metas: list = [None, None]
            torch.distributed.all_gather_object(metas, source.metadata())
            yield model, source, metas[0] + metas[1]
        finally:
            parallel_state.destroy_model_parallel()


def report_stream(outcomes: Any, rank: int, attempt: int, stream: Callable[..., Iterable], *args: Any) -> Exception | None:
    """Run `stream(*args)` to its end and put `(rank, attempt, what happened, seconds)` on `outcomes`: "streamed N"
    (N parts), or the error as "Type: message", which is also returned."""
    start = time.monotonic()
    try:
        parts = list(stream(*args))
    except Exception as error:  # noqa: BLE001 - what each rank saw is the test's result
        outcomes.put((rank, attempt, f"{type(error).__name__}: {error}", time.monotonic() - start))
        return error
    outcomes.put((rank, attempt, f"streamed {len(parts)}", time.monotonic() - start))
    return None
