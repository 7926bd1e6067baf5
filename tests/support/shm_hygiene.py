"""Unlink the shared-memory segments that this test session's processes leave behind.

vLLM's engines talk to their workers through `multiprocessing.shared_memory`
ring buffers (`/dev/shm/psm_*`, 160-240 MiB each, sparse), tensor-parallel
CPU workers through `vllm_dist_*` files, and multiprocessing's semaphores
live there too (`sem.*`); the process that made one unlinks it when it
shuts down (a semaphore: its resource tracker, a process of its own).
Tests kill engines with SIGKILL (a crash is what they test), so nothing
unlinks those, and every run of the suite left dozens in the machine's
`/dev/shm`.

`SegmentWatcher` records the files in `/dev/shm` that processes of this
session (the pytest process and its descendants: xdist workers, the Ray
cluster's nodes and workers, `vllm serve` subprocesses, engine cores) have
mapped, by inode: glibc's `sem_open` maps a temporary file that it then
links under the semaphore's name and unlinks, so the mapping names another
file, "deleted". It looks every few seconds, and as soon as a new file
appears there, since an engine a test kills just after its start (a sync
that fails at once, a start that must be refused) maps its segments for
well under a regular interval. At the end of the session, each recorded
segment that no process maps any more is unlinked. A segment only another
session's processes ever mapped is never recorded, so never touched.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import psutil

__all__ = ["SegmentWatcher", "mapped_segments"]

SHM = Path("/dev/shm")
_PREFIX = b" /dev/shm/"  # the path column, after the padding that follows the inode


def mapped_segments(pids: list[int]) -> set[str]:
    """The names of the files in `/dev/shm` that the processes `pids` (those that still exist and may be read) map,
    under that name or another (the module docstring: a semaphore)."""
    inodes = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        start = maps.find(_PREFIX)
        while start != -1:
            fields = maps[maps.rfind(b"\n", 0, start) + 1:start].split()  # address, perms, offset, device, inode
            inodes.add(int(fields[4]))
            start = maps.find(_PREFIX, start + 1)
    return {name for name, inode in _inodes().items() if inode in inodes}


def _inodes() -> dict[str, int]:
    """Each file in `/dev/shm` (a mapped file's inode stays its own until the last mapping goes, unlinked or not)."""
    inodes = {}
    for name in _present():
        try:
            inodes[name] = (SHM / name).stat().st_ino
        except OSError:  # unlinked meanwhile
            continue
    return inodes


def _present() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


class SegmentWatcher:
    """Records the segments this process's descendants map, every `interval_s` and within `poll_s` of a new file in
    `/dev/shm`; `stop()` unlinks the orphaned ones.

    `stop` returns the names it unlinked. Only segments still present, recorded as this session's and mapped by no
    process on the machine are unlinked: a live engine of another session keeps its segments mapped. Listing the
    directory is cheap next to a pass over the processes' maps, so passes run only when needed. A file exists
    before its maker maps it (`shm_open`, then `mmap`): a new file no pass found mapped is looked for again at each
    poll for `NEW_FILE_PASSES` polls.
    """

    NEW_FILE_PASSES = 8

    def __init__(self, interval_s: float = 5.0, poll_s: float = 0.25) -> None:
        self.recorded: set[str] = set()
        self._root = psutil.Process(os.getpid())
        self._stopped = threading.Event()
        self._interval_s = interval_s
        self._poll_s = poll_s
        self._thread = threading.Thread(target=self._watch, name="shm-hygiene", daemon=True)
        self._thread.start()

    def record(self) -> None:
        try:
            pids = [self._root.pid, *(child.pid for child in self._root.children(recursive=True))]
        except psutil.Error:
            return
        self.recorded |= mapped_segments(pids)

    def _watch(self) -> None:
        present, last_pass = _present(), time.monotonic()
        unseen: dict[str, int] = {}  # new files no pass found mapped yet: the polls left to look again
        while not self._stopped.wait(self._poll_s):
            present, before = _present(), present
            unseen |= dict.fromkeys(present - before, self.NEW_FILE_PASSES)
            if unseen or time.monotonic() - last_pass >= self._interval_s:
                self.record()
                last_pass = time.monotonic()
                unseen = {name: left - 1 for name, left in unseen.items()
                          if left > 1 and name in present and name not in self.recorded}

    def stop(self) -> list[str]:
        self._stopped.set()
        self._thread.join()
        self.record()
        present = [name for name in sorted(self.recorded) if (SHM / name).exists()]
        if not present:
            return []
        in_use = mapped_segments(psutil.pids())
        unlinked = []
        for name in present:
            if name not in in_use:
                try:
                    (SHM / name).unlink()
                    unlinked.append(name)
                except OSError:
                    pass
        return unlinked
