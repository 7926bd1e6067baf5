"""LoRA adapters synced alone into running FP8_BLOCK replicas: only the adapter's bytes move, the base never reloads.

The trainer trains a peft adapter over the frozen tiny Qwen3 (bf16); the
replicas serve the same model's llmcompressor FP8_BLOCK checkpoint, loaded
with LoRA on (`EngineConfig(lora_rank=8)`), from disk or from a weight sync
through vLLM's LoRA layers.
"""

from __future__ import annotations

import threading

import pytest
import ray

import refit
from fixtures import NEW_TOKENS, PROMPT_LEN, make_prompts, make_sequences, model_dir
from tests.support.actors import engine_state, run_in
from tests.support.lora import LORA, generate_with_adapter_dir, loaded_lora_ids, poison_adapter, save_adapter, save_merged

FP8 = model_dir(False, "fp8_block")
BF16 = model_dir(False, "bf16")
PROMPTS = make_prompts(8, PROMPT_LEN, seed=61)
SEQUENCES = make_sequences(16, 16, seed=62).flip(1).tolist()  # counting down: what the base never learnt


def test_adapter_only_syncs_move_the_adapters_bytes_serve_what_vllm_loads_from_a_directory_and_refuse_bad_ones(
        actors_factory, tmp_path):
    trainer = actors_factory.trainer(BF16, lora=LORA, lr=1e-2)
    replica = actors_factory.rollout(FP8, node=1, lora_rank=8, load_format="dummy")
    fresh = actors_factory.rollout(FP8, node=2, lora_rank=8)
    syncer = refit.Syncer(trainer, [replica])
    # Its base first, by a weight sync through vLLM's LoRA layers (the base alone: a replica that serves LoRA applies
    # the adapter itself): every FP8 code and scale is the checkpoint's.
    syncer.sync()
    base = run_in(replica, engine_state)
    assert base == run_in(fresh, engine_state)
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
    assert (served.version, served.adapter.version) == (1, 3)  # tagged: the base version and the adapter version
    assert served.token_ids == expected_tokens and served.logprobs == expected_logprobs
    base_only = ray.get(fresh.generate.remote(PROMPTS, NEW_TOKENS))
    assert base_only.adapter is None and base_only.logprobs != expected_logprobs  # the adapter changes what is served

    # A NaN in the adapter: refused by the replica, naming the tensor; the old adapter serves on, and the refused one
    # is not left installed.
    poisoned = run_in(trainer, poison_adapter)
    with pytest.raises(refit.InvalidTensorError, match=poisoned.replace(".", r"\.")):
        syncer.sync_adapter()
    after = ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS))
    assert after.adapter == served.adapter and after.token_ids == served.token_ids
    assert len(run_in(replica, loaded_lora_ids)) == 1

    # A rank above the engine's max_lora_rank is refused by the replica, by name.
    wide = actors_factory.trainer(BF16, lora={**LORA, "r": 16})
    with pytest.raises(refit.ConfigError, match="max_lora_rank 8"):
        refit.Syncer(wide, [replica]).sync_adapter()
    assert ray.get(replica.status.remote()).adapter == served.adapter

    # Two adapter syncs at once on one replica, from two Syncers: whichever stages second while the first's adapter is
    # staged is refused; whatever ran, the replica serves the newest version that succeeded, and holds at most two.
    results: dict[int, object] = {}

    def adapter_sync(index: int) -> None:
        try:
            results[index] = refit.Syncer(trainer, [replica]).sync_adapter().version
        except refit.RefitError as error:
            results[index] = error

    run_in(trainer, poison_adapter, 0.01)  # finite again: a valid adapter
    threads = [threading.Thread(target=adapter_sync, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    won = [r for r in results.values() if isinstance(r, int)]
    assert len(results) == 2 and won and all(isinstance(r, refit.LifecycleError) for r in results.values() if r not in won)
    assert ray.get(replica.status.remote()).adapter.version == max(won) and len(run_in(replica, loaded_lora_ids)) <= 2


def test_an_adapter_swap_under_concurrent_requests_loses_none_and_each_ends_on_the_adapter_it_began_with(actors_factory):
    """An `AsyncLLM` replica serves requests throughout the swap: the ones admitted before it finish on the old
    adapter (tagged with it), the ones after run on the new one; none is aborted or lost."""
    from actors import AsyncRolloutActor

    trainer = actors_factory.trainer(BF16, lora=LORA, lr=1e-2)
    # A bf16 base: the swap is what is tested here (an FP8 base's reference kernel would only make it slower).
    config = refit.EngineConfig(model=str(BF16), lora_rank=8, max_model_len=128, kv_cache_bytes=64 << 20)
    replica = actors_factory.keep(AsyncRolloutActor.options(num_cpus=0, resources={"node1": 0.01}).remote(config))
    ray.get(trainer.train_step.remote(SEQUENCES), timeout=120)
    syncer = refit.Syncer(trainer, [replica])
    syncer.sync_adapter()
    expected = {1: [c.token_ids for c in ray.get([replica.generate.remote(p, 16) for p in PROMPTS])]}
    ray.get(trainer.train_step.remote(SEQUENCES), timeout=120)

    during = [replica.generate.remote(p, 16) for p in PROMPTS * 2]
    report = syncer.sync_adapter()
    after = [replica.generate.remote(p, 16) for p in PROMPTS]
    done = ray.get(during + after, timeout=300)
    expected[2] = [c.token_ids for c in ray.get([replica.generate.remote(p, 16) for p in PROMPTS])]

    # Ray starts an actor's calls in the order one caller sent them, and a request takes its adapter before its
    # first wait: every request sent before the sync began on v1, every one after it on v2.
    assert report.version == 2 and not any(c.aborted for c in done)
    assert [c.adapter.version for c in done] == [1] * len(during) + [2] * len(after)
    for i, completion in enumerate(done):
        assert completion.token_ids == expected[completion.adapter.version][i % len(PROMPTS)], (i, completion.adapter)
    assert report.replicas[0]["retired"] == "policy v1"


def test_merge_mode_syncs_the_base_with_the_adapter_merged_in_as_peft_merges_it(actors_factory, tmp_path):
    """A replica that serves no LoRA gets the LoRA trainer's weights merged (an ordinary sync), bit for bit what a
    checkpoint of peft's `merge_and_unload` holds."""
    trainer = actors_factory.trainer(BF16, lora={**LORA, "init_lora_weights": False})
    replica = actors_factory.rollout(BF16, node=1, load_format="dummy")
    report = refit.sync(trainer, [replica])
    assert report.tensors == 25  # the base's, under their checkpoint names; no adapter tensor
    run_in(trainer, save_merged, str(tmp_path))
    merged = actors_factory.rollout(tmp_path, node=2)
    assert run_in(replica, engine_state) == run_in(merged, engine_state)
    with pytest.raises(refit.ConfigError, match="serves no LoRA adapters"):
        refit.Syncer(trainer, [replica]).sync_adapter()




def test_a_weight_sync_keeps_the_adapter_a_lora_replica_serves_and_sends_it_the_base_unmerged(actors_factory):
    """Found: vLLM drops every LoRA adapter when a weight update finishes; refit's, installed from memory, name no
    directory to be read again from, so after any weight sync (a replica added, say) every request on the served
    adapter failed (LoRAAdapterNotFoundError) until the next adapter sync. And the sync sent the base with the
    trained adapter merged in, which the replica then served the adapter on top of: base + 2 B A."""
    trainer = actors_factory.trainer(BF16, lora=LORA, lr=1e-2)
    replica = actors_factory.rollout(FP8, node=1, lora_rank=8)
    syncer = refit.Syncer(trainer, [replica])
    ray.get(trainer.train_step.remote(SEQUENCES), timeout=120)
    syncer.sync_adapter()
    base = run_in(replica, engine_state)
    served = ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS))
    syncer.sync()  # the base again
    assert run_in(replica, engine_state) == base  # the checkpoint's every FP8 code and scale: no adapter merged in
    after = ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS))
    assert after.adapter == served.adapter and after.logprobs == served.logprobs
    assert syncer.sync_adapter().version == 2
