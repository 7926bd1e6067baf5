"""`Syncer`: put a trainer's current weights into every rollout engine.

The whole flow of one sync, top to bottom:

1. plan (once, reused): trainer metadata + rollout model description ->
   `TransferPlan` (names, FP8_BLOCK decisions, tied alias, buckets);
2. every replica pauses serving and starts a layerwise reload;
3. the trainer streams buckets (Ray streaming generator: each bucket is put
   once in the object store, and the trainer runs at most
   `max_buckets_in_flight` ahead); each bucket is handed to every replica as
   soon as it exists, so quantizing bucket i+1 overlaps loading bucket i, and
   Ray moves it to whichever node a replica lives on;
4. every replica finalizes the reload, runs the post-refit KV-scale stage,
   clears its prefix cache and resumes serving under the new version.

A failure anywhere after step 2 abandons the update on every replica: they
refuse to serve (rather than serve a half-updated model) until a later sync
completes. A retry always starts a fresh stream from the trainer.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from refit.provenance import KvScalePolicy
from refit.orchestration.plan import TransferPlan, make_plan
from refit.orchestration.report import ReplicaReport, SyncReport

__all__ = ["SyncConfig", "Syncer", "sync"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncConfig:
    bucket_bytes: int = 64 << 20
    quantize_on: str = "trainer"  # or "rollout": send bf16, quantize in the rollout process
    kv_scales: KvScalePolicy = KvScalePolicy.AUTO
    calibration_prompts: tuple[tuple[int, ...], ...] = ()  # for kv_scales="recompute"
    max_buckets_in_flight: int = 2

    def __post_init__(self) -> None:
        problems = []
        if self.bucket_bytes <= 0:
            problems.append(f"bucket_bytes={self.bucket_bytes}: must be positive")
        if self.quantize_on not in ("trainer", "rollout"):
            problems.append(f"quantize_on={self.quantize_on!r}: expected 'trainer' or 'rollout'")
        if self.kv_scales not in tuple(KvScalePolicy):
            problems.append(f"kv_scales={self.kv_scales!r}: expected one of {[p.value for p in KvScalePolicy]}")
        if self.kv_scales == KvScalePolicy.RECOMPUTE and not self.calibration_prompts:
            problems.append("kv_scales='recompute' needs calibration_prompts (token-id sequences)")
        if self.max_buckets_in_flight < 1:
            problems.append(f"max_buckets_in_flight={self.max_buckets_in_flight}: must be >= 1")
        if problems:
            raise ValueError("invalid SyncConfig:\n  " + "\n  ".join(problems))


class Syncer:
    """Repeated syncs from one trainer actor to a fixed set of rollout actors."""

    def __init__(self, trainer: Any, rollouts: Any | Sequence[Any], config: SyncConfig | None = None) -> None:
        self.trainer = trainer
        self.rollouts = list(rollouts) if isinstance(rollouts, (list, tuple)) else [rollouts]
        if not self.rollouts:
            raise ValueError("Syncer needs at least one rollout actor")
        self.config = config or SyncConfig()
        self._plan: TransferPlan | None = None
        self._version: int | None = None

    def plan(self) -> TransferPlan:
        """The transfer plan, made on first use from both sides' metadata."""
        if self._plan is None:
            descriptions = ray.get([r.describe.remote() for r in self.rollouts])
            _check_same_model(descriptions)
            self._plan = make_plan(
                ray.get(self.trainer.weight_metadata.remote()), descriptions[0],
                bucket_bytes=self.config.bucket_bytes, quantize_on=self.config.quantize_on,
            )
        return self._plan

    def sync(self) -> SyncReport:
        """Put the trainer's current weights into every rollout; see the module docstring."""
        start = time.perf_counter()
        planned_before = self._plan is not None
        plan = self.plan()
        plan_seconds = 0.0 if planned_before else time.perf_counter() - start
        version = self._next_version()

        ray.get([r.begin_update.remote(plan, version) for r in self.rollouts])
        try:
            load_seconds = self._stream(plan)
            finished = ray.get([
                r.finish_update.remote(self.config.kv_scales, self.config.calibration_prompts)
                for r in self.rollouts
            ])
        except BaseException:
            ray.get([r.abort_update.remote() for r in self.rollouts])
            raise
        self._version = version

        nodes = ray.get([r.node_id.remote() for r in self.rollouts])
        served = ray.get([r.served_version.remote() for r in self.rollouts])
        return SyncReport(
            version=version,
            tensors=len(plan.tensors),
            buckets=len(plan.buckets),
            bytes_on_wire=plan.wire_bytes,
            plan_seconds=plan_seconds,
            trainer_seconds=self._trainer_seconds(),
            total_seconds=time.perf_counter() - start,
            replicas=tuple(
                ReplicaReport(i, nodes[i], served[i], load_seconds[i], finished[i][0], tuple(finished[i][1]))
                for i in range(len(self.rollouts))
            ),
        )

    def _stream(self, plan: TransferPlan) -> list[float]:
        """Hand each bucket to every replica as it is produced; bounded in flight."""
        buckets = self.trainer.stream_buckets.options(
            num_returns="streaming", _generator_backpressure_num_objects=self.config.max_buckets_in_flight
        ).remote(plan)
        in_flight: collections.deque[list[ray.ObjectRef]] = collections.deque()
        seconds = [0.0] * len(self.rollouts)

        def wait_oldest() -> None:
            for replica, spent in enumerate(ray.get(in_flight.popleft())):
                seconds[replica] += spent

        count = 0
        for bucket in buckets:
            in_flight.append([r.load_bucket.remote(bucket) for r in self.rollouts])
            count += 1
            while len(in_flight) >= self.config.max_buckets_in_flight:
                wait_oldest()
        while in_flight:
            wait_oldest()
        if count != len(plan.buckets):
            raise RuntimeError(f"the trainer streamed {count} buckets, the plan has {len(plan.buckets)}")
        return seconds

    def _trainer_seconds(self) -> float | None:
        # Optional in the weight-source protocol: custom trainers may not time themselves.
        try:
            method = self.trainer.last_stream_seconds
        except AttributeError:
            return None
        return ray.get(method.remote())

    def _next_version(self) -> int:
        if self._version is None:
            served = [v for v in ray.get([r.served_version.remote() for r in self.rollouts]) if v is not None]
            self._version = max(served, default=0)
        return self._version + 1


def sync(trainer: Any, rollouts: Any | Sequence[Any], config: SyncConfig | None = None) -> SyncReport:
    """One-off sync. For repeated syncs keep a `Syncer`: it plans once."""
    return Syncer(trainer, rollouts, config).sync()


def _check_same_model(descriptions: list) -> None:
    first = descriptions[0]
    for i, d in enumerate(descriptions[1:], start=1):
        if (d.quantization_config, d.tie_word_embeddings) != (first.quantization_config, first.tie_word_embeddings):
            raise ValueError(
                f"rollout {i} runs a differently configured model than rollout 0 "
                "(quantization_config or tie_word_embeddings differ); use one Syncer per model"
            )

