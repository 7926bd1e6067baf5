"""A real `vllm serve` process started with `refit serve` (on loopback, its default), with a key, for tests.

Started in a session of its own so that stopping it ends its whole process
group (the API server, its engine core and its workers) by the group's id,
and nothing else.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import ray

from actors._replica_shell import CONCURRENCY_GROUPS, ReplicaShell
from fixtures.cluster import QUIET_ENV
from refit.engine.server import server_replica
from refit.sharding.process_group import free_port
from tests.support.scripts import REPO

__all__ = ["RefitServer", "ServerHoldingUsers", "ServerSignalledAfterBegin", "free_port", "http_json", "http_status"]


def http_json(url: str, body: dict | None = None, *, key: str | None = None, timeout_s: float = 600,
              method: str | None = None, headers: dict | None = None) -> dict:
    """GET `url` (or POST `body` as JSON) with `key` (`Authorization: Bearer`), and return the JSON answer, as a
    user's client would.

    `timeout_s` only guards against a hung test, it asserts no speed: on a loaded 2-core machine (a whole
    suite and a busy loop beside) a restarted server's first 16 completions took over 60 s.
    """
    with urllib.request.urlopen(_request(url, body, key, method, headers), timeout=timeout_s) as response:
        return json.loads(response.read())


def http_status(url: str, body: dict | None = None, *, key: str | None = None, method: str | None = None,
                timeout_s: float = 600) -> tuple[int, str]:
    """As `http_json`, but an HTTP error is an answer too: the status and the body's text, whatever they are."""
    try:
        with urllib.request.urlopen(_request(url, body, key, method, None), timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _request(url: str, body: dict | None, key: str | None, method: str | None,
             headers: dict | None) -> urllib.request.Request:
    data = None if body is None else json.dumps(body).encode()
    sent = {"Content-Type": "application/json", **({} if key is None else {"Authorization": f"Bearer {key}"}),
            **(headers or {})}
    return urllib.request.Request(url, data=data, headers=sent, method=method)


class RefitServer:
    """`refit serve MODEL --port P OPTIONS...` (no --host: loopback) as a subprocess; `stop()` ends its process group.

    `port`: a given one (a server restarted where another was), else a free one. `api_key`: the server's key
    (REFIT_API_KEY in its environment), else a new random one; `json` sends it.
    """

    def __init__(self, model: str | Path, options: list[str], log_path: Path, *, port: int | None = None,
                 api_key: str | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        self.log_path = log_path
        self.api_key = api_key or secrets.token_urlsafe(16)
        env = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "REFIT_API_KEY": self.api_key}
        env.pop("VLLM_API_KEY", None)
        command = [sys.executable, "-m", "refit.cli", "serve", self.model, "--port", str(self.port), *options]
        self.started = time.monotonic()
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def wait_until_healthy(self, within_s: float) -> float:
        """Block until `/health` answers, at most `within_s` after the process started; seconds since the start."""
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"refit serve exited with {self.process.returncode}:\n{self.log_tail()}")
            request = urllib.request.Request(self.url + "/health", headers={"Authorization": f"Bearer {self.api_key}"})
            try:
                with urllib.request.urlopen(request, timeout=5):
                    return time.monotonic() - self.started
            except urllib.error.HTTPError as error:
                if error.code in (401, 403):
                    raise RuntimeError(f"refit serve refused the test's key (HTTP {error.code}):\n{self.log_tail()}") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() - self.started > within_s:
                raise TimeoutError(f"refit serve did not answer /health within {within_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def json(self, path: str, body: dict | None = None, **options) -> dict:
        """`http_json` on this server's `path`, with its key."""
        return http_json(self.url + path, body, key=self.api_key, **options)

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

    def __init__(self, url: str, api_key: str, pgid: int, signum: int) -> None:
        self.replica = server_replica(url, api_key)
        self._pgid, self._signum = pgid, signum

    @ray.method(concurrency_group="update")
    def begin_update(self, plan, sync_id, config) -> int:
        version = self.replica.begin_update(plan, sync_id, config)
        os.killpg(self._pgid, self._signum)
        return version


@ray.remote(num_cpus=0, concurrency_groups=CONCURRENCY_GROUPS)
class ServerHoldingUsers(ReplicaShell):
    """`actors.ServerRollout` for the server at `url` whose users send `bodies` to `/v1/completions` once its update began.

    Each user's request is sent, from a thread of this actor, after the replica's hold is on, and `begin_update`
    returns only when the server's gate holds them all. `timeline()` says when each answer arrived, and when the
    post-refit KV-scale stage and `mark_version` returned (monotonic seconds of this process), with the answers.
    """

    def __init__(self, url: str, api_key: str, bodies: list[dict]) -> None:
        self.replica = server_replica(url, api_key)
        self._url, self._key, self._bodies = url, api_key, bodies
        self._answers: list = [None] * len(bodies)
        self._answered_at: list[float | None] = [None] * len(bodies)
        self._threads: list[threading.Thread] = []
        self._stage_at: float | None = None
        self._marked_at: float | None = None
        engine, workers = self.replica.engine, self.replica.workers
        apply_kv_policy, mark_version = workers.apply_kv_policy, engine.mark_version

        def staged(*args, **kwargs):
            written = apply_kv_policy(*args, **kwargs)
            self._stage_at = time.monotonic()
            return written

        def marked(version):
            mark_version(version)
            self._marked_at = time.monotonic()

        workers.apply_kv_policy, engine.mark_version = staged, marked

    @ray.method(concurrency_group="update")
    def begin_update(self, plan, sync_id, config) -> int:
        version = self.replica.begin_update(plan, sync_id, config)
        for index in range(len(self._bodies)):
            thread = threading.Thread(target=self._ask, args=(index,), daemon=True)
            thread.start()
            self._threads.append(thread)
        deadline = time.monotonic() + 120
        while self.replica.engine.gate_state()["waiting"] < len(self._bodies):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gate holds {self.replica.engine.gate_state()}, not the users' requests")
            time.sleep(0.05)
        return version

    def _ask(self, index: int) -> None:
        try:
            self._answers[index] = http_json(self._url + "/v1/completions", self._bodies[index], key=self._key)
        except Exception as error:  # noqa: BLE001 - the test asserts on what came back
            self._answers[index] = f"{type(error).__name__}: {error}"
        self._answered_at[index] = time.monotonic()

    @ray.method(concurrency_group="observe")
    def timeline(self, timeout_s: float = 600) -> dict:
        for thread in self._threads:
            thread.join(timeout=timeout_s)
        return {"answers": self._answers, "answered_at": self._answered_at, "stage_at": self._stage_at,
                "marked_at": self._marked_at}
