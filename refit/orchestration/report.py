"""What one sync did, per stage and per replica (all plain data, JSON-friendly)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["ReplicaReport", "SyncReport"]


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    replica: int
    node_id: str
    served_version: int | None
    load_seconds: float  # inside load_weights, all buckets
    finish_seconds: float  # reload finalization + post-refit stage
    kv_scales_written: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SyncReport:
    version: int
    tensors: int  # planned tensors (a quantized weight counts once)
    buckets: int
    bytes_on_wire: int  # what each replica fetched
    plan_seconds: float  # 0.0 when the plan was reused
    trainer_seconds: float | None  # preflight checks, quantization and packing (if the trainer reports it)
    total_seconds: float
    replicas: tuple[ReplicaReport, ...]

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        mib = self.bytes_on_wire / 2**20
        lines = [
            f"sync v{self.version}: {self.tensors} tensors in {self.buckets} buckets, {mib:.1f} MiB on the wire, "
            f"{self.total_seconds:.3f} s total (plan {self.plan_seconds:.3f} s"
            + (f", trainer {self.trainer_seconds:.3f} s)" if self.trainer_seconds is not None else ")")
        ]
        lines += [
            f"  replica {r.replica} on {r.node_id[:8]}: load {r.load_seconds:.3f} s, finish {r.finish_seconds:.3f} s, "
            f"serves v{r.served_version}, {len(r.kv_scales_written)} KV scales written"
            for r in self.replicas
        ]
        return "\n".join(lines)
