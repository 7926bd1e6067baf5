"""`refit plan` (what a sync would send, nothing started), `refit inspect` (a running cluster's replicas) and
`refit serve`'s refusals (the server itself: tests/sync/test_server_rollout.py)."""

import json
import os
import shutil

import pytest

from fixtures import model_dir
from refit.cli import main


def test_plan_lists_every_tensor_with_its_form(capsys):
    assert main(["plan", str(model_dir(True, "bf16")), str(model_dir(True, "fp8_block")), "--bucket-mib", "0.5"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[1:] if line[:6].strip().isdigit()]
    assert len(rows) == 25
    assert sum(row[-2] == "fp8_block" for row in rows) == 14
    head = next(row for row in rows if row[1] == "lm_head.weight")
    assert head[2] == "model.embed_tokens.weight" and head[-2] == "bfloat16" and head[-1] == "0"  # a copy: not sent
    assert "24 tensors (and 1 loaded from their bytes) in 4 buckets" in out


def test_plan_of_the_moe_pair_shows_each_expert_as_an_fp8_target_cut_from_its_fused_parameter(capsys):
    moe = dict(tied=False, arch="qwen3_moe")
    assert main(["plan", str(model_dir(variant="bf16", **moe)), str(model_dir(variant="fp8_block", **moe))]) == 0
    rows = {row[1]: row for row in (line.split() for line in capsys.readouterr().out.splitlines()[1:]) if row and row[0].isdigit()}
    experts = {name: row for name, row in rows.items() if ".mlp.experts." in name}
    assert len(experts) == 2 * 4 * 3 and all(row[-2] == "fp8_block" for row in experts.values())
    up = rows["model.layers.1.mlp.experts.3.up_proj.weight"]
    assert up[2] == "model.layers.1.mlp.experts.gate_up_proj" and up[3:5] == ["[256,", "256]"]
    assert rows["model.layers.1.mlp.experts.3.down_proj.weight"][2] == "model.layers.1.mlp.experts.down_proj"
    assert rows["model.layers.0.mlp.gate.weight"][-2] == "bfloat16"  # the router, ignored by the scheme


def test_plan_refuses_an_unsupported_rollout_scheme(tmp_path, capsys):
    rollout = tmp_path / "rollout"
    shutil.copytree(model_dir(True, "fp8_block"), rollout)
    config = json.loads((rollout / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "channel"
    (rollout / "config.json").write_text(json.dumps(config))
    assert main(["plan", str(model_dir(True, "bf16")), str(rollout)]) == 1
    assert "weights.strategy='channel', FP8_BLOCK needs 'block'" in capsys.readouterr().err


def test_plan_with_a_missing_path_is_an_error_not_a_traceback(tmp_path, capsys):
    """Found: a bad path printed a traceback."""
    assert main(["plan", str(tmp_path / "nowhere"), str(model_dir(True, "fp8_block"))]) == 1
    err = capsys.readouterr().err
    assert "trainer checkpoint" in err and "nowhere" in err and "has no config.json" in err and "Traceback" not in err
    assert main(["plan", str(model_dir(True, "bf16")), str(tmp_path)]) == 1
    assert "rollout checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("mib", ["0", "-1", "nan", "inf", "many"])
def test_plan_with_a_bad_bucket_size_names_the_flag(mib, capsys):
    """Regression: nan and inf printed a traceback (int() of them); 0 was refused under SyncConfig's name."""
    with pytest.raises(SystemExit) as exited:
        main(["plan", str(model_dir(True, "bf16")), str(model_dir(True, "fp8_block")), "--bucket-mib", mib])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"argument --bucket-mib: {mib!r}: expected a positive number of MiB" in err
    assert "Traceback" not in err


def test_plan_with_a_bucket_too_small_for_a_byte_names_the_setting(capsys):
    assert main(["plan", str(model_dir(True, "bf16")), str(model_dir(True, "fp8_block")), "--bucket-mib", "1e-9"]) == 1
    assert "bucket_bytes=0" in capsys.readouterr().err


@pytest.mark.parametrize("config, message", [
    ("{not json", "config.json: not valid JSON"),
    ("[]", "config.json: expected a JSON object, not a list"),
    (json.dumps({"model_type": "nosuch", "tie_word_embeddings": False}), "nosuch"),
], ids=["malformed", "not-an-object", "unknown-model-type"])
def test_plan_with_a_rollout_config_it_cannot_read_is_an_error_not_a_traceback(config, message, tmp_path, capsys):
    """Regression: the rollout side was not wrapped as the trainer side is, so these printed a traceback."""
    (tmp_path / "config.json").write_text(config)
    assert main(["plan", str(model_dir(True, "bf16")), str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("refit: ") and str(tmp_path) in err and message in err and "Traceback" not in err



def _sharded(rollout):
    """The rollout checkpoint split into two shards with an index, as a large checkpoint is."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(rollout / "model.safetensors"))
    names = sorted(tensors)
    shards = {name: f"model-0000{1 + (i >= len(names) // 2)}-of-00002.safetensors" for i, name in enumerate(names)}
    for shard in set(shards.values()):
        save_file({n: tensors[n] for n, s in shards.items() if s == shard}, str(rollout / shard), metadata={"format": "pt"})
    (rollout / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    (rollout / "model.safetensors").unlink()


def test_plan_names_a_shard_the_rollouts_index_names_but_the_directory_lacks(tmp_path, capsys):
    """Found: the missing shard's tensors were each reported as "extra in the trainer", blaming the wrong side."""
    rollout = tmp_path / "rollout"
    shutil.copytree(model_dir(True, "fp8_block"), rollout)
    _sharded(rollout)
    assert main(["plan", str(model_dir(True, "bf16")), str(rollout)]) == 0
    (rollout / "model-00002-of-00002.safetensors").unlink()
    assert main(["plan", str(model_dir(True, "bf16")), str(rollout)]) == 1
    err = capsys.readouterr().err
    assert "names 1 shard(s) missing" in err and "model-00002-of-00002.safetensors" in err and "extra in the trainer" not in err


@pytest.mark.parametrize("length", [100, 2**40, 2**63 - 1])
def test_plan_names_a_rollout_safetensors_file_whose_header_is_corrupt(length, tmp_path, capsys):
    """Found: a header length past the file's end printed a traceback (MemoryError, OverflowError) or a JSON error
    naming no file."""
    rollout = tmp_path / "rollout"
    shutil.copytree(model_dir(True, "fp8_block"), rollout)
    weights = rollout / "model.safetensors"
    weights.write_bytes(length.to_bytes(8, "little") + b'{"a": 1}')
    assert main(["plan", str(model_dir(True, "bf16")), str(rollout)]) == 1
    err = capsys.readouterr().err
    assert f"{weights}: not a readable safetensors file" in err and "Traceback" not in err

def test_serve_refuses_an_option_refit_sets_before_starting_anything(capsys, monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    assert main(["serve", str(model_dir(True, "fp8_block")), "--worker-extension-cls", "my.Extension"]) == 1
    assert "--worker-extension-cls: refit sets these" in capsys.readouterr().err
    assert "VLLM_SERVER_DEV_MODE" not in os.environ  # nothing was started, nothing was changed


def test_serve_refuses_more_than_one_key_or_api_server_before_starting_anything(capsys, monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    monkeypatch.delenv("REFIT_API_KEY", raising=False)
    assert main(["serve", str(model_dir(True, "fp8_block")), "--api-key", "a", "b"]) == 1
    assert "--api-key takes one key with refit serve (2 given)" in capsys.readouterr().err
    assert main(["serve", str(model_dir(True, "fp8_block")), "--api-server-count", "2"]) == 1
    assert "--api-server-count 2: refit serve runs one API server process" in capsys.readouterr().err
    assert "VLLM_SERVER_DEV_MODE" not in os.environ and "REFIT_API_KEY" not in os.environ


def _never_serve(monkeypatch) -> None:
    """vLLM's serve command raises instead of serving: a refusal that fails to come must not start a server here."""
    from vllm.entrypoints.cli.serve import ServeSubcommand

    def serve(*args) -> None:
        raise AssertionError("refit serve went on to start vLLM's server")

    monkeypatch.setattr(ServeSubcommand, "cmd", staticmethod(serve))
    for name in ("VLLM_SERVER_DEV_MODE", "REFIT_API_KEY", "VLLM_API_KEY", "REFIT_SERVE_DUMMY"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("option", "refusal"), [
    ("worker-extension-cls: my.Extension", "--worker-extension-cls: refit sets these"),
    ("api-server-count: 2", "--api-server-count 2: refit serve runs one API server process"),
    ("api-key: [a, b]", "--api-key takes one key with refit serve (2 given)"),
])
def test_serve_refuses_an_option_it_must_refuse_when_vllms_config_file_gives_it(option, refusal, tmp_path, capsys,
                                                                                monkeypatch):
    """Found by review: refit read only the command line, and vLLM reads `--config FILE` later, so the file's options
    passed refit's refusals (and its `load-format: dummy` and `api-key:` went unseen: tests/engine/test_server.py)."""
    _never_serve(monkeypatch)
    config = tmp_path / "serve.yaml"
    config.write_text(option + "\n")
    assert main(["serve", str(model_dir(True, "fp8_block")), "--config", str(config)]) == 1
    assert refusal in capsys.readouterr().err
    assert "VLLM_SERVER_DEV_MODE" not in os.environ  # nothing was started, nothing was changed


def test_serve_takes_the_key_and_a_dummy_load_from_vllms_config_file(tmp_path, monkeypatch):
    """The file's `api-key:` is the server's key, as `--api-key` is (before, the environment's silently replaced
    it), and its `load-format: dummy` is told to the gate (a real server: tests/engine/test_server.py)."""
    _never_serve(monkeypatch)
    monkeypatch.setenv("REFIT_API_KEY", "from-the-environment")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "spawn"))
    config = tmp_path / "serve.yaml"
    config.write_text("api-key: from-the-file\nload-format: dummy\n")
    with pytest.raises(AssertionError, match="went on to start"):
        main(["serve", str(model_dir(True, "fp8_block")), "--config", str(config), "--port", "1"])
    assert os.environ["REFIT_API_KEY"] == "from-the-file" and os.environ["REFIT_SERVE_DUMMY"] == "1"


def test_serve_names_a_config_file_it_cannot_read(tmp_path, capsys, monkeypatch):
    _never_serve(monkeypatch)
    config = tmp_path / "serve.yaml"
    config.write_text("- not\n- a mapping\n")
    assert main(["serve", str(model_dir(True, "fp8_block")), "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "--config: vLLM's config file could not be read" in err and "Traceback" not in err
    assert main(["serve", str(model_dir(True, "fp8_block")), "--config", str(tmp_path / "absent.yaml")]) == 1
    assert "--config: vLLM's config file could not be read (FileNotFoundError" in capsys.readouterr().err


def test_inspect_of_an_address_without_a_ray_cluster_is_an_error_within_its_deadline():
    """Found: `ray.init` at such an address was still retrying after 120 s, so `refit inspect` never answered."""
    import socket
    import subprocess
    import sys
    import time

    def inspect(address: str) -> tuple[subprocess.CompletedProcess, float]:
        script = f"import sys, refit.cli as cli; cli.CONNECT_TIMEOUT_S = 3; sys.exit(cli.main(['inspect', '--address', {address!r}]))"
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        return result, time.monotonic() - start

    with socket.socket() as nobody:  # a port bound, never listened on: refused
        nobody.bind(("127.0.0.1", 0))
        refused, _ = inspect(f"127.0.0.1:{nobody.getsockname()[1]}")
    assert refused.returncode == 1 and "no Ray cluster at address='127.0.0.1:" in refused.stderr, refused.stderr[-2000:]
    assert "Connection refused" in refused.stderr and "Traceback" not in refused.stderr
    with socket.socket() as stranger:  # something listens, but it is no Ray cluster: the deadline
        stranger.bind(("127.0.0.1", 0))
        stranger.listen()
        silent, seconds = inspect(f"127.0.0.1:{stranger.getsockname()[1]}")
    assert silent.returncode == 1 and "no Ray cluster answered at address='127.0.0.1:" in silent.stderr, silent.stderr[-2000:]
    assert "within 3 s" in silent.stderr and "SIGTERM handler" not in silent.stderr
    assert seconds < 60  # the deadline, plus importing Ray on a busy machine


def test_inspect_shows_each_named_replica_its_version_last_update_and_provenance(module_actors, shared_replicas, ray_cluster):
    """Run as a user would, from another process on the cluster's machine; a broken replica is listed, not fatal."""
    import subprocess
    import sys

    import ray

    import refit
    from tests.support.actors import UnreadableReplica
    from tests.support.names import NAMESPACE, SHARED_REPLICAS

    trainer = module_actors.trainer(model_dir(True, "bf16"))
    broken = module_actors.keep(UnreadableReplica.options(name="broken-rollout", namespace=NAMESPACE).remote())
    rollout = shared_replicas[0]
    report = refit.sync(trainer, rollout)
    ray.get([rollout.status.remote(), broken.__ray_ready__.remote()])

    def inspect(*flags: str) -> str:
        command = [sys.executable, "-m", "refit.cli", "inspect", "--address", ray_cluster.address, *flags]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    shown = {r["name"]: r for r in json.loads(inspect("--json"))}
    mine = shown[f"{NAMESPACE}/{SHARED_REPLICAS[0]}"]
    assert mine["status"] == {"phase": "serving", "served_version": report.version, "reason": None, "sync_id": None,
                              "adapter": None}
    assert mine["last_update"]["outcome"] == "served" and mine["last_update"]["version"] == report.version
    assert mine["last_update"]["buckets"] == report.buckets
    sources = {(s["module"], s["scale"]): s["source"] for s in mine["scales"]}
    assert sources[("model.layers.0.self_attn.attn", "k_scale")] == "default"
    assert sources[("model.layers.0.mlp.down_proj", "weight_scale")] == "refit"

    assert "the engine core died" in shown[f"{NAMESPACE}/broken-rollout"]["error"]

    text = inspect()
    assert f"{NAMESPACE}/{SHARED_REPLICAS[0]} on node" in text and f"serving v{report.version}" in text
    assert f"{NAMESPACE}/broken-rollout: could not be inspected (RayTaskError" in text, text
    assert "model.layers.1.self_attn.attn" in text


def test_inspect_json_stdout_holds_only_the_json_while_ray_broadcasts_a_warning(ray_cluster):
    """Found in a fresh clone: the raylet's "N PYTHON worker processes have been started" warning, which Ray's
    driver prints to stdout whatever `log_to_driver` says, came before the JSON. Here the inspecting process
    broadcasts such a warning itself once connected, and waits until its driver has printed it."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys, threading
        import ray, ray._private.worker as driver
        from ray._private.utils import publish_error_to_driver
        import refit.cli as cli

        printed, print_to_stdstream = threading.Event(), driver.print_to_stdstream
        driver.print_to_stdstream = lambda *a, **k: (print_to_stdstream(*a, **k), printed.set())
        connect = cli._connect

        def connect_then_warn(address):
            connect(address)
            for _ in range(120):  # again until printed: the driver's subscription may start after a publish
                publish_error_to_driver("refit_test", "a warning for every driver", driver.global_worker.gcs_client)
                if printed.wait(0.5):
                    return
            raise AssertionError("Ray's driver never printed the broadcast warning")

        cli._connect = connect_then_warn
        sys.exit(cli.main(["inspect", "--json", "--address", {ray_cluster.address!r}]))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "a warning for every driver" in result.stderr  # still shown to the user, on stderr
    assert isinstance(json.loads(result.stdout), list), result.stdout[:1000]


def test_serve_takes_the_model_as_model_option_beside_vllms_config_file(tmp_path, monkeypatch):
    """Found by review: `vllm serve --model M --config FILE` is vLLM's own form (its parser moves `--model` to the
    front before reading the file), but refit read the file first and refused it as naming no model."""
    _never_serve(monkeypatch)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "spawn"))
    config = tmp_path / "serve.yaml"
    config.write_text("api-key: from-the-file\nload-format: dummy\n")
    with pytest.raises(AssertionError, match="went on to start"):
        main(["serve", "--model", str(model_dir(True, "fp8_block")), "--config", str(config), "--port", "1"])
    assert os.environ["REFIT_API_KEY"] == "from-the-file" and os.environ["REFIT_SERVE_DUMMY"] == "1"
