"""`SyncConfig`: how a sync runs, validated once, here.

Every field is checked on construction and strings are accepted wherever an
enum is (`quantize_on="rollout"`, `kv_scales="recompute"`), so a config that
exists is a config that works: nothing downstream re-validates or compares
strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from refit.errors import ConfigError, InvalidTensorError
from refit.provenance.kv_stage import KvScalePolicy
from refit.tokens import token_prompts
from refit.transport.kinds import TransportKind, transport_kind

__all__ = ["Delta", "Draft", "Pause", "QuantizeOn", "SyncConfig", "Transport", "Verify", "coerce_enum"]

_LONGEST_WAIT_S = 7 * 24 * 3600  # SyncConfig's deadlines; beyond a week a deadline is no deadline
# Beyond this a window bounds nothing, and what is sized by it is not: the shm transport reuses a file only once it
# is out of a window of about 2n buckets, so a larger one keeps a file per bucket, and Ray's backpressure count is a
# C long (2**63 overflowed it).
_MOST_BUCKETS_IN_FLIGHT = 1 << 16


class Verify(StrEnum):
    """How much of a sync is verified (see `refit.verification`)."""

    OFF = "off"
    CHECKSUMS = "checksums"  # in transit (keyed integrity tags), complete (every tensor), in the engine (scales read back)
    PROBE = "probe"  # the same, plus the logprob probe against the trainer, before serving


class QuantizeOn(StrEnum):
    """Where FP8_BLOCK quantization runs."""

    TRAINER = "trainer"  # FP8 codes + scales on the wire: about half the bytes of bf16
    ROLLOUT = "rollout"  # bf16 on the wire, quantized in the rollout process


class Transport(StrEnum):
    """How a bucket's bytes travel from the trainer to the rollouts' workers (refit/transport/)."""

    AUTO = "auto"  # the Syncer picks one every member can take (refit.transport.kinds.choose_transport)
    RAY = "ray"  # Ray's object store; needs the engine core in the rollout actor's process
    COLLECTIVE = "collective"  # one broadcast group of trainer and workers (gloo on CPU, NCCL on GPU)
    IPC = "ipc"  # CUDA IPC handles: a trainer and rollout on the same GPU
    SHM = "shm"  # memory files of the trainer's, mapped by the workers: trainer and rollouts on one host


class Pause(StrEnum):
    """What an update does to requests in flight (an `AsyncLLM` or `vllm serve` replica; `RolloutActor` always waits)."""

    WAIT = "wait"  # let them finish on the old weights, then update
    ABORT = "abort"  # end them now, marked aborted, then update


class Delta(StrEnum):
    """Whether a sync may send a replica only what changed since the version it serves (refit/transport/delta.py)."""

    AUTO = "auto"  # a delta to every replica whose base is the sender's, a full sync to the others
    OFF = "off"  # every byte, every sync; no base kept on either side


class Draft(StrEnum):
    """What a sync does to a replica's speculative draft model (docs/draft.md)."""

    SYNC = "sync"  # the trainer's `draft.` tensors go to the draft, in the same version as the target's
    FROZEN = "frozen"  # the draft is never touched, whatever the trainer holds


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncConfig:
    bucket_bytes: int = 64 << 20
    """Upper bound of one bucket's wire bytes (the first two buckets hold a quarter and a half of it, so the
    rollout starts loading sooner); a larger tensor travels alone."""

    quantize_on: QuantizeOn = QuantizeOn.TRAINER
    """Where FP8_BLOCK quantization runs (`"trainer"` or `"rollout"`)."""

    kv_scales: KvScalePolicy = KvScalePolicy.AUTO
    """Post-refit KV-scale policy: `"auto"` (reset placeholders to 1.0), `"recompute"`, `"keep"`."""

    calibration_prompts: tuple[tuple[int, ...], ...] = ()
    """Token-id prompts the `"recompute"` policy measures q/k/v on (required for it)."""

    max_buckets_in_flight: int = 2
    """How far the trainer may run ahead of the slowest replica, in buckets."""

    check_against_rollout: bool = True
    """Check the plan against the rollout's own weights (names, shapes, FP8 forms) before any byte
    moves. Turn it off only for a model whose trainer names differ from its checkpoint's and which
    vLLM maps itself; the engine's check that every weight was loaded still applies, but nothing then
    checks a weight's shape against the engine's parameter, and vLLM's loaders may cut a larger one to
    fit (a row-parallel loader narrows its columns) and serve it."""

    verify: Verify = Verify.CHECKSUMS
    """`"checksums"` (default: every entry's bytes carry a keyed integrity tag, checked before they are loaded;
    every planned tensor arrived; the engine's weight scales read back), `"probe"` (also the logprob probe; the
    trainer needs `reference_logprobs`), or `"off"` (no tags: nothing authenticates the bytes in transit, and
    every sync is a full one, since tags are what name a version for deltas). Names, dtypes, shapes and scale
    values are checked against the plan whatever this says."""

    on_probe_breach: str = "fail"
    """What a breached probe threshold does: `"fail"` the sync (replicas refuse) or `"flag"` it in the report."""

    transport: Transport = Transport.AUTO
    """`"auto"` (default: the Syncer asks every member what it can take and picks, before its first sync
    and after the fleet changes; `SyncReport.transport` says which and why), `"shm"` (memory files the
    workers map: trainer and every replica on one host; no deltas), `"ray"` (the object store;
    the engine core must run in the rollout actor's process), `"collective"` (a broadcast group straight
    into the workers; any engine process layout), or `"ipc"` (CUDA only, trainer and rollout on one GPU).
    One per Syncer: a sequence naming several is refused."""

    delta: Delta = Delta.AUTO
    """`"auto"`: send each replica whose last version is the trainer's last one (equal digests) only
    the FP8 codes, scales and bf16 elements that changed, and the others everything; `"off"`: always
    everything. Deltas need `quantize_on="trainer"` and the `ray` or `collective` transport; with
    `"auto"` both ends keep the last version's wire bytes (about 1 byte per FP8 weight). `verify="off"` turns
    deltas off too."""

    draft: Draft = Draft.SYNC
    """`"sync"`: a trainer's tensors named `draft.<checkpoint name>` update the replicas' draft models (a
    speculative `draft_model`) in the same update as the target, so no draft ever serves beside another version
    of its target; `"frozen"`: the drafts keep their weights whatever the trainer holds. A replica without a
    draft ignores the trainer's draft tensors."""

    pause: Pause = Pause.WAIT
    """`"wait"`: requests in flight finish on the old weights before an update; `"abort"`: they end
    at once, marked aborted (an `AsyncLLM` replica, `actors.AsyncRolloutActor`, or a `vllm serve` server's)."""

    progress: bool | None = None
    """A progress bar over buckets on stderr; None: only when stderr is a terminal."""

    timeout_s: float = 120.0
    """Deadline of every remote wait of a sync (begin, each bucket, finish, abort). A trainer that
    dies or stops answering fails the sync, naming it, within this time; a replica is dropped from
    the sync within it (see `min_replicas`); a replica whose update gets no call for
    `update_lease_s` (three of these) closes it by itself. It must also cover the trainer's
    check of every tensor before its first bucket (about 4 GB/s of bf16 on one CPU core)."""

    min_replicas: int = 1
    """How many replicas must serve the new version for a sync to count. A replica that dies or misses
    `timeout_s` during a sync is dropped from it (and from the `Syncer`) while the others complete it;
    once fewer than `min_replicas` remain, the sync fails instead, naming the lost one, and every
    survivor's update is aborted. Set it to the fleet's size to fail on any loss, as before fleets."""

    metrics_tag: str = "refit"
    """The `syncer` label of this Syncer's Ray metrics (`refit/orchestration/metrics.py`): give Syncers
    that share a driver (a policy and a reference model, say) their own, to tell their syncs apart."""

    startup_timeout_s: float = 1800.0
    """How long a sync waits for trainer ranks and replicas that are still being constructed
    (loading a model, starting an engine: minutes on a GPU with torch.compile and CUDA graphs)
    before its first remote call. Awaited once per `Syncer`, before `timeout_s` applies; an actor
    whose constructor fails ends the wait at once, by name."""

    @property
    def update_lease_s(self) -> float:
        """How long a replica's open update lives without a call from its sync before it closes it.

        Why three deadlines: a live driver may rightly be silent towards one
        replica for two of them (waiting out a straggler it then drops, then
        the trainer's next bucket) plus its own work on a loaded machine. A
        lease of one deadline closed a healthy survivor's update while the
        driver dropped a hung replica, and failed the sync it was rescuing.
        """
        return 3 * self.timeout_s

    @property
    def keeps_delta_base(self) -> bool:
        """Whether senders and replicas keep the last version's bytes, so the next sync may be a delta.

        Not for bf16 on the wire (`quantize_on="rollout"`): that base would
        be a second bf16 copy of the model on each side. Not over `ipc` or
        `shm`, where trainer and rollout share a GPU or a host and there is
        no wire to save. Not with `verify="off"`: a version is named by its
        bytes' keyed tags, which such a sync does not make. Under `"auto"`,
        whether the picked transport keeps one (True until a Syncer picks).
        """
        keeps = self.transport is Transport.AUTO or self.transport_kind.traits.delta_base_in is not None
        return self.delta is Delta.AUTO and self.quantize_on is QuantizeOn.TRAINER and self.verify is not Verify.OFF and keeps

    @property
    def transport_kind(self) -> TransportKind:
        """The object that is `transport`: what the driver, the trainer and the replicas ask of it (refit/transport/kinds/)."""
        if self.transport is Transport.AUTO:
            raise ConfigError("transport='auto' names no transport until a Syncer picks one for its fleet (Syncer.transport)")
        return transport_kind(self.transport)

    def __post_init__(self) -> None:
        problems: list[str] = []
        if isinstance(self.transport, (list, tuple, set)):
            kinds = sorted({str(t) for t in self.transport})
            if len(kinds) != 1:
                problems.append(
                    f"transport={self.transport!r}: one Syncer moves every replica's bytes one way, and mixing "
                    f"transports ({', '.join(kinds)}) within one Syncer is not supported; use one Syncer per transport"
                )
            object.__setattr__(self, "transport", kinds[0] if kinds else None)
        for name, enum in (("quantize_on", QuantizeOn), ("kv_scales", KvScalePolicy), ("verify", Verify),
                           ("transport", Transport), ("pause", Pause), ("delta", Delta), ("draft", Draft)):
            try:
                object.__setattr__(self, name, coerce_enum(enum, getattr(self, name), name))
            except ConfigError as error:
                problems.append(str(error))
        _check_positive_int(problems, "bucket_bytes", self.bucket_bytes)
        _check_positive_int(problems, "max_buckets_in_flight", self.max_buckets_in_flight, most=_MOST_BUCKETS_IN_FLIGHT)
        _check_positive_int(problems, "min_replicas", self.min_replicas)
        if self.on_probe_breach not in ("fail", "flag"):
            problems.append(f"on_probe_breach={self.on_probe_breach!r}: expected 'fail' or 'flag'")
        if self.progress not in (None, True, False):
            problems.append(f"progress={self.progress!r}: expected True, False or None")
        if not isinstance(self.metrics_tag, str) or not self.metrics_tag:
            problems.append(f"metrics_tag={self.metrics_tag!r}: expected a non-empty str")
        if not isinstance(self.check_against_rollout, bool):
            problems.append(f"check_against_rollout={self.check_against_rollout!r}: expected True or False")
        for name in ("timeout_s", "startup_timeout_s"):
            value = getattr(self, name)
            # An infinite deadline is none, and a replica's update lease (3 x timeout_s) would never lapse.
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= _LONGEST_WAIT_S:
                problems.append(f"{name}={value!r}: expected a positive number of seconds, at most {_LONGEST_WAIT_S} (a week)")
        try:
            prompts = token_prompts(self.calibration_prompts, setting="calibration_prompts")
            object.__setattr__(self, "calibration_prompts", prompts)
        except InvalidTensorError as error:
            problems.append(str(error))
        if self.kv_scales == KvScalePolicy.RECOMPUTE and not self.calibration_prompts:
            problems.append("kv_scales='recompute' needs calibration_prompts (token-id sequences)")
        if problems:
            raise ConfigError("invalid SyncConfig:\n  " + "\n  ".join(problems))


def coerce_enum(enum: type[StrEnum], value: Any, setting: str) -> Any:
    """`value` as a member of `enum`, from the member or its string value."""
    try:
        return enum(value)
    except ValueError:
        raise ConfigError(f"{setting}={value!r}: expected one of {[m.value for m in enum]}") from None


def _check_positive_int(problems: list[str], name: str, value: Any, *, most: int | None = None) -> None:
    # bool is an int to Python, and "64MB" or 1.5 would fail far from here.
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(f"{name}={value!r}: expected a positive int, got {type(value).__name__}")
    elif value <= 0:
        problems.append(f"{name}={value!r}: expected a positive int")
    elif most is not None and value > most:
        problems.append(f"{name}={value!r}: expected a positive int, at most {most}")
