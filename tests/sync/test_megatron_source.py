"""megatron-core ranks (gloo, one Ray actor per rank) as the trainer: every layout syncs the FP8 replica into
exactly the state a single-process `TrainerActor` of the same checkpoint leaves it in.

Each case: the `TrainerActor` syncs first (the reference: the engine's
parameters, FP8 codes and scales, hashed, and greedy tokens with their
logprobs), then the Megatron group syncs the same checkpoint into the same
replica; then both change the same tensors the same way (in their own
layouts) and sync again, the Megatron group with a delta. Megatron's forward
pass needs CUDA in megatron-core 0.16, so the change is an elementwise
function of the weights rather than an optimizer step.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import ray
import torch

import refit
from actors import MegatronGroup, MegatronParallel
from fixtures import NEW_TOKENS, PROMPT_LEN, make_prompts, model_dir
from tests.support.actors import change_megatron, change_trainer, engine_state, nudge, run_in
from tests.support.checkpoints import write_random, write_variant

FP8_DUMMY = {"load_format": "dummy", "kv_cache_dtype": "fp8_e4m3"}
CONFIG = refit.SyncConfig(transport="ray", bucket_bytes=256 << 10)  # deltas, as between hosts (shm sends whole buckets)


def served(replica, prompts):
    out = ray.get(replica.generate.remote(prompts, NEW_TOKENS, prompt_logprobs=True))
    return out.token_ids, out.logprobs, [row[1:] for row in out.prompt_logprobs]


def assert_megatron_syncs_like_a_trainer(actors_factory, bf16_dir, fp8_dir, parallel, nodes, changed, vocab=512, group=None):
    prompts = [[t % vocab for t in p] for p in make_prompts(8, PROMPT_LEN, seed=47)]
    trainer = actors_factory.trainer(bf16_dir, node=0)
    group = group or actors_factory.megatron_group(bf16_dir, parallel, nodes=nodes)
    replica = actors_factory.rollout(fp8_dir, node=2, **FP8_DUMMY)
    reference, megatron = refit.Syncer(trainer, [replica], CONFIG), refit.Syncer(group, [replica], CONFIG)

    reference.sync()
    expected = run_in(replica, engine_state), served(replica, prompts)
    first = megatron.sync()
    assert (run_in(replica, engine_state), served(replica, prompts)) == expected
    assert first.replicas[0].mode == "full"

    if isinstance(group, MegatronGroup):
        assert group.apply(changed, nudge) > 0
    else:  # a job's own ranks
        assert sum(run_in(rank, change_megatron, changed, nudge) for rank in group.ranks) > 0
    run_in(trainer, change_trainer, changed, nudge)
    second = megatron.sync()  # the replica's base is the group's first version: a delta of what changed
    got = run_in(replica, engine_state), served(replica, prompts)
    reference.sync()
    assert got == (run_in(replica, engine_state), served(replica, prompts))
    assert second.replicas[0].mode == "delta"
    assert second.replicas[0].bytes_received < 0.6 * first.replicas[0].bytes_received
    return group, first


def test_dense_qwen3_at_tp2(actors_factory):
    group, first = assert_megatron_syncs_like_a_trainer(
        actors_factory, model_dir(False, "bf16"), model_dir(False, "fp8_block"), MegatronParallel(tp=2), (0, 1),
        ["model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.layers.1.self_attn.o_proj.weight",
         "model.norm.weight"])
    stats = group.stream_stats()
    # Megatron's own groups (where k, v, o and down are gathered) time out as the trainer's group does, in its minutes.
    def tp_group_timeout_s(rank) -> float:
        from megatron.core import parallel_state

        backend = parallel_state.get_tensor_model_parallel_group()._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()

    timeouts = [run_in(rank, tp_group_timeout_s) for rank in group.ranks]
    assert timeouts == [60 * math.ceil(group.timeout_s / 60)] * 2
    # q, gate, up (128-row blocks per rank) quantized where they lie; k and v (64 rows per rank) and the row-parallel
    # o and down (column shards) gathered over the tensor-parallel group.
    assert [s["quantized_rows"] for s in stats] == [6, 6]
    assert sum(s["gather"] for s in stats) == 8
    # Each rank joins every gather of its group (k, v, o, down of 2 layers; bf16); the first sync's report adds them up.
    per_rank = 2 * (128 * 256 + 128 * 256 + 256 * 256 + 256 * 512) * 2
    assert first.gathered_bytes == 2 * per_rank


def test_llama_with_tied_embeddings_at_tp2_by_cp2_from_a_jobs_own_rank_actors(actors_factory):
    """The ranks are the job's own actors (tests/support/own_megatron.py), made sources with one call each; two
    context-parallel copies of a TP=2 group. Found by review: both copies (data-parallel rank 0 each, context
    parallelism not counted) sent every tensor; their rows overlapped, so q, gate and up were all-gathered instead of
    quantized where they lie. One copy sends, as at TP=2 alone."""
    from refit.sharding.process_group import free_port
    from tests.support.own_megatron import OwnMegatronRank

    bf16 = model_dir(True, "bf16", arch="llama")
    port = free_port()
    ranks = [actors_factory.keep(OwnMegatronRank.options(num_cpus=0, resources={f"node{r % 2}": 0.01}).remote(
        r, 4, "127.0.0.1", port, str(bf16), 2, 2)) for r in range(4)]
    job = SimpleNamespace(ranks=ranks)  # what refit.Syncer needs of a sharded trainer
    assert_megatron_syncs_like_a_trainer(
        actors_factory, bf16, model_dir(True, "fp8_block", arch="llama"), None, (0, 1),
        ["model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight"], group=job)
    sent = [run_in(rank, lambda rank: rank.source.sent) for rank in ranks]
    assert sorted(s["bytes"] for s in sent)[:2] == [0, 0]  # one context-parallel copy sends nothing
    quantized = sorted(s["quantized_rows"] for s in sent)
    assert quantized[:2] == [0, 0] and quantized[2] == quantized[3] > 0  # where the rows lie, on each TP rank


def test_tp2_by_uneven_pp2_with_a_vocabulary_tp_does_not_divide(actors_factory, tmp_path):
    """Four ranks; three layers, two on the first stage; 509 tokens, padded to 512 by Megatron (never sent)."""
    bf16, fp8 = write_variant(model_dir(False, "bf16"), tmp_path, seed=3, num_hidden_layers=3, vocab_size=509)
    assert_megatron_syncs_like_a_trainer(
        actors_factory, bf16, fp8, MegatronParallel(tp=2, pp=2, first_stage_layers=2, vocab_multiple=64), (0, 1, 0, 1),
        ["model.layers.2.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight", "lm_head.weight"], vocab=509)


def test_mqa_over_two_pipeline_stages(actors_factory, tmp_path):
    """One query group (MQA): megatron-core cannot split it over tensor-parallel ranks, so two stages instead.
    Heads of 128 dimensions: vLLM's FP8_BLOCK linears need k and v rows in whole 128-row blocks."""
    bf16, fp8 = write_variant(model_dir(False, "bf16"), tmp_path, seed=4, num_key_value_heads=1, num_attention_heads=2,
                              head_dim=128)
    assert_megatron_syncs_like_a_trainer(actors_factory, bf16, fp8, MegatronParallel(pp=2), (0, 1),
                                         ["model.layers.1.self_attn.v_proj.weight"])


@pytest.mark.parametrize("parallel, nodes", [(MegatronParallel(ep=2), (0, 1)),
                                             (MegatronParallel(tp=2, ep=2, etp=2), (0, 1, 0, 1))],
                         ids=["ep2", "tp2-ep2-etp2"])
def test_qwen3_moe_over_expert_parallel_ranks(actors_factory, parallel, nodes):
    _, first = assert_megatron_syncs_like_a_trainer(
        actors_factory, model_dir(False, "bf16", arch="qwen3_moe"), model_dir(False, "fp8_block", arch="qwen3_moe"),
        parallel, nodes, ["model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.gate.weight"])
    # Each expert lies whole on one EP rank, each dense layer on both (one data-parallel replica sends): nothing is
    # gathered but, with TP, what tensor-parallel ranks split.
    assert (first.gathered_bytes == 0) == (parallel.tp == 1 and parallel.etp == 1)


def moe_family(family: str, tmp_path) -> tuple:
    """A tiny random MoE model of another family (bf16 and FP8_BLOCK checkpoints), its routers left bf16 as
    llmcompressor's MoE recipes leave them."""
    from transformers import MixtralConfig, Qwen2MoeConfig

    common = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256, pad_token_id=0)
    config = {
        # q/k/v biases, and a shared expert with a sigmoid gate beside the routed experts
        "qwen2_moe": lambda: Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=256,
                                            shared_expert_intermediate_size=256, architectures=["Qwen2MoeForCausalLM"]),
        # the experts as block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down)
        "mixtral": lambda: MixtralConfig(**common, num_local_experts=4, architectures=["MixtralForCausalLM"]),
    }[family]()
    return write_random(config, tmp_path / family, seed=11, like=model_dir(False, "fp8_block"), ignore=["lm_head", "re:.*gate$"])


@pytest.mark.parametrize("family, parallel, changed", [
    ("qwen2_moe", MegatronParallel(tp=2), ["model.layers.1.self_attn.q_proj.bias", "model.layers.0.mlp.shared_expert_gate.weight",
                                           "model.layers.0.mlp.shared_expert.up_proj.weight",
                                           "model.layers.1.mlp.experts.2.down_proj.weight"]),
    ("mixtral", MegatronParallel(ep=2), ["model.layers.0.block_sparse_moe.experts.3.w1.weight",
                                         "model.layers.1.block_sparse_moe.gate.weight"]),
], ids=["qwen2_moe-tp2", "mixtral-ep2"])
def test_moe_families_that_name_or_build_their_layers_their_own_way(actors_factory, tmp_path, family, parallel, changed):
    """Regression: the group built Qwen2-MoE without its q/k/v biases and shared expert (Qwen2's config does not
    name its biases) and dropped those checkpoint tensors silently; Mixtral's experts were sent under Qwen's names."""
    bf16, fp8 = moe_family(family, tmp_path)
    assert_megatron_syncs_like_a_trainer(actors_factory, bf16, fp8, parallel, (0, 1), changed)


def test_a_megatron_rank_that_dies_in_a_gather_is_named_and_the_replica_is_never_half_served(actors_factory):
    from refit.engine import Phase
    from tests.support.faults import die_at

    group = actors_factory.megatron_group(model_dir(False, "bf16"), MegatronParallel(tp=2), nodes=(0, 1), timeout_s=20)
    replica = actors_factory.rollout(model_dir(False, "fp8_block"), node=2, **FP8_DUMMY)
    config = refit.SyncConfig(bucket_bytes=32 << 10, max_buckets_in_flight=1, timeout_s=20)
    refit.sync(group, [replica], config)
    version = ray.get(replica.status.remote(), timeout=30).served_version
    run_in(group.ranks[1], die_at, "gathered", 2)  # rank 0 is waiting for it in the tensor-parallel all-gather
    with pytest.raises(refit.ActorDiedError, match=r"^trainer rank 1 died or is unreachable"):
        refit.sync(group, [replica], config)
    status = ray.get(replica.status.remote(), timeout=30)
    # Its old version whole, or (buckets of the new one loaded) refusing until the next sync: never a mix.
    assert status.phase in (Phase.SERVING, Phase.REFUSING) and status.served_version == version


def test_a_megatron_rank_that_cannot_read_its_part_of_a_gather_fails_the_sync_at_once_and_the_group_syncs_on(
        actors_factory):
    """Found by review: a TP rank whose read of its columns of a row-parallel weight raised, before the gather's first
    collective, joined no more gathers; its error reached the driver, but its peer waited in the all-gather until the
    group's timeout, which broke the gloo group for good, so the next sync failed too."""
    import time

    from refit.engine import Phase
    from tests.support.faults import unreadable_part

    group = actors_factory.megatron_group(model_dir(False, "bf16"), MegatronParallel(tp=2), nodes=(0, 1), timeout_s=60)
    replica = actors_factory.rollout(model_dir(False, "fp8_block"), node=2, **FP8_DUMMY)
    config = refit.SyncConfig(transport="ray", bucket_bytes=256 << 10, timeout_s=60)
    version = refit.sync(group, [replica], config).version
    o_proj = "model.layers.1.self_attn.o_proj.weight"
    run_in(group.ranks[1], unreadable_part, o_proj)
    start = time.monotonic()
    try:
        with pytest.raises(Exception, match=o_proj):  # rank 1's cause, or its peer's error naming it
            refit.sync(group, [replica], config)
    finally:
        run_in(group.ranks[1], unreadable_part, None)
    assert time.monotonic() - start < 30  # at once, not at the group's timeout
    status = ray.get(replica.status.remote(), timeout=30)
    assert status.phase in (Phase.SERVING, Phase.REFUSING) and status.served_version == version  # never a mix
    assert refit.sync(group, [replica], config).replicas[0].served_version is not None


def test_a_nan_in_a_fused_parameter_is_refused_naming_the_tensor_that_holds_it_and_the_group_syncs_on(actors_factory):
    """Found by review: the refusal named the first tensor cut from the parameter (q_proj, for a NaN in the v rows of
    `linear_qkv`), and checked the parameter once per tensor cut from it."""
    import re

    group = actors_factory.megatron_group(model_dir(False, "bf16"), MegatronParallel(tp=2), nodes=(0, 1), timeout_s=30)
    replica = actors_factory.rollout(model_dir(False, "fp8_block"), node=2, **FP8_DUMMY)
    v = "model.layers.1.self_attn.v_proj.weight"
    assert group.apply([v], lambda part: torch.full_like(part, float("nan"))) == 2  # each TP rank's v rows
    with pytest.raises(refit.InvalidTensorError, match=re.escape(v) + r" holds NaN or Inf on rank [01] \(in its megatron"):
        refit.sync(group, [replica], CONFIG)
    group.apply([v], torch.zeros_like)
    assert refit.sync(group, [replica], CONFIG).replicas[0].served_version is not None


def test_a_megatron_model_of_another_shape_is_refused_naming_the_tensor(actors_factory, tmp_path):
    bf16, _ = write_variant(model_dir(False, "bf16"), tmp_path, seed=5, intermediate_size=384)
    group = actors_factory.megatron_group(bf16, MegatronParallel(tp=2), nodes=(0, 1))
    replica = actors_factory.rollout(model_dir(False, "fp8_block"), node=2, **FP8_DUMMY)
    with pytest.raises(refit.PlanMismatchError, match=r"model.layers.0.mlp.gate_proj.weight: shape \(384, 256\) from the "
                                                      r"trainer, \(512, 256\) in the rollout's model"):
        refit.sync(group, [replica])
