"""Configs are validated on construction, with the setting and its type named (no Ray, no vLLM)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from refit import ConfigError, EngineConfig, QuantizeOn, SyncConfig
from refit.engine.config import TRANSFER_BACKEND, WORKER_EXTENSION
from refit.engine.worker_rpc import RefitWorkerExtension, refuse_engine_without_refit
from refit.provenance import KvScalePolicy

REPO = Path(__file__).parents[2]
MODEL = str(REPO / "fixtures/models/qwen3-tiny-tied/fp8_block")


def test_policies_are_accepted_as_strings_or_enums_alike():
    """Finding 4: kv_scales="recompute" as a string silently behaved like "auto"."""
    config = SyncConfig(kv_scales="recompute", calibration_prompts=[[1, 2, 3]], quantize_on="rollout")
    assert config.kv_scales is KvScalePolicy.RECOMPUTE and config.quantize_on is QuantizeOn.ROLLOUT
    assert config.calibration_prompts == ((1, 2, 3),)


@pytest.mark.parametrize("kwargs, message", [
    ({"bucket_bytes": "64MB"}, "bucket_bytes='64MB': expected a positive int, got str"),
    ({"bucket_bytes": None}, "bucket_bytes=None: expected a positive int"),
    ({"bucket_bytes": 1.5}, "bucket_bytes=1.5: expected a positive int, got float"),
    ({"bucket_bytes": 0}, "bucket_bytes=0"),
    ({"quantize_on": "gpu"}, "quantize_on='gpu': expected one of ['trainer', 'rollout']"),
    ({"kv_scales": "calibrate"}, "kv_scales='calibrate'"),
    ({"kv_scales": "recompute"}, "needs calibration_prompts"),
    ({"kv_scales": "recompute", "calibration_prompts": ((),)}, "calibration_prompts[0] is empty"),
    ({"calibration_prompts": ["hello"]}, "expected a sequence of token ids, not text"),
    ({"calibration_prompts": [[1, -2]]}, "token ids [-2]"),
    ({"timeout_s": 0}, "timeout_s=0"),
    ({"timeout_s": float("inf")}, "timeout_s=inf: expected a positive number of seconds, at most 604800 (a week)"),
    ({"startup_timeout_s": 1e308}, "startup_timeout_s=1e+308: expected a positive number of seconds, at most"),
    ({"max_buckets_in_flight": 0}, "max_buckets_in_flight=0"),
    # Found: accepted, then the shm ring allocated a list of 2n + 2 files (16 GB for 10**9) and Ray's stream
    # overflowed a C long at 2**63, naming nothing.
    ({"max_buckets_in_flight": 10**9}, "max_buckets_in_flight=1000000000: expected a positive int, at most 65536"),
    ({"max_buckets_in_flight": 2**63}, "max_buckets_in_flight=9223372036854775808: expected a positive int, at most"),
    ({"metrics_tag": ""}, "metrics_tag='': expected a non-empty str"),
    ({"metrics_tag": 3}, "metrics_tag=3: expected a non-empty str"),
])
def test_bad_sync_settings_are_named(kwargs, message):
    with pytest.raises(ConfigError) as error:
        SyncConfig(**kwargs)
    assert message in str(error.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as error:
        SyncConfig(bucket_bytes=-1, quantize_on="x", timeout_s=-1)
    assert all(name in str(error.value) for name in ("bucket_bytes", "quantize_on", "timeout_s"))


def test_engine_config_refuses_a_missing_model_directory_where_the_engine_starts(tmp_path):
    """Found: a wrong path failed after ~10 s with Hugging Face's 'Repo id must be in the form'.

    The directory is checked on the engine's node (the engines call `check_model_directory` first):
    the driver may not have the checkpoint at all.
    """
    elsewhere = EngineConfig(model="/nonexistent/model")  # the driver need not have it
    with pytest.raises(ConfigError, match=r"model='/nonexistent/model' does not exist on this node"):
        elsewhere.check_model_directory()
    with pytest.raises(ConfigError, match="has no config.json"):
        EngineConfig(model=str(tmp_path)).check_model_directory()
    EngineConfig(model=MODEL).check_model_directory()
    with pytest.raises(ConfigError, match=r"model=None: expected the path"):
        EngineConfig(model=None)
    with pytest.raises(ConfigError, match=r"extra sets \['gpu_memory_utilization'\]"):
        EngineConfig(model=MODEL, extra={"gpu_memory_utilization": 0.5})
    with pytest.raises(ConfigError, match="memory_fraction=2"):
        EngineConfig(model=MODEL, memory_fraction=2)


def test_engine_config_serves_lora_adapters_with_room_for_two_over_a_base_it_loads():
    kwargs = EngineConfig(model=MODEL, lora_rank=8).llm_kwargs(on_gpu=False)
    assert (kwargs["enable_lora"], kwargs["max_lora_rank"], kwargs["max_loras"], kwargs["max_cpu_loras"]) == (True, 8, 2, 2)
    assert "enable_lora" not in EngineConfig(model=MODEL).llm_kwargs(on_gpu=False)
    with pytest.raises(ConfigError, match="lora_rank=0: expected a positive int"):
        EngineConfig(model=MODEL, lora_rank=0)
    with pytest.raises(ConfigError, match=r"extra sets \['max_loras'\]: refit sets these .* lora_rank"):
        EngineConfig(model=MODEL, extra={"max_loras": 4})


def test_engine_memory_is_bounded_on_a_cpu_and_left_to_vllm_on_a_gpu():
    config = EngineConfig(model=MODEL)
    assert config.llm_kwargs(on_gpu=False)["kv_cache_memory_bytes"] == 1 << 30
    assert "kv_cache_memory_bytes" not in config.llm_kwargs(on_gpu=True)
    assert "gpu_memory_utilization" not in config.llm_kwargs(on_gpu=True)  # vLLM's own default
    custom = EngineConfig(model=MODEL, kv_cache_bytes=256 << 20, memory_fraction=0.5)
    assert custom.llm_kwargs(on_gpu=True)["kv_cache_memory_bytes"] == 256 << 20
    assert custom.llm_kwargs(on_gpu=False)["gpu_memory_utilization"] == 0.5


@pytest.mark.engine  # a subprocess importing torch, Ray and transformers (~4 s): not the fast tier
def test_a_trainer_process_does_not_import_vllm():
    """What a trainer and a driver import (actors, the library's public names) leaves vLLM out."""
    code = (
        "import sys, refit, actors\n"
        "from actors import TrainerActor, RolloutActor, TrainerGroup, TrainerRank\n"
        "from refit.sharding import RankSource, route_tensors\n"
        "from refit.plan import make_plan, produce_buckets, describe_weights, checkpoint_tensors\n"
        "from refit.orchestration import Syncer\n"
        "from refit import EngineConfig, SyncConfig, Syncer, WeightSource, RolloutReplica, RolloutModelInfo\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm')))\n"
    )
    out = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True, text=True, check=True, cwd=REPO)
    assert json.loads(out.stdout) == []


def test_verification_settings_are_checked():
    from refit.plan.config import Verify

    assert SyncConfig().verify is Verify.CHECKSUMS
    assert SyncConfig(verify="probe").verify is Verify.PROBE
    with pytest.raises(ConfigError) as error:
        SyncConfig(verify="sha", on_probe_breach="ignore", progress="yes")
    message = str(error.value)
    assert "verify='sha': expected one of ['off', 'checksums', 'probe']" in message
    assert "on_probe_breach='ignore'" in message and "progress='yes'" in message


class _OwnExtension(RefitWorkerExtension):
    """A user's worker extension built on refit's."""


def test_an_engine_started_without_refits_engine_kwargs_is_refused_naming_each_setting():
    from types import SimpleNamespace

    def vllm_config(extension: str, backend: str | None):
        transfer = None if backend is None else SimpleNamespace(backend=backend)
        return SimpleNamespace(parallel_config=SimpleNamespace(worker_extension_cls=extension), weight_transfer_config=transfer)

    with pytest.raises(ConfigError, match=r"not started with refit\.engine_kwargs\(\) merged into its arguments: "
                                          r"worker_extension_cls is '', not 'refit\.engine\.worker_rpc\.RefitWorkerExtension' "
                                          r"or a subclass; weight_transfer_config's backend is None, not 'refit'$"):
        refuse_engine_without_refit(vllm_config("", None))
    with pytest.raises(ConfigError, match=r"backend is 'nccl', not 'refit'$"):
        refuse_engine_without_refit(vllm_config(WORKER_EXTENSION, "nccl"))
    with pytest.raises(ConfigError, match=r"worker_extension_cls is 'no\.such\.Module'"):
        refuse_engine_without_refit(vllm_config("no.such.Module", TRANSFER_BACKEND))
    refuse_engine_without_refit(vllm_config(WORKER_EXTENSION, TRANSFER_BACKEND))
    refuse_engine_without_refit(vllm_config(f"{__name__}._OwnExtension", TRANSFER_BACKEND))
