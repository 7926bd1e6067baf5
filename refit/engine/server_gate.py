"""`RefitGate`: the ASGI middleware `refit serve` puts in front of every route of its `vllm serve` server.

vLLM's dev routes (`/collective_rpc`, `/pause`, `/update_weight_version`,
...) let whoever reaches them drive the server's workers, and vLLM's own
`--api-key` guards only paths under `/v1`. The gate guards them all:

- every request, on every route (`/health`, `/v1/...`, the dev routes,
  the gate's own), must carry `Authorization: Bearer KEY`, compared in
  constant time with the key in `REFIT_API_KEY` (set by `refit serve` in
  its own process before vLLM starts). No key: 401; another key: 403; a
  JSON body says which, and the request never reaches vLLM;
- while refit holds requests (a sync in progress, `ServerAdapter.hold_requests`),
  requests to generation routes (every route but the control routes in
  `CONTROL_PATHS`) wait in the gate, and go on when refit releases them,
  after the sync's KV-scale stage and probe. Refit's own stage and probe
  carry the `PASS_HOLD_HEADER` header with the hold's own token (a random
  one `POST /refit/hold` answers with, void once released), which passes
  the hold: users hold the key, not the token;
- a server started with `--load-format dummy` (`DUMMY_ENV`) answers
  generation routes 503 until a sync has been released as verified: its
  placeholder KV scales would make vLLM's engine die on the first request.
  Requests sent during that first sync are held like any others;
- a hold lives on calls: each request by which the replica that holds it
  drives its update (`DRIVING_PATHS`, the gate's own POST routes, refit's
  own generation), carrying the hold's token, renews it for `lease_s`
  (`POST /refit/hold?lease_s=T`; the replica asks three of its sync's
  deadlines, as its own update lease). A replica that died while it held
  the server (its update left open, the model perhaps half-loaded) renews
  nothing: the hold then lapses into a refusal, so held users get a 503
  that says why instead of waiting for ever;
- a hold is its replica's: while it has not lapsed, another replica's
  `/refit/hold` or `/refit/release` (without its token) is refused 409, so
  a second replica of the same server cannot release users onto a model
  the first is loading. A lapsed hold may be taken over: the server then
  refuses (the dead replica's update may be half-loaded) until a sync is
  released as verified. A drive call or a `/refit/release` carrying a
  lapsed (or released) hold's token is refused 409 whoever holds now, and
  so is a drive call carrying no token while a hold lives (a replica whose
  release was refused has forgotten its token): only the holder drives the
  workers during its update. Worker calls that only read
  (`READING_METHODS`) pass, so other replicas can connect and look;
- vLLM's worker RPC and weight-transfer routes are refused (403, naming
  the route or method): every `/collective_rpc` whose `method` is not
  `RPC_METHOD` (vLLM's route calls any worker method with the request's
  arguments; refit's own calls go through `refit_call`, which runs only
  refit's allow-list and never takes a file or an IPC handle from the
  network), and vLLM's weight-transfer routes (`REFUSED_PATHS`), none of
  which refit's replica sends. A `/collective_rpc` body is read whole (at
  most `MAX_RPC_BODY_BYTES`, else 413) and handed on to vLLM unchanged.
  Other routes that can change what is served stay the key holder's, as
  operations of the server: `/sleep` (level 2 drops the weights) with
  `/wake_up`, and `/v1/load_lora_adapter` where runtime LoRA updates are on;
- a replica that refuses after a failed sync (its model a mix of two
  versions) releases the hold as refusing: generation routes then answer
  503 with its reason, until a sync is released as verified. Whoever routes
  users' traffic sees the server out of rotation without asking refit.

The gate answers its own routes, under `/refit/` (all key-protected):
`POST /refit/hold`, `POST /refit/drain?timeout_s=T` (waits until the
generation requests that passed the gate have ended), `POST
/refit/release?synced=1` (a verified sync: serve) or `?refusing=REASON` (a
failed one: refuse) or neither (nothing changed: as before the hold), `GET
/refit/state`. Its state lives in the
API server's process: `refit serve` runs one (`--api-server-count 1`).

This module imports no vLLM (vLLM adds the class with `app.add_middleware`,
from `--middleware refit.engine.server_gate.RefitGate`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

__all__ = ["CONTROL_PATHS", "DRIVING_PATHS", "DUMMY_ENV", "GATE_PREFIX", "KEY_ENV", "MAX_RPC_BODY_BYTES", "PASS_HOLD_HEADER",
           "READING_METHODS", "REFUSED_PATHS", "RPC_METHOD", "RefitGate", "clean_key"]

KEY_ENV = "REFIT_API_KEY"
"""The environment variable holding the server's key (the gate's), and the replica's default key."""

DUMMY_ENV = "REFIT_SERVE_DUMMY"
"""Set to "1" by `refit serve` for a server started with `--load-format dummy`."""

PASS_HOLD_HEADER = "x-refit-pass-hold"
"""A request carrying this header (with the key) passes a hold: refit's post-refit stage and probe."""

GATE_PREFIX = "/refit/"

CONTROL_PATHS = frozenset({
    "/collective_rpc", "/pause", "/resume", "/is_paused", "/update_weight_version", "/weight_info", "/health",
    "/ping", "/reset_prefix_cache", "/reset_mm_cache", "/abort_requests", "/v1/models", "/version", "/load",
    "/server_info", "/is_sleeping", "/metrics",
})
"""Routes that pass a hold (refit's control messages, health and information): every other route is a generation route."""

DRIVING_PATHS = frozenset({"/collective_rpc", "/pause", "/resume", "/update_weight_version", "/reset_prefix_cache",
                           "/abort_requests"})
"""The control routes by which a replica drives an update: they renew a hold (and `POST /refit/...`, and refit's own
generation). Health checks and reads do not, so a load balancer's probes cannot keep a dead replica's hold alive."""

RPC_METHOD = "refit_call"
"""The one worker method refit calls through `/collective_rpc` (`RefitWorkerExtension.refit_call`); any other is refused."""

REFUSED_PATHS = frozenset({
    "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/start_weight_update",
    "/start_draft_weight_update", "/update_weights", "/finish_weight_update", "/weight_checker",
})
"""vLLM's weight-transfer routes, which refit's replica never sends: each would open, load into, finish or reset the
workers' weights outside refit's update (its plan, its integrity tags, its post-refit stage), and `/update_weights`
hands the backend contents naming memory files or CUDA IPC handles, which `refit_call` refuses from the network."""

MAX_RPC_BODY_BYTES = 256 << 20
"""The largest `/collective_rpc` body the gate reads (a plan of a model of many thousand tensors is a few MiB)."""

READING_METHODS = frozenset({"refit_boot_id", "refit_engine_facts", "refit_streamed", "refit_base_digest",
                             "refit_scale_records"})
"""refit's worker methods that change nothing: a replica without the hold may call them (connecting, looking whether
the server restarted) while another replica's update holds the server."""

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class RefitGate:
    """Pure ASGI middleware: the key on every route, and refit's hold on generation routes (see the module docstring)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"{KEY_ENV} is not set: refit's gate will not serve without a key (start the server "
                               "with `refit serve`, which sets it)")
        self.app = app
        self._key_digest = hashlib.sha256(clean_key(key, KEY_ENV, RuntimeError).encode()).digest()
        self._held = False
        self._pass_token: str | None = None  # the hold's: refit's own requests pass it with this, users cannot
        self._hold_lease_s = 0.0
        self._hold_deadline = 0.0  # monotonic; renewed by every control request while held
        self._awaiting_first_sync = os.environ.get(DUMMY_ENV) == "1"
        self._refusing: str | None = None  # why the replica refuses, after a failed sync
        self._in_flight = 0  # generation requests that passed the gate and have not ended
        self._waiting = 0  # generation requests waiting in the gate for a release
        self._changed: asyncio.Condition | None = None  # made in the server's event loop, on first use

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        refused = self._refusal(scope)
        if refused is not None:
            await _answer(scope, send, *refused)
            return
        path = _path(scope)
        route = path.rstrip("/")
        if route in REFUSED_PATHS:
            await _answer(scope, send, 403, {"error": (
                f"{path} is refused by refit's gate: it would change the served weights outside refit's update (its "
                "plan, integrity tags and post-refit stage); sync the server through its actors.ServerRollout")})
            return
        worker_method = None
        if route == "/collective_rpc" and scope["type"] == "http":
            receive, refused, worker_method = await _checked_rpc(scope, receive)
            if refused is not None:
                await _answer(scope, send, *refused)
                return
        if path.startswith(GATE_PREFIX):
            await _answer(scope, send, *await self._own_route(scope, path))
            return
        sent = _header(scope, PASS_HOLD_HEADER)
        holder = sent is not None and self._passes_hold(sent)
        if _is_control(path):  # passes whatever it carries; only the holder's drive renews the hold
            driving = route in DRIVING_PATHS
            if driving and sent is not None and not holder:
                # A replica whose hold lapsed (or was released) would drive the workers' update on: into another
                # replica's update, once that one holds the server. A call without a token: below.
                await _answer(scope, send, 409, {"error": (
                    f"this request's {PASS_HOLD_HEADER} names a hold this server no longer has (it lapsed, or was "
                    "released): the replica that sent it no longer drives an update here; begin a new sync")})
                return
            if driving and sent is None and self._held and worker_method not in READING_METHODS:
                left = self._hold_deadline - time.monotonic()
                if left > 0:
                    # The key's holder drives freely between updates, not into one: a replica whose release was refused
                    # (its hold lapsed and another took the server) forgets its token, and its abandon, resume or
                    # bucket would close or change the update of the replica that holds the server now.
                    await _answer(scope, send, 409, {"error": (
                        f"{path} ({worker_method or 'no worker call'}) without the {PASS_HOLD_HEADER} header of the "
                        f"hold that a replica's update has on this server (it lapses in {left:.0f} s unless that "
                        "replica calls again): only the holder drives the workers during its update; sync through "
                        "that replica, or begin a new sync once its hold has lapsed (a replica whose own release "
                        "failed or timed out has let its token go, so this may be its own hold)")})
                    return
                await self._lapse()
            if holder and driving:
                self._renew_hold()
            await self.app(scope, receive, send)
            return
        if sent is not None:
            if not holder:
                await _answer(scope, send, 409, {"error": f"the {PASS_HOLD_HEADER} header does not carry the current "
                                                          "hold's token: only refit's own requests pass a hold"})
                return
            self._renew_hold()
            await self.app(scope, receive, send)
            return
        if self._held:
            self._waiting += 1
            try:
                await self._wait_out_the_hold()
            finally:
                self._waiting -= 1
        if self._awaiting_first_sync:
            await _answer(scope, send, 503, {"error": (
                "this server was started with --load-format dummy: its weights and KV-cache scales are placeholders "
                "until refit's first sync has been verified; retry after it"
            )})
            return
        if self._refusing is not None:
            await _answer(scope, send, 503, {"error": (
                f"refit's replica of this server refuses to serve until its next verified sync: {self._refusing}"
            )})
            return
        self._in_flight += 1  # no await since the hold was checked: a hold set from here on drains this request
        try:
            await self.app(scope, receive, send)
        finally:
            self._in_flight -= 1
            await self._notify()

    # -- the key ------------------------------------------------------------------------------
    def _refusal(self, scope: Scope) -> tuple[int, dict, list] | None:
        given = _header(scope, "authorization")
        if given is None:
            return 401, {"error": "missing API key: send 'Authorization: Bearer KEY' with the key refit serve "
                                  "was started with"}, [(b"www-authenticate", b"Bearer")]
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
                hashlib.sha256(key.strip().encode()).digest(), self._key_digest):
            return 403, {"error": "wrong API key: the key sent is not the one refit serve was started with"}, []
        return None

    # -- the hold -----------------------------------------------------------------------------
    async def _own_route(self, scope: Scope, path: str) -> tuple[int, dict]:
        query = {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()}
        verb = scope.get("method")
        sent = _header(scope, PASS_HOLD_HEADER)
        holder = sent is not None and self._passes_hold(sent)
        if verb == "POST" and holder:
            self._renew_hold()
        if verb == "POST" and path == "/refit/release" and sent is not None and not holder:
            # As on the drive routes: a replica whose hold lapsed would release users (as synced, even) onto the model
            # of the replica that holds, or held, the server since.
            return 409, {"error": (
                f"this request's {PASS_HOLD_HEADER} names a hold this server no longer has (it lapsed, or was "
                "released): the replica that sent it no longer holds users here")}
        if verb == "POST" and path in ("/refit/hold", "/refit/release") and self._held and not holder:
            # Another replica's hold: while it lives, its update may be loading; once lapsed, the server refuses.
            left = self._hold_deadline - time.monotonic()
            if left > 0:
                return 409, {"error": (
                    f"another replica's update holds this server (its hold lapses in {left:.0f} s unless that replica "
                    "calls again): one replica syncs a server at a time; sync it through that replica's Syncer, or "
                    "retry once its hold has lapsed")}
            await self._lapse()
        if path == "/refit/hold" and verb == "POST":
            lease_s = _seconds(query.get("lease_s", "360"))
            if lease_s is None or lease_s <= 0:
                return 400, {"error": "lease_s must be a positive, finite number of seconds"}
            self._held, self._hold_lease_s, self._hold_deadline = True, lease_s, time.monotonic() + lease_s
            self._pass_token = secrets.token_hex(16)
            return 200, {**self._state(), "pass_token": self._pass_token}
        elif path == "/refit/release" and verb == "POST":
            self._held, self._pass_token = False, None
            if query.get("synced") == "1":
                self._awaiting_first_sync, self._refusing = False, None
            elif "refusing" in query:
                self._refusing = query["refusing"][:2000] or "a sync failed"
            await self._notify()
        elif path == "/refit/drain" and verb == "POST":
            timeout_s = _seconds(query.get("timeout_s", "60"))
            if timeout_s is None:
                return 400, {"error": "timeout_s must be a finite number of seconds"}
            try:
                await asyncio.wait_for(self._wait_for(lambda: self._in_flight == 0), max(0.0, timeout_s))
            except TimeoutError:
                pass
        elif path != "/refit/state" or verb != "GET":
            return 404, {"error": f"no route {verb} {path}: refit's gate answers POST /refit/hold, /refit/release, "
                                  "/refit/drain and GET /refit/state"}
        return 200, self._state()

    def _state(self) -> dict:
        return {"refit_gate": True, "held": self._held, "in_flight": self._in_flight, "waiting": self._waiting,
                "awaiting_first_sync": self._awaiting_first_sync, "refusing": self._refusing}

    def _passes_hold(self, sent: str) -> bool:
        """Whether a pass-hold header carries the current hold's token (refit's own stage and probe)."""
        return self._pass_token is not None and secrets.compare_digest(sent.encode("latin-1"), self._pass_token.encode())

    def _renew_hold(self) -> None:
        if self._held:
            self._hold_deadline = time.monotonic() + self._hold_lease_s

    async def _wait_out_the_hold(self) -> None:
        """Until the hold is released, or lapses (its replica stopped calling): then the server refuses."""
        while self._held:
            left = self._hold_deadline - time.monotonic()
            if left <= 0:
                await self._lapse()
                return
            try:
                await asyncio.wait_for(self._wait_for(lambda: not self._held), min(left, 1.0))
            except TimeoutError:
                pass

    async def _lapse(self) -> None:
        """The hold's replica stopped calling: its update may be half-loaded, so the server refuses."""
        self._held, self._pass_token = False, None
        self._refusing = (f"refit's replica stopped driving the update it began (no call for {self._hold_lease_s:.0f} s): "
                          "its driver or its actor is gone, and the update may be half-loaded")
        await self._notify()

    async def _wait_for(self, predicate: Callable[[], bool]) -> None:
        changed = self._condition()
        async with changed:
            await changed.wait_for(predicate)

    async def _notify(self) -> None:
        changed = self._condition()
        async with changed:
            changed.notify_all()

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed


def clean_key(key: str, source: str, error: type[Exception]) -> str:
    """`key` as `Authorization: Bearer KEY` carries it, without surrounding whitespace (a secret file's newline, which
    the gate strips from what it is sent); `error`, naming `source` but never the key, for one no header can carry."""
    key = key.strip()
    if not key or any(ord(c) < 32 or 126 < ord(c) < 160 or ord(c) > 255 for c in key):
        raise error(f"{source} holds a control character or one outside Latin-1, or nothing: no HTTP header can carry "
                    "it as the server's key; use printable characters (secrets.token_urlsafe(32) makes one)")
    return key


async def _checked_rpc(scope: Scope, receive: Receive) -> tuple[Receive, tuple[int, dict] | None, str | None]:
    """Read a `/collective_rpc` body whole and check it names `RPC_METHOD`: a `receive` that hands vLLM the same
    body, the gate's answer if it refuses the call (400, 403, 413) instead, and the refit worker method it calls
    (None if it names none: the worker refuses it)."""
    declared = _header(scope, "content-length")
    too_big = (413, {"error": f"a /collective_rpc body is larger than refit's gate reads ({MAX_RPC_BODY_BYTES} bytes, "
                              "MAX_RPC_BODY_BYTES); refit's own calls are far smaller"})
    if declared is not None and declared.strip().isdigit() and int(declared) > MAX_RPC_BODY_BYTES:
        return receive, too_big, None
    chunks, size, disconnect = [], 0, None
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away: vLLM sees that as it would have
            disconnect = message
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_RPC_BODY_BYTES:
            return receive, too_big, None
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if not replayed:
            replayed = True
            return disconnect or {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    if disconnect is not None:
        return replay, None, None
    try:
        call = json.loads(body)
    except ValueError as error:
        return replay, (400, {"error": f"a /collective_rpc body must be a JSON object ({error})"}), None
    method = call.get("method") if isinstance(call, dict) else None
    if method != RPC_METHOD:
        return replay, (403, {"error": (
            f"/collective_rpc method {str(method)[:100]!r} is refused by refit's gate: only {RPC_METHOD!r} (refit's "
            "worker RPC, which runs refit's own worker methods) passes; vLLM's route would call any worker method "
            "with the request's arguments")}), None
    return replay, None, _worker_method(call.get("args"))


def _worker_method(args: Any) -> str | None:
    """The refit worker method a `refit_call`'s arguments name (`worker_rpc.encode_call`), or None."""
    try:
        named = json.loads(args[0]).get("method") if isinstance(args, list) and args else None
    except (TypeError, ValueError, AttributeError):
        return None
    return named if isinstance(named, str) else None


def _seconds(text: str) -> float | None:
    """A query's number of seconds; None for what is none (NaN and infinity parse as floats, but a hold that never
    lapses, or a deadline that is no time, would be the gate's own hang)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _path(scope: Scope) -> str:
    return scope["path"].removeprefix(scope.get("root_path", "")) or "/"


def _is_control(path: str) -> bool:
    return path.rstrip("/") in CONTROL_PATHS or path.startswith("/metrics/")


def _header(scope: Scope, name: str) -> str | None:
    wanted = name.encode()
    for key, value in scope.get("headers", ()):
        if key.lower() == wanted:
            return value.decode("latin-1")
    return None


async def _answer(scope: Scope, send: Send, status: int, body: dict, headers: list | None = None) -> None:
    """A JSON answer from the gate itself (a websocket is closed instead: policy violation, or try again later)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008 if status in (401, 403) else 1013, "reason": str(body.get("error", ""))[:120]})
        return
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})
