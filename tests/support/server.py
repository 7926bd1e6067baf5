"""A real `vllm serve` process started with `refit serve`, on loopback, for tests.

Started in a session of its own so that stopping it ends its whole process
group (the API server, its engine core and its workers) by the group's id,
and nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import ray

from actors._replica_shell import CONCURRENCY_GROUPS, ReplicaShell
from fixtures.cluster import QUIET_ENV
from refit.engine.server import server_replica
from tests.support.scripts import REPO

__all__ = ["RefitServer", "ServerSignalledAfterBegin", "free_port", "http_json"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, *, timeout_s: float = 600) -> dict:
    """GET `url` (or POST `body` as JSON) and return the JSON answer, as a user's client would.

    `timeout_s` only guards against a hung test, it asserts no speed: on a loaded 2-core machine (a whole
    suite and a busy loop beside) a restarted server's first 16 completions took over 60 s.
    """
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


class RefitServer:
    """`refit serve MODEL --host 127.0.0.1 --port P OPTIONS...` as a subprocess; `stop()` ends its process group.

    `port`: a given one (a server restarted where another was), else a free one.
    """

    def __init__(self, model: str | Path, options: list[str], log_path: Path, *, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        self.log_path = log_path
        env = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "refit.cli", "serve", self.model, "--host", "127.0.0.1",
                   "--port", str(self.port), *options]
        self.started = time.monotonic()
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def wait_until_healthy(self, within_s: float) -> float:
        """Block until `/health` answers, at most `within_s` after the process started; seconds since the start."""
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"refit serve exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return time.monotonic() - self.started
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() - self.started > within_s:
                raise TimeoutError(f"refit serve did not answer /health within {within_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """End the server's process group (SIGKILL: a test may stop it mid-sync, as a crash would)."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=30)


@ray.remote(num_cpus=0, concurrency_groups=CONCURRENCY_GROUPS)
class ServerSignalledAfterBegin(ReplicaShell):
    """`actors.ServerRollout` for the server at `url`, whose process group `pgid` gets `signum` once an update began.

    A fault at a chosen point: the sync goes on to form its collective group with a replica whose actor
    answers and whose server is gone (SIGKILL) or hung (SIGSTOP; the test sends SIGCONT after).
    """

    def __init__(self, url: str, pgid: int, signum: int) -> None:
        self.replica = server_replica(url)
        self._pgid, self._signum = pgid, signum

    @ray.method(concurrency_group="update")
    def begin_update(self, plan, sync_id, config) -> int:
        version = self.replica.begin_update(plan, sync_id, config)
        os.killpg(self._pgid, self._signum)
        return version
