"""A running `vllm serve` server as a refit replica: its control messages over HTTP, its bytes over a collective group.

RL stacks that serve rollouts from OpenAI-compatible vLLM servers behind a
router (prime-rl, SkyRL, TRL's and verl's server modes) cannot hand refit an
engine object. `ServerAdapter` gives `ReplicaCore` (refit/engine/replica.py)
what it needs from such a server through vLLM's own routes, so the update
lifecycle, provenance, the KV stage and verification are the core's, as for
every other replica:

- the workers: the dev route `/collective_rpc`, always with one method,
  `RefitWorkerExtension.refit_call`, carrying a pickled `(method, args)`
  and answering the pickled result or exception (refit/engine/worker_rpc.py):
  `WorkerCalls` is used unchanged and a worker's error arrives with its type;
- generation (the post-refit stage, the probe): `/v1/completions` with
  token-id prompts, greedy, with `logprobs` and vLLM's `prompt_logprobs`;
- pause and resume: vLLM's `/pause?mode=wait|abort` and `/resume`.

The bytes never cross HTTP: the server's workers join the sync's collective
group themselves (`transport="collective"`); `ray` and `ipc` are refused.

What differs from an in-process engine, because users' requests reach the
server directly and never pass through this process:

- nothing here holds requests. vLLM's own pause does: with `pause="wait"`
  requests already running finish on the old weights while queued and new
  ones wait in the server, then run on the new weights (each whole on one
  version); `pause="abort"` ends the running ones, returned marked aborted;
- the server resumes before the post-refit stage and the probe, which
  generate through its scheduler, so requests that waited out the update
  run beside them (on the new weights, under the scales the reload left
  until the stage writes its own);
- a replica that refuses (a failed sync, a dummy load before its first
  sync) cannot stop the server from answering: `status()` says refusing,
  and whoever routes users' traffic must take it out of rotation. A dummy-
  loaded server with an FP8 KV cache must get no request before its first
  sync: its placeholder scales make vLLM's engine die on the first one;
- after a sync, the server's weight version (vLLM's `/update_weight_version`,
  shown by `/weight_info` and carried by its outputs) is the sync's version,
  set once the update is verified (`mark_version`, the core's last step);
  requests that ran beside the post-refit stage still carry the old label.

Every HTTP call has a deadline: the sync's `timeout_s` once a sync has
begun (a socket-level timeout: each connect and read must progress within
it), and the connect timeout before. Errors name the server's URL and what
to do. This module imports no vLLM: the process that holds the adapter
needs none.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from refit.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, TRANSFER_BACKEND, WORKER_EXTENSION
from refit.engine.replica import EngineFacts, Generation, ReplicaCore
from refit.engine.worker_rpc import decode_reply, encode_call
from refit.errors import ConfigError, EngineError, EngineHungError, ServerError, ServerGoneError
from refit.plan.config import Pause, SyncConfig, Transport
from refit.tokens import token_prompts
from refit.transport.collective import JOIN_MARGIN_S

__all__ = ["DEV_MODE_ENV", "ServerAdapter", "serve_arguments", "server_replica"]

DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
"""The environment a server needs: vLLM registers `/collective_rpc`, `/pause` and the RL routes only in dev mode."""

_START_HINT = "start it with `refit serve MODEL ...` (or the plain `vllm serve` line in the README)"


def serve_arguments(options: Sequence[str], *, on_gpu: bool) -> list[str]:
    """The `vllm serve` options refit needs, for a server started with `options` (vLLM's own, passed on unchanged).

    Its weight-transfer backend and worker extension; on a CPU the KV-cache
    size of `EngineConfig`'s default (vLLM's CPU backend otherwise reserves
    92% of the machine), unless `options` sizes it. Appended after `options`
    by `refit serve`; the environment needs `DEV_MODE_ENV` too.
    """
    given = {option.split("=", 1)[0] for option in options if option.startswith("--")}
    needed = [
        "--worker-extension-cls", WORKER_EXTENSION,
        "--weight-transfer-config", json.dumps({"backend": TRANSFER_BACKEND}),
    ]
    clashing = sorted(given & {"--worker-extension-cls", "--weight-transfer-config"})
    if clashing:
        raise ConfigError(f"{', '.join(clashing)}: refit sets these (its worker extension and weight-transfer backend)")
    sized = given & {"--kv-cache-memory-bytes", "--gpu-memory-utilization"}
    if not on_gpu and not sized:
        needed += ["--kv-cache-memory-bytes", str(DEFAULT_CPU_KV_CACHE_BYTES)]
    return needed


def server_replica(url: str, *, connect_timeout_s: float = 30.0) -> ReplicaCore:
    """The running `vllm serve` server at `url` (started by `refit serve`, or with its options) as a replica a
    `refit.Syncer` can sync, for a Ray actor to hold and delegate the replica methods to (`refit.ReplicaMethods`);
    `actors.ServerRollout` is one. Raises `refit.ServerError`, naming the URL and the fix, if it cannot be used."""
    return ReplicaCore(ServerAdapter(url, connect_timeout_s=connect_timeout_s))


class ServerAdapter:
    """`ReplicaCore`'s access to a running `vllm serve` server at `url` (see the module docstring).

    Connecting checks, within `connect_timeout_s`, that the server answers,
    has the dev routes, refit's worker extension and weight-transfer
    backend, and reads its `EngineFacts` and its workers' boot ids (to
    detect a restart later).
    """

    def __init__(self, url: str, *, connect_timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = connect_timeout_s  # the sync's timeout_s from its first `check` on
        self._require_health()
        models = self._request("GET", "/v1/models")
        self.served_model = models["data"][0]["id"]
        self.boot_ids = self._boot_ids()
        try:
            self.facts: EngineFacts = self._call_workers_once("refit_engine_facts")[0]
        except EngineError as error:
            if "weight_transfer_config" not in str(error):
                raise
            raise ServerError(
                f"the server at {self.url} was started without refit's weight-transfer backend "
                f"(--weight-transfer-config '{{\"backend\": \"{TRANSFER_BACKEND}\"}}'); {_START_HINT}"
            ) from None

    # -- the core's calls ---------------------------------------------------------------
    def check(self, config: SyncConfig) -> None:
        """Refuse a transport whose bytes would cross HTTP, and a server that restarted since it connected."""
        if config.transport is not Transport.COLLECTIVE:
            raise ConfigError(
                f"transport={str(config.transport)!r}: a vllm serve replica ({self.url}) takes its bytes only over "
                "a collective group its workers join (HTTP carries only control messages); "
                "use SyncConfig(transport='collective')"
            )
        self.timeout_s = config.timeout_s
        now = self._boot_ids()
        if now != self.boot_ids:
            raise ServerGoneError(
                f"the server at {self.url} restarted since this replica connected to it (worker boot id "
                f"{self.boot_ids} is now {now}): it serves the weights it started with, not the last sync's, and "
                "refit's record of it (version, scale provenance, collective group) is stale; create a new "
                f"actors.ServerRollout.remote({self.url!r}) for it and sync that"
            )

    def call_workers(self, method: str, *args: Any) -> list:
        # A join blocks until every member joined, within the group's own deadline: the HTTP call waits a margin more.
        timeout_s = self.timeout_s + (JOIN_MARGIN_S if method == "refit_join_group" else 0.0)
        return self._call_workers_once(method, *args, timeout_s=timeout_s)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, *, prompt_logprobs: bool = False) -> Generation:
        """Greedy continuations of token-id prompts from the server's `/v1/completions`, one choice per prompt."""
        checked = token_prompts(prompts, vocab_size=self.facts.vocab_size)
        body: dict[str, Any] = {
            "model": self.served_model, "prompt": [list(p) for p in checked], "max_tokens": max_tokens,
            "temperature": 0.0, "logprobs": 0, "return_token_ids": True,
        }
        if prompt_logprobs:
            body["prompt_logprobs"] = 0  # vLLM's extra parameter: each prompt token's own logprob
        choices = sorted(self._request("POST", "/v1/completions", body)["choices"], key=lambda c: c["index"])
        token_ids = [list(c["token_ids"]) for c in choices]
        logprobs = [list(c["logprobs"]["token_logprobs"]) for c in choices]
        prompts_scored = None
        if prompt_logprobs:
            prompts_scored = [_own_logprobs(c["prompt_logprobs"], p) for c, p in zip(choices, checked)]
        return Generation(token_ids, logprobs, prompts_scored)

    def reset_prefix_cache(self) -> None:
        self._request("POST", "/reset_prefix_cache")

    def hold_requests(self) -> None:
        """Nothing: users' requests never pass through here; vLLM's pause (next) holds them in the server."""

    def pause(self, mode: Pause, timeout_s: float) -> None:
        """vLLM's pause: running requests finish (`wait`) or end aborted (`abort`); queued and new ones wait."""
        self._request("POST", f"/pause?mode={mode}", timeout_s=timeout_s)

    def resume(self) -> None:
        """The server's scheduler runs again, and with it every request that waited out the update."""
        self._request("POST", "/resume")

    def mark_version(self, version: int) -> None:
        """The server's weight version (its `/weight_info`, its outputs' spans) becomes the sync's `version`."""
        self._request("POST", "/update_weight_version", {"new_version": str(version)})

    def release_requests(self) -> None:
        """Nothing: `resume` already let the server's waiting requests go on."""

    # -- the server's own state ---------------------------------------------------------
    def weight_version(self) -> str | None:
        return self._request("GET", "/weight_info")["weight_version"]

    # -- HTTP ---------------------------------------------------------------------------
    def _require_health(self) -> None:
        self._request("GET", "/health", raw=True, if_unreachable=f"is a server running there? {_START_HINT}, then connect")

    def _boot_ids(self) -> list[str]:
        return self._call_workers_once("refit_boot_id")

    def _call_workers_once(self, method: str, *args: Any, timeout_s: float | None = None) -> list:
        """`method(*args)` on every worker through `refit_call`; raises the first worker's exception, with the URL."""
        body = {"method": "refit_call", "args": [encode_call(method, *args)]}
        answer = self._request("POST", "/collective_rpc", body, timeout_s=timeout_s, what=f"worker call {method}")
        results = []
        for reply in answer["results"]:
            ok, value = decode_reply(reply)
            if not ok:
                value.add_note(f"raised by a worker of the vllm serve replica at {self.url} ({method})")
                raise value
            results.append(value)
        return results

    def _request(self, verb: str, path: str, body: dict | None = None, *, timeout_s: float | None = None,
                 what: str | None = None, raw: bool = False, if_unreachable: str | None = None) -> Any:
        what = what or f"{verb} {path}"
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=verb, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                payload = response.read()
        except urllib.error.HTTPError as error:
            raise self._refused(what, path, error.code, error.read().decode(errors="replace")) from None
        except TimeoutError:
            raise EngineHungError(
                f"the server at {self.url} did not answer {what} within {timeout_s:.0f} s (SyncConfig.timeout_s); "
                "it is hung or overloaded"
            ) from None
        except (urllib.error.URLError, ConnectionError, OSError, http.client.HTTPException) as error:
            # An HTTPException (IncompleteRead, RemoteDisconnected): the connection closed part-way through the
            # answer, as when the server dies while it answers. The server is as gone as one that refuses connections.
            reason = (f"the connection closed before the answer was complete ({error!r})"
                      if isinstance(error, http.client.HTTPException) else getattr(error, "reason", error))
            fix = if_unreachable or (
                f"it died or its address is wrong. If it died, restart it ({_START_HINT}) and create a new "
                "actors.ServerRollout for it"
            )
            raise ServerGoneError(f"the server at {self.url} could not be reached for {what}: {reason}; {fix}") from None
        if raw or not payload:
            return payload
        return json.loads(payload)

    def _refused(self, what: str, path: str, status: int, detail: str) -> ServerError:
        """The error for an HTTP error status, saying which of refit's requirements the server lacks."""
        if status == 404 and path.split("?")[0] in ("/collective_rpc", "/pause", "/resume", "/update_weight_version",
                                                      "/reset_prefix_cache", "/weight_info"):
            return ServerError(
                f"the server at {self.url} has no {path.split('?')[0]} route: it was started without "
                f"VLLM_SERVER_DEV_MODE=1, which refit needs for its control messages; {_START_HINT}"
            )
        if "has no attribute 'refit_call'" in detail:
            return ServerError(
                f"the server at {self.url} was started without refit's worker extension "
                f"(--worker-extension-cls {WORKER_EXTENSION}); {_START_HINT}"
            )
        return ServerError(f"the server at {self.url} refused {what} (HTTP {status}): {detail[:1000]}")


def _own_logprobs(steps: list[dict | None] | None, prompt: Sequence[int]) -> list[float | None]:
    """Each prompt token's own logprob from a completion's `prompt_logprobs` (None for the first token)."""
    if steps is None:
        raise EngineError("the server returned no prompt_logprobs; is it vLLM's OpenAI server?")
    own: list[float | None] = []
    for step, token in zip(steps, prompt):
        if step is None:
            own.append(None)
            continue
        entry = step.get(str(token)) or step.get(f"token_id:{token}") or next(iter(step.values()))
        own.append(float(entry["logprob"]))
    return own
