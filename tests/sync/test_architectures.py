"""Architectures beyond dense Qwen3, end to end: a Qwen3 mixture of experts and a Llama (tied and untied).

Each FP8_BLOCK rollout starts with `load_format="dummy"` (random weights) and
an FP8 KV cache, so it can only match a fresh engine loaded from
llmcompressor's FP8_BLOCK checkpoint of the trainer's weights if the sync
delivered every tensor, every expert included, in the form llmcompressor
writes. The trainer holds exactly the committed bf16 fixture, of which the
committed FP8 fixture is llmcompressor's output.
"""

from __future__ import annotations

import pytest
import ray

import refit
from fixtures import NEW_TOKENS, PROMPT_LEN, accuracy, make_prompts, model_dir
from refit.provenance import ScaleSource
from tests.support.actors import engine_state, run_in
from tests.support.checkpoints import write_random, write_variant
from tests.support.serving import assert_serves

PROMPTS = make_prompts(24, PROMPT_LEN, seed=23)
FP8_KV = {"kv_cache_dtype": "fp8_e4m3"}


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


@pytest.mark.parametrize(
    "arch, tied, quantize_on",
    # Each side of quantization on the MoE; on the Llama one per tying (the dense path is the same code).
    [("qwen3_moe", False, ["trainer", "rollout"]), ("llama", True, ["trainer"]), ("llama", False, ["rollout"])],
    ids=["qwen3-moe", "llama-tied", "llama-untied"],
)
def test_dummy_fp8_rollout_matches_a_fresh_engine_on_llmcompressors_checkpoint(actors_factory, arch, tied, quantize_on):
    trainer = actors_factory.trainer(model_dir(tied, "bf16", arch=arch))
    fresh = actors_factory.rollout(model_dir(tied, "fp8_block", arch=arch), node=1, **FP8_KV)
    expected = ray.get(fresh.generate.remote(PROMPTS, NEW_TOKENS, prompt_logprobs=True))

    # One replica for both sides of quantization: the second sync rewrites every weight and scale.
    replica = actors_factory.rollout(model_dir(tied, "fp8_block", arch=arch), node=2, load_format="dummy", **FP8_KV)
    for version, where in enumerate(quantize_on, start=1):
        report = refit.Syncer(trainer, [replica], refit.SyncConfig(quantize_on=where)).sync()
        assert report.replicas[0].served_version == version

        got = ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS, prompt_logprobs=True))
        assert got.token_ids == expected.token_ids, where
        assert max_abs_diff(got.logprobs, expected.logprobs) < 1e-5, where
        assert max_abs_diff([r[1:] for r in got.prompt_logprobs], [r[1:] for r in expected.prompt_logprobs]) < 1e-5, where
        assert accuracy(PROMPTS, got.token_ids) == accuracy(PROMPTS, ray.get(trainer.generate.remote(PROMPTS, NEW_TOKENS)))

        weight_scales = [r for r in ray.get(replica.scale_records.remote()) if r.kind == "weight"]
        assert weight_scales and all(r.source is ScaleSource.REFIT and r.version == version for r in weight_scales)
        if tied:  # the head computes its logits with the kernel the embedding's layer packed: one packed copy
            assert run_in(replica, lambda actor: actor.engine.llm.collective_rpc(
                lambda worker: worker.model_runner.model.lm_head.cpu_linear is worker.model_runner.model.model.embed_tokens.cpu_linear
            )) == [True]
        if arch == "qwen3_moe":  # one record per expert and fused scale, in each of 2 layers
            experts = {(r.module, r.scale) for r in weight_scales if ".mlp.experts." in r.module}
            assert experts == {
                (f"model.layers.{layer}.mlp.experts.{e}", scale)
                for layer in range(2) for e in range(4) for scale in ("w13_weight_scale", "w2_weight_scale")
            }


def test_moe_trainer_with_another_expert_count_is_refused_and_the_replica_keeps_serving(actors_factory, moe_checkpoint_replica,
                                                                                       tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir(False, "bf16", arch="qwen3_moe"))
    config.num_experts = 8
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "eight-experts")
    replica = moe_checkpoint_replica  # serving its checkpoint's weights, never synced
    before = ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS))

    with pytest.raises(refit.PlanMismatchError) as error:
        refit.sync(actors_factory.trainer(tmp_path / "eight-experts"), [replica])

    message = str(error.value)
    assert "nothing was sent" in message
    assert "model.layers.1.mlp.experts.7.down_proj.weight: the rollout's model has no such weight" in message
    assert "model.layers.0.mlp.gate.weight: shape (8, 256) from the trainer, (4, 256)" in message
    status = ray.get(replica.status.remote())
    assert status.phase is refit.Phase.SERVING and status.served_version is None  # still its checkpoint's weights
    assert ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS)).token_ids == before.token_ids


def test_a_model_without_a_head_module_loads_every_weight_as_its_checkpoint_does(actors_factory, tmp_path):
    """vLLM's Gemma 2 ties its output head by taking logits from the embedding: it has no `lm_head` to load the
    plan's tied head into (regression: every sync failed in `load_weights`). A tiny random Gemma 2, made here; its
    engine, loaded from the FP8_BLOCK checkpoint, is synced away from those weights and back, and then holds every
    parameter (FP8 codes, scales, bf16 norms) exactly as the checkpoint load left it."""
    from transformers import Gemma2Config

    config = Gemma2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
                          max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          architectures=["Gemma2ForCausalLM"])
    bf16, fp8 = write_random(config, tmp_path / "gemma2", seed=5, like=model_dir(True, "fp8_block"))
    other, _ = write_variant(bf16, tmp_path / "other", seed=6)

    assert_synced_away_and_back(actors_factory.rollout(fp8, **FP8_KV), actors_factory.trainer(other),
                                actors_factory.trainer(bf16))


def test_a_bf16_moe_rollout_loads_every_expert_as_its_checkpoint_does(actors_factory):
    """On a CPU vLLM packs unquantized experts into its grouped GEMM's layout on the first load only; a weight
    update skipped the packing (regression: the reload copied unpacked values into the packed storage, and every
    synced bf16 MoE served garbage, logprobs 2.5 away from a fresh engine's)."""
    bf16 = model_dir(False, "bf16", arch="qwen3_moe")
    assert_synced_away_and_back(actors_factory.rollout(bf16), actors_factory.trainer(bf16, reinitialize=True, seed=11),
                                actors_factory.trainer(bf16))


def assert_synced_away_and_back(replica, other, same) -> None:
    """`replica` was loaded from `same`'s checkpoint: synced from `other` (every parameter changes), then from `same`,
    it holds every parameter exactly as the checkpoint load left it."""
    loaded = run_in(replica, engine_state)
    refit.sync(other, replica)
    assert run_in(replica, engine_state) != loaded
    report = refit.sync(same, replica)
    assert report.replicas[0].served_version == 2
    assert run_in(replica, engine_state) == loaded


def test_a_dummy_loaded_engine_on_vllms_transformers_backend_starts_and_syncs(actors_factory):
    """vLLM's Transformers modeling backend puts its compile decorator on transformers' own classes in its process,
    where describing a dummy-loaded engine builds transformers' model of the engine's config (regression: the
    replica failed to start, as vLLM had no current config for the decorated class)."""
    trainer = actors_factory.trainer(model_dir(True, "bf16"))
    replica = actors_factory.rollout(model_dir(True, "fp8_block"), own_process=True, load_format="dummy",
                                     extra={"model_impl": "transformers"}, **FP8_KV)
    report = refit.sync(trainer, replica)
    assert_serves([replica], trainer, report.version)
