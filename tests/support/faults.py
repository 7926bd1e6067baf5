"""Injecting a fault into a running sync."""

from __future__ import annotations

import threading
import time

import pytest
import ray
import torch

import refit

__all__ = [
    "HandWrittenSource", "die_at", "die_when_joining", "fail_loading_from", "kill_during_syncs", "kill_mid_stream", "quantizing_fault",
    "slow_loading", "tamper_next_stream",
]


def kill_during_syncs(syncer: refit.Syncer, victim, *, after_s: float, error: type[BaseException], match: str,
                      within_s: float = 60) -> BaseException:
    """Kill actor `victim` `after_s` into back-to-back syncs; the error one of them raises, within `within_s`.

    The syncs run until one fails (50 at most), so the kill lands mid-sync whatever a sync costs.
    """
    threading.Timer(after_s, lambda: ray.kill(victim)).start()
    start = time.monotonic()
    with pytest.raises(error, match=match) as raised:
        for _ in range(50):
            syncer.sync()
    assert time.monotonic() - start < within_s
    return raised.value


def kill_mid_stream(victim, *, after_buckets: int = 3, within_s: float = 300) -> threading.Thread:
    """Kill rollout actor `victim` once an update of it has loaded `after_buckets` buckets; the (started) watching thread.

    Watching the replica's own progress, not a clock, puts the kill mid-stream however loaded the machine
    is. The thread gives up after `within_s`; join it, then check `victim` is dead.
    """
    from tests.support.actors import buckets_loaded, run_in

    def watch() -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if run_in(victim, buckets_loaded) >= after_buckets:
                ray.kill(victim)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, name="kill-mid-stream", daemon=True)
    thread.start()
    return thread


def die_at(rank, method: str, call: int) -> None:
    """Run in a `TrainerRank` (`run_in`): its process exits at its `call`-th call of its layout's `method`, a crash at a chosen point."""
    import os

    original, calls = getattr(rank.source.layout, method), [0]

    def dying(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            os._exit(1)
        return original(*args, **kwargs)

    setattr(rank.source.layout, method, dying)


def die_when_joining(trainer) -> None:
    """Run in a `TrainerActor` (`run_in`): its process exits when a sync asks it to join a collective group."""
    import os

    def dying(*args, **kwargs):
        os._exit(1)

    trainer.weights.sender.join = dying


def tamper_next_stream(trainer, how: str, bucket: int = 0) -> None:
    """Run in a `TrainerActor` (`run_in`): bucket `bucket` of its next stream is altered after it was packed and tagged.

    `how`: "forged" flips a byte and tags it again with a key of the attacker's own (what an attacker on the data
    plane can do: a CRC it would simply recompute); "stripped" flips a byte and drops the tag; the others stand for
    a broken source that holds the sync's key: "zero_scale", "negative_scale", "nan_scale" write into an FP8 weight
    scale, "wrong_dtype" relabels a scale's bf16 bytes float16, "unplanned" renames an entry; each is tagged again
    with the sync's own key, so only the receiver's plan checks can refuse it. Later streams are honest.
    """
    import dataclasses
    import inspect

    from refit.transport.buckets import WireBucket, element_view
    from refit.transport.integrity import new_sync_key, tag

    # The globals its `_produce` reads (under Ray's tracing wrapper): Ray ships an actor class by value, with globals
    # of its own.
    namespace = inspect.unwrap(type(trainer)._produce).__globals__
    honest = namespace["produce_buckets"]

    def altered(packed: WireBucket, key: bytes) -> WireBucket:
        buffer = packed.buffer.copy()
        flat = torch.from_numpy(buffer)
        table = list(packed.tensors)
        i = next((n for n, t in enumerate(table) if t.name.endswith("weight_scale")), 0) if how.endswith(("scale", "dtype")) else 0
        entry = table[i]
        data = flat[entry.offset : entry.offset + entry.nbytes]
        if how in ("forged", "stripped"):
            data[0] ^= 0xFF
        elif how.endswith("scale"):
            data.view(element_view(entry.dtype))[0] = {"zero_scale": 0.0, "negative_scale": -0.5, "nan_scale": float("nan")}[how]
        elif how == "wrong_dtype":
            entry = dataclasses.replace(entry, dtype="float16")
        elif how == "unplanned":
            entry = dataclasses.replace(entry, name="model.layers.0.self_attn.injected.weight")
        else:
            raise ValueError(how)
        signing = {"forged": new_sync_key(), "stripped": None}.get(how, key)
        table[i] = dataclasses.replace(entry, tag=None if signing is None else tag(signing, entry.identity, data))
        return WireBucket(packed.index, tuple(table), buffer)

    def tampering(plan, tensor):
        namespace["produce_buckets"] = honest  # one stream only
        for packed in honest(plan, tensor):
            yield altered(packed, plan.integrity_key) if packed.index == bucket else packed

    namespace["produce_buckets"] = tampering


class HandWrittenSource:
    """What hand-written weight sources share: a bf16 model from a checkpoint, its metadata, its buckets. Each
    subclass (a Ray actor) writes its own `stream_buckets`, the way a user's faulty one would be.

    Here rather than in a test module: a Ray actor's base class is pickled by reference, and a test module is not
    importable in Ray's workers.
    """

    def __init__(self, checkpoint: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)

    def weight_metadata(self):
        return refit.describe_weights(self.model)

    def buckets(self, plan):
        return refit.produce_buckets(plan, refit.checkpoint_tensors(self.model))


@ray.remote
class DroppingTrainer(HandWrittenSource):
    """Claims every weight in its metadata, then streams none whose name begins with `drop` (a buggy custom weight
    source)."""

    def __init__(self, checkpoint: str, drop: str) -> None:
        super().__init__(checkpoint)
        self.drop = drop

    def stream_buckets(self, plan):
        from refit.transport.buckets import pack_bucket

        for bucket in self.buckets(plan):
            kept = [(name, tensor) for name, tensor in bucket.unpack() if not name.startswith(self.drop)]
            yield pack_bucket(bucket.index, kept, key=plan.integrity_key)


def quantizing_fault(rank, fail_from: int | None = None, delay_s: float = 0.0) -> None:
    """Run in a sharded trainer rank (`run_in`): from its `fail_from`-th tensor on, its quantizing raises MemoryError,
    `delay_s` into the call (time for its peers to reach their next gather); with no `fail_from`, each tensor takes
    `delay_s` longer; with neither, quantizing is as before."""
    from refit.quantizer import fp8_block
    from refit.sharding import rank_source

    if fail_from is None and not delay_s:
        rank_source.loadable_form = fp8_block.loadable_form
        return
    seen = []

    def faulty(*args, **kwargs):
        seen.append(None)
        time.sleep(delay_s)
        if fail_from is not None and len(seen) >= fail_from:
            raise MemoryError("out of memory quantizing (injected)")
        return fp8_block.loadable_form(*args, **kwargs)

    rank_source.loadable_form = faulty


def unreadable_part(rank, target: str | None) -> None:
    """Run in a `MegatronRank` (`run_in`): reading its own part of checkpoint tensor `target` raises MemoryError (as
    out of memory casting it would); with no `target`, reading is as before."""
    layout = rank.source.layout
    layout.__dict__.pop("_part", None)
    if target is None:
        return
    read = layout._part

    def failing(param, slot):
        if slot.target == target:
            raise MemoryError(f"out of memory reading {target} (injected)")
        return read(param, slot)

    layout._part = failing


def fail_loading_from(rollout, bucket: int | None) -> None:
    """Run in a rollout actor (`run_in`): from its `bucket`-th bucket on, loading raises (None: loading is as before)."""
    if bucket is None:
        rollout.replica.__dict__.pop("load_bucket", None)
        return
    original, seen = rollout.replica.load_bucket, []

    def failing(*args, **kwargs):
        seen.append(None)
        if len(seen) >= bucket:
            raise RuntimeError("this replica failed to load a bucket (injected)")
        return original(*args, **kwargs)

    rollout.replica.load_bucket = failing


def slow_loading(rollout, delay_s: float | None) -> None:
    """Run in a rollout actor (`run_in`): each bucket's load waits `delay_s` first (None: loading is as before)."""
    rollout.replica.__dict__.pop("load_bucket", None)
    if delay_s is None:
        return
    original = rollout.replica.load_bucket

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return original(*args, **kwargs)

    rollout.replica.load_bucket = slow
