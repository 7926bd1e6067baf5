"""The server replica's parts that need no server: `refit serve`'s additions to `vllm serve`'s options and its key,
the worker end of `refit_call` (JSON only, an allow-list), and what the replica does with an answer that is not a
refit server's (syncs of a real server: tests/sync/test_server_rollout.py). Last, one real server started with
vLLM's config file, which no Ray cluster syncs: its gate's refusals and its workers' owner of an update."""

import asyncio
import base64
import json
import os
import pickle
import time

import pytest

from refit.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, TRANSFER_BACKEND, WORKER_EXTENSION
from refit.engine.server import GATE_MIDDLEWARE, key_argument, serve_arguments, serve_environment, serve_key
from refit.engine.server_gate import DUMMY_ENV
from refit.engine.worker_rpc import (
    SERVER_METHODS,
    WORKER_METHODS,
    RefitWorkerExtension,
    WorkerCalls,
    decode_reply,
    encode_call,
    results_of,
)
from refit.errors import ConfigError, EngineError, ServerError, VerificationError
from refit.plan.config import Transport
from refit.provenance import KvScalePolicy


def test_refit_adds_its_worker_extension_backend_and_on_a_cpu_the_engine_configs_kv_cache():
    added = serve_arguments(["--port", "8000", "--load-format", "dummy"], on_gpu=False)
    options = dict(zip(added[::2], added[1::2]))
    assert options["--worker-extension-cls"] == WORKER_EXTENSION
    assert json.loads(options["--weight-transfer-config"]) == {"backend": TRANSFER_BACKEND}
    assert options["--kv-cache-memory-bytes"] == str(DEFAULT_CPU_KV_CACHE_BYTES)


@pytest.mark.parametrize("sizing", [["--kv-cache-memory-bytes", "1024"], ["--kv-cache-memory-bytes=1024"],
                                    ["--gpu-memory-utilization", "0.5"]])
def test_a_users_own_cache_sizing_wins_and_a_gpu_keeps_vllms_own(sizing):
    assert "--kv-cache-memory-bytes" not in serve_arguments(sizing, on_gpu=False)
    assert "--kv-cache-memory-bytes" not in serve_arguments([], on_gpu=True)


@pytest.mark.parametrize("option", ["--worker-extension-cls", "--weight-transfer-config"])
def test_an_option_refit_must_set_is_refused_naming_it(option):
    with pytest.raises(ConfigError, match=f"{option}: refit sets these"):
        serve_arguments([option, "x"], on_gpu=False)


def test_a_server_error_is_an_engine_error():
    assert issubclass(ServerError, EngineError)


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("not picklable")


class _Worker(RefitWorkerExtension):
    """A vLLM worker as refit's extension sees it, minus vLLM: no weight-transfer backend attached."""

    def refit_streamed(self) -> list[str]:
        return ["a", "b"]

    def refit_base_digest(self) -> str | None:
        raise _Unpicklable("kept as text")

    def refit_scale_records(self) -> list:
        raise VerificationError("a refit error keeps its type")

    def refit_leave_group(self, group_id: str | None = None) -> object:
        return object()  # not JSON

    def update_weights(self, update_info: dict) -> dict:
        return update_info

    def add(self, a: int, b: int) -> int:  # a method of the worker, but none refit calls through a server
        return a + b


def test_refit_call_returns_the_result_or_the_workers_error_with_its_type():
    worker = _Worker()
    assert decode_reply(worker.refit_call(encode_call("refit_streamed"))) == (True, ["a", "b"])
    ok, error = decode_reply(worker.refit_call(encode_call("refit_engine_facts")))  # started without refit's backend
    assert not ok and isinstance(error, EngineError) and "weight_transfer_config={'backend': 'refit'}" in str(error)
    ok, error = decode_reply(worker.refit_call(encode_call("refit_scale_records")))
    assert not ok and type(error) is VerificationError and str(error) == "a refit error keeps its type"
    ok, error = decode_reply(worker.refit_call(encode_call("refit_leave_group")))
    assert not ok and type(error) is EngineError and str(error) == "refit_leave_group returned object, which is not JSON"


def test_a_workers_error_of_another_type_arrives_as_an_engine_error_naming_its_type():
    ok, error = decode_reply(_Worker().refit_call(encode_call("refit_base_digest")))
    assert not ok and type(error) is EngineError and str(error) == "_Unpicklable: kept as text"


@pytest.mark.parametrize("method", ["add", "no_such_method", "__init__", "refit_call", "collective_rpc"])
def test_refit_call_refuses_a_method_outside_its_allow_list(method):
    ok, error = decode_reply(_Worker().refit_call(encode_call(method, 2, 3)))
    assert not ok and type(error) is ConfigError
    assert str(error).startswith(f"refit_call refuses method {method!r}: only refit's worker methods can be called")


def test_a_typed_call_answers_as_data_and_results_of_raises_the_workers_error_with_its_type():
    """Workers in another process answer through vLLM's RPC, which keeps only an error's message: refit's own errors
    come back as data, so that the replica can tell a bucket refused before loading from any other failure."""
    worker = _Worker()
    answers = [worker.refit_typed_call("refit_streamed"), worker.refit_typed_call("update_weights", {"v": 1})]
    assert results_of(answers) == [["a", "b"], {"v": 1}]
    with pytest.raises(VerificationError, match="^a refit error keeps its type$"):
        results_of([answers[0], worker.refit_typed_call("refit_scale_records")])
    with pytest.raises(EngineError, match="^_Unpicklable: kept as text$"):
        results_of([worker.refit_typed_call("refit_base_digest")])
    for method in ("add", "refit_typed_call", "__init__"):
        with pytest.raises(ConfigError, match=f"refit_typed_call refuses method {method!r}"):
            results_of([worker.refit_typed_call(method, 2, 3)])
    with pytest.raises(ValueError, match="not refit's answer shape"):
        results_of([["a", "b"]])  # a worker that answered the call itself, not refit_typed_call


def test_every_rpc_of_worker_calls_is_in_the_allow_list():
    """`WorkerCalls` is the replica's end for a server too: each of its methods must reach the workers."""
    from refit.plan.transfer_plan import QuantizeOn, TransferPlan
    from refit.transport.collective import Rendezvous

    called = []
    calls = WorkerCalls(lambda method, *args: called.append((method, args)) or [[]])
    plan = TransferPlan((), QuantizeOn.TRAINER, b"k")
    calls.start_update(plan, Transport.COLLECTIVE)
    calls.base_digests(), calls.drop_base(), calls.streamed(), calls.finish_update(), calls.abandon_update()
    calls.receive([], [], 1, verify=True), calls.start_amax(), calls.stop_amax(), calls.leave_group()
    calls.apply_kv_policy(KvScalePolicy.AUTO, 1, None), calls.scale_records()
    calls.join_group(Rendezvous("127.0.0.1", 1, "g", ("trainer", "worker"), 5.0), 0)
    assert {m for m, _ in called} | {"refit_engine_facts", "refit_boot_id"} == SERVER_METHODS
    assert SERVER_METHODS | {"refit_add_adapter", "refit_remove_adapter"} == WORKER_METHODS  # LoRA: never over HTTP
    for _, args in called:  # every argument crosses HTTP as JSON
        json.dumps(args)
    (plan_args,) = [args for method, args in called if method == "refit_start_update"]
    sent = TransferPlan.from_plain(json.loads(json.dumps(plan_args[0])))
    assert sent == plan and sent.integrity_key == b"k"


@pytest.mark.parametrize("payload", [
    json.dumps({"method": "update_weights", "args": [{"version": 1, "tensors": [["w", [1.0]]], "verify": True}]}),
    json.dumps({"method": "update_weights", "args": [{"version": 1}]}),
])
def test_update_weights_over_http_takes_contents_never_tensors(payload):
    ok, error = decode_reply(_Worker().refit_call(payload))
    assert not ok and type(error) is ConfigError
    assert "takes a bucket's `contents` only" in str(error) and "tensors never cross HTTP" in str(error)


@pytest.mark.parametrize("part", [
    [0, [], 0, base64.b64encode(pickle.dumps("anything")).decode("ascii"), None],  # a CUDA IPC handle
    [0, [], 0, None, [1, 3, "0" * 32, 1]],  # a memory file of some process's
    [0, [], 0, base64.b64encode(pickle.dumps("anything")).decode("ascii")],  # the old form, its handle fourth
], ids=["ipc-handle", "shm-file", "four-fields"])
def test_update_weights_over_http_refuses_contents_naming_ipc_handles_or_memory_files(part):
    """A CUDA IPC handle is unpickled by the worker that opens it, and a memory file read by the worker that maps it:
    over HTTP either would be the network's choice."""
    payload = json.dumps({"method": "update_weights", "args": [
        {"version": 1, "contents": [part], "next_bucket_bytes": [None], "verify": True}]})
    ok, error = decode_reply(_Worker().refit_call(payload))
    assert not ok and type(error) is ConfigError and "contents without IPC handles or shared-memory files" in str(error)


def test_a_pickled_payload_is_refused_and_never_unpickled(tmp_path):
    marker = tmp_path / "ran"
    payload = base64.b64encode(pickle.dumps(_Marker(str(marker)))).decode("ascii")
    ok, error = decode_reply(_Worker().refit_call(payload))
    assert not ok and type(error) is ConfigError and not marker.exists()
    assert str(error) == 'refit_call takes a JSON string {"method": ..., "args": [...]}; nothing else is accepted'


@pytest.mark.parametrize("reply", ["not json", json.dumps({"ok": "yes"}), json.dumps([1, 2]), None, 5])
def test_a_reply_that_is_not_refit_calls_json_is_refused(reply):
    with pytest.raises(ValueError, match="a worker's answer is"):
        decode_reply(reply)


def test_engine_facts_cross_json_unchanged():
    from fixtures import model_dir
    from refit.engine.facts import EngineFacts
    from refit.plan.transfer_plan import RolloutModelInfo

    facts = EngineFacts(RolloutModelInfo.from_checkpoint(model_dir(True, "fp8_block"), from_files=True), 512, 2, True,
                        "a dummy load")
    assert EngineFacts.from_plain(json.loads(json.dumps(facts.to_plain()))) == facts
    with pytest.raises(EngineError, match="not an engine's facts .*the sender is not refit's"):
        EngineFacts.from_plain({"vocab_size": 5})


class _Marker:
    """Unpickling it runs `touch PATH`: what a payload from anyone on the network could do to a pickle-reading end."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


# -- refit serve's options and key ----------------------------------------------------------------------------------

def test_refit_serve_listens_on_loopback_behind_its_gate_in_one_api_server_unless_told_otherwise():
    added = serve_arguments(["--port", "8000"], on_gpu=True)
    options = dict(zip(added[::2], added[1::2]))
    assert options["--host"] == "127.0.0.1" and options["--middleware"] == GATE_MIDDLEWARE
    assert options["--api-server-count"] == "1"
    assert "--host" not in serve_arguments(["--host", "0.0.0.0"], on_gpu=True)
    assert "--host" not in serve_arguments(["--host=::"], on_gpu=True)
    with pytest.raises(ConfigError, match="--api-server-count 2: refit serve runs one API server process"):
        serve_arguments(["--api-server-count", "2"], on_gpu=True)


def test_the_servers_key_is_the_api_key_option_else_refits_else_vllms_env_else_generated():
    assert serve_key(["m", "--api-key", "a"], {"REFIT_API_KEY": "b", "VLLM_API_KEY": "c"}) == ("a", "--api-key")
    assert serve_key(["m", "--api-key=a"], {}) == ("a", "--api-key")
    assert serve_key(["m"], {"REFIT_API_KEY": "b", "VLLM_API_KEY": "c"}) == ("b", "REFIT_API_KEY")
    assert serve_key(["m"], {"VLLM_API_KEY": "c"}) == ("c", "VLLM_API_KEY")
    key, source = serve_key(["m"], {})
    assert source is None and len(key) >= 40 and key != serve_key(["m"], {})[0]
    with pytest.raises(ConfigError, match=r"--api-key takes one key with refit serve \(2 given\)"):
        serve_key(["--api-key", "a", "b"], {})


@pytest.mark.parametrize("key", ["-starts-with-a-dash", "--looks-like-an-option", "plain"])
def test_any_key_reaches_vllms_own_parser_as_one_key(key):
    """A generated key starts with "-" one time in 64; as a separate argument vLLM's parser took it for an option."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    assert parser.parse_args(key_argument(key, "REFIT_API_KEY")).api_key == [key]
    assert key_argument(key, "--api-key") == []  # given among the options already


def test_a_dummy_load_is_told_to_the_gate():
    assert serve_environment(["m", "--load-format", "dummy"], "k")[DUMMY_ENV] == "1"
    assert serve_environment(["m", "--load_format=dummy"], "k")[DUMMY_ENV] == "1"
    assert serve_environment(["m"], "k") == {"VLLM_SERVER_DEV_MODE": "1", "REFIT_API_KEY": "k", DUMMY_ENV: "0"}


def test_a_replica_without_a_key_says_where_to_get_one(monkeypatch):
    from refit.engine.server import ServerAdapter

    monkeypatch.delenv("REFIT_API_KEY", raising=False)
    with pytest.raises(ServerError, match=r"no API key for the server at http://127.0.0.1:1: .*pass the server's key as "
                                          r"api_key= .* or set REFIT_API_KEY in the replica's environment.*printed "
                                          r"to its stderr"):
        ServerAdapter("http://127.0.0.1:1")


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n{}",  # the body stops 38 bytes short: IncompleteRead
    b"",  # no status line at all: RemoteDisconnected
])
def test_a_server_that_closes_the_connection_mid_answer_is_gone_not_an_unknown_error(answer):
    """What a `vllm serve` killed while it answers looks like to its replica (seen in a suite run beside a busy loop:
    the fleet then raised `IncompleteRead` instead of dropping the server's replica)."""
    import socket
    import threading

    from refit.engine.server import ServerAdapter
    from refit.errors import ServerGoneError

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_once() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(answer)

    thread = threading.Thread(target=answer_once, daemon=True)
    thread.start()
    try:
        with pytest.raises(ServerGoneError, match=rf"127\.0\.0\.1:{port} could not be reached for GET /health: "
                                                  r"the connection closed before the answer was complete"):
            ServerAdapter(f"http://127.0.0.1:{port}", "a key", connect_timeout_s=10)
    finally:
        thread.join(timeout=10)
        listener.close()


def test_an_impostor_answering_pickles_runs_nothing_in_the_replica_and_is_named_not_a_refit_server(tmp_path):
    """A server at the URL that answers every route 200 with a pickle whose unpickling would create a file."""
    import refit

    marker = tmp_path / "ran"
    poison = pickle.dumps(_Marker(str(marker)))
    server = _Recorder(lambda path, _: (200, {"Content-Type": "application/json"}, poison))
    try:
        with pytest.raises(refit.ServerError, match=rf"the server at {server.url} is not a refit server \(started by "
                                                    r"`refit serve`\): its answer is not JSON .*for GET /refit/state; "
                                                    r"nothing of it was used"):
            refit.server_replica(server.url, api_key="a key", connect_timeout_s=10)
    finally:
        server.close()
    assert [path for path, _ in server.seen] == ["/health", "/refit/state"] and not marker.exists()


class _Recorder:
    """A local HTTP server that records each request's path and Authorization header and answers `answer(path, body)`:
    (status, headers, body); by default 200 with an empty JSON object."""

    def __init__(self, answer=None) -> None:
        import http.server
        import threading

        self.seen: list[tuple[str, str | None]] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                recorder.seen.append((self.path, self.headers.get("Authorization")))
                sent = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, headers, body = (answer or (lambda path, sent: (200, {}, b"{}")))(self.path, sent)
                self.send_response(status)
                for name, value in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _adapter(url: str, timeout_s: float = 10.0):
    """A `ServerAdapter` for `url` without its connection checks (what the tests below exercise comes after them)."""
    from refit.engine.server import ServerAdapter

    adapter = object.__new__(ServerAdapter)
    adapter.url, adapter._key, adapter.timeout_s, adapter._marked, adapter._pass_token = url, "a key", timeout_s, False, None
    adapter._gone = None
    return adapter


def test_a_failed_update_releases_users_to_its_refusal_even_after_the_version_was_marked():
    """Found by review: once `mark_version` ran, a failure after it (the workers' base digest unreadable) released the
    held requests as a synced version while the replica refused; and a short deadline's hold lease rounded to 0."""
    server = _Recorder(lambda path, _: (200, {}, b'{"pass_token": "t"}' if path.startswith("/refit/hold") else b"{}"))
    try:
        adapter = _adapter(server.url, timeout_s=0.1)
        adapter.hold_requests(0.1)
        adapter.mark_version(3)
        adapter.release_requests("sync s1 failed: the base digest could not be read")
    finally:
        server.close()
    paths = [path for path, _ in server.seen]
    assert paths[0] == "/refit/hold?lease_s=0.300"
    assert paths[-1].startswith("/refit/release?refusing=sync%20s1%20failed")


def test_a_rival_syncs_check_leaves_the_running_updates_deadline_to_it():
    """Found by review: `check`, which a rival sync's begin runs before the update lifecycle refuses it, set the
    server's deadline to the rival's, so the running update's calls to the server waited the rival's time."""
    from refit.plan.config import SyncConfig

    boot, asked = RefitWorkerExtension().refit_boot_id(), []

    def answer(path: str, sent: bytes):
        if path.startswith("/refit/hold"):
            return 200, {}, b'{"pass_token": "t"}'
        if path == "/collective_rpc":
            asked.append(path)
            if len(asked) > 1:  # the running update's call, after the rival's check: slower than the rival's deadline
                time.sleep(2.0)
            return 200, {}, json.dumps({"results": [RefitWorkerExtension().refit_call(json.loads(sent)["args"][0])]}).encode()
        return 200, {}, b"{}"

    server = _Recorder(answer)
    try:
        adapter = _adapter(server.url)
        adapter.boot_ids = [boot]
        adapter.hold_requests(60.0)  # the update of the sync that claimed the replica
        adapter.check(SyncConfig(timeout_s=1))  # a rival's begin, refused after it by the lifecycle
        assert adapter.call_workers("refit_boot_id") == [boot]
    finally:
        server.close()


def test_a_gate_that_gives_no_token_for_refits_own_requests_is_refused_by_name_and_released():
    """A server running another version of refit's gate: its hold would hold the replica's own stage and probe."""
    server = _Recorder()
    try:
        with pytest.raises(ServerError, match="runs another version of refit's gate"):
            _adapter(server.url).hold_requests(10.0)
    finally:
        server.close()
    assert [path for path, _ in server.seen] == ["/refit/hold?lease_s=30.000", "/refit/release"]


def test_the_key_goes_to_the_server_alone_never_through_a_proxy_or_a_redirect(monkeypatch):
    """Found by review: urllib sent every request, key included, through the environment's HTTP proxy (loopback too),
    and re-sent it wherever a redirect pointed."""
    proxy, elsewhere = _Recorder(), _Recorder()
    server = _Recorder(lambda path, _: (302, {"Location": elsewhere.url + path}, b"") if path == "/moved" else (200, {}, b"{}"))
    monkeypatch.setenv("http_proxy", proxy.url)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    try:
        adapter = _adapter(server.url)
        adapter.reset_prefix_cache()
        with pytest.raises(ServerError, match=r"answered GET /moved with a redirect \(HTTP 302 to .*refit follows none"):
            adapter._request("GET", "/moved")
    finally:
        for recorder in (proxy, elsewhere, server):
            recorder.close()
    assert server.seen == [("/reset_prefix_cache", "Bearer a key"), ("/moved", "Bearer a key")]
    assert proxy.seen == [] and elsewhere.seen == []


def test_a_server_that_restarted_since_the_last_sync_is_shown_refusing_not_serving_that_version():
    """Found by review: only the next sync's begin compared the workers' boot ids, so between syncs a restarted
    server (serving the weights it started with) was reported as serving the last sync's version."""
    boot = {"id": "host:1:100.0"}

    class Worker(RefitWorkerExtension):
        def refit_boot_id(self) -> str:
            return boot["id"]

    def answer(path: str, sent: bytes):
        if path == "/collective_rpc":
            return 200, {}, json.dumps({"results": [Worker().refit_call(json.loads(sent)["args"][0])]}).encode()
        return 200, {}, b"{}"

    server = _Recorder(answer)
    try:
        adapter = _adapter(server.url)
        adapter.boot_ids = ["host:1:100.0"]
        assert adapter._look() is None
        boot["id"] = "host:2:200.0"  # the same URL, another process
        assert f"the server at {server.url} restarted since this replica connected to it" in adapter._look()
    finally:
        server.close()
    assert "cannot be asked whether it still serves" in adapter._look()  # gone now: said, not raised
    adapter._gone = "what the last look found"
    assert adapter.gone() == "what the last look found"  # what status reads: it never waits for the server


# -- the gate, as vLLM's app sees it (an ASGI middleware), in this process ----------------------------------------

class _App:
    """vLLM's app behind the gate: records what reached it (and the body it read); `/v1/completions` waits for `finish`
    when told to."""

    def __init__(self) -> None:
        self.reached: list[str] = []
        self.bodies: list[bytes] = []
        self.finish: asyncio.Event | None = None

    async def __call__(self, scope, receive, send) -> None:
        self.reached.append(scope["path"])
        message, read = {"more_body": True}, b""
        while message.get("more_body"):
            message = await receive()
            read += message.get("body", b"")
        self.bodies.append(read)
        if scope["path"] == "/v1/completions" and self.finish is not None:
            await self.finish.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


_RPC_BODY = json.dumps({"method": "refit_call", "args": ['{"method": "refit_boot_id", "args": []}']}).encode()


async def _ask(gate, path: str, key: str | None = "the key", verb: str = "POST", headers=(),
               body: bytes | None = None) -> tuple[int, dict | None]:
    """`verb path` through the gate; `body` is sent in two chunks (a `/collective_rpc` sends refit's call unless told)."""
    body = (_RPC_BODY if path.startswith("/collective_rpc") else b"") if body is None else body
    query = b""
    if "?" in path:
        path, query = path.split("?", 1)[0], path.split("?", 1)[1].encode()
    sent = [(b"authorization", f"Bearer {key}".encode())] if key is not None else []
    scope = {"type": "http", "method": verb, "path": path, "query_string": query, "root_path": "",
             "headers": [*sent, *headers]}
    answer: dict = {}
    chunks = [body[: len(body) // 2], body[len(body) // 2:]]

    async def receive() -> dict:
        return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)} if chunks else \
            {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        else:
            answer["body"] = json.loads(message["body"]) if message["body"] != b"{}" else None

    await gate(scope, receive, send)
    return answer["status"], answer["body"]


async def _hold(gate, query: str = "/refit/hold") -> list[tuple[bytes, bytes]]:
    """A replica's hold: the header carrying its token, which its own calls (and its release) send."""
    from refit.engine.server_gate import PASS_HOLD_HEADER

    status, body = await _ask(gate, query)
    assert status == 200, body
    return [(PASS_HOLD_HEADER.encode(), body["pass_token"].encode())]


@pytest.fixture
def gate(monkeypatch):
    from refit.engine.server_gate import RefitGate

    monkeypatch.setenv("REFIT_API_KEY", "the key")
    monkeypatch.setenv(DUMMY_ENV, "0")
    app = _App()
    return RefitGate(app), app


@pytest.mark.parametrize("path", ["/health", "/collective_rpc", "/pause", "/v1/completions", "/refit/hold", "/metrics",
                                  "/anything"])
def test_the_gate_refuses_a_missing_or_wrong_key_on_every_route_before_vllm_sees_it(gate, path):
    refit_gate, app = gate
    status, body = asyncio.run(_ask(refit_gate, path, key=None))
    assert status == 401 and body["error"].startswith("missing API key: send 'Authorization: Bearer KEY'")
    status, body = asyncio.run(_ask(refit_gate, path, key="the key!"))
    assert status == 403 and body["error"].startswith("wrong API key")
    assert app.reached == [] and not refit_gate._held
    assert asyncio.run(_ask(refit_gate, "/health"))[0] == 200 and app.reached == ["/health"]


def test_a_gate_without_a_key_refuses_to_start(monkeypatch):
    from refit.engine.server_gate import RefitGate

    monkeypatch.delenv("REFIT_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="REFIT_API_KEY is not set: refit's gate will not serve without a key"):
        RefitGate(_App())


def test_the_gate_holds_generation_not_control_routes_drains_what_passed_and_releases(gate):
    from refit.engine.server_gate import PASS_HOLD_HEADER

    refit_gate, app = gate

    async def scenario() -> None:
        app.finish = asyncio.Event()
        running = asyncio.create_task(_ask(refit_gate, "/v1/completions"))  # passed before the hold
        await asyncio.sleep(0.05)
        hold = (await _ask(refit_gate, "/refit/hold"))[1]
        assert hold["in_flight"] == 1 and "pass_token" not in (await _ask(refit_gate, "/refit/state", verb="GET"))[1]
        held = asyncio.create_task(_ask(refit_gate, "/v1/chat/completions"))
        await asyncio.sleep(0.05)
        assert (await _ask(refit_gate, "/refit/drain?timeout_s=0.1"))[1]["in_flight"] == 1  # not yet ended
        app.finish.set()
        await running
        state = (await _ask(refit_gate, "/refit/drain?timeout_s=5"))[1]
        assert state["in_flight"] == 0 and state["waiting"] == 1 and "/v1/chat/completions" not in app.reached
        token = hold["pass_token"].encode()
        for control in ("/pause", "/resume", "/collective_rpc", "/update_weight_version", "/v1/models"):
            assert (await _ask(refit_gate, control, headers=[(PASS_HOLD_HEADER.encode(), token)]))[0] == 200
        assert (await _ask(refit_gate, "/v1/completions", headers=[(PASS_HOLD_HEADER.encode(), token)]))[0] == 200
        # Found by review: any key holder passed the hold with the header; only the hold's own token passes it.
        for guessed in (b"1", "\u00e9t\u00e9".encode("latin-1")):
            assert (await _ask(refit_gate, "/v1/completions", headers=[(PASS_HOLD_HEADER.encode(), guessed)]))[0] == 409
        assert not held.done()
        mine = [(PASS_HOLD_HEADER.encode(), token)]
        assert (await _ask(refit_gate, "/refit/release?synced=1", headers=mine))[1]["held"] is False
        assert (await held)[0] == 200
        following = await _hold(refit_gate)  # the next hold: the last one's token passes it no more
        assert (await _ask(refit_gate, "/v1/completions", headers=mine))[0] == 409
        await _ask(refit_gate, "/refit/release", headers=following)

    asyncio.run(scenario())


def test_a_dummy_loaded_servers_gate_answers_503_until_a_verified_sync_released_it(gate, monkeypatch):
    from refit.engine.server_gate import RefitGate

    monkeypatch.setenv(DUMMY_ENV, "1")
    app = _App()
    refit_gate = RefitGate(app)

    async def scenario() -> None:
        status, body = await _ask(refit_gate, "/v1/completions")
        assert status == 503 and "started with --load-format dummy" in body["error"]
        mine = await _hold(refit_gate)
        held = asyncio.create_task(_ask(refit_gate, "/v1/completions"))
        await asyncio.sleep(0.05)
        await _ask(refit_gate, "/refit/release?synced=0", headers=mine)  # a failed first sync: still placeholders
        assert (await held)[0] == 503
        mine = await _hold(refit_gate)
        held = asyncio.create_task(_ask(refit_gate, "/v1/completions"))
        await asyncio.sleep(0.05)
        assert (await _ask(refit_gate, "/refit/state", verb="GET"))[1] == {
            "refit_gate": True, "held": True, "in_flight": 0, "waiting": 1, "awaiting_first_sync": True, "refusing": None}
        await _ask(refit_gate, "/refit/release?synced=1", headers=mine)
        assert (await held)[0] == 200 and app.reached == ["/v1/completions"]

    asyncio.run(scenario())


def test_the_gate_refuses_after_a_failed_sync_until_a_verified_one(gate):
    """A replica left refusing (its model a mix of two versions) must keep users off the server, which they reach
    directly: the release says so, and generation routes answer 503 with the reason until a verified sync."""
    refit_gate, app = gate

    async def scenario() -> None:
        assert (await _ask(refit_gate, "/v1/completions"))[0] == 200
        mine = await _hold(refit_gate)
        held = asyncio.create_task(_ask(refit_gate, "/v1/completions"))
        await asyncio.sleep(0.05)
        await _ask(refit_gate, "/refit/release?refusing=loading%20a%20bucket%20failed", headers=mine)
        status, body = await held
        assert status == 503 and body["error"].endswith("until its next verified sync: loading a bucket failed")
        assert (await _ask(refit_gate, "/health", verb="GET"))[0] == 200  # control routes still answer
        mine = await _hold(refit_gate)
        await _ask(refit_gate, "/refit/release?synced=0", headers=mine)  # a sync that failed before changing anything
        assert (await _ask(refit_gate, "/v1/completions"))[0] == 503
        await _ask(refit_gate, "/refit/release?synced=1")
        assert (await _ask(refit_gate, "/v1/completions"))[0] == 200
        assert app.reached == ["/v1/completions", "/health", "/v1/completions"]

    asyncio.run(scenario())


def test_a_hold_whose_replica_stops_calling_lapses_into_a_refusal_and_health_checks_do_not_renew_it(gate):
    """A replica that died mid-update leaves the server half-updated: its held users get a 503 saying so, within the
    hold's lease, rather than waiting for ever; a load balancer's probes must not keep the hold alive."""
    refit_gate, app = gate

    from refit.engine.server_gate import PASS_HOLD_HEADER

    async def scenario() -> None:
        token = (await _ask(refit_gate, "/refit/hold?lease_s=0.6"))[1]["pass_token"]
        held = asyncio.create_task(_ask(refit_gate, "/v1/completions"))
        for _ in range(3):  # the holder's driving call renews the hold: still held after more than one lease
            await asyncio.sleep(0.3)
            await _ask(refit_gate, "/collective_rpc", headers=[(PASS_HOLD_HEADER.encode(), token.encode())])
        assert not held.done()
        for _ in range(4):  # health checks and reads do not
            await asyncio.sleep(0.3)
            await _ask(refit_gate, "/health", verb="GET")
            await _ask(refit_gate, "/refit/state", verb="GET")
        status, body = await asyncio.wait_for(held, 5)
        assert status == 503 and "stopped driving the update it began (no call for 1 s)" in body["error"]
        state = (await _ask(refit_gate, "/refit/state", verb="GET"))[1]
        assert state["held"] is False and "stopped driving" in state["refusing"]
        assert "/v1/completions" not in app.reached

    asyncio.run(scenario())


@pytest.mark.parametrize("query", ["/refit/hold?lease_s=inf", "/refit/hold?lease_s=nan", "/refit/hold?lease_s=0",
                                   "/refit/hold?lease_s=-5", "/refit/hold?lease_s=soon", "/refit/drain?timeout_s=inf",
                                   "/refit/drain?timeout_s=nan"])
def test_a_hold_that_would_never_lapse_or_a_drain_without_a_deadline_is_refused(gate, query):
    """NaN and infinity parse as floats: a hold of either never lapsed, and users' requests waited for ever."""
    refit_gate, app = gate

    async def scenario() -> None:
        status, body = await _ask(refit_gate, query)
        assert status == 400 and "finite number of seconds" in body["error"], body
        assert (await _ask(refit_gate, "/refit/state", verb="GET"))[1]["held"] is False
        assert (await _ask(refit_gate, "/v1/completions"))[0] == 200

    asyncio.run(scenario())


def test_a_query_that_is_no_utf8_is_refused_by_name_not_a_bare_server_error(gate):
    """Found by review: the gate decoded its own routes' query strings as UTF-8, so a byte that is none raised
    `UnicodeDecodeError` in the middleware and the client got a bare 500."""
    refit_gate, app = gate
    answer: dict = {}

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        answer.setdefault(message["type"], message)

    scope = {"type": "http", "method": "POST", "path": "/refit/hold", "query_string": b"lease_s=\xff", "root_path": "",
             "headers": [(b"authorization", b"Bearer the key")]}
    asyncio.run(refit_gate(scope, receive, send))
    assert answer["http.response.start"]["status"] == 400
    assert "finite number of seconds" in json.loads(answer["http.response.body"]["body"])["error"]
    assert not refit_gate._held


def test_a_second_replica_cannot_take_or_release_a_hold_whose_replica_still_drives_its_update(gate):
    """Two `ServerRollout`s on one server (two drivers, or a new one beside an old one still syncing): the second's
    hold replaced the first's token and its failed begin released the first's users onto a model mid-load."""
    from refit.engine.server_gate import PASS_HOLD_HEADER

    refit_gate, app = gate

    async def scenario() -> None:
        first = (await _ask(refit_gate, "/refit/hold?lease_s=60"))[1]["pass_token"]
        mine = [(PASS_HOLD_HEADER.encode(), first.encode())]
        held = asyncio.create_task(_ask(refit_gate, "/v1/completions"))
        await asyncio.sleep(0.05)
        status, body = await _ask(refit_gate, "/refit/hold?lease_s=60")
        assert status == 409 and "another replica's update holds this server" in body["error"], body
        status, body = await _ask(refit_gate, "/refit/release?synced=0")
        assert status == 409 and "another replica's update holds this server" in body["error"], body
        assert not held.done() and (await _ask(refit_gate, "/v1/completions", headers=mine))[0] == 200
        assert (await _ask(refit_gate, "/refit/release?synced=1", headers=mine))[0] == 200
        assert (await held)[0] == 200

    asyncio.run(scenario())


def test_a_new_replica_takes_over_a_lapsed_hold_and_its_users_stay_refused_until_a_verified_sync(gate):
    """A replica that died mid-update left its update open in the workers; a new replica's first sync then failed
    before loading anything (the workers' update was still active) and released users to that half-loaded model.
    Its connection calls (the workers' boot ids) must not keep the dead replica's hold alive either."""
    from refit.engine.server_gate import PASS_HOLD_HEADER

    refit_gate, app = gate

    async def scenario() -> None:
        dead = (await _ask(refit_gate, "/refit/hold?lease_s=0.5"))[1]["pass_token"]
        await _ask(refit_gate, "/collective_rpc", headers=[(PASS_HOLD_HEADER.encode(), dead.encode())])
        for _ in range(4):  # the new replica connects: its calls carry no token of the dead one's hold
            await asyncio.sleep(0.2)
            await _ask(refit_gate, "/collective_rpc")
        status, body = await _ask(refit_gate, "/refit/hold?lease_s=60")
        assert status == 200 and "stopped driving the update it began" in (body["refusing"] or ""), body
        mine = [(PASS_HOLD_HEADER.encode(), body["pass_token"].encode())]
        await _ask(refit_gate, "/refit/release?synced=0", headers=mine)  # its sync failed before loading anything
        status, body = await _ask(refit_gate, "/v1/completions")
        assert status == 503 and "stopped driving the update it began" in body["error"]
        token = (await _ask(refit_gate, "/refit/hold?lease_s=60"))[1]["pass_token"]  # its next sync, verified
        await _ask(refit_gate, "/refit/release?synced=1", headers=[(PASS_HOLD_HEADER.encode(), token.encode())])
        assert (await _ask(refit_gate, "/v1/completions"))[0] == 200 and app.reached.count("/v1/completions") == 1

    asyncio.run(scenario())


def test_a_replica_whose_hold_lapsed_cannot_drive_the_update_of_the_replica_that_holds_the_server_now(gate):
    """Found by review: the gate passed every control call whatever hold token it carried, so a replica whose hold
    lapsed (a stalled driver that comes back) drove the workers on, into the update of the replica that took the
    server over (a load, a finish or an abandon of the other's update)."""
    from refit.engine.server_gate import PASS_HOLD_HEADER

    refit_gate, app = gate

    async def scenario() -> None:
        stale = (await _ask(refit_gate, "/refit/hold?lease_s=0.3"))[1]["pass_token"]
        stale_header = [(PASS_HOLD_HEADER.encode(), stale.encode())]
        await asyncio.sleep(0.6)
        status, body = await _ask(refit_gate, "/refit/hold?lease_s=60")  # the other replica takes the server over
        assert status == 200, body
        mine = [(PASS_HOLD_HEADER.encode(), body["pass_token"].encode())]
        app.reached.clear()
        status, body = await _ask(refit_gate, "/collective_rpc", headers=stale_header)
        assert status == 409 and "no longer has" in body["error"] and app.reached == [], body
        assert (await _ask(refit_gate, "/collective_rpc", headers=mine))[0] == 200  # the holder's own
        assert (await _ask(refit_gate, "/collective_rpc"))[0] == 200  # a key holder's call without a token
        assert (await _ask(refit_gate, "/health", headers=stale_header))[0] == 200  # reads are no drive

    asyncio.run(scenario())


def _rpc(method: str, *args) -> bytes:
    return json.dumps({"method": "refit_call", "args": [encode_call(method, *args)]}).encode()


def test_while_a_hold_lives_a_call_without_its_token_drives_nothing_and_reads_pass(gate):
    """Found by review: a replica whose release was refused (its hold lapsed, another replica took the server over)
    forgets its token, and its calls without one passed: its abandon closed the new holder's open update, its resume
    restarted the scheduler mid-load."""
    refit_gate, app = gate

    async def scenario() -> None:
        mine = await _hold(refit_gate, "/refit/hold?lease_s=60")
        for path, body in (("/collective_rpc", _rpc("refit_abandon_update")), ("/collective_rpc", _rpc("update_weights")),
                           ("/collective_rpc", _rpc("refit_start_update", None, "ray", False)), ("/resume", b""),
                           ("/pause", b""), ("/update_weight_version", b"{}")):
            status, answer = await _ask(refit_gate, path, body=body)
            assert status == 409 and "only the holder drives the workers during its update" in answer["error"], answer
            # A replica whose own release timed out sends no token either: the refusal must not tell it the hold is
            # surely another replica's.
            assert "may be its own hold" in answer["error"] and "another replica's update" not in answer["error"]
        assert app.reached == []
        for method in ("refit_boot_id", "refit_engine_facts", "refit_streamed"):  # connecting, looking: reads pass
            assert (await _ask(refit_gate, "/collective_rpc", body=_rpc(method)))[0] == 200
        assert (await _ask(refit_gate, "/collective_rpc", headers=mine, body=_rpc("refit_abandon_update")))[0] == 200
        assert (await _ask(refit_gate, "/refit/release?synced=0", headers=mine))[0] == 200
        assert (await _ask(refit_gate, "/collective_rpc", body=_rpc("refit_abandon_update")))[0] == 200  # no hold
        await _hold(refit_gate, "/refit/hold?lease_s=0.3")
        await asyncio.sleep(0.6)  # lapsed: its update may be half-loaded, the server refuses, a key holder drives
        assert (await _ask(refit_gate, "/resume"))[0] == 200
        assert (await _ask(refit_gate, "/refit/state", verb="GET"))[1]["refusing"].startswith("refit's replica stopped")

    asyncio.run(scenario())
    from refit.engine.server_gate import READING_METHODS
    from refit.engine.worker_rpc import SERVER_METHODS

    assert READING_METHODS <= SERVER_METHODS


def test_a_key_with_a_secret_files_newline_is_sent_without_it_and_a_key_no_header_carries_is_refused_unprinted(
        monkeypatch):
    """A key read from a secret file often ends in a newline: the replica raised urllib's bare `ValueError: Invalid
    header value b'Bearer KEY\\n'`, printing the key into every log and traceback, and `refit serve` made it the
    gate's key, which no request could then carry."""
    from refit.engine.server import ServerAdapter

    server = _Recorder()
    monkeypatch.setenv("REFIT_API_KEY", "s3cret-key\n")
    try:
        with pytest.raises(ServerError):  # the recorder is no refit server; what matters is what reached it
            ServerAdapter(server.url, connect_timeout_s=10)
        with pytest.raises(ServerError, match=r"api_key= holds a control character") as refused:
            ServerAdapter(server.url, "s3cret\x00key", connect_timeout_s=10)
    finally:
        server.close()
    assert server.seen[0] == ("/health", "Bearer s3cret-key") and "s3cret" not in str(refused.value)
    assert serve_key(["m"], {"REFIT_API_KEY": "s3cret-key\n"}) == ("s3cret-key", "REFIT_API_KEY")
    with pytest.raises(ConfigError, match="--api-key holds a control character") as refused:
        serve_key(["m", "--api-key", "s3cret\rkey"], {})
    assert "s3cret" not in str(refused.value)


def test_a_replica_whose_hold_lapsed_cannot_release_users_onto_the_model_another_replica_left_half_loaded(gate):
    """Found by review: the gate refused a lapsed hold's token on the drive routes but took it on `/refit/release`, so a
    stalled replica that came back released users as synced (`synced=1`) onto the model of the replica that took the
    server over and failed mid-load, clearing that one's refusal."""
    from refit.engine.server_gate import PASS_HOLD_HEADER

    refit_gate, app = gate

    async def scenario() -> None:
        stale = (await _ask(refit_gate, "/refit/hold?lease_s=0.3"))[1]["pass_token"]
        await asyncio.sleep(0.6)
        status, body = await _ask(refit_gate, "/refit/hold?lease_s=60")  # another replica takes the server over
        mine = [(PASS_HOLD_HEADER.encode(), body["pass_token"].encode())]
        await _ask(refit_gate, "/refit/release?refusing=half-loaded", headers=mine)  # and fails mid-load
        status, body = await _ask(refit_gate, "/refit/release?synced=1",
                                  headers=[(PASS_HOLD_HEADER.encode(), stale.encode())])
        assert status == 409 and "no longer has" in body["error"], body
        status, body = await _ask(refit_gate, "/v1/completions")
        assert status == 503 and "half-loaded" in body["error"], body

    asyncio.run(scenario())


def test_a_release_that_fails_still_forgets_the_holds_token():
    """A token kept after a failed release (refused once its hold lapsed, or a timeout) went with every later call:
    the gate refuses a lapsed hold's token on the drive routes, so the replica's own look at its workers failed and it
    was shown gone."""
    server = _Recorder(lambda path, _: (200, {}, b'{"pass_token": "t"}') if path.startswith("/refit/hold")
                       else (409, {}, b'{"error": "no longer has"}'))
    try:
        adapter = _adapter(server.url)
        adapter.hold_requests(10.0)
        with pytest.raises(ServerError):
            adapter.release_requests("failed")
    finally:
        server.close()
    assert adapter._pass_token is None and adapter._marked is False


@pytest.mark.parametrize("method", ["reset_weights", "refit_expect_plan", "update_weights", "", None, 7])
def test_the_gate_refuses_a_worker_rpc_other_than_refits_naming_the_method_before_vllm_sees_it(gate, method):
    """Found by review: behind the key, vLLM's `/collective_rpc` called any worker method with the request's
    arguments (a memory file or a CUDA IPC handle for `update_weights`, `reset_weights`), though refit only ever
    calls `refit_call`."""
    refit_gate, app = gate
    status, body = asyncio.run(_ask(refit_gate, "/collective_rpc", body=json.dumps({"method": method, "args": []}).encode()))
    assert status == 403 and f"/collective_rpc method {str(method)!r} is refused by refit's gate" in body["error"], body
    assert app.reached == []
    status, body = asyncio.run(_ask(refit_gate, "/collective_rpc", body=b"{not json"))
    assert status == 400 and "must be a JSON object" in body["error"] and app.reached == []
    assert asyncio.run(_ask(refit_gate, "/collective_rpc")) == (200, None)  # refit's own passes, its body unchanged
    assert app.reached == ["/collective_rpc"] and app.bodies == [_RPC_BODY]


@pytest.mark.parametrize("path", ["/update_weights", "/start_weight_update", "/finish_weight_update",
                                  "/init_weight_transfer_engine", "/weight_checker", "/start_weight_update/"])
def test_the_gate_refuses_vllms_weight_transfer_routes_by_name_and_keeps_generation_routes(gate, path):
    """Found by review: vLLM's weight-transfer routes, which refit never sends, loaded, finished or reset the
    workers' weights outside refit's update, and were held or passed as if they were users' generation routes."""
    refit_gate, app = gate
    status, body = asyncio.run(_ask(refit_gate, path, body=b'{"update_info": {}}'))
    assert status == 403 and f"{path} is refused by refit's gate" in body["error"] and app.reached == [], body
    assert asyncio.run(_ask(refit_gate, "/v1/completions"))[0] == 200 and app.reached == ["/v1/completions"]


def test_the_gate_reads_no_worker_rpc_body_past_its_bound(gate, monkeypatch):
    from refit.engine import server_gate

    monkeypatch.setattr(server_gate, "MAX_RPC_BODY_BYTES", 64)
    refit_gate, app = gate
    huge = json.dumps({"method": "refit_call", "args": ["x" * 100]}).encode()
    status, body = asyncio.run(_ask(refit_gate, "/collective_rpc", body=huge))
    assert status == 413 and "larger than refit's gate reads (64 bytes" in body["error"] and app.reached == []
    declared = [(b"content-length", str(1 << 40).encode())]  # refused before a byte is read
    status, body = asyncio.run(_ask(refit_gate, "/collective_rpc", headers=declared, body=b""))
    assert status == 413 and app.reached == []
