"""The server replica's parts that need no server: `refit serve`'s additions to `vllm serve`'s options, and the
worker end of `refit_call` (the real server is tests/sync/test_server_rollout.py)."""

import json

import pytest

from refit.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, TRANSFER_BACKEND, WORKER_EXTENSION
from refit.engine.server import serve_arguments
from refit.engine.worker_rpc import RefitWorkerExtension, decode_reply, encode_call
from refit.errors import ConfigError, EngineError, ServerError


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

    def add(self, a: int, b: int) -> int:
        return a + b

    def fail_unpicklably(self) -> None:
        raise _Unpicklable("kept as text")


def test_refit_call_returns_the_result_or_the_workers_exception_with_its_type():
    worker = _Worker()
    assert decode_reply(worker.refit_call(encode_call("add", 2, 3))) == (True, 5)
    ok, error = decode_reply(worker.refit_call(encode_call("refit_engine_facts")))  # started without refit's backend
    assert not ok and isinstance(error, EngineError) and "weight_transfer_config={'backend': 'refit'}" in str(error)
    ok, error = decode_reply(worker.refit_call(encode_call("no_such_method")))
    assert not ok and isinstance(error, AttributeError)


def test_an_exception_that_cannot_be_pickled_arrives_as_its_type_and_message():
    ok, error = decode_reply(_Worker().refit_call(encode_call("fail_unpicklably")))
    assert not ok and type(error) is RuntimeError and str(error) == "_Unpicklable: kept as text"


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
            ServerAdapter(f"http://127.0.0.1:{port}", connect_timeout_s=10)
    finally:
        thread.join(timeout=10)
        listener.close()
