"""The GPU transports: `ipc` (CUDA IPC, trainer and rollout on one GPU) and `collective` over NCCL.

They run only where CUDA is (scripts/gpu_check.sh runs them with the
benchmark) and are skipped elsewhere, saying why. Each compares against the
`ray` transport on the same replica: the same tokens and logprobs.
On CPUs the `collective` transport runs on gloo (test_transports.py).
"""

from __future__ import annotations

import pytest
import ray
import torch

import refit
from fixtures import NEW_TOKENS, PROMPT_LEN, make_prompts, make_sequences, model_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh on a GPU machine)")

PROMPTS = make_prompts(16, PROMPT_LEN, seed=19)
ONE_GPU = {"CUDA_VISIBLE_DEVICES": "0"}  # the local cluster's nodes do not schedule GPUs: pin both actors to device 0


@pytest.fixture(scope="module")
def colocated(module_actors):
    trainer = module_actors.trainer(model_dir(True, "bf16"), node=0, reinitialize=True, seed=5, lr=3e-3)
    for step in range(3):
        ray.get(trainer.train_step.remote(make_sequences(8, 16, seed=step).tolist()))
    rollout = module_actors.rollout(model_dir(True, "bf16"), node=0, load_format="dummy", memory_fraction=0.3, env=ONE_GPU)
    refit.sync(trainer, rollout)
    return trainer, rollout, ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, prompt_logprobs=True))


def test_ipc_serves_what_the_ray_transport_serves(colocated):
    trainer, rollout, expected = colocated
    report = refit.sync(trainer, rollout, refit.SyncConfig(transport="ipc", bucket_bytes=256 << 10))
    assert report.buckets > 1
    got = ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, prompt_logprobs=True))
    assert got.token_ids == expected.token_ids
    assert max(abs(a - b) for x, y in zip(got.logprobs, expected.logprobs) for a, b in zip(x, y)) < 1e-5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: the trainer and the worker on two devices")
def test_collective_over_nccl_serves_what_the_ray_transport_serves(colocated, module_actors):
    trainer, _, expected = colocated
    rollout = module_actors.rollout(model_dir(True, "bf16"), node=0, load_format="dummy", memory_fraction=0.3,
                                    env={"CUDA_VISIBLE_DEVICES": "1"})
    refit.sync(trainer, rollout, refit.SyncConfig(transport="collective", bucket_bytes=256 << 10))
    assert ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS)).token_ids == expected.token_ids
