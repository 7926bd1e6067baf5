"""A real `vllm serve` server (started with `refit serve`) synced by `refit.Syncer` as a replica, used over HTTP,
and its protections (issue #45): loopback by default, a key on every route, no pickle across HTTP, and no
user's request on unchecked weights.

One server start costs ~11 CPU-s and over a minute on a busy two-core
machine, so the module makes do with two, both started the seed bug's way
(FP8_BLOCK, `--load-format dummy`, `--kv-cache-dtype fp8_e4m3`: its
placeholder KV scales make vLLM's CPU attention die on the first request
they serve). The first starts while the Ray cluster, the trainer and the
reference `RolloutActor` start. Both replicas are synced from the same
trainer over the collective transport; the server is then queried as its
users query it, over its OpenAI API, and must serve what the reference
serves. Then the server is killed mid-sync (its fleet drops it), and a
second server is started on the same port: the protections are checked on
it while it has never been synced, then it is synced while users'
requests are held, and last the old replica names the restart and the
new server is hung and killed after its replica began an update.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import pickle
import signal
import threading
import time

import pytest
import ray

import actors
import refit
from fixtures import NEW_TOKENS, PROMPT_LEN, accuracy, make_prompts, model_dir
from refit import Phase
from tests.conftest import TEST_KV_CACHE_BYTES
from tests.support.actors import STARTUP_S, run_in, started
from tests.support.faults import tamper_next_stream
from tests.support.lora import LORA
from tests.support.server import RefitServer, ServerHoldingUsers, ServerSignalledAfterBegin, free_port, http_status

PROMPTS = make_prompts(8, PROMPT_LEN, seed=21)
COLLECTIVE = refit.SyncConfig(transport="collective", timeout_s=60)
QUICK = refit.SyncConfig(transport="collective", timeout_s=15)  # for a server the test hangs: its deadlines are waited out
# Generous: measured from the process start, on a machine other sessions share.
SERVER_START_WITHIN_S = 600


# The seed bug's way: placeholder weights and scales, FP8 KV cache; options `refit serve` passes on to vllm serve.
SERVER_OPTIONS = ["--load-format", "dummy", "--kv-cache-dtype", "fp8_e4m3", "--enforce-eager", "--max-model-len", "128",
                  "--kv-cache-memory-bytes", str(TEST_KV_CACHE_BYTES)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = RefitServer(model_dir(True, "fp8_block"), SERVER_OPTIONS, tmp_path_factory.mktemp("server") / "serve.log")
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def synced(server, module_actors):
    """Trainer, reference RolloutActor and ServerRollout, all started the seed bug's way; one collective sync of both."""
    trainer = module_actors.trainer(model_dir(True, "bf16"), node=0)
    reference = module_actors.rollout(model_dir(True, "fp8_block"), node=1, load_format="dummy", kv_cache_dtype="fp8_e4m3")
    ray.get(reference.status.remote(), timeout=600)  # the reference engine starts while the server does
    server_start_s = server.wait_until_healthy(SERVER_START_WITHIN_S)
    replica = module_actors.keep(actors.ServerRollout.options(resources={"node2": 0.01}).remote(server.url, server.api_key))
    before = ray.get(replica.status.remote(), timeout=120)
    start = time.perf_counter()
    with refit.Syncer(trainer, [reference, replica], COLLECTIVE) as syncer:
        report = syncer.sync()
    print(f"server ready {server_start_s:.1f} s after its start; first collective sync {time.perf_counter() - start:.2f} s")
    return trainer, reference, replica, before, report


def completions(server: RefitServer, prompt, **extra) -> list[dict]:
    """Greedy continuations from the server's `/v1/completions`, as a user's client asks for them."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, "logprobs": 0,
            "return_token_ids": True, **extra}
    return sorted(server.json("/v1/completions", body)["choices"], key=lambda c: c["index"])


def test_before_its_first_sync_a_dummy_loaded_server_replica_refuses(synced):
    _, _, _, before, report = synced
    assert before.phase is Phase.REFUSING and "load_format='dummy'" in before.reason
    assert [r.served_version for r in report.replicas] == [1, 1]


def test_the_server_serves_over_http_the_tokens_the_rollout_actor_serves(server, synced):
    """Token-id prompts, greedy: the same tokens as the reference replica synced from the same trainer; the task solved."""
    _, reference, _, _, _ = synced
    expected = ray.get(reference.generate.remote(PROMPTS, NEW_TOKENS), timeout=120)
    choices = completions(server, PROMPTS)
    assert [c["token_ids"] for c in choices] == expected.token_ids
    served = [lp for c in choices for lp in c["logprobs"]["token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(served, [lp for row in expected.logprobs for lp in row])) < 1e-2
    assert accuracy(PROMPTS, [c["token_ids"] for c in choices]) >= 0.9
    # Text prompts, through the fixtures' toy tokenizer (token i is the word "t<i>"): the same continuation.
    (text_choice,) = completions(server, " ".join(f"t{t}" for t in PROMPTS[0]))
    assert text_choice["token_ids"] == expected.token_ids[0]


def test_the_server_records_the_scale_provenance_the_rollout_actor_records(synced):
    """The seed bug healed over HTTP: the dummy load's placeholder KV scales were reset by the sync's KV stage."""
    _, reference, replica, _, _ = synced
    records = ray.get(replica.scale_records.remote(), timeout=120)
    assert records == ray.get(reference.scale_records.remote(), timeout=120)
    kv = [r for r in records if r.kind == "attention" and r.scale in ("k_scale", "v_scale")]
    assert kv and all((r.source, r.version, r.value) == (refit.ScaleSource.DEFAULT, 1, 1.0) for r in kv)
    assert any(r.kind == "weight" and r.source is refit.ScaleSource.REFIT and r.version == 1 for r in records)


def test_an_fsdp2_trainer_group_syncs_the_server_beside_the_rollout_actor(server, synced, actors_factory):
    """Two FSDP2 ranks of the same checkpoint, each broadcasting its parts to the server's workers: the same model."""
    _, reference, replica, _, _ = synced
    report = refit.sync(actors_factory.trainer_group(model_dir(True, "bf16")), [reference, replica], COLLECTIVE)
    assert [r.served_version for r in report.replicas] == [report.version] * 2
    assert server.json("/weight_info")["weight_version"] == str(report.version)
    expected = ray.get(reference.generate.remote(PROMPTS, NEW_TOKENS), timeout=120)
    assert [c["token_ids"] for c in completions(server, PROMPTS)] == expected.token_ids
    assert accuracy(PROMPTS, expected.token_ids) >= 0.9  # the checkpoint's trained model, not placeholders


def test_a_probed_sync_over_http_passes_and_the_servers_weight_version_is_the_syncs(server, synced):
    trainer, _, replica, _, _ = synced
    report = refit.sync(trainer, replica, refit.SyncConfig(transport="collective", timeout_s=60, verify="probe"))
    assert "probe passed" in report.replicas[0].verification
    assert server.json("/weight_info")["weight_version"] == str(report.version)
    assert ray.get(replica.status.remote()).served_version == report.version


def test_a_sync_that_aborts_requests_in_flight_pauses_the_server_with_vllms_abort_mode(server, synced):
    trainer, _, replica, _, _ = synced
    report = refit.sync(trainer, replica, refit.SyncConfig(transport="collective", timeout_s=60, pause="abort"))
    assert server.json("/weight_info")["weight_version"] == str(report.version)
    assert accuracy(PROMPTS, [c["token_ids"] for c in completions(server, PROMPTS)]) >= 0.9  # resumed, serving


def test_a_transport_whose_bytes_would_cross_http_is_refused_naming_collective(server, synced):
    trainer, _, replica, _, _ = synced
    served = ray.get(replica.status.remote()).served_version
    with pytest.raises(refit.ConfigError, match=r"transport='ray'.*use SyncConfig\(transport='collective'\)"):
        refit.sync(trainer, replica, refit.SyncConfig(transport="ray"))
    status = ray.get(replica.status.remote())
    assert (status.phase, status.served_version) == (Phase.SERVING, served)


def test_an_adapter_sync_is_refused_naming_why_a_server_cannot_take_one_from_memory(synced, actors_factory):
    """vLLM's routes name an adapter by a directory it loads and requests name it by model name (docs/lora.md)."""
    _, _, replica, _, _ = synced
    served = ray.get(replica.status.remote())
    lora_trainer = actors_factory.trainer(model_dir(True, "bf16"), lora=LORA)
    with pytest.raises(refit.ConfigError, match=r"serves no LoRA adapters.*`vllm serve` replica cannot take adapters"):
        refit.Syncer(lora_trainer, replica).sync_adapter()
    assert ray.get(replica.status.remote()) == served


def test_an_unreachable_url_fails_the_replica_naming_the_url_and_what_to_do(ray_cluster):
    url = f"http://127.0.0.1:{free_port()}"
    replica = actors.ServerRollout.remote(url, api_key="any key", connect_timeout_s=5)
    try:
        with pytest.raises(ray.exceptions.ActorDiedError, match=rf"{url} could not be reached.*refit serve"):
            ray.get(replica.status.remote(), timeout=STARTUP_S)  # the constructor's failure, however long its imports take
    finally:
        ray.kill(replica)


def test_a_fleet_drops_its_server_killed_mid_sync_and_takes_a_replica_that_joins(server, synced, shared_replicas):
    """A server and two actors; the server dies under back-to-back syncs, then a third actor joins.

    The module's first server dies here (a second takes its port below). Its replica's actor lives on, but its
    engine is gone (`ServerGoneError`), so the fleet drops it as it drops a dead actor: the report names it and the
    URL, and the actors complete the sync. The replica that joins afterwards serves what the others serve.
    """
    trainer, reference, replica, _, _ = synced
    other, joiner = shared_replicas
    with refit.Syncer(trainer, [reference, replica, other], COLLECTIVE) as syncer:
        syncer.sync()  # the group is made: the kill lands in a sync's begin, stream or finish
        threading.Timer(0.3, server.stop).start()
        for _ in range(100):  # back-to-back syncs until one loses the server
            report = syncer.sync()
            if report.dropped:
                break
        (dropped,) = report.dropped
        assert (dropped.replica, dropped.cause) == (1, "died") and server.url in dropped.error, dropped
        assert [r.replica for r in report.replicas] == [0, 2]
        assert all(r.served_version == report.version for r in report.replicas)
        assert syncer.replica_names == ["rollout 0", "rollout 2"]

        assert syncer.add_replica(joiner) == "rollout 3"
        report = syncer.sync()
        assert [r.replica for r in report.replicas] == [0, 2, 3] and not report.dropped
    expected = ray.get(reference.generate.remote(PROMPTS, NEW_TOKENS), timeout=120)
    for actor in (other, joiner):
        assert ray.get(actor.status.remote()).served_version == report.version
        assert ray.get(actor.generate.remote(PROMPTS, NEW_TOKENS), timeout=120).token_ids == expected.token_ids
    state = ray.get(replica.status.remote(), timeout=120)
    assert state.phase is not Phase.UPDATING  # the dropped replica closed its update: serving, or refusing


# -- a second server on the same port, never synced: its protections (issue #45), then its first sync -------------

USER_PROMPTS = make_prompts(4, PROMPT_LEN, seed=45)
HELD_COLLECTIVE = refit.SyncConfig(transport="collective", timeout_s=120)  # users' requests are held through it


@pytest.fixture(scope="module")
def restarted(server, tmp_path_factory, ray_cluster):
    """A new server where the killed one was (same port and key), its options in vLLM's config file (`--config`): the
    module's first is gone by now (stopped again in case the test that kills it did not get that far), and no sync
    has reached this one yet.

    Requests `ray_cluster` so that the tests using it are engine tests: the suite's order keeps the file's."""
    server.stop()
    folder = tmp_path_factory.mktemp("restarted")
    (folder / "serve.yaml").write_text(_as_config_file(SERVER_OPTIONS))  # the same options, through vLLM's file
    started = RefitServer(server.model, ["--config", str(folder / "serve.yaml")], folder / "serve.log",
                          port=server.port, api_key=server.api_key)
    try:
        started.wait_until_healthy(SERVER_START_WITHIN_S)
        yield started
    finally:
        started.stop()


def _as_config_file(options: list[str]) -> str:
    """Command-line options as vLLM's YAML config file (`--config`) gives them: `--name value`, or a flag alone."""
    lines, items = [], list(options)
    while items:
        name = items.pop(0).removeprefix("--")
        value = items.pop(0) if items and not items[0].startswith("--") else "true"
        lines.append(f"{name}: {value}")
    return "\n".join(lines) + "\n"


class _Marker:
    """Unpickling it runs `touch PATH`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _status(server: RefitServer, verb: str, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, str]:
    return http_status(server.url + path, body, key=key, method=verb)


def _completion(server: RefitServer, prompt: list[int]) -> dict:
    return {"model": server.model, "prompt": [prompt], "max_tokens": NEW_TOKENS, "temperature": 0.0,
            "return_token_ids": True}


def test_a_default_refit_serve_listens_on_loopback_only(restarted):
    """No --host (tests/support/server.py passes none): the listening socket is 127.0.0.1's, in no other address."""
    port = f"{restarted.port:04X}"
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


def test_without_the_key_or_with_a_wrong_one_every_route_is_refused_and_nothing_changes(restarted):
    def observed() -> tuple:
        return restarted.json("/weight_info"), restarted.json("/is_paused"), restarted.json("/refit/state")

    before = observed()
    assert before[2]["awaiting_first_sync"] and not before[2]["held"] and before[1] == {"is_paused": False}
    for verb, path, body in ROUTES:
        status, text = _status(restarted, verb, path, body)
        assert status == 401 and json.loads(text)["error"].startswith("missing API key"), (path, status, text)
        status, text = _status(restarted, verb, path, body, key=restarted.api_key + "x")
        assert status == 403 and json.loads(text)["error"].startswith("wrong API key"), (path, status, text)
    assert observed() == before
    status, text = _status(restarted, "POST", "/v1/completions", _completion(restarted, USER_PROMPTS[0]), key=restarted.api_key)
    assert status == 503 and "started with --load-format dummy" in json.loads(text)["error"]  # placeholders: never served
    assert observed() == before and restarted.process.poll() is None


def test_a_pickled_payload_to_the_worker_rpc_runs_nothing_with_or_without_the_key(restarted, tmp_path):
    marker = tmp_path / "ran"
    version = restarted.json("/weight_info")["weight_version"]
    pickled = base64.b64encode(pickle.dumps(_Marker(str(marker)))).decode("ascii")
    for method in ("refit_call", "refit_expect_plan"):  # refit's entry point, and the one that took a pickled plan
        body = {"method": method, "args": [pickled, "collective", False][: 1 if method == "refit_call" else 3]}
        assert _status(restarted, "POST", "/collective_rpc", body)[0] == 401
        status, text = _status(restarted, "POST", "/collective_rpc", body, key=restarted.api_key)
        if method == "refit_call":
            (reply,) = json.loads(text)["results"]
            assert json.loads(reply) == {"ok": False, "type": "ConfigError", "message": (
                'refit_call takes a JSON string {"method": ..., "args": [...]}; nothing else is accepted')}
        else:  # vLLM's route calls it directly: the plan is refused as data, a worker's error
            assert status >= 400, (status, text)
    assert not marker.exists()
    assert restarted.json("/weight_info")["weight_version"] == version and restarted.process.poll() is None


# Before any sync reaches it: what it took from vLLM's config file, and its gate.

def test_a_dummy_load_given_in_vllms_config_file_is_refused_to_users_until_a_verified_sync(restarted):
    """Found by review: refit serve looked for --load-format on the command line only, and vLLM reads `--config FILE`
    later, so a server whose file said `load-format: dummy` served its placeholder weights and KV scales (the seed
    bug: with an FP8 KV cache the engine dies on the first request)."""
    state = restarted.json("/refit/state")
    assert state["awaiting_first_sync"] is True, state
    body = {"model": restarted.model, "prompt": [[1, 2, 3]], "max_tokens": 1}
    status, text = http_status(restarted.url + "/v1/completions", body, key=restarted.api_key)
    assert status == 503 and "started with --load-format dummy" in json.loads(text)["error"], (status, text)
    assert restarted.process.poll() is None


def test_a_real_server_refuses_every_worker_rpc_and_weight_route_but_refits_and_serves_the_rest(restarted):
    """The gate's refusals (tests/engine/test_server.py) in front of vLLM itself: nothing refused reaches a worker."""
    from refit.engine.worker_rpc import decode_reply, encode_call

    url, key = restarted.url, restarted.api_key
    version = restarted.json("/weight_info")
    for method in ("reset_weights", "refit_expect_plan", "update_weights"):
        status, text = http_status(url + "/collective_rpc", {"method": method, "args": []}, key=key)
        assert status == 403 and f"/collective_rpc method {method!r} is refused" in text, (method, status, text)
    for path, body in (("/update_weights", {"update_info": {"version": 9}}), ("/start_weight_update", None),
                       ("/weight_checker", {"action": "reset"}), ("/finish_weight_update", {})):
        status, text = http_status(url + path, body, key=key, method="POST")
        assert status == 403 and f"{path} is refused by refit's gate" in text, (path, status, text)
    boot = {"method": "refit_call", "args": [encode_call("refit_boot_id")]}
    status, text = http_status(url + "/collective_rpc", boot, key=key)
    assert status == 200 and decode_reply(json.loads(text)["results"][0])[0] is True
    assert restarted.json("/v1/models")["data"][0]["id"] == restarted.model
    assert restarted.json("/weight_info") == version and restarted.process.poll() is None


def test_a_replica_without_the_hold_cannot_close_or_change_the_holders_open_update(restarted):
    """Found by review, on a real server: a replica whose hold lapsed and whose release was refused (another
    replica had taken the server over) sent its calls on without a token, and its abandon closed the new holder's
    open update on the workers (vLLM then took any replica's start over it)."""
    from refit.engine.server import ServerAdapter
    from refit.engine.worker_rpc import WorkerCalls
    from refit.errors import EngineError, ServerError
    from refit.plan.config import Transport
    from refit.plan.transfer_plan import QuantizeOn, TransferPlan

    url, key = restarted.url, restarted.api_key
    holder = ServerAdapter(url, key)
    stale = ServerAdapter(url, key)  # no token: as a lapsed replica after its refused release
    mine, theirs = WorkerCalls(holder.call_workers), WorkerCalls(stale.call_workers)
    plan = TransferPlan((), QuantizeOn.TRAINER, b"k")
    holder.hold_requests(120)
    try:
        mine.start_update(plan, Transport.RAY)
        refused = r"HTTP 409.*only the holder drives the workers during its update"
        for act in (theirs.abandon_update, theirs.finish_update, lambda: theirs.start_update(plan, Transport.RAY),
                    lambda: theirs.receive([], [], 3, verify=True), stale.resume):
            with pytest.raises(ServerError, match=refused):
                act()
        assert theirs.streamed() == [] and len(theirs.base_digests()) == 1  # reading passes
        with pytest.raises(EngineError, match="already active"):  # the holder's update is still open
            mine.start_update(plan, Transport.RAY)
    finally:
        mine.abandon_update()  # its holder closes it
        holder.release_requests()
    theirs.start_update(plan, Transport.RAY)  # no hold now: the key's holder drives
    theirs.abandon_update()
    assert restarted.json("/refit/state")["held"] is False


def test_requests_sent_during_a_dummy_servers_first_sync_wait_for_its_kv_stage(restarted, module_actors):
    """Users' requests sent once the first sync began are held by the gate: none runs on the placeholder KV scales
    (which would kill vLLM's engine) or before the KV stage and the weight version; all complete after the sync."""
    trainer = module_actors.trainer(model_dir(True, "bf16"), node=0)
    bodies = [_completion(restarted, prompt) for prompt in USER_PROMPTS]
    replica = module_actors.keep(ServerHoldingUsers.options(resources={"node2": 0.01}).remote(
        restarted.url, restarted.api_key, bodies))
    report = refit.sync(trainer, replica, HELD_COLLECTIVE)
    timeline = ray.get(replica.timeline.remote(), timeout=600)
    answers = timeline["answers"]
    assert all(isinstance(a, dict) for a in answers), answers
    assert timeline["stage_at"] is not None and timeline["marked_at"] is not None
    assert min(timeline["answered_at"]) > timeline["marked_at"] > timeline["stage_at"]
    tokens = [a["choices"][0]["token_ids"] for a in answers]
    assert accuracy(USER_PROMPTS, tokens) >= 0.9  # the trainer's model, with valid KV scales
    assert restarted.json("/weight_info")["weight_version"] == str(report.version)
    assert restarted.json("/refit/state") == {"refit_gate": True, "held": False, "in_flight": 0, "waiting": 0,
                                              "awaiting_first_sync": False, "refusing": None}
    again = restarted.json("/v1/completions", _completion(restarted, USER_PROMPTS[0]))
    assert again["choices"][0]["token_ids"] == tokens[0] and restarted.process.poll() is None


def test_a_server_a_failed_sync_left_refusing_answers_users_503_until_the_next_sync_heals_it(restarted, module_actors):
    """Bytes altered mid-stream: the buckets before them were loaded, so the model is a mix and the replica refuses.
    Users reach the server directly, so its gate must refuse them too (not only `status()`), until a verified sync."""
    trainer = module_actors.trainer(model_dir(True, "bf16"), node=0)
    replica = module_actors.keep(actors.ServerRollout.options(resources={"node2": 0.01}).remote(restarted.url, restarted.api_key))
    syncer = refit.Syncer(trainer, [replica], dataclasses.replace(HELD_COLLECTIVE, bucket_bytes=256 << 10, delta="off"))
    try:
        syncer.sync()
        assert len(syncer.plan().buckets) > 2
        run_in(trainer, tamper_next_stream, "forged", 1)
        with pytest.raises(refit.VerificationError, match=r"bucket 1 arrived altered"):
            syncer.sync()
        assert ray.get(replica.status.remote(), timeout=120).phase is refit.Phase.REFUSING
        status, body = _status(restarted, "POST", "/v1/completions", _completion(restarted, USER_PROMPTS[0]), key=restarted.api_key)
        assert status == 503 and "refuses to serve until its next verified sync: loading a bucket failed" in body, body
        report = syncer.sync()
        answer = restarted.json("/v1/completions", _completion(restarted, USER_PROMPTS[0]))
        assert accuracy(USER_PROMPTS[:1], [answer["choices"][0]["token_ids"]]) == 1.0
        assert restarted.json("/refit/state")["refusing"] is None
        assert restarted.json("/weight_info")["weight_version"] == str(report.version)
    finally:
        syncer.close()


def test_a_new_replica_syncs_a_server_whose_last_replica_died_with_its_update_open(restarted, module_actors):
    """A replica that died mid-update left the workers' update open (vLLM's session flag set, layers in loadable
    form). Once its hold lapsed, the next replica's first sync took the server and failed at its start ("already
    active"), and only its second sync healed the server: the new holder closes the dead one's update first."""
    from refit.engine.server import ServerAdapter
    from refit.engine.worker_rpc import WorkerCalls
    from refit.plan.config import Transport
    from refit.plan.transfer_plan import QuantizeOn, TransferPlan

    dead = ServerAdapter(restarted.url, restarted.api_key)
    dead.hold_requests(0.5)  # a hold that lapses 1.5 s after its last call: no call comes, as from a dead actor
    dead.timeout_s = 120.0  # its call may take longer than its lease on a loaded machine: the hold may lapse meanwhile
    WorkerCalls(dead.call_workers).start_update(TransferPlan((), QuantizeOn.TRAINER, b"k"), Transport.RAY)
    time.sleep(2.0)
    trainer = module_actors.trainer(model_dir(True, "bf16"), node=0)
    replica = module_actors.keep(actors.ServerRollout.options(resources={"node2": 0.01}).remote(restarted.url, restarted.api_key))
    report = refit.sync(trainer, replica, HELD_COLLECTIVE)
    assert restarted.json("/weight_info")["weight_version"] == str(report.version)
    assert restarted.json("/refit/state")["refusing"] is None
    answer = restarted.json("/v1/completions", _completion(restarted, USER_PROMPTS[0]))
    assert accuracy(USER_PROMPTS[:1], [answer["choices"][0]["token_ids"]]) == 1.0


def test_a_server_restarted_since_its_replica_connected_is_named_and_a_new_replica_syncs_it(server, synced, restarted,
                                                                                            module_actors, shared_replicas, caplog):
    """After the kill above: the server on the same URL is another; the old replica says so, a new one syncs it.

    Then that server hangs, and later dies, after its replica began an update, as the sync forms a new
    collective group: the replica's actor answers, but it is lost all the same, and the survivor serves the sync.
    """
    trainer, _, replica, _, _ = synced
    with pytest.raises(refit.ServerError, match=rf"the server at {server.url} restarted since .*create a new actors.ServerRollout"):
        refit.sync(trainer, replica, COLLECTIVE)
    fresh = module_actors.keep(actors.ServerRollout.options(resources={"node2": 0.01}).remote(restarted.url, restarted.api_key))
    report = refit.sync(trainer, fresh, COLLECTIVE)
    assert restarted.json("/weight_info")["weight_version"] == str(report.version)
    assert accuracy(PROMPTS, [c["token_ids"] for c in completions(restarted, PROMPTS)]) >= 0.9

    other, _ = shared_replicas
    # Killed, it must not be waited out: a long deadline that the sync must end well within.
    patient = refit.SyncConfig(transport="collective", timeout_s=300)
    for signum, config, cause in ((signal.SIGSTOP, QUICK, "missed the deadline"), (signal.SIGKILL, patient, "died")):
        failing = started(module_actors.keep(ServerSignalledAfterBegin.options(resources={"node2": 0.01}).remote(
            restarted.url, restarted.api_key, restarted.process.pid, signum)))
        caplog.clear()
        try:
            with refit.Syncer(trainer, [other, failing], config) as syncer:
                report = syncer.sync()
        finally:
            if signum == signal.SIGSTOP:
                os.killpg(restarted.process.pid, signal.SIGCONT)
                # Let the calls the hung server held up drain (their own errors are not this test's).
                ray.wait([failing.leave_transport.remote()], timeout=120)
        (dropped,) = report.dropped
        assert (dropped.replica, dropped.stage, dropped.cause) == (1, "connect", cause), dropped
        assert restarted.url in dropped.error
        assert [r.replica for r in report.replicas] == [0] and report.attempts == 2
        # Lost as the group formed, it is not asked to leave it: hung, it would hold the sync another deadline.
        assert not [r for r in caplog.records if r.getMessage().startswith("rollout 1 could not leave")], caplog.text
        assert ray.get(other.status.remote(), timeout=120).served_version == report.version
        if signum == signal.SIGKILL:
            # The others were told the group would not form, rather than waiting out its deadline for the dead server.
            assert report.total_seconds < config.timeout_s
