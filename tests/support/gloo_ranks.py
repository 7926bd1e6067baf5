"""Two real trainer ranks over gloo, each in a process of its own: for the sharded tests whose fault needs a peer.

A rank function runs in a spawned process as `target(rank, store_path, outcomes, *args)`, joins the world with
`gloo_rank` (or `megatron_fixture_rank`), and says what each of its streams did with `report_stream`;
`run_two_ranks` runs it on both and returns what they said. Each report carries its seconds, so a test can tell a
refusal at once from a wait until the group's timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import queue
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["gloo_rank", "megatron_fixture_rank", "report_stream", "run_two_ranks"]


def run_two_ranks(target: Callable[..., None], tmp_path: Path, *args: Any, reports: int,
                  timeout_s: float = 240) -> list[tuple]:
    """`target(rank, store_path, outcomes, *args)` on the two rank processes; the `reports` tuples they put, sorted.

    The processes are this pytest process's pair, kept between tests: a spawned one spends most of a test's time
    importing torch and megatron-core before it can run a rank (docs/performance.md, "The test suite"). A test's
    ranks leave no state behind (`gloo_rank` destroys its group, `megatron_fixture_rank` Megatron's parallel
    state); a pair whose rank raised, exited or did not end within the deadline is killed, and the next test gets
    a new one.
    """
    global _pair
    if _pair is None or not _pair.alive():
        _pair = _RankPair()
    pair, clean = _pair, False
    try:
        seen = pair.run(target, str(tmp_path / "store"), args, reports, timeout_s)
        clean = True
        return seen
    finally:
        if not (clean and pair.finished(timeout_s=60)):
            pair.kill()
            _pair = None


class _RankPair:
    """Two spawned processes, rank 0 and rank 1, each running one test's rank function at a time (`_serve_rank`)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.outcomes, self.done = context.Queue(), context.Queue()
        self.inboxes = [context.Queue() for _ in range(2)]
        self.jobs = 0
        self.processes = [context.Process(target=_serve_rank, args=(rank, inbox, self.outcomes, self.done), daemon=True)
                          for rank, inbox in enumerate(self.inboxes)]
        for process in self.processes:
            process.start()

    def alive(self) -> bool:
        return all(process.is_alive() for process in self.processes)

    def run(self, target: Callable[..., None], store_path: str, args: tuple, reports: int, timeout_s: float) -> list[tuple]:
        """The job's reports; any a rank put for an earlier job (more than that test waited for) are dropped."""
        self.jobs += 1
        for inbox in self.inboxes:
            inbox.put((self.jobs, target, store_path, args))
        deadline, seen = time.monotonic() + timeout_s, []
        while len(seen) < reports:
            job, report = self.outcomes.get(timeout=max(deadline - time.monotonic(), 0.01))
            if job == self.jobs:
                seen.append(report)
        return sorted(seen)

    def finished(self, timeout_s: float) -> bool:
        """Whether both ranks returned from this job's function, rather than raised."""
        try:
            returned = [self.done.get(timeout=timeout_s) for _ in self.processes]
        except queue.Empty:
            return False
        return all(returned)

    def kill(self) -> None:
        for process in self.processes:
            process.kill()
            process.join(timeout=60)


_pair: _RankPair | None = None


class _JobReports:
    """What a rank function puts its reports on: the pair's queue, each report tagged with its job."""

    def __init__(self, outcomes: Any, job: int) -> None:
        self.outcomes, self.job = outcomes, job

    def put(self, report: tuple) -> None:
        self.outcomes.put((self.job, report))


def _serve_rank(rank: int, inbox: Any, outcomes: Any, done: Any) -> None:
    """A rank process's loop: run each function sent to it; say whether it returned."""
    while True:
        job, target, store_path, args = inbox.get()
        try:
            target(rank, store_path, _JobReports(outcomes, job), *args)
        except BaseException:  # noqa: BLE001 - shown in the test's output; the pair is then replaced
            traceback.print_exc()
            done.put(False)
        else:
            done.put(True)


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
