"""Run a script of this repository in its own Python process, as a user would start it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_python(args: list[str], timeout: float = 1800, *, ray_address: str | None = None,
               without: tuple[str, ...] = ()) -> str:
    """`python ARGS` from the repository root; its stdout, after asserting it exited 0 (showing its output if not).

    `ray_address`: set as RAY_ADDRESS, so a plain `ray.init()` joins that cluster. `without`: environment
    variables of this process the script does not get.
    `timeout` only guards against a hung script and asserts no speed: on a
    2-core CPU the demo takes about 5 minutes, and twice that with one core
    busy elsewhere (its three engines' start alone can take most of it), so
    the guard is 30 minutes.
    """
    # Actors' logs stay in Ray's log files, out of the script's stdout: Ray's thread that forwards them to a driver
    # writes beside the script's own prints, and on a busy machine it spliced a log line into a printed one.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_LOG_TO_DRIVER": "0",
           **({"RAY_ADDRESS": ray_address} if ray_address else {})}
    for name in without:
        env.pop(name, None)
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    assert result.returncode == 0, f"exit status {result.returncode}\n" + result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout
