"""LoRA adapters synced alone into running FP8_BLOCK replicas: only the adapter's bytes move, the base never reloads.

The trainer trains a peft adapter over the frozen tiny Qwen3 (bf16); the
replicas serve the same model's llmcompressor FP8_BLOCK checkpoint, loaded
from disk, with LoRA on (`EngineConfig(lora_rank=8)`).
"""

from __future__ import annotations

import pytest
import ray

import refit
from fixtures import NEW_TOKENS, PROMPT_LEN, make_prompts, make_sequences, model_dir
from tests.support.actors import engine_state, run_in
from tests.support.lora import LORA, generate_with_adapter_dir, loaded_lora_ids, poison_adapter, save_adapter

FP8 = model_dir(False, "fp8_block")
BF16 = model_dir(False, "bf16")
PROMPTS = make_prompts(8, PROMPT_LEN, seed=61)
SEQUENCES = make_sequences(16, 16, seed=62).flip(1).tolist()  # counting down: what the base never learnt


def test_adapter_only_syncs_move_the_adapters_bytes_and_serve_what_vllm_loads_from_a_directory(actors_factory, tmp_path):
    trainer = actors_factory.trainer(BF16, lora=LORA, lr=1e-2)
    replica = actors_factory.rollout(FP8, node=1, lora_rank=8)
    fresh = actors_factory.rollout(FP8, node=2, lora_rank=8)
    base = run_in(replica, engine_state)
    syncer = refit.Syncer(trainer, [replica])
    for step in range(1, 4):
        ray.get(trainer.train_step.remote(SEQUENCES), timeout=120)
        report = syncer.sync_adapter()
        assert report.version == step and report.replicas[0]["serving"] == f"policy v{step}", report.summary()
        assert report.bytes_per_replica == ray.get(trainer.adapter_meta.remote()).nbytes
        assert run_in(replica, engine_state) == base  # the base was never reloaded
    status = ray.get(replica.status.remote())
    assert (status.adapter.name, status.adapter.version) == ("policy", 3) and "with adapter policy v3" in str(status)
    assert len(run_in(replica, loaded_lora_ids)) == 1  # versions 1 and 2 unloaded once their requests ended

    run_in(trainer, save_adapter, str(tmp_path))
    expected_tokens, expected_logprobs = run_in(fresh, generate_with_adapter_dir, PROMPTS, NEW_TOKENS, str(tmp_path))
    served = ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS))
    assert served.adapter.version == 3 and served.version is None  # the base: what the engine loaded
    assert served.token_ids == expected_tokens and served.logprobs == expected_logprobs
    base_only = ray.get(fresh.generate.remote(PROMPTS, NEW_TOKENS))
    assert base_only.adapter is None and base_only.logprobs != expected_logprobs  # the adapter changes what is served


def test_a_refused_adapter_leaves_the_old_one_serving(actors_factory):
    trainer = actors_factory.trainer(BF16, lora=LORA, lr=1e-2)
    replica = actors_factory.rollout(FP8, node=1, lora_rank=8)
    ray.get(trainer.train_step.remote(SEQUENCES), timeout=120)
    syncer = refit.Syncer(trainer, [replica])
    syncer.sync_adapter()
    before = ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS))
    poisoned = run_in(trainer, poison_adapter)
    with pytest.raises(refit.InvalidTensorError, match=poisoned.replace(".", r"\.")):
        syncer.sync_adapter()
    after = ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS))
    assert after.adapter == before.adapter and after.token_ids == before.token_ids
    assert len(run_in(replica, loaded_lora_ids)) == 1  # the refused one was never left installed

    # A rank above the engine's max_lora_rank is refused by the replica, by name; a module the base lacks, by the
    # driver before anything is sent.
    wide = actors_factory.trainer(BF16, lora={**LORA, "r": 16})
    with pytest.raises(refit.ConfigError, match="max_lora_rank 8"):
        refit.Syncer(wide, [replica]).sync_adapter()
    assert ray.get(replica.status.remote()).adapter == before.adapter
