"""The shm transport's files (refit/transport/shm.py), written and mapped in this process: real memory files, real mmap."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from refit.errors import TransportError, VerificationError
from refit.transport.buckets import BucketContents, buffers_from, pack_bucket
from refit.transport.shm import (
    SegmentRef,
    SharedSegments,
    forget_unused_mappings,
    host_identity,
    open_shm_bucket,
    refuse_rewritten,
)


@pytest.fixture
def ring():
    segments = SharedSegments()
    yield segments
    segments.close()


def bucket(index: int, fill: float, rows: int = 64):
    return pack_bucket(index, [(f"w{index}", torch.full((rows, 128), fill, dtype=torch.bfloat16)),
                               (f"b{index}", torch.arange(rows, dtype=torch.int32))])


def test_a_bucket_is_mapped_back_byte_for_byte_without_a_copy(ring: SharedSegments) -> None:
    sent = [bucket(i, 0.5 + i) for i in range(3)]
    contents = list(ring.send(sent, keep=6))
    for original, arrived in zip(sent, contents):
        assert arrived.shm is not None and arrived.shm[0] == os.getpid()
        mapped = open_shm_bucket(BucketContents.from_plain(arrived.to_plain()))  # as it crosses vLLM's RPC
        assert mapped.tensors == original.tensors
        assert bytes(mapped.buffer) == bytes(original.buffer)
        assert not mapped.buffer.flags.writeable  # a worker reads the trainer's memory, never writes it
        refuse_rewritten(arrived)


def test_a_file_is_reused_after_keep_buckets_and_a_stale_reader_is_refused(ring: SharedSegments) -> None:
    first = list(ring.send([bucket(0, 1.0)], keep=2))[0]
    mapped = open_shm_bucket(first)
    list(ring.send([bucket(1, 2.0), bucket(2, 3.0)], keep=2))  # the ring wraps: bucket 2 rewrites bucket 0's file
    assert list(mapped.unpack())[0][1][0, 0].item() == 3.0
    with pytest.raises(VerificationError, match=r"bucket 0's shared memory was rewritten .*#3, not #1"):
        refuse_rewritten(first)
    with pytest.raises(VerificationError, match="rewritten"):
        open_shm_bucket(first)


def test_a_larger_bucket_gets_a_new_file_and_the_old_mapping_stays_valid(ring: SharedSegments) -> None:
    sent = [bucket(0, 1.0, rows=8), bucket(1, 2.0, rows=8192 * 2)]  # 4 MiB: over the first file's 1 MiB
    small = list(ring.send(sent[:1], keep=1))[0]
    mapped = open_shm_bucket(small)
    big = list(ring.send(sent[1:], keep=1))[0]
    assert big.shm[2] != small.shm[2]
    assert bytes(open_shm_bucket(big).buffer) == bytes(sent[1].buffer)
    assert bytes(mapped.buffer) == bytes(sent[0].buffer)  # the closed file lives while mapped


def test_bad_places_are_refused_by_name(ring: SharedSegments) -> None:
    good = list(ring.send([bucket(0, 1.0)], keep=1))[0]
    pid, fd, segment, sequence = good.shm
    with pytest.raises(TransportError, match="is not the trainer's bucket file"):
        open_shm_bucket(BucketContents(0, good.tensors, good.nbytes, shm=(pid, fd, "0" * 32, sequence)))
    with pytest.raises(TransportError, match="cannot open the trainer's shared memory /proc/.*needs the trainer"):
        open_shm_bucket(BucketContents(0, good.tensors, good.nbytes, shm=(pid, 987654, segment, sequence)))
    with pytest.raises(TransportError, match="is no memory file"):
        open_shm_bucket(BucketContents(0, good.tensors, good.nbytes, shm=(pid, 0, segment, sequence)))  # stdin
    with pytest.raises(TransportError, match="claims .* bytes, but its file holds"):
        open_shm_bucket(BucketContents(0, good.tensors, 1 << 40, shm=good.shm))
    for plain in [("1", fd, segment, 1), (pid, fd, "../../etc/passwd", 1), (pid, -1, segment, 1), (pid, fd, segment)]:
        with pytest.raises(TransportError, match="is not \\(pid, fd, 32-hex segment id, sequence\\)"):
            SegmentRef.from_plain(plain)


def test_a_place_naming_a_fifo_is_refused_at_once_not_waited_on(ring: SharedSegments, tmp_path) -> None:
    """Found by review: the worker opened the place it was given blocking, so one naming a FIFO without a writer (which
    anyone holding a server's key can send through vLLM's /collective_rpc) hung the worker in `open` for ever."""
    import threading

    good = list(ring.send([bucket(0, 1.0)], keep=1))[0]
    os.mkfifo(tmp_path / "fifo")
    fifo = os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK)  # a reader alone: a blocking open waits for a writer
    outcome: list[BaseException] = []

    def open_it() -> None:
        try:
            open_shm_bucket(BucketContents(0, good.tensors, good.nbytes, shm=(os.getpid(), fifo, good.shm[2], 1)))
        except BaseException as error:  # noqa: BLE001 - what the open raised is the test's result
            outcome.append(error)

    opener = threading.Thread(target=open_it, daemon=True)  # left blocked in `open` on the old code
    opener.start()
    opener.join(timeout=30)
    os.close(fifo)
    assert not opener.is_alive() and isinstance(outcome[0], TransportError) and "is no memory file" in str(outcome[0])


def test_the_host_identity_names_boot_pid_namespace_and_user() -> None:
    identity = host_identity()
    assert identity.count("|") == 2 and identity.endswith(f"uid {os.getuid()}") and "pid:[" in identity
    assert np.uint8  # numpy is what the files are viewed through


def test_a_bucket_written_in_its_file_is_sent_without_a_copy(ring: SharedSegments) -> None:
    with buffers_from(lambda nbytes: ring.reserve(nbytes, keep=2)):
        written = bucket(0, 1.5)
    contents = list(ring.send([written], keep=2))[0]
    mapped = open_shm_bucket(contents)
    assert bytes(mapped.buffer) == bytes(written.buffer)
    assert written.buffer.ctypes.data == ring._ring[0].data.ctypes.data  # the producer wrote into the file itself
    # Outside the block a producer writes fresh memory again, which is copied in.
    fresh = bucket(1, 2.5)
    copied = list(ring.send([fresh], keep=2))[0]
    assert fresh.buffer.ctypes.data != ring._ring[1].data.ctypes.data
    assert bytes(open_shm_bucket(copied).buffer) == bytes(fresh.buffer)


def test_a_file_still_being_written_is_never_lent_to_another_stream(ring: SharedSegments) -> None:
    """Found by review: a second stream of a threaded actor could be lent the file a first stream was still writing
    into; it renumbered the file, wrote and sent its bucket, and the first stream's late writes then changed that
    sent bucket under its own, valid, number (undetected with `verify="off"`). The busy file is passed over."""
    with buffers_from(lambda nbytes: ring.reserve(nbytes, keep=2)):
        slow = bucket(0, 7.0)  # stream A: its bucket's file, written later
        sent = []
        for index in range(2):  # stream B: each bucket sent as soon as it is written; the ring wraps round
            fast = bucket(index, 1.0 + index)
            sent += ring.send([fast], keep=2)
    slow.buffer[:] = 0xAB  # A's late writes
    assert bytes(open_shm_bucket(sent[1]).buffer) == bytes(fast.buffer)  # B's last bucket is B's
    refuse_rewritten(sent[1])
    assert bytes(open_shm_bucket(list(ring.send([slow], keep=2))[0]).buffer) == bytes(slow.buffer)


def test_a_stream_is_refused_when_every_file_holds_a_bucket_being_written_or_one_of_the_last(ring: SharedSegments) -> None:
    with buffers_from(lambda nbytes: ring.reserve(nbytes, keep=3)):
        writing = [bucket(i, 1.0 + i) for i in range(3)]  # buckets that other streams are still writing
    for index in (3, 4):
        list(ring.send([bucket(index, 1.0)], keep=3))  # the two spare files: the last 2 buckets
    with pytest.raises(TransportError, match="every one of this trainer process's 5 shared-memory files holds one of "
                                             "its last 2 buckets or a bucket another stream is still writing"):
        list(ring.send([bucket(5, 2.0)], keep=3))
    assert bytes(open_shm_bucket(list(ring.send(writing[:1], keep=3))[0]).buffer) == bytes(writing[0].buffer)
    del writing  # buckets their producers dropped unsent hold their files no more
    later = bucket(6, 4.0)
    assert bytes(open_shm_bucket(list(ring.send([later], keep=3))[0]).buffer) == bytes(later.buffer)


def test_a_worker_unmaps_the_files_its_last_update_did_not_read(ring: SharedSegments) -> None:
    forget_unused_mappings(), forget_unused_mappings()  # a clean slate: what earlier tests mapped
    first = list(ring.send([bucket(0, 1.0)], keep=1))[0]
    open_shm_bucket(first)
    assert forget_unused_mappings() == 0  # read by the update that just ended: kept for the next
    replaced = list(ring.send([bucket(1, 1.0, rows=8192 * 2)], keep=1))[0]  # too large: a new file beside the first
    open_shm_bucket(replaced)
    assert forget_unused_mappings() == 1  # the replaced file, read one update ago
    assert forget_unused_mappings() == 1  # and the new one, once an update went by without it


def test_a_platform_without_memory_files_is_refused_by_name(ring: SharedSegments, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "memfd_create")
    with pytest.raises(TransportError, match=r"transport='shm' needs memory files \(os.memfd_create: Linux\)"):
        list(ring.send([bucket(0, 1.0)], keep=1))


def test_a_delta_base_over_shm_is_refused_by_name() -> None:
    """Found by review: a base kept over shm viewed the ring's files, which later buckets rewrite under it (the
    Syncer streams `delta="off"` over shm; a direct call could ask for more)."""
    import refit
    from refit.errors import ConfigError
    from refit.plan import RolloutModelInfo, SyncConfig, checkpoint_tensors, describe_weights, make_plan, produce_buckets
    from refit.transport.shm import ShmHandle
    from tests.support.fakes import FP8_BLOCK, tiny_decoder

    model = tiny_decoder()
    plan = make_plan(describe_weights(model), RolloutModelInfo(FP8_BLOCK, False), SyncConfig(transport="shm"))
    weights = refit.TrainerWeights(lambda: describe_weights(model), lambda p: produce_buckets(p, checkpoint_tensors(model)))
    with pytest.raises(ConfigError, match=r"delta='full' over a transport that writes each bucket into memory it reuses "
                                          r"\(shm\): no delta base can be kept"):
        next(weights.stream_buckets(plan, ShmHandle(6), "full"))
    streamed = list(weights.stream_buckets(plan, ShmHandle(6), "off"))
    assert [type(item).__name__ for item in streamed] == ["BucketContents"] * len(plan.buckets) + ["ReadersDone"] * 3


def plan_of_buckets(sizes: list[int]) -> list:
    """One sync's buckets: a flat byte tensor each, as many bytes as asked."""
    return [pack_bucket(index, [(f"t{index}", torch.zeros(nbytes, dtype=torch.uint8))]) for index, nbytes in enumerate(sizes)]


def test_a_bucket_larger_than_the_rest_keeps_to_one_file_from_sync_to_sync(ring: SharedSegments) -> None:
    """Regression: the ring's place ran on from sync to sync, so with a bucket count no multiple of the ring's size a
    tensor over bucket_bytes (sent alone, in a bucket larger than the rest) landed in another file each sync, until
    every file had grown to it. Now each bucket takes the smallest file the window leaves that fits it."""
    keep, small, big = 6, 1 << 20, 4 << 20
    sizes = [small // 2] * 7
    sizes[3] = big - 4096  # the embedding, alone in its bucket
    for _ in range(4 * keep):
        list(ring.send(plan_of_buckets(sizes), keep=keep))
    # keep files of 1 MiB and one of 4 MiB (round robin grew all six to 4 MiB: 24 MiB)
    assert ring.nbytes() <= keep * small + big, ring.nbytes()


def test_no_file_takes_a_bucket_while_one_of_the_last_keep_buckets_is_in_it(ring: SharedSegments) -> None:
    """The window every transport's ring keeps: a file takes a new bucket only after keep-1 later ones were handed
    out, whichever streams they came from and whatever their sizes."""
    keep = 4
    streams = [[1 << 19] * 5 + [3 << 20], [1 << 18] * 3, [1 << 20] * 2 + [5 << 20] + [1 << 19] * 4]
    handed: list[tuple[str, int]] = []  # (file, bucket number) in the order they were handed out
    for turn in range(40):  # the streams interleaved, bucket by bucket, each one's plan over and over
        sizes = streams[turn % len(streams)]
        contents = list(ring.send(plan_of_buckets([sizes[turn % len(sizes)]]), keep=keep))[0]
        handed.append((contents.shm[2], contents.shm[3]))
    assert [number for _, number in handed] == sorted(number for _, number in handed)
    last: dict[str, int] = {}
    for position, (segment, _) in enumerate(handed):
        assert position - last.get(segment, -keep) >= keep, (segment, position, last[segment])
        last[segment] = position


def test_a_ring_asked_for_a_smaller_window_closes_the_files_beyond_it(ring: SharedSegments) -> None:
    list(ring.send(plan_of_buckets([1 << 19] * 8), keep=6))
    assert len(ring._ring) == 6
    contents = list(ring.send(plan_of_buckets([1 << 19] * 3), keep=1))  # max_buckets_in_flight lowered, say
    assert len(ring._ring) == 1 + 2
    assert bytes(open_shm_bucket(contents[-1]).buffer) == bytes(plan_of_buckets([1 << 19] * 3)[-1].buffer)


def test_a_worker_keeps_every_file_of_a_ring_larger_than_its_mapping_cache_mapped(ring: SharedSegments) -> None:
    """Regression: a worker kept at most 16 mappings, least recently used first out, but with max_buckets_in_flight=8
    a trainer's ring holds 18 to 20 files (keep = 18, and two spare), so a sync that went round the ring found each file
    unmapped again: every bucket of every sync opened and mapped (MAP_POPULATE) its file anew. The files an update
    reads stay mapped; only those it did not read are let go."""
    from refit.transport import shm

    keep = 2 * 8 + 2  # `IpcTransport.for_buckets_in_flight(8).keep`
    forget_unused_mappings(), forget_unused_mappings()  # a clean slate: what earlier tests mapped
    mapped: dict[str, object] = {}
    for _ in range(2):  # two updates, each going round the ring
        forget_unused_mappings()
        for contents in ring.send(plan_of_buckets([1 << 19] * (keep + 2)), keep=keep):
            open_shm_bucket(contents)
            refuse_rewritten(contents)
            mapped.setdefault(contents.shm[2], shm._mappings[contents.shm[2]])
    assert len(mapped) == len(ring._ring) == keep > shm._MAPPINGS_KEPT  # even buckets: `keep` files, no spare
    assert all(shm._mappings.get(segment) is mapping for segment, mapping in mapped.items())  # none mapped twice
    assert forget_unused_mappings() == 0


def test_a_place_of_a_trainer_that_died_is_refused_naming_the_death_not_the_set_up(ring: SharedSegments) -> None:
    """Found by killing a trainer mid-sync over shm: the buckets already handed on named files of a process that was
    gone, and each worker's error said the trainer and worker must share a host, PID namespace and user (they did)."""
    import subprocess
    import sys

    good = list(ring.send([bucket(0, 1.0)], keep=1))[0]
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    pid = int(gone.stdout)
    _, fd, segment, sequence = good.shm
    with pytest.raises(TransportError, match=rf"/proc/{pid}/fd/{fd}: the trainer's process {pid} is gone \(it died"):
        open_shm_bucket(BucketContents(0, good.tensors, good.nbytes, shm=(pid, fd, segment, sequence)))


def test_a_worker_unmaps_the_files_of_a_trainer_that_died_at_its_next_update() -> None:
    """Found by killing a trainer mid-sync over shm: its files were read by the update it failed, so the workers kept
    them mapped, and alive (their pages a whole ring of the dead trainer's), through the next sync as well."""
    import subprocess
    import sys
    import uuid

    forget_unused_mappings(), forget_unused_mappings()  # a clean slate: what earlier tests mapped
    segment = uuid.uuid4()
    trainer = subprocess.Popen([sys.executable, "-c", f"""
import os, sys, time
fd = os.memfd_create("refit-bucket-test")
os.ftruncate(fd, 4096)
os.pwrite(fd, bytes.fromhex("{segment.hex}"), 0)
print(fd, flush=True)
sys.stdin.read()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        fd = int(trainer.stdout.readline())
        ref = (trainer.pid, fd, segment.hex, 0)
        open_shm_bucket(BucketContents(0, (), 0, shm=ref))  # the update the trainer's death failed read it
    finally:
        trainer.stdin.close()
        trainer.wait(timeout=30)
    assert forget_unused_mappings() == 1
