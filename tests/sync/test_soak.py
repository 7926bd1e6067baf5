"""Soak: many syncs with generation in between and faults injected, nothing lost or leaked.

Sized for CI by default; `REFIT_SOAK_SYNCS=200 .venv/bin/python -m pytest tests/sync/test_soak.py -s`
runs the long version by hand (the README reports that run). Every fourth
round injects a fault, in turn: a NaN in the trainer (refused before any
byte moves), a trainer missing a layer (refused by the plan check, before
any byte moves), and a second sync racing the first (refused, or run after
it, never sharing its version).
"""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import ray

import refit
from fixtures import NEW_TOKENS, PROMPT_LEN, make_prompts, make_sequences, model_dir
from refit import Phase
from tests.support.actors import parameter, process_id, rss_bytes, run_in, set_parameter
from tests.support.checkpoints import write_fewer_layers

SYNCS = int(os.environ.get("REFIT_SOAK_SYNCS", "12"))
PROMPTS = make_prompts(8, PROMPT_LEN, seed=77)
CONFIG = refit.SyncConfig(bucket_bytes=256 << 10, timeout_s=30)
NAN_TARGET = "model.layers.0.mlp.up_proj.weight"

pytestmark = pytest.mark.soak


def object_store_summary(**kwargs) -> str:
    """Ray's memory summary of this test's cluster: named by address, since another Ray instance
    (a second test session, a demo) may run on the same machine and Ray refuses to guess."""
    from ray._private.internal_api import memory_summary

    return memory_summary(address=ray.get_runtime_context().gcs_address, **kwargs)


def objects_held(pids: set[int]) -> int:
    """Object references the given processes hold, in every node's object store.

    Counted per process, not for the whole cluster: the suite's other workers share its nodes and run
    their own tests meanwhile.
    """
    gc.collect()
    rows = (line.split("|") for line in object_store_summary(units="B").splitlines() if line.count("|") >= 8)
    return sum(1 for row in rows if row[1].strip().isdigit() and int(row[1]) in pids and row[7].strip() != "ACTOR_HANDLE")


def settled_objects_held(pids: set[int], baseline: int, deadline_s: float = 60.0) -> int:
    """`objects_held`, asked again while above `baseline`: released references reach the raylets
    asynchronously, and a loaded machine can take seconds."""
    start = time.monotonic()
    while (held := objects_held(pids)) > baseline and time.monotonic() - start < deadline_s:
        time.sleep(1)
    return held


def test_soak(shared_replicas, module_actors, tmp_path):
    replicas = shared_replicas  # the session's two dummy-loaded FP8 replicas; the first sync makes them whole
    # Start from the trained model: FP8 rollouts then match the bf16 trainer token for token.
    trainer = module_actors.trainer(model_dir(True, "bf16"), lr=3e-4)
    short = module_actors.trainer(write_fewer_layers(model_dir(True, "bf16"), tmp_path / "one-layer", 1))
    syncer = refit.Syncer(trainer, replicas, CONFIG)

    faults = {"nan": 0, "missing layer": 0, "racing sync": 0}
    versions: list[int] = []
    rss: list[int] = []
    pids = {os.getpid(), *(run_in(actor, process_id) for actor in (trainer, short, *replicas))}
    held_before = objects_held(pids)
    for step in range(SYNCS):
        ray.get(trainer.train_step.remote(make_sequences(8, 16, seed=step).tolist()))
        kind = list(faults)[(step // 4) % len(faults)] if step % 4 == 3 else None
        if kind == "nan":
            good = run_in(trainer, parameter, NAN_TARGET)
            bad = good.clone()
            bad[0, 0] = float("nan")
            run_in(trainer, set_parameter, NAN_TARGET, bad)
            with pytest.raises(refit.InvalidTensorError, match="holds NaN"):
                syncer.sync()
            run_in(trainer, set_parameter, NAN_TARGET, good)
            assert all(ray.get(r.status.remote()).phase is Phase.SERVING for r in replicas)  # untouched
        elif kind == "missing layer":
            with pytest.raises(refit.PlanMismatchError, match="the trainer sends nothing"):
                refit.Syncer(short, replicas, CONFIG).sync()
            assert all(ray.get(r.status.remote()).phase is Phase.SERVING for r in replicas)  # nothing was sent
        elif kind == "racing sync":
            rival = threading.Thread(target=lambda: _quietly(refit.Syncer(trainer, replicas, CONFIG).sync))
            rival.start()
        if kind:
            faults[kind] += 1
        report = syncer.sync() if kind != "racing sync" else _retry_while_busy(syncer)
        if kind == "racing sync":
            rival.join(60)
        versions.append(report.version)
        expected = ray.get(trainer.generate.remote(PROMPTS, NEW_TOKENS))
        for replica in replicas:
            state = ray.get(replica.status.remote())
            assert state.phase is Phase.SERVING and state.served_version >= report.version
            assert ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS)).token_ids == expected, f"sync {step}: data lost"
        rss.append(run_in(replicas[0], rss_bytes))

    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert all(faults.values()) or SYNCS < 12
    # Memory: after 4 warm-up syncs, growth stays under 4 syncs' worth of wire bytes plus 16 MiB of allocator noise.
    growth = rss[-1] - rss[min(3, len(rss) - 1)]
    bound = 4 * report.bytes_on_wire + (16 << 20)
    left = settled_objects_held(pids, held_before) - held_before
    print(f"\nsoak: {SYNCS} syncs, faults {faults}, versions {versions[0]}..{versions[-1]}, rollout RSS growth "
          f"{growth / 2**20:.1f} MiB (bound {bound / 2**20:.1f}), object references left {left}")
    assert growth < bound
    if left > 0:
        print(object_store_summary(units="B"))
    assert left <= 0


def _quietly(fn) -> None:
    try:
        fn()
    except refit.RefitError:
        pass  # the race's loser is refused: that is the point


def _retry_while_busy(syncer: refit.Syncer) -> refit.SyncReport:
    for _ in range(50):
        try:
            return syncer.sync()
        except refit.LifecycleError as error:
            if "another sync" not in str(error):
                raise
    raise AssertionError("the racing sync never finished")
