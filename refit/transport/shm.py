"""The shm transport: a trainer and rollouts on one host share each bucket through a memory file, written once.

Why: between two processes of one host, Ray's object store copies every
bucket into its store, and a second time between two Ray nodes (raylets copy
objects between their stores even on one host); measured on a 2-core VM, the
copy between raylets took as long as vLLM's load of the same bytes. Here the
trainer writes each bucket into one of a few memory files (`memfd_create`)
it owns (the quantizer straight into the file, through `buffers_from`; a
bucket made elsewhere is copied in), and only the table of contents and
the file's place cross Ray and vLLM's RPC; each vLLM worker maps the file read-only and
loads from the mapping, in whichever process it runs.

Why a ring of files, reused: a fresh buffer per bucket costs a page
fault per 4 KiB on both sides, every sync. The trainer runs at most
`max_buckets_in_flight` buckets ahead of the driver (the ipc transport's
rule, `IpcTransport.for_buckets_in_flight`: `keep`), so a file that took a
bucket is given another only after `keep - 1` newer ones, when its readers
are done with it; which of the files outside that window, by size
(`SharedSegments`).

Why a sequence number in each file's header, checked before and after the
load: nothing else stops a writer, e.g. a second stream of a threaded trainer
actor, from rewriting a file a worker is still loading. The trainer
writes the new number before the bytes, so a worker that finds the number
it was told, after its load, loaded bytes that nobody rewrote meanwhile;
otherwise the bucket is refused by name and the update abandoned, whether or
not integrity tags are checked. (A sync's stream ends only once its replicas
loaded every bucket, `refit.transport.buckets.ReadersDone`, so a second
Syncer of the same trainer actor streams after it, not into its files.)

Why a memory file: it lives exactly as long as the trainer's process (or a
worker's mapping of it), so a killed trainer leaves nothing in /dev/shm. A
worker opens it as `/proc/<pid>/fd/<fd>`, which needs the trainer's process
visible: one host, one PID namespace, one user (`host_identity`, which
`transport="auto"` compares before picking it).
"""

from __future__ import annotations

import collections
import mmap
import os
import stat
import threading
import uuid
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from refit.errors import TransportError, VerificationError
from refit.transport.buckets import BucketContents, WireBucket

__all__ = ["SegmentRef", "ShmHandle", "SharedSegments", "forget_unused_mappings", "host_identity", "open_shm_bucket",
           "refuse_rewritten", "shared_segments"]

_HEADER = 64  # segment id (16 bytes), sequence number (8), then padding: the bytes start cache-line aligned
_MIN_CAPACITY = 1 << 20
_SPARE = 2  # files a trainer's ring holds beyond `keep`, so that a bucket has a choice (`SharedSegments`)
# Per worker process, of the files its current update has not read (a ring's files, 8 by default, twice over for a
# second trainer); those it has read stay mapped however many: a ring of keep + _SPARE files (20 at
# max_buckets_in_flight=8) would otherwise be mapped anew at every bucket.
_MAPPINGS_KEPT = 16


@dataclass(frozen=True, slots=True)
class ShmHandle:
    """What a trainer's stream is told for `transport="shm"`: how many buckets its ring of files holds."""

    keep: int


@dataclass(frozen=True, slots=True)
class SegmentRef:
    """Where a bucket's bytes lie: the trainer's `pid` and `fd` of the file, the file's id and the bucket's sequence
    number in it. Plain values only: it crosses vLLM's RPC inside `BucketContents`."""

    pid: int
    fd: int
    segment: str
    sequence: int

    @classmethod
    def from_plain(cls, plain: object) -> SegmentRef:
        """A ref from what crossed an RPC, refused unless it is four values of the right types."""
        if not (isinstance(plain, (list, tuple)) and len(plain) == 4 and all(type(v) is int for v in (plain[0], plain[1], plain[3]))
                and isinstance(plain[2], str) and len(plain[2]) == 32 and plain[0] > 0 and plain[1] >= 0):
            raise TransportError(f"a bucket's shared-memory place {plain!r} is not (pid, fd, 32-hex segment id, sequence)")
        return cls(*plain)

    def to_plain(self) -> tuple[int, int, str, int]:
        return (self.pid, self.fd, self.segment, self.sequence)


def host_identity() -> str:
    """Who can open this process's memory files: same boot of the same kernel, same PID namespace, same user.
    Empty where /proc does not say (then `transport="auto"` never picks `shm`)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()}|{os.readlink('/proc/self/ns/pid')}|uid {os.getuid()}"
    except OSError:
        return ""


class _Segment:
    """One memory file of the trainer's, mapped read-write; never resized (a reader's mapping must stay valid)."""

    def __init__(self, capacity: int) -> None:
        if not hasattr(os, "memfd_create"):
            raise TransportError("transport='shm' needs memory files (os.memfd_create: Linux), which this trainer's "
                                 "platform lacks; use 'ray' or 'collective'")
        self.id = uuid.uuid4()
        self.fd = os.memfd_create(f"refit-bucket-{self.id.hex[:8]}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, _HEADER + capacity)  # sparse: pages exist once written
            self._map = mmap.mmap(self.fd, _HEADER + capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.capacity = capacity
        self.data = np.frombuffer(self._map, dtype=np.uint8, offset=_HEADER)
        header = np.frombuffer(self._map, dtype=np.uint8, count=_HEADER)
        header[:16] = np.frombuffer(self.id.bytes, dtype=np.uint8)
        self._sequence = np.frombuffer(self._map, dtype=np.uint64, count=1, offset=16)

    def number(self, sequence: int) -> None:
        """Mark the file as holding bucket `sequence`: before its bytes are written, so a reader that still finds its
        own number after reading read none of them."""
        self._sequence[0] = sequence

    def holds(self) -> int:
        return int(self._sequence[0])

    def close(self) -> None:
        del self.data, self._sequence
        try:
            self._map.close()
        except BufferError:  # a bucket written in place still views it: unmapped with the last view
            pass
        os.close(self.fd)


class SharedSegments:
    """The trainer process's memory files: each bucket takes one that none of the last `keep - 1` buckets took.

    Why `keep + _SPARE` files, and of those outside the window the smallest that fits: with only `keep` files the
    window leaves exactly one to take (round robin), so a bucket larger than the rest (a tensor over `bucket_bytes`,
    sent alone) lands in another file each sync whenever a sync's bucket count is no multiple of `keep`, and over a
    few syncs every file grows to it. The window holds at most `keep - 1` files; a second stream of a threaded actor
    may hold one more that it is still writing; two more leave a choice, so the large bucket finds its own file again
    (as long as a sync has `keep` buckets or more; fewer make the window hold that file, and another grows) and the
    rest stay the size of theirs. A file is made only when none outside the window is of the bucket's size, so a
    ring of even buckets keeps `keep` files.

    A producer writes a bucket straight into its file when the sender lends it the file's memory (`reserve`, through
    `refit.transport.buckets.buffers_from`); any other bucket is copied in (`send`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a threaded actor may run two streams at once
        self._ring: list[_Segment] = []  # each file's header holds the number of the last bucket it took
        self._sequence = 0  # the last bucket's number, of any stream: the window is counted in these
        # id(buffer) -> (the buffer, weakly: a producer that dropped it writes there no more; its file; its number)
        self._lent: dict[int, tuple[weakref.ref, _Segment, int]] = {}

    def reserve(self, nbytes: int, keep: int) -> np.ndarray:
        """A file's first `nbytes`, writable, numbered as the next bucket (`buffers_from`'s allocator)."""
        with self._lock:
            self._lent = {key: lent for key, lent in self._lent.items() if lent[0]() is not None}
            segment, sequence = self._next(nbytes, keep)
            buffer = segment.data[:nbytes]
            self._lent[id(buffer)] = (weakref.ref(buffer), segment, sequence)
            while len(self._lent) > keep:  # a bucket is sent right after it is written: older ones were never sent
                del self._lent[next(iter(self._lent))]
        return buffer

    def send(self, buckets: Iterable[WireBucket], keep: int) -> Iterator[BucketContents]:
        for bucket in buckets:
            yield self._publish(bucket, keep)

    def _publish(self, bucket: WireBucket, keep: int) -> BucketContents:
        buffer = np.asarray(bucket.buffer)  # a host bucket (the trainer packs on the host)
        with self._lock:
            lent = self._lent.pop(id(bucket.buffer), None)
            if (lent is not None and lent[0]() is bucket.buffer and any(lent[1] is segment for segment in self._ring)
                    and lent[1].holds() == lent[2]):
                _, segment, sequence = lent
            elif any(np.may_share_memory(buffer, segment.data) for segment in self._ring):
                raise TransportError(f"bucket {bucket.index}'s shared memory was taken by another stream while it "
                                     "was written; this stream is refused")
            else:  # not written in place: copied into a file
                segment, sequence = self._next(buffer.nbytes, keep)
                np.copyto(segment.data[: buffer.nbytes], buffer.reshape(-1).view(np.uint8))
        return bucket.contents(shm=SegmentRef(os.getpid(), segment.fd, segment.id.hex, sequence).to_plain())

    def _next(self, nbytes: int, keep: int) -> tuple[_Segment, int]:
        """A file for the next bucket, at least `nbytes` long, numbered as it; the caller holds the lock."""
        sequence = self._sequence + 1
        # A file lent to a bucket still being written (another stream of a threaded actor) is passed over: renumbered
        # and written by this bucket too, the late writes of the other would land in this one after it was sent.
        being_written = {id(lent[1]) for lent in self._lent.values() if lent[0]() is not None}
        free = [s for s in self._ring if sequence - s.holds() >= keep and id(s) not in being_written]
        size = max(_MIN_CAPACITY, 1 << (nbytes - 1).bit_length())  # rounded up: a ring settles after a sync or two
        fitting = sorted((s for s in free if s.capacity >= nbytes), key=lambda s: s.capacity)
        smaller = [s for s in free if s.capacity < nbytes]
        if fitting and fitting[0].capacity <= size:
            segment = fitting[0]
        elif len(self._ring) < keep + _SPARE or smaller:
            # A new file rather than one far larger than the bucket (kept for the bucket it was made for); with the
            # ring full, one outside the window grows: of those smaller than the bucket, the one that wastes least.
            if len(self._ring) >= keep + _SPARE:
                grown = max(smaller, key=lambda s: s.capacity)
                free.remove(grown)
                self._drop(grown)
            segment = _Segment(size)
            self._ring.append(segment)
        elif fitting:
            segment = fitting[0]
        else:
            raise TransportError(f"every one of this trainer process's {len(self._ring)} shared-memory files holds one "
                                 f"of its last {keep - 1} buckets or a bucket another stream is still writing; this "
                                 "stream is refused (run one sync at a time per trainer over shm, or raise "
                                 "SyncConfig.max_buckets_in_flight)")
        excess = len(self._ring) - keep - _SPARE  # `keep` shrank since the files were made: those outside the window go
        for surplus in [s for s in free if s is not segment][: max(excess, 0)]:
            self._drop(surplus)
        segment.number(sequence)
        self._sequence = sequence
        return segment, sequence

    def _drop(self, segment: _Segment) -> None:
        self._ring.remove(segment)
        segment.close()  # a reader still mapping it keeps its pages until it lets go

    def nbytes(self) -> int:
        """The ring's files' sizes (the pages written are the memory they hold)."""
        return sum(segment.capacity for segment in self._ring)

    def close(self) -> None:
        with self._lock:
            for segment in list(self._ring):
                self._drop(segment)


_PROCESS_SEGMENTS = SharedSegments()  # no file exists until a bucket needs one


def shared_segments() -> SharedSegments:
    """This process's ring (one per trainer process: the memory files are the process's, like its GPU memory)."""
    return _PROCESS_SEGMENTS


# -- the worker's end --------------------------------------------------------------------------

class _Mapping:
    def __init__(self, ref: SegmentRef) -> None:
        path = f"/proc/{ref.pid}/fd/{ref.fd}"
        try:
            # Non-blocking: a place naming a FIFO (anyone with the server's key can send one) would block the open
            # until a writer came; the type check below then refuses it.
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as error:
            if _process_gone(ref.pid):  # the usual cause once a sync ran: not a wrong set-up
                raise TransportError(f"cannot open the trainer's shared memory {path}: the trainer's process "
                                     f"{ref.pid} is gone (it died or was killed during this sync)") from None
            raise TransportError(
                f"cannot open the trainer's shared memory {path} ({error.strerror}); transport='shm' needs the trainer "
                "and this vLLM worker on one host, in one PID namespace, as one user (use 'ray' or 'collective')"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size <= _HEADER:
                raise TransportError(f"{path} is not a refit bucket file of the trainer's (it is no memory file)")
            self._map = mmap.mmap(fd, info.st_size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), mmap.PROT_READ)
        finally:
            os.close(fd)  # the mapping keeps the file
        if self._map[:16] != uuid.UUID(hex=ref.segment).bytes:
            self._map.close()
            raise TransportError(f"{path} is not the trainer's bucket file {ref.segment} (the trainer replaced it?)")
        self.data = np.frombuffer(self._map, dtype=np.uint8, offset=_HEADER)
        self.sequence = np.frombuffer(self._map, dtype=np.uint64, count=1, offset=16)
        self.pid = ref.pid


_mappings: collections.OrderedDict[str, _Mapping] = collections.OrderedDict()
_used: set[str] = set()  # the files mapped since the worker's last update began
_mappings_lock = threading.Lock()


def _mapping(ref: SegmentRef) -> _Mapping:
    with _mappings_lock:
        mapping = _mappings.get(ref.segment)
        if mapping is None:
            mapping = _mappings[ref.segment] = _Mapping(ref)
            # The least recently read first, never one this update read (the trainer's ring bounds those); each is
            # unmapped once no bucket's tensors view it any more.
            idle = [segment for segment in _mappings if segment not in _used and segment != ref.segment]
            for segment in idle[: max(len(_mappings) - _MAPPINGS_KEPT, 0)]:
                del _mappings[segment]
        _mappings.move_to_end(ref.segment)
        _used.add(ref.segment)
        return mapping


def forget_unused_mappings() -> int:
    """At the start of a worker's update: unmap the files its last update did not read (a trainer that is gone or
    replaced its files), so their pages are not held; the ring's files stay mapped. Returns how many were dropped.

    Also those of a trainer whose process is gone, read or not: a trainer killed mid-sync left its ring mapped by
    the update it failed, and this worker's mapping was all that kept those pages (a whole ring) for one more sync."""
    with _mappings_lock:
        stale = [segment for segment, mapping in _mappings.items()
                 if segment not in _used or _process_gone(mapping.pid)]
        for segment in stale:
            del _mappings[segment]
        _used.clear()
        return len(stale)


def _process_gone(pid: int) -> bool:
    """Whether the trainer process that owned a memory file has ended (its files then open no more)."""
    return not os.path.exists(f"/proc/{pid}")


def open_shm_bucket(contents: BucketContents) -> WireBucket:
    """The bucket as a read-only view of the trainer's memory file (no copy); `refuse_rewritten` after loading it."""
    if contents.shm is None:
        raise TransportError(f"bucket {contents.index} arrived without its shared-memory place during a shm update")
    ref = SegmentRef.from_plain(contents.shm)
    mapping = _mapping(ref)
    if contents.nbytes > mapping.data.nbytes:
        raise TransportError(f"bucket {contents.index} claims {contents.nbytes} bytes, but its file holds {mapping.data.nbytes}")
    _refuse_other_bucket(contents.index, ref, mapping)
    return contents.with_bytes(mapping.data)


def refuse_rewritten(contents: BucketContents) -> None:
    """Raise `VerificationError` if the bucket's file holds another bucket than `contents` names (rewritten before or
    while it was read)."""
    ref = SegmentRef.from_plain(contents.shm)
    _refuse_other_bucket(contents.index, ref, _mapping(ref))


def _refuse_other_bucket(index: int, ref: SegmentRef, mapping: _Mapping) -> None:
    found = int(mapping.sequence[0])
    if found != ref.sequence:  # a verification failure: a replica that loaded nothing of the update serves on
        raise VerificationError(
            f"bucket {index}'s shared memory was rewritten (it holds the trainer's bucket #{found}, not "
            f"#{ref.sequence}) before this worker finished loading it: the trainer ran more than its ring of buckets "
            "ahead, or another sync streamed from the same trainer meanwhile; this update is refused"
        )
