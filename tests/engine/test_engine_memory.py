"""An engine that cannot fit is refused by refit, naming the setting, before vLLM starts (issue 14)."""

import psutil
import pytest
import ray

import refit
from fixtures import model_dir


def test_an_engine_that_cannot_fit_is_refused_naming_the_setting(actors_factory):
    """Without the check vLLM's CPU worker raised its own error after ~10 s, or the process aborted."""
    too_big = psutil.virtual_memory().available + (4 << 30)  # what a third engine on a full machine meets
    rollout = actors_factory.rollout(model_dir(True, "fp8_block"), load_format="dummy", kv_cache_bytes=too_big,
                                     own_process=True)  # its constructor must fail
    with pytest.raises(ray.exceptions.RayActorError, match=r"lower EngineConfig\.kv_cache_bytes"):
        ray.get(rollout.status.remote(), timeout=120)


def test_an_async_engine_that_cannot_fit_is_refused_the_same_way_before_its_core_process_starts(actors_factory):
    from actors import AsyncRolloutActor

    too_big = psutil.virtual_memory().available + (4 << 30)
    config = refit.EngineConfig(model=str(model_dir(True, "fp8_block")), load_format="dummy", max_model_len=128,
                                kv_cache_bytes=too_big)
    rollout = actors_factory.keep(AsyncRolloutActor.options(num_cpus=0, resources={"node1": 0.01}).remote(config))
    with pytest.raises(ray.exceptions.RayActorError, match=r"lower EngineConfig\.kv_cache_bytes"):
        ray.get(rollout.status.remote(), timeout=120)
