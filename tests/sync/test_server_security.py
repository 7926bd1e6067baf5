"""`refit serve`'s protections on a real server (issue #45): loopback by default, a key on every route, no pickle
across HTTP, and no user's request on unchecked weights.

One server for the module, started the seed bug's way (FP8_BLOCK, `--load-format dummy`, `--kv-cache-dtype
fp8_e4m3`: its placeholder KV scales make vLLM's CPU attention die on the first request they serve). The tests
that must see it before its first sync come first; the last one syncs it while users' requests are held.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import pickle
import urllib.error
import urllib.request

import pytest
import ray

import actors
import refit
from fixtures import NEW_TOKENS, PROMPT_LEN, accuracy, make_prompts, model_dir
from tests.conftest import TEST_KV_CACHE_BYTES
from tests.support.actors import run_in
from tests.support.faults import tamper_next_stream
from tests.support.server import RefitServer, ServerHoldingUsers

PROMPTS = make_prompts(4, PROMPT_LEN, seed=45)
COLLECTIVE = refit.SyncConfig(transport="collective", timeout_s=120)
SERVER_START_WITHIN_S = 600  # generous: measured from the process start, on a machine other sessions share
SERVER_OPTIONS = ["--load-format", "dummy", "--kv-cache-dtype", "fp8_e4m3", "--enforce-eager", "--max-model-len", "128",
                  "--kv-cache-memory-bytes", str(TEST_KV_CACHE_BYTES)]


class _Marker:
    """Unpickling it runs `touch PATH`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.fixture(scope="module")
def server(tmp_path_factory, ray_cluster):
    """Requests `ray_cluster` so that every test here is an engine test: the suite's order keeps the file's."""
    started = RefitServer(model_dir(True, "fp8_block"), SERVER_OPTIONS, tmp_path_factory.mktemp("server") / "serve.log")
    try:
        started.wait_until_healthy(SERVER_START_WITHIN_S)
        yield started
    finally:
        started.stop()


def _status(server: RefitServer, verb: str, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({} if key is None else {"Authorization": f"Bearer {key}"})}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=verb, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _completion(server: RefitServer, prompt: list[int]) -> dict:
    return {"model": server.model, "prompt": [prompt], "max_tokens": NEW_TOKENS, "temperature": 0.0,
            "return_token_ids": True}


def test_a_default_refit_serve_listens_on_loopback_only(server):
    """No --host (tests/support/server.py passes none): the listening socket is 127.0.0.1's, in no other address."""
    port = f"{server.port:04X}"
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                local, state = row.split()[1], row.split()[3]
                if state == "0A" and local.endswith(f":{port}"):  # LISTEN
                    listening.append((table, local.split(":")[0]))
    assert listening == [("/proc/net/tcp", "0100007F")], listening  # 127.0.0.1, little-endian; no IPv6 socket


ROUTES = [
    ("POST", "/collective_rpc", {"method": "refit_call", "args": ["{}"]}),
    ("POST", "/pause?mode=abort", None), ("POST", "/resume", None), ("GET", "/is_paused", None),
    ("POST", "/update_weight_version", {"new_version": "forged"}), ("GET", "/weight_info", None),
    ("GET", "/health", None), ("POST", "/v1/completions", {"model": "m", "prompt": [[1, 2]], "max_tokens": 1}),
    ("GET", "/v1/models", None), ("POST", "/reset_prefix_cache", None), ("POST", "/abort_requests", {}),
    ("POST", "/sleep?level=1", None), ("GET", "/metrics", None), ("POST", "/refit/hold", None),
    ("POST", "/refit/release?synced=1", None), ("GET", "/refit/state", None),
]


def test_without_the_key_or_with_a_wrong_one_every_route_is_refused_and_nothing_changes(server):
    def observed() -> tuple:
        return server.json("/weight_info"), server.json("/is_paused"), server.json("/refit/state")

    before = observed()
    assert before[2]["awaiting_first_sync"] and not before[2]["held"] and before[1] == {"is_paused": False}
    for verb, path, body in ROUTES:
        status, text = _status(server, verb, path, body)
        assert status == 401 and json.loads(text)["error"].startswith("missing API key"), (path, status, text)
        status, text = _status(server, verb, path, body, key=server.api_key + "x")
        assert status == 403 and json.loads(text)["error"].startswith("wrong API key"), (path, status, text)
    assert observed() == before
    status, text = _status(server, "POST", "/v1/completions", _completion(server, PROMPTS[0]), key=server.api_key)
    assert status == 503 and "started with --load-format dummy" in json.loads(text)["error"]  # placeholders: never served
    assert observed() == before and server.process.poll() is None


def test_a_pickled_payload_to_the_worker_rpc_runs_nothing_with_or_without_the_key(server, tmp_path):
    marker = tmp_path / "ran"
    version = server.json("/weight_info")["weight_version"]
    pickled = base64.b64encode(pickle.dumps(_Marker(str(marker)))).decode("ascii")
    for method in ("refit_call", "refit_expect_plan"):  # refit's entry point, and the one that took a pickled plan
        body = {"method": method, "args": [pickled, "collective", False][: 1 if method == "refit_call" else 3]}
        assert _status(server, "POST", "/collective_rpc", body)[0] == 401
        status, text = _status(server, "POST", "/collective_rpc", body, key=server.api_key)
        if method == "refit_call":
            (reply,) = json.loads(text)["results"]
            assert json.loads(reply) == {"ok": False, "type": "ConfigError", "message": (
                'refit_call takes a JSON string {"method": ..., "args": [...]}; nothing else is accepted')}
        else:  # vLLM's route calls it directly: the plan is refused as data, a worker's error
            assert status >= 400, (status, text)
    assert not marker.exists()
    assert server.json("/weight_info")["weight_version"] == version and server.process.poll() is None


def test_requests_sent_during_a_dummy_servers_first_sync_wait_for_its_kv_stage(server, module_actors):
    """Users' requests sent once the first sync began are held by the gate: none runs on the placeholder KV scales
    (which would kill vLLM's engine) or before the KV stage and the weight version; all complete after the sync."""
    trainer = module_actors.trainer(model_dir(True, "bf16"), node=0)
    bodies = [_completion(server, prompt) for prompt in PROMPTS]
    replica = module_actors.keep(ServerHoldingUsers.options(resources={"node2": 0.01}).remote(
        server.url, server.api_key, bodies))
    report = refit.sync(trainer, replica, COLLECTIVE)
    timeline = ray.get(replica.timeline.remote(), timeout=600)
    answers = timeline["answers"]
    assert all(isinstance(a, dict) for a in answers), answers
    assert timeline["stage_at"] is not None and timeline["marked_at"] is not None
    assert min(timeline["answered_at"]) > timeline["marked_at"] > timeline["stage_at"]
    tokens = [a["choices"][0]["token_ids"] for a in answers]
    assert accuracy(PROMPTS, tokens) >= 0.9  # the trainer's model, with valid KV scales
    assert server.json("/weight_info")["weight_version"] == str(report.version)
    assert server.json("/refit/state") == {"refit_gate": True, "held": False, "in_flight": 0, "waiting": 0,
                                           "awaiting_first_sync": False, "refusing": None}
    again = server.json("/v1/completions", _completion(server, PROMPTS[0]))
    assert again["choices"][0]["token_ids"] == tokens[0] and server.process.poll() is None


def test_a_server_a_failed_sync_left_refusing_answers_users_503_until_the_next_sync_heals_it(server, module_actors):
    """Bytes altered mid-stream: the buckets before them were loaded, so the model is a mix and the replica refuses.
    Users reach the server directly, so its gate must refuse them too (not only `status()`), until a verified sync."""
    trainer = module_actors.trainer(model_dir(True, "bf16"), node=0)
    replica = module_actors.keep(actors.ServerRollout.options(resources={"node2": 0.01}).remote(server.url, server.api_key))
    syncer = refit.Syncer(trainer, [replica], dataclasses.replace(COLLECTIVE, bucket_bytes=256 << 10, delta="off"))
    try:
        syncer.sync()
        assert len(syncer.plan().buckets) > 2
        run_in(trainer, tamper_next_stream, "forged", 1)
        with pytest.raises(refit.VerificationError, match=r"bucket 1 arrived altered"):
            syncer.sync()
        assert ray.get(replica.status.remote(), timeout=120).phase is refit.Phase.REFUSING
        status, body = _status(server, "POST", "/v1/completions", _completion(server, PROMPTS[0]), key=server.api_key)
        assert status == 503 and "refuses to serve until its next verified sync: loading a bucket failed" in body, body
        report = syncer.sync()
        answer = server.json("/v1/completions", _completion(server, PROMPTS[0]))
        assert accuracy(PROMPTS[:1], [answer["choices"][0]["token_ids"]]) == 1.0
        assert server.json("/refit/state")["refusing"] is None
        assert server.json("/weight_info")["weight_version"] == str(report.version)
    finally:
        syncer.close()
