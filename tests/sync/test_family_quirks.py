"""Families whose vLLM model needs more than the common path, end to end: buffers a checkpoint holds (GLM-4-MoE's
router bias, Apertus' xIELU constants), modules registered under two parents (dots1), a loader that writes tensors
past vLLM's layerwise reload (gpt-oss), a view the reload leaves behind on a CPU (Mamba2 hybrids).

Each model is made by the test (tiny, random, from transformers' config class); a dummy-loaded replica synced from
it must hold what a checkpoint load holds, or be refused naming what it would lack.
"""

from __future__ import annotations

import pytest
import ray
import torch

import refit
from fixtures import NEW_TOKENS, PROMPT_LEN, make_prompts, model_dir
from refit import Phase
from tests.support.actors import engine_buffer, engine_tensors, parameter, run_in
from tests.support.checkpoints import TINY, TINY_ROUTED_MOE, write_random, write_random_bf16
from tests.support.faults import DroppingTrainer
from tests.support.serving import status

PROMPTS = make_prompts(24, PROMPT_LEN, seed=23)
FP8_KV = {"kv_cache_dtype": "fp8_e4m3"}


def _random_router_biases(model) -> None:
    """Router biases far from their zero init, so that a replica routing by any other values picks other experts."""
    generator = torch.Generator().manual_seed(3)
    biases = [layer.mlp.gate.e_score_correction_bias for layer in model.model.layers
              if hasattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias")]
    assert biases, "no router bias found: transformers' model changed its names"
    for bias in biases:
        bias.copy_(torch.randn(bias.shape, generator=generator) * 0.5)


@pytest.mark.parametrize("model_type, config, edit", [
    ("glm4_moe", TINY_ROUTED_MOE, _random_router_biases),
    ("apertus", {}, None),
    ("dots1", TINY_ROUTED_MOE, _random_router_biases),
], ids=["glm4-moe-router-bias", "apertus-xielu-constants", "dots1-modules-registered-twice"])
def test_a_dummy_loaded_engine_of_another_family_holds_what_a_checkpoint_load_holds(actors_factory, tmp_path, model_type,
                                                                                     config, edit):
    """Synced, every parameter and buffer of the engine equals a checkpoint load's. Regressions: buffers a checkpoint
    holds were not sent (only parameters), so a GLM-4-MoE replica never loaded its router bias
    `e_score_correction_bias` (DeepSeek-V3's routing) and refused to serve, and an Apertus one served with xIELU
    constants (`beta`, `eps`) the layerwise reload left uninitialized; and vLLM registers dots1's router and shared
    experts under two parents, so weights `load_weights` reported under their other path counted as unloaded."""
    from transformers import AutoConfig

    bf16, fp8 = write_random(AutoConfig.for_model(model_type, **TINY, **config), tmp_path, seed=7,
                             like=model_dir(True, "fp8_block"), edit=edit)
    fresh = actors_factory.rollout(fp8, node=1, **FP8_KV)
    replica = actors_factory.rollout(fp8, node=2, load_format="dummy", **FP8_KV)
    report = refit.sync(actors_factory.trainer(bf16), replica)
    assert report.replicas[0].served_version == 1
    expected = run_in(fresh, engine_tensors)
    assert run_in(replica, engine_tensors) == expected
    assert ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS)).token_ids == ray.get(fresh.generate.remote(PROMPTS, NEW_TOKENS)).token_ids


def test_an_update_that_leaves_out_a_buffer_the_engine_loads_is_refused_and_never_served(actors_factory, tmp_path):
    """The engine's own completeness check covers buffers, the last guard when verification is off: vLLM's reload
    copies a left-out buffer back uninitialized (regression: a stream without Apertus' xIELU `beta` was finished,
    and the replica served a NaN constant)."""
    from transformers import AutoConfig

    bf16, fp8 = write_random(AutoConfig.for_model("apertus", **TINY), tmp_path, seed=7, like=model_dir(True, "fp8_block"))
    replica = actors_factory.rollout(fp8, node=1, **FP8_KV)
    liar = actors_factory.keep(DroppingTrainer.options(num_cpus=0, resources={"node0": 0.01}).remote(
        str(bf16), "model.layers.1.mlp.act_fn.beta"))
    with pytest.raises(refit.EngineError, match=r"left 1 tensor\(s\) of the model unloaded.*model\.layers\.1\.mlp\.act_fn\.beta'"):
        refit.Syncer(liar, [replica], refit.SyncConfig(verify="off")).sync()
    assert status(replica).phase is Phase.REFUSING
    report = refit.sync(actors_factory.trainer(bf16), replica)
    assert report.replicas[0].served_version == report.version


def test_a_model_whose_vllm_loader_writes_tensors_itself_is_refused_naming_them(actors_factory, tmp_path):
    """vLLM 0.32's gpt-oss `load_weights` writes its experts and attention sinks with a bare `copy_`, which vLLM's
    layerwise reload never sees (vLLM PR 57795): regression: the sync reported success and the replica served its
    dummy experts and sinks beside new attention weights. Refused at finish now, naming them."""
    from transformers import AutoConfig

    bf16 = write_random_bf16(AutoConfig.for_model("gpt_oss", **TINY, head_dim=64, num_local_experts=4,
                                                  num_experts_per_tok=2, sliding_window=64,
                                                  layer_types=["sliding_attention", "full_attention"]), tmp_path, seed=7)
    replica = actors_factory.rollout(bf16, node=1, load_format="dummy")
    with pytest.raises(refit.EngineError, match=r"GptOssForCausalLM\.load_weights wrote \d+ tensor\(s\) itself.*"
                                                r"model\.layers\.0\.attn\.sinks.*model\.layers\.0\.mlp\.experts\."
                                                r"routed_experts\.w13_weight"):
        refit.sync(actors_factory.trainer(bf16), replica)
    assert status(replica).phase is Phase.REFUSING


def test_a_mamba2_hybrids_new_convolutions_reach_the_view_its_kernels_read(actors_factory, tmp_path):
    """On a CPU vLLM packs each Mamba2 conv weight into new storage, and `MambaMixer2`'s kernels read a view of the
    old one (regression: a synced Granite 4.0-H served its first load's convolutions, logprobs 0.56 away from a
    fresh engine's; Falcon-H1 0.14)."""
    from transformers import AutoConfig

    bf16 = write_random_bf16(AutoConfig.for_model(
        "granitemoehybrid", **TINY, layer_types=["mamba", "attention"], num_local_experts=0, shared_intermediate_size=512,
        mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_expand=2), tmp_path, seed=7)
    trainer = actors_factory.trainer(bf16)
    replica = actors_factory.rollout(bf16, node=1, load_format="dummy")
    refit.sync(trainer, replica)
    weight = run_in(trainer, parameter, "model.layers.0.mamba.conv1d.weight")
    assert torch.equal(run_in(replica, engine_buffer, "model.layers.0.mamba.conv_weights"), weight.squeeze(1))
