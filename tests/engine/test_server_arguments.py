"""`refit serve`'s additions to `vllm serve`'s options (no server started: the real one is tests/sync/test_server_rollout.py)."""

import json

import pytest

from refit.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, TRANSFER_BACKEND, WORKER_EXTENSION
from refit.engine.server import ServerError, serve_arguments
from refit.errors import ConfigError, EngineError


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
