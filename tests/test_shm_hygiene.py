"""The session's shared-memory watcher unlinks what its killed processes left, and nothing anyone still maps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.shm_hygiene import SHM, SegmentWatcher, mapped_segments

# Makes a segment, as vLLM's engines do, says its process id and name on one line, and waits to be killed.
HOLDER = """
import os, time
from multiprocessing import resource_tracker, shared_memory
segment = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(segment._name, "shared_memory")  # as in a process killed with its tracker: nothing unlinks it
print(os.getpid(), segment.name, flush=True)
time.sleep(600)
"""


# A spawn-context lock, as vLLM's engine cores and workers make: a named semaphore, which glibc maps under a temporary
# name it then unlinks (tests/support/shm_hygiene.py); every run of the suite left one or more.
SEMAPHORE_HOLDER = """
import multiprocessing, os, time
from multiprocessing import resource_tracker
lock = multiprocessing.get_context("spawn").Lock()
resource_tracker.unregister(lock._semlock.name, "semaphore")  # as in a process killed with its tracker
print(os.getpid(), "sem." + lock._semlock.name.lstrip("/"), flush=True)
time.sleep(600)
"""


def _holder(script: str = HOLDER) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    return process, process.stdout.readline().split()[1]


@pytest.mark.parametrize("script", [HOLDER, SEMAPHORE_HOLDER], ids=["shared-memory", "semaphore"])
def test_a_killed_descendants_segment_is_unlinked_and_a_live_ones_is_kept(script):
    watcher = SegmentWatcher(interval_s=3600)  # recorded below, by hand
    killed, killed_name = _holder(script)
    alive, alive_name = _holder(script)
    try:
        watcher.record()
        assert {killed_name, alive_name} <= watcher.recorded
        assert mapped_segments([killed.pid]) == {killed_name}
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert (SHM / killed_name).exists()  # left behind
        unlinked = watcher.stop()
        assert killed_name in unlinked and alive_name not in unlinked
        assert not (SHM / killed_name).exists() and (SHM / alive_name).exists()
    finally:
        for process in (killed, alive):
            process.kill()
            process.wait(timeout=30)
        for name in (killed_name, alive_name):
            (SHM / name).unlink(missing_ok=True)


# Makes its file first and maps it a little later, as shm_open then mmap do, with a gap a busy machine can stretch.
LATE_MAPPER = """
import mmap, os, time
name = f"refit-test-late-{os.getpid()}"
fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
print(os.getpid(), name, flush=True)
time.sleep(0.3)
mapped = mmap.mmap(fd, 4096)
time.sleep(600)
"""


@pytest.mark.parametrize("script", [HOLDER, LATE_MAPPER], ids=["mapped-at-once", "mapped-after-the-first-pass"])
def test_a_segment_made_between_two_regular_passes_is_recorded_without_waiting_for_the_next(script):
    """A process that makes a segment and is killed long before the next regular pass: the new file starts passes,
    until one finds it mapped."""
    watcher = SegmentWatcher(interval_s=3600, poll_s=0.1)
    process, name = _holder(script)
    try:
        deadline = time.monotonic() + 30  # from the segment's making
        while name not in watcher.recorded and time.monotonic() < deadline:
            time.sleep(0.05)
        assert name in watcher.recorded
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        assert name in watcher.stop() and not (SHM / name).exists()
    finally:
        process.kill()
        process.wait(timeout=30)
        (SHM / name).unlink(missing_ok=True)


# Starts a holder and exits at once: the holder is left to init, outside this process's tree, like another session's.
ORPHANING = f"""
import subprocess, sys
subprocess.Popen([sys.executable, "-c", {HOLDER!r}])
"""


def test_a_segment_only_processes_outside_the_session_map_is_never_recorded_nor_unlinked():
    watcher = SegmentWatcher(interval_s=3600)
    parent = subprocess.Popen([sys.executable, "-c", ORPHANING], stdout=subprocess.PIPE, text=True)
    pid, name = parent.stdout.readline().split()
    pid = int(pid)
    parent.wait(timeout=30)
    try:
        assert mapped_segments([pid]) == {name}
        watcher.record()
        assert name not in watcher.recorded
        os.kill(pid, signal.SIGKILL)  # its segment is left behind, but not by this session
        assert name not in watcher.stop() and (SHM / name).exists()
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        (SHM / name).unlink(missing_ok=True)
