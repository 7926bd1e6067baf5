"""A running `vllm serve` server as a refit replica: its control messages over HTTP, its bytes over a collective group.

RL stacks that serve rollouts from OpenAI-compatible vLLM servers behind a
router (prime-rl, SkyRL, TRL's and verl's server modes) cannot hand refit an
engine object. `ServerAdapter` gives `ReplicaCore` (refit/engine/replica.py)
what it needs from such a server through vLLM's own routes, so the update
lifecycle, provenance, the KV stage and verification are the core's, as for
every other replica:

- the workers: the dev route `/collective_rpc`, always with one method,
  `RefitWorkerExtension.refit_call`, carrying a JSON `{"method", "args"}`
  for one of refit's worker methods (an allow-list) and answering JSON: the
  result, or a worker's error as its type name and message
  (refit/engine/worker_rpc.py). Nothing is pickled, in either direction: an
  answer that is not refit's JSON is refused as not a refit server's, never
  executed. `WorkerCalls` is used unchanged;
- generation (the post-refit stage, the probe): `/v1/completions` with
  token-id prompts, greedy, with `logprobs` and vLLM's `prompt_logprobs`;
- pause and resume: vLLM's `/pause?mode=wait|abort` and `/resume`;
- holding users' requests: the routes of refit's gate (`/refit/hold`,
  `/refit/drain`, `/refit/release`, refit/engine/server_gate.py), an ASGI
  middleware `refit serve` puts in front of every route.

The bytes never cross HTTP: the server's workers join the sync's collective
group themselves (`transport="collective"`); `ray` and `ipc` are refused.

Every route, vLLM's and the gate's, takes only requests that carry the
server's key (`Authorization: Bearer KEY`): `refit serve` takes it from
`--api-key`, `REFIT_API_KEY` or `VLLM_API_KEY`, or generates one and prints
it. The replica sends the key it is given (`api_key=`, else `REFIT_API_KEY`
in its environment). `refit serve` listens on 127.0.0.1 unless `--host` says
otherwise; across a network, serve over TLS (vLLM's `--ssl-keyfile`,
`--ssl-certfile`) and give the replica an `https://` URL.

Users' requests reach the server directly, never through this process, so
the gate holds them for an update:

- `hold_requests` turns the gate's hold on: from then, requests to
  generation routes (everything but refit's control routes) wait in the
  gate. `pause` then drains what passed the gate before: with `wait`, the
  gate waits (within the sync's `timeout_s`) until those requests have
  ended, on the old weights, and only then does vLLM's `/pause?mode=wait`
  stop its scheduler; waiting first matters, because vLLM's `wait` drains
  only running requests and keeps queued ones queued until `/resume`, when
  they would run before the post-refit stage. With `abort`, vLLM's
  `/pause?mode=abort` ends them (returned marked aborted), and a request
  that reached the engine after that is aborted too (`/abort_requests`)
  until none that passed the gate is left;
- `resume` restarts vLLM's scheduler for the post-refit KV-scale stage and
  the probe, whose requests carry the header that passes the hold; users'
  requests are still held. `mark_version` sets the server's weight version
  (vLLM's `/update_weight_version`, shown by `/weight_info` and carried by
  its outputs) once the update is verified, and `release_requests` lets
  the held requests go on, on the verified weights with their new scales:
  each request runs whole on one version, the old or the new;
- a server started with `--load-format dummy` answers generation routes
  503 until a sync has been released as verified (its placeholder KV
  scales would make vLLM's engine die on the first request); requests
  sent during that first sync are held and run after it;
- a replica that refuses after a failed sync releases the hold as
  refusing: the gate answers generation routes 503 with its reason until a
  sync is released as verified. A replica that dies while it holds requests leaves
  them held until its hold lapses (its calls renew it; nobody else's do):
  the gate then refuses them, and another replica may hold the server
  only from then on. That replica first closes the update the dead one
  left open in the workers.

Every HTTP call has a deadline: the sync's `timeout_s` once a sync has
begun (a socket-level timeout: each connect and read must progress within
it), and the connect timeout before. Errors name the server's URL and what
to do. This module imports no vLLM: the process that holds the adapter
needs none.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Sequence
from typing import Any

from refit.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, TRANSFER_BACKEND, WORKER_EXTENSION
from refit.engine.facts import EngineFacts
from refit.engine.replica import Generation, ReplicaCore
from refit.engine.server_gate import DUMMY_ENV, KEY_ENV, PASS_HOLD_HEADER, RPC_METHOD, clean_key
from refit.engine.worker_rpc import decode_reply, encode_call
from refit.errors import ConfigError, EngineError, EngineHungError, ServerError, ServerGoneError
from refit.plan.config import Pause, SyncConfig
from refit.tokens import token_prompts
from refit.transport.collective import JOIN_MARGIN_S
from refit.transport.kinds import TransportKind

__all__ = ["DEV_MODE_ENV", "GATE_MIDDLEWARE", "ServerAdapter", "key_argument", "serve_arguments", "serve_key", "server_replica"]

DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
"""The environment a server needs: vLLM registers `/collective_rpc`, `/pause` and the RL routes only in dev mode."""

GATE_MIDDLEWARE = "refit.engine.server_gate.RefitGate"
"""vLLM's `--middleware` for refit's gate: the key on every route, and the hold (refit/engine/server_gate.py)."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any) -> None:
        return None  # the 30x is raised as an HTTPError: `_request` names it


# Every request carries the key (and a sync's secrets): never through a proxy the environment names (urllib's default,
# even for loopback), never re-sent to wherever a redirect points.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())

GONE_CHECK_TIMEOUT_S = 5.0
"""How long a look at the server waits for its workers to say who they are."""

GONE_POLL_S = 10.0
"""How often a replica looks whether its server restarted, between updates (`ServerAdapter.gone`)."""


def _keep_looking(adapter: weakref.ref) -> None:
    """Look at the adapter's server every `GONE_POLL_S` while no hold is open, on a daemon thread that ends with
    the adapter. Why a thread: `status` must never wait (it shares the replica's one observation thread with the
    driver's questions), yet between syncs only asking the server tells a restart."""

    def watch() -> None:
        while True:
            time.sleep(GONE_POLL_S)
            server = adapter()
            if server is None:
                return
            if server._pass_token is None:  # an update's own calls say more, and its workers may be busy
                server._gone = server._look()
            del server

    threading.Thread(target=watch, name="refit-server-watch", daemon=True).start()


_START_HINT = "start it with `refit serve MODEL ...` (or the plain `vllm serve` line in the README)"
_KEY_HINT = (f"pass the server's key as api_key= (actors.ServerRollout.remote(url, api_key=KEY), "
             f"refit.server_replica(url, api_key=KEY)) or set {KEY_ENV} in the replica's environment; it is the key "
             f"`refit serve` was given (--api-key, {KEY_ENV} or VLLM_API_KEY), or the one it generated and printed "
             "to its stderr when it started")


def serve_arguments(options: Sequence[str], *, on_gpu: bool) -> list[str]:
    """The `vllm serve` options refit needs, for a server started with `options` (vLLM's own, passed on unchanged).

    Its weight-transfer backend, worker extension and gate (`GATE_MIDDLEWARE`);
    one API server process (the gate's hold lives in it); `--host 127.0.0.1`
    unless `options` gives a host; on a CPU the KV-cache size of
    `EngineConfig`'s default (vLLM's CPU backend otherwise reserves 92% of
    the machine), unless `options` sizes it. Appended after `options` by
    `refit serve`, which also sets the key (`serve_key`); the environment
    needs `DEV_MODE_ENV` too.
    """
    given = _given(options)
    needed = [
        "--worker-extension-cls", WORKER_EXTENSION,
        "--weight-transfer-config", json.dumps({"backend": TRANSFER_BACKEND}),
        "--middleware", GATE_MIDDLEWARE,
    ]
    clashing = sorted(set(given) & {"--worker-extension-cls", "--weight-transfer-config"})
    if clashing:
        raise ConfigError(f"{', '.join(clashing)}: refit sets these (its worker extension and weight-transfer backend)")
    servers = given.get("--api-server-count", given.get("-asc"))
    if servers is not None and servers != ["1"]:
        raise ConfigError(f"--api-server-count {' '.join(servers)}: refit serve runs one API server process "
                          "(refit's gate holds users' requests during a sync in it); leave the option out")
    if servers is None:
        needed += ["--api-server-count", "1"]
    if "--host" not in given:
        needed += ["--host", "127.0.0.1"]  # loopback unless the user says otherwise
    sized = set(given) & {"--kv-cache-memory-bytes", "--gpu-memory-utilization"}
    if not on_gpu and not sized:
        needed += ["--kv-cache-memory-bytes", str(DEFAULT_CPU_KV_CACHE_BYTES)]
    return needed


def serve_key(options: Sequence[str], environ: dict[str, str]) -> tuple[str, str | None]:
    """The key a server started with `options` requires on every route, and where it came from (None: generated).

    vLLM's `--api-key` if given (one key), else `REFIT_API_KEY`, else `VLLM_API_KEY`, else a new random one.
    """
    import secrets

    given = _given(options).get("--api-key")
    if given is not None:
        if len(given) != 1 or not given[0]:
            raise ConfigError(f"--api-key takes one key with refit serve ({len(given)} given)")
        if clean_key(given[0], "--api-key", ConfigError) != given[0]:  # vLLM's own check of /v1 takes it as given
            raise ConfigError("--api-key holds surrounding whitespace: give the key without it")
        return given[0], "--api-key"
    for name in (KEY_ENV, "VLLM_API_KEY"):
        if environ.get(name):
            return clean_key(environ[name], name, ConfigError), name
    return secrets.token_urlsafe(32), None


def key_argument(key: str, source: str | None) -> list[str]:
    """vLLM's `--api-key` for the server's key, unless the options gave it already.

    One `--api-key=KEY` element: a key that starts with "-" (a generated `token_urlsafe` one does, 1 time in 64)
    would read as another option after a separate `--api-key`, and vLLM's parser would refuse to start.
    """
    return [] if source == "--api-key" else [f"--api-key={key}"]


def serve_environment(options: Sequence[str], key: str) -> dict[str, str]:
    """What `refit serve` sets in its own environment before vLLM starts: dev mode, the gate's key, a dummy load."""
    load_format = _given(options).get("--load-format", [])
    return {**DEV_MODE_ENV, KEY_ENV: key, DUMMY_ENV: "1" if load_format == ["dummy"] else "0"}


def _given(options: Sequence[str]) -> dict[str, list[str]]:
    """The options in `options` (`--name value...` or `--name=value`; underscores as dashes), with their values."""
    given: dict[str, list[str]] = {}
    name = None
    for option in options:
        if option.startswith("-") and not _is_number(option):
            name, _, value = option.partition("=")
            if name.startswith("--"):
                name = name.replace("_", "-")
            given[name] = [value] if value else []
        elif name is not None:
            given[name].append(option)
    return given


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def server_replica(url: str, api_key: str | None = None, *, connect_timeout_s: float = 30.0) -> ReplicaCore:
    """The running `vllm serve` server at `url` (started by `refit serve`, or with its options) as a replica a
    `refit.Syncer` can sync, for a Ray actor to hold and delegate the replica methods to (`refit.ReplicaMethods`);
    `actors.ServerRollout` is one. `api_key`: the server's key, else `REFIT_API_KEY` from the environment.
    Raises `refit.ServerError`, naming the URL and the fix, if it cannot be used (no key, a refused key, not a
    refit server)."""
    return ReplicaCore(ServerAdapter(url, api_key, connect_timeout_s=connect_timeout_s))


class ServerAdapter:
    """`ReplicaCore`'s access to a running `vllm serve` server at `url` (see the module docstring).

    Connecting checks, within `connect_timeout_s`, that the server answers,
    takes the key (`api_key`, else `REFIT_API_KEY`), is a refit server (its
    gate answers), has the dev routes, refit's worker extension and
    weight-transfer backend, and reads its `EngineFacts` and its workers'
    boot ids (to detect a restart later).
    """

    def __init__(self, url: str, api_key: str | None = None, *, connect_timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = connect_timeout_s  # the sync's timeout_s from its first update's hold on
        key = api_key or os.environ.get(KEY_ENV)
        if not key:
            raise ServerError(f"no API key for the server at {self.url}: every route of a refit server requires one; "
                              f"{_KEY_HINT}")
        self._key = clean_key(key, "api_key=" if api_key else KEY_ENV, ServerError)
        self._marked = False  # whether the update the hold is for was verified (`mark_version`)
        self._pass_token: str | None = None  # the current hold's, which refit's own requests pass it with
        # vLLM's routes name a LoRA adapter by a directory it loads (`/v1/load_lora_adapter`), and a request names
        # it by model name, which only vLLM's serving layer knows: one installed from memory is unreachable there.
        self.lora_rank: int | None = None
        self.worker_calls_beside_requests = True  # `/collective_rpc` queues in the engine core between its steps
        self._require_health()
        state = self._request("GET", "/refit/state")
        if not (isinstance(state, dict) and state.get("refit_gate") is True):
            raise self._not_refit("GET /refit/state", "its answer is not refit's gate's")
        models = self._request("GET", "/v1/models")
        try:
            self.served_model = models["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise self._not_refit("GET /v1/models", "its answer is not vLLM's model list") from None
        self.boot_ids = self._boot_ids()
        self._gone: str | None = None
        _keep_looking(weakref.ref(self))
        try:
            self.facts: EngineFacts = EngineFacts.from_plain(self._call_workers_once("refit_engine_facts")[0])
        except EngineError as error:
            if "weight_transfer_config" not in str(error):
                raise
            raise ServerError(
                f"the server at {self.url} was started without refit's weight-transfer backend "
                f"(--weight-transfer-config '{{\"backend\": \"{TRANSFER_BACKEND}\"}}'); {_START_HINT}"
            ) from None

    # -- the core's calls ---------------------------------------------------------------
    def transport_refusal(self, kind: TransportKind) -> str | None:
        if not kind.traits.reaches_server:
            return (f"transport={kind.name!r}: a vllm serve replica ({self.url}) takes its bytes only over a collective "
                    "group its workers join (HTTP carries only control messages); use SyncConfig(transport='collective')")
        return None

    def check(self, config: SyncConfig) -> None:
        """Refuse a server that restarted since this replica connected (its transport: `transport_refusal`)."""
        now = self._boot_ids()
        if now != self.boot_ids:
            raise ServerGoneError(
                f"the server at {self.url} restarted since this replica connected to it (worker boot id "
                f"{self.boot_ids} is now {now}): it serves the weights it started with, not the last sync's, and "
                "refit's record of it (version, scale provenance, collective group) is stale; create a new "
                f"actors.ServerRollout.remote({self.url!r}) for it and sync that"
            )
        self._gone = None  # asked just now: the same server

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
        answer = self._request("POST", "/v1/completions", body)
        try:
            choices = sorted(answer["choices"], key=lambda c: c["index"])
        except (KeyError, TypeError):
            raise self._not_refit("POST /v1/completions", "its answer is not vLLM's completions") from None
        token_ids = [list(c["token_ids"]) for c in choices]
        logprobs = [list(c["logprobs"]["token_logprobs"]) for c in choices]
        prompts_scored = None
        if prompt_logprobs:
            prompts_scored = [_own_logprobs(c["prompt_logprobs"], p) for c, p in zip(choices, checked)]
        return Generation(token_ids, logprobs, prompts_scored)

    def reset_prefix_cache(self) -> None:
        self._request("POST", "/reset_prefix_cache")

    def hold_requests(self, timeout_s: float) -> None:
        """The gate holds users' requests to generation routes from now on, until `release_requests`; every call to
        the server waits `timeout_s`, the sync's deadline, from now on."""
        self.timeout_s = timeout_s
        self._marked = False
        # The hold lapses into a refusal if this replica stops calling, as the core's own update lease does.
        answer = self._request("POST", f"/refit/hold?lease_s={3 * self.timeout_s:.3f}")
        self._pass_token = answer.get("pass_token") if isinstance(answer, dict) else None
        if self._pass_token is None:  # its own stage and probe would wait behind the hold it made
            self._request("POST", "/refit/release")
            raise ServerError(f"the server at {self.url} runs another version of refit's gate (its hold gave no token "
                              f"for refit's own requests); restart it with this refit: {_START_HINT}")
        if answer.get("refusing") is not None:
            # A replica that died mid-update left the workers' update open (its hold lapsed into this refusal), and
            # vLLM would refuse this one's start ("already active"). Holding the server, this replica is the only one
            # that drives its workers now, so that update is no one's: closed here, as its own replica would have.
            try:
                self._call_workers_once("refit_abandon_update")
            except BaseException:
                self.release_requests(refusal=answer["refusing"])  # still refusing, and not held until a lapse
                raise

    def pause(self, mode: Pause, timeout_s: float) -> None:
        """Requests that passed the gate before the hold end (`wait`: finish; `abort`: aborted), then vLLM's
        scheduler stops. Nothing of theirs is left queued in vLLM to run before the post-refit stage."""
        deadline = time.monotonic() + timeout_s
        if mode is Pause.WAIT:
            # vLLM's own `wait` keeps queued requests queued until /resume: they must end first, here.
            left = self._drain(timeout_s)
            if left:
                raise EngineHungError(
                    f"{left} request(s) that reached the server at {self.url} before the update were still running "
                    f"after {timeout_s:.0f} s (SyncConfig.timeout_s); raise it, or sync with pause='abort'"
                )
            self._request("POST", "/pause?mode=wait", timeout_s=timeout_s)
            return
        self._request("POST", f"/pause?mode={mode}", timeout_s=timeout_s)
        while left := self._drain(min(1.0, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise EngineHungError(f"{left} request(s) at the server at {self.url} did not end within "
                                      f"{timeout_s:.0f} s of being aborted (SyncConfig.timeout_s)")
            self._request("POST", "/abort_requests", {})  # reached the engine after /pause aborted the others

    def resume(self) -> None:
        """The server's scheduler runs again, for the post-refit stage and the probe; users' requests stay held."""
        self._request("POST", "/resume")

    def spec_decode_counts(self) -> tuple[int, int] | None:
        return None  # a server's counters are in its Prometheus /metrics, which refit does not read yet (docs/draft.md)

    def gone(self) -> str | None:
        """What the last look at the server found (`_look`): never waits, so `status` never does."""
        return self._gone

    def _look(self) -> str | None:
        """Whether the server restarted since this replica connected (its workers' boot ids), or cannot be asked."""
        try:
            now = self._call_workers_once("refit_boot_id", timeout_s=min(self.timeout_s, GONE_CHECK_TIMEOUT_S))
        except Exception as error:  # noqa: BLE001 - whatever it is, the server cannot say it still serves the version
            return f"its server cannot be asked whether it still serves this replica's version: {error}"
        if now != self.boot_ids:
            return (f"the server at {self.url} restarted since this replica connected to it: it serves the weights it "
                    f"started with, not the last sync's; create a new actors.ServerRollout.remote({self.url!r})")
        return None

    def mark_version(self, version: int) -> None:
        """The server's weight version (its `/weight_info`, its outputs' spans) becomes the sync's `version`."""
        self._request("POST", "/update_weight_version", {"new_version": str(version)})
        self._marked = True

    def release_requests(self, refusal: str | None = None) -> None:
        """The gate lets held requests go on: to the new version once it is marked; with `refusal`, to a 503 that
        says why, until a verified sync (a dummy-loaded server's, only once an update was verified)."""
        # A refusal wins over a mark: an update that failed after the server's version was marked (its base digest
        # unreadable, say) must not release its users to it as a synced version.
        if refusal is not None:
            query = "refusing=" + urllib.parse.quote(refusal[:2000])
        elif self._marked:
            query = "synced=1"
        else:
            query = "synced=0"
        try:
            self._request("POST", f"/refit/release?{query}")
        finally:  # a hold's token kept past its release would make the gate refuse this replica's every drive call
            self._marked, self._pass_token = False, None

    # -- the server's own state ---------------------------------------------------------
    def weight_version(self) -> str | None:
        return self._request("GET", "/weight_info")["weight_version"]

    def gate_state(self) -> dict:
        """The gate's hold: `held`, `in_flight` and `waiting` requests, `awaiting_first_sync` (a dummy load)."""
        return self._request("GET", "/refit/state")

    # -- HTTP ---------------------------------------------------------------------------
    def _require_health(self) -> None:
        self._request("GET", "/health", raw=True, if_unreachable=f"is a server running there? {_START_HINT}, then connect")

    def _boot_ids(self) -> list[str]:
        return self._call_workers_once("refit_boot_id")

    def _drain(self, timeout_s: float) -> int:
        """Wait, within `timeout_s`, until no request that passed the gate is running; how many still are."""
        state = self._request("POST", f"/refit/drain?timeout_s={timeout_s:.3f}", timeout_s=timeout_s + self.timeout_s)
        return int(state["in_flight"])

    def _call_workers_once(self, method: str, *args: Any, timeout_s: float | None = None) -> list:
        """`method(*args)` on every worker through `refit_call`; raises the first worker's exception, with the URL."""
        body = {"method": RPC_METHOD, "args": [encode_call(method, *args)]}
        what = f"worker call {method}"
        answer = self._request("POST", "/collective_rpc", body, timeout_s=timeout_s, what=what)
        if not (isinstance(answer, dict) and isinstance(answer.get("results"), list) and answer["results"]):
            raise self._not_refit(what, "its answer has no workers' results")
        results = []
        for reply in answer["results"]:
            try:
                ok, value = decode_reply(reply)
            except ValueError as error:
                raise self._not_refit(what, str(error)) from None
            if not ok:
                value.add_note(f"raised by a worker of the vllm serve replica at {self.url} ({method})")
                raise value
            results.append(value)
        return results

    def _request(self, verb: str, path: str, body: dict | None = None, *, timeout_s: float | None = None,
                 what: str | None = None, raw: bool = False, if_unreachable: str | None = None) -> Any:
        """The server's answer to `verb path`, parsed as JSON only (`raw`: its bytes, unparsed); raises `ServerError`s."""
        what = what or f"{verb} {path}"
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self._key}"}
        if self._pass_token is not None:  # the hold's own token: its stage and probe pass it, its calls keep it alive
            headers[PASS_HOLD_HEADER] = self._pass_token
        request = urllib.request.Request(self.url + path, data=data, method=verb, headers=headers)
        try:
            with _OPENER.open(request, timeout=timeout_s) as response:
                payload = response.read()
        except urllib.error.HTTPError as error:
            if 300 <= error.code < 400:
                raise ServerError(
                    f"the server at {self.url} answered {what} with a redirect (HTTP {error.code} to "
                    f"{error.headers.get('Location')!r}); refit follows none, since each request carries the key: "
                    "give the replica the server's own URL") from None
            raise self._refused(what, path, error.code, error.read().decode(errors="replace")) from None
        except (urllib.error.URLError, ConnectionError, OSError, http.client.HTTPException) as error:
            cause = getattr(error, "reason", error)  # urllib wraps what failed while connecting
            if isinstance(cause, TimeoutError):  # also a connect or TLS handshake that timed out
                raise EngineHungError(
                    f"the server at {self.url} did not answer {what} within {timeout_s:.0f} s (SyncConfig.timeout_s); "
                    "it is hung or overloaded"
                ) from None
            if isinstance(cause, ssl.SSLCertVerificationError):
                raise ServerError(
                    f"the server at {self.url} presented a certificate this replica does not trust for {what} "
                    f"({cause.verify_message}); give the replica's process the CA that signed it "
                    "(SSL_CERT_FILE=PATH in its environment)") from None
            # An HTTPException (IncompleteRead, RemoteDisconnected): the connection closed part-way through the
            # answer, as when the server dies while it answers. The server is as gone as one that refuses connections.
            reason = (f"the connection closed before the answer was complete ({error!r})"
                      if isinstance(error, http.client.HTTPException) else cause)
            fix = if_unreachable or (
                f"it died or its address is wrong. If it died, restart it ({_START_HINT}) and create a new "
                "actors.ServerRollout for it"
            )
            raise ServerGoneError(f"the server at {self.url} could not be reached for {what}: {reason}; {fix}") from None
        if raw or not payload:
            return payload
        try:
            return json.loads(payload)
        except ValueError:  # parsed only: bytes that are not JSON (a pickle, say) are never executed
            raise self._not_refit(what, f"its answer is not JSON ({payload[:40]!r}...)") from None

    def _not_refit(self, what: str, why: str) -> ServerError:
        return ServerError(f"the server at {self.url} is not a refit server (started by `refit serve`): {why}, "
                           f"for {what}; nothing of it was used. Check the URL; {_START_HINT}")

    def _refused(self, what: str, path: str, status: int, detail: str) -> ServerError:
        """The error for an HTTP error status, saying which of refit's requirements the server lacks."""
        if status in (401, 403):
            refusal = "no key was sent" if status == 401 else "it is not the server's key"
            return ServerError(f"the server at {self.url} refused refit's API key for {what} (HTTP {status}: "
                               f"{refusal}); {_KEY_HINT}")
        if status == 404 and path.startswith("/refit/"):
            return ServerError(f"the server at {self.url} has no {path.split('?')[0]} route: it runs without refit's "
                               f"gate (--middleware {GATE_MIDDLEWARE}), which refit needs to hold users' requests "
                               f"during a sync and to require a key on every route; {_START_HINT}")
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
