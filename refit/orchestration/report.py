"""What one sync did, per stage and per replica (all plain data, JSON-friendly)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["AdapterSyncReport", "DroppedReplica", "ReplicaReport", "SyncReport"]


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    replica: int  # its id in the Syncer ("rollout <id>"): given when it joined, never reused
    node_id: str
    served_version: int | None
    load_seconds: float  # inside load_weights, all buckets
    finish_seconds: float  # verification, reload finalization, post-refit stage, probe
    kv_scales_written: tuple[str, ...]
    verification: str = ""  # what was verified, and the probe's outcome
    mode: str = "full"  # "delta": it got only what changed since the version it served
    bytes_received: int = 0  # bucket bytes it received
    digest: str | None = None  # of the version it serves, when it keeps that version as a delta base
    draft_acceptance: float | None = None  # its draft model's accepted share of drafted tokens after the sync, if any


@dataclass(frozen=True, slots=True)
class DroppedReplica:
    """A replica a sync went on without: it died or missed the deadline; the Syncer no longer has it."""

    replica: int  # its id ("rollout <id>")
    stage: str  # where it was lost: "pick" (of the transport, `transport="auto"`), "begin", "connect", "stream" or "finish"
    cause: str  # "died" or "missed the deadline"
    error: str  # the error that said so, `Type: first line`

    def __str__(self) -> str:
        return f"rollout {self.replica} {self.cause} at {self.stage} ({self.error})"


@dataclass(frozen=True, slots=True)
class SyncReport:
    version: int
    tensors: int  # planned tensors (a quantized weight counts once)
    buckets: int
    bytes_on_wire: int  # a full sync's size; a replica synced by a delta received less (`ReplicaReport.bytes_received`)
    plan_seconds: float  # 0.0 when the plan was reused; never includes the wait for actors to start
    trainer_seconds: float | None  # preflight checks, quantization and packing (if the trainer reports it)
    total_seconds: float
    replicas: tuple[ReplicaReport, ...]
    begin_seconds: float = 0.0  # every replica paused and its reload started
    stream_seconds: float = 0.0  # first bucket requested to last bucket loaded everywhere
    finish_seconds: float = 0.0  # every replica verified, finished and serving
    probe_breached: bool = False  # the probe breached its thresholds somewhere and `on_probe_breach="flag"`
    startup_seconds: float = 0.0  # waiting for trainer ranks and replicas to be constructed (the Syncer's first call only)
    dropped: tuple[DroppedReplica, ...] = ()  # replicas lost during the sync; `replicas` are the ones that serve it
    attempts: int = 1  # more than one: the survivors began again (a replica lost mid-broadcast, or a delta base that failed)
    digest: str | None = None  # of the version the trainer sent (its entries' keyed integrity tags, combined), with delta syncs on
    gathered_bytes: int | None = None  # what a sharded trainer's ranks all-gathered to send what they could not send as held
    transport: str = ""  # the road the bytes took ("ray", "collective", "ipc", "shm")
    transport_reason: str = ""  # why: picked by transport="auto" for this fleet, or set by SyncConfig.transport

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        mib = self.bytes_on_wire / 2**20
        lines = [
            f"sync v{self.version}: {self.tensors} tensors in {self.buckets} buckets, {mib:.1f} MiB in a full sync, "
            f"{self.total_seconds:.3f} s total ("
            + (f"waited {self.startup_seconds:.3f} s for actors to start, " if self.startup_seconds else "")
            + f"plan {self.plan_seconds:.3f} s, begin {self.begin_seconds:.3f} s, "
            f"stream {self.stream_seconds:.3f} s, finish {self.finish_seconds:.3f} s"
            + (f"; trainer busy {self.trainer_seconds:.3f} s" if self.trainer_seconds is not None else "")
            + (f", its ranks gathered {self.gathered_bytes / 2**20:.2f} MiB" if self.gathered_bytes else "") + ")"
        ]
        if self.transport:
            lines.append(f"  over {self.transport}: {self.transport_reason}")
        lines += [
            f"  replica {r.replica} on {r.node_id[:8]}: load {r.load_seconds:.3f} s, finish {r.finish_seconds:.3f} s, "
            f"serves v{r.served_version} ({r.mode}, {r.bytes_received / 2**20:.2f} MiB received), "
            f"{len(r.kv_scales_written)} KV scales written"
            + (f", draft acceptance {r.draft_acceptance:.0%}" if r.draft_acceptance is not None else "")
            + (f"; verified: {r.verification}" if r.verification else "")
            for r in self.replicas
        ]
        lines += [f"  dropped {d}" for d in self.dropped]
        if self.attempts > 1:
            lines.append(f"  the survivors began again {self.attempts - 1} time(s)")
        if self.probe_breached:
            lines.append("  WARNING: the logprob probe breached its thresholds (on_probe_breach='flag')")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class AdapterSyncReport:
    """What one adapter sync did (`Syncer.sync_adapter`): only the adapter's bytes moved, the base untouched."""

    name: str
    version: int  # the adapter version every replica in `replicas` serves
    sync_id: str
    bytes_per_replica: int  # the adapter's tensors, what each replica fetched
    digest: str  # SHA-256 of the adapter's bytes, which every replica's engine reported holding
    stage_seconds: float  # until every replica held it (staged), beside the adapter it served
    total_seconds: float
    replicas: dict[int, dict] = field(default_factory=dict)  # id -> what it serves now, what it retired and unloaded
    dropped: tuple[DroppedReplica, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        lines = [f"adapter sync {self.name!r} v{self.version}: {self.bytes_per_replica / 2**10:.1f} KiB per replica, "
                 f"staged in {self.stage_seconds:.3f} s, {self.total_seconds:.3f} s total; base untouched"]
        lines += [f"  replica {rid}: serves {swap['serving']}" + (f", retired {swap['retired']}" if swap["retired"] else "")
                  + (" (unloaded)" if swap["unloaded"] else " (unloaded once its requests end)" if swap["retired"] else "")
                  for rid, swap in sorted(self.replicas.items())]
        lines += [f"  dropped {d}" for d in self.dropped]
        return "\n".join(lines)
