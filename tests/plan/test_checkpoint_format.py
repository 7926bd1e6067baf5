"""Trainer models in the rollout's checkpoint format, and MoE plans checked against the rollout. No Ray, no engine.

The MoE trainer is the fixture's Qwen3-MoE as transformers 5 holds it (fused
3-D experts); the rollout side is llmcompressor's FP8_BLOCK checkpoint of it
(per-expert FP8 weights), so both layouts are the real ones.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from fixtures import model_dir
from refit.errors import InvalidTensorError, PlanMismatchError
from refit.plan import CheckpointView, RolloutModelInfo, SyncConfig, TensorMeta, describe_weights, make_plan, produce_buckets
from refit.quantizer.fp8_block import dequantize_fp8_block
from tests.support.checkpoints import TINY, TINY_ROUTED_MOE

MOE = dict(tied=False, arch="qwen3_moe")
EXPERTS = 4


def moe_trainer(**config_changes) -> torch.nn.Module:
    if not config_changes:
        return AutoModelForCausalLM.from_pretrained(model_dir(variant="bf16", **MOE), dtype=torch.bfloat16)
    config = AutoConfig.from_pretrained(model_dir(variant="bf16", **MOE))
    for key, value in config_changes.items():
        setattr(config, key, value)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def moe_rollout(*, from_files: bool = True) -> RolloutModelInfo:
    return RolloutModelInfo.from_checkpoint(model_dir(variant="fp8_block", **MOE), from_files=from_files)


def checkpoint_names(variant: str) -> dict[str, tuple[int, ...]]:
    with safe_open(str(model_dir(variant=variant, **MOE) / "model.safetensors"), "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)


def test_fused_experts_are_described_per_expert_exactly_as_save_pretrained_writes_them():
    model = moe_trainer()
    assert tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape) == (EXPERTS, 512, 256)  # fused in memory
    described = {m.name: m.shape for m in describe_weights(model)}
    assert described == checkpoint_names("bf16")
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in described
    experts = [m for m in describe_weights(model) if ".experts." in m.name]
    assert len(experts) == 2 * EXPERTS * 3 and all(m.module_classes == ("Linear",) for m in experts)


def test_expert_tensors_are_views_of_the_fused_parameter_with_the_saved_values():
    """No copy of a layer's experts is made to read one of them; the values are the checkpoint's."""
    model = moe_trainer()
    view = CheckpointView(model)
    with safe_open(str(model_dir(variant="bf16", **MOE) / "model.safetensors"), "pt") as f:
        for expert in range(EXPERTS):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"model.layers.1.mlp.experts.{expert}.{proj}.weight"
                piece = view.tensor(name)
                assert torch.equal(piece, f.get_tensor(name)), name
                experts = model.model.layers[1].mlp.experts
                fused = experts.down_proj if proj == "down_proj" else experts.gate_up_proj
                assert piece.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr(), name
    with pytest.raises(KeyError):
        view.tensor("model.layers.1.mlp.experts.gate_up_proj")  # the in-memory name is not a checkpoint name


@pytest.mark.parametrize("from_files", [True, False], ids=["checkpoint-headers", "config-only"])
def test_moe_plan_sends_every_expert_fp8_block_and_the_router_in_bf16(from_files):
    plan = make_plan(describe_weights(moe_trainer()), moe_rollout(from_files=from_files), SyncConfig(bucket_bytes=1 << 20))
    forms = {t.target: t.is_quantized for t in plan.tensors}
    assert {n for n, q in forms.items() if q and ".experts." in n} == {
        f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
        for layer in range(2) for e in range(EXPERTS) for proj in ("gate_proj", "up_proj", "down_proj")
    }
    assert not forms["model.layers.0.mlp.gate.weight"] and not forms["lm_head.weight"]


def test_moe_buckets_hold_exactly_the_llmcompressor_checkpoint():
    plan = make_plan(describe_weights(moe_trainer()), moe_rollout(), SyncConfig(bucket_bytes=1 << 20))
    sent = {name: value for bucket in produce_buckets(plan, CheckpointView(moe_trainer()).tensor) for name, value in bucket.unpack()}
    with safe_open(str(model_dir(variant="fp8_block", **MOE) / "model.safetensors"), "pt") as f:
        assert set(sent) == set(f.keys())
        for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            expected = f.get_tensor(name)
            as_bits = (lambda t: t.view(torch.uint8)) if expected.dtype == torch.float8_e4m3fn else (lambda t: t)
            assert sent[name].dtype == expected.dtype and torch.equal(as_bits(sent[name]), as_bits(expected)), name


def refusal(metas: list[TensorMeta]) -> str:
    with pytest.raises(PlanMismatchError) as error:
        make_plan(metas, moe_rollout(), SyncConfig(bucket_bytes=1 << 20))
    assert "nothing was sent" in str(error.value)
    return str(error.value)


def test_a_renamed_missing_extra_or_reshaped_expert_is_refused_by_name():
    metas = {m.name: m for m in describe_weights(moe_trainer())}
    renamed = metas.pop("model.layers.0.mlp.experts.1.up_proj.weight")
    metas["model.layers.0.mlp.experts.1.upper_proj.weight"] = TensorMeta(
        "model.layers.0.mlp.experts.1.upper_proj.weight", renamed.shape, renamed.dtype, renamed.module_classes)
    del metas["model.layers.1.mlp.experts.2.down_proj.weight"]
    metas["model.layers.1.mlp.experts.4.down_proj.weight"] = TensorMeta(
        "model.layers.1.mlp.experts.4.down_proj.weight", (256, 256), "bfloat16", ("Linear",))
    gate = metas["model.layers.1.mlp.experts.0.gate_proj.weight"]
    metas[gate.name] = TensorMeta(gate.name, (384, 256), gate.dtype, gate.module_classes)
    message = refusal(list(metas.values()))
    assert "model.layers.0.mlp.experts.1.upper_proj.weight: the rollout's model has no such weight" in message
    assert "model.layers.0.mlp.experts.1.up_proj.weight: the rollout's model has it, the trainer sends nothing" in message
    assert "model.layers.1.mlp.experts.2.down_proj.weight: the rollout's model has it, the trainer sends nothing" in message
    assert "model.layers.1.mlp.experts.4.down_proj.weight: the rollout's model has no such weight" in message
    assert "model.layers.1.mlp.experts.0.gate_proj.weight: shape (384, 256) from the trainer, (256, 256)" in message


def test_a_trainer_with_another_expert_count_is_refused_naming_the_experts_and_routers():
    message = refusal(describe_weights(moe_trainer(num_experts=6)))
    assert "model.layers.0.mlp.experts.5.gate_proj.weight: the rollout's model has no such weight" in message
    assert "model.layers.0.mlp.gate.weight: shape (6, 256) from the trainer, (4, 256)" in message
    assert "14 problem(s)" in message  # per layer: experts 4 and 5 (3 projections each), the router


def test_a_trainer_with_another_expert_width_is_refused():
    message = refusal(describe_weights(moe_trainer(moe_intermediate_size=384)))
    assert "model.layers.0.mlp.experts.0.down_proj.weight: shape (256, 384) from the trainer, (256, 256)" in message


@pytest.mark.parametrize("arch, tied", [("llama", True), ("llama", False)], ids=["llama-tied", "llama-untied"])
def test_dense_llama_plans_against_its_llmcompressor_checkpoint(arch, tied):
    model = AutoModelForCausalLM.from_pretrained(model_dir(tied, "bf16", arch=arch), dtype=torch.bfloat16)
    rollout = RolloutModelInfo.from_checkpoint(model_dir(tied, "fp8_block", arch=arch), from_files=True)
    plan = make_plan(describe_weights(model), rollout, SyncConfig(bucket_bytes=1 << 20))
    assert sum(t.is_quantized for t in plan.tensors) == 14
    sent = {t.target for t in plan.tensors}
    assert (("lm_head.weight", "model.embed_tokens.weight") in plan.copies) == tied == ("lm_head.weight" not in sent)


def test_dequantizing_stacked_experts_equals_dequantizing_each():
    codes = torch.randn(3, 256, 384).to(torch.float8_e4m3fn)
    scales = torch.rand(3, 2, 3, dtype=torch.bfloat16)
    stacked = dequantize_fp8_block(codes, scales)
    for e in range(3):
        assert torch.equal(stacked[e], dequantize_fp8_block(codes[e], scales[e]))


def test_fp32_master_weights_are_described_and_read_in_the_wire_dtype():
    """A trainer holding fp32 masters (FSDP2 mixed precision) streams bf16: experts, pieces and all."""
    model = moe_trainer().float()
    view = CheckpointView(model, wire_dtype=torch.bfloat16)
    assert {m.dtype for m in view.metadata()} == {"bfloat16"}
    assert [m.name for m in view.metadata()] == [m.name for m in describe_weights(moe_trainer())]
    reference = CheckpointView(moe_trainer())
    for name in ("model.layers.1.mlp.experts.2.up_proj.weight", "model.embed_tokens.weight"):
        value = view.tensor(name)
        assert value.dtype == torch.bfloat16 and torch.equal(value, reference.tensor(name))  # bf16 -> fp32 -> bf16 is exact
    assert CheckpointView(model).tensor("model.embed_tokens.weight").dtype == torch.float32  # no wire dtype: as held


def test_a_parameter_the_save_conversion_only_renames_keeps_its_module_class():
    """A multimodal model's language model is moved under `model.` on save (a rename), and GraniteMoE's fused
    experts keep their 3-D form under a checkpoint name: neither is a Linear layer in the checkpoint format, so an
    FP8_BLOCK plan quantizes the projections and leaves norms, the embedding and 3-D experts as they are
    (regression: every renamed parameter was described as a Linear one, norms and embeddings included)."""
    from transformers import GraniteMoeConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    vision = dict(depth=1, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=256, fullatt_block_indexes=[0])
    with torch.device("meta"):
        vlm = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}}, vision_config=vision,
            image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503))
        granite = AutoModelForCausalLM.from_config(GraniteMoeConfig(**{**text, "intermediate_size": 256}, num_local_experts=4,
                                                                   num_experts_per_tok=2))
    scheme = RolloutModelInfo.from_checkpoint(model_dir(True, "fp8_block"), from_files=True).quantization_config

    plan = make_plan(describe_weights(vlm), RolloutModelInfo(scheme, False), SyncConfig(check_against_rollout=False))
    quantized = {t.target for t in plan.tensors if t.block is not None}
    assert "model.layers.0.self_attn.q_proj.weight" in quantized  # renamed from model.language_model.layers.0...
    assert not quantized & {"model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight"}

    plan = make_plan(describe_weights(granite), RolloutModelInfo(scheme, False), SyncConfig(check_against_rollout=False))
    experts = {t.target: t.block for t in plan.tensors if ".block_sparse_moe." in t.target}
    assert experts == dict.fromkeys(["model.layers.0.block_sparse_moe.input_linear.weight",
                                     "model.layers.0.block_sparse_moe.output_linear.weight",
                                     "model.layers.0.block_sparse_moe.router.layer.weight"])
    assert {t.target for t in plan.tensors if t.block is not None} >= {"model.layers.0.self_attn.q_proj.weight"}


def _tiny(model_type: str, **changes) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**TINY, **changes}))


@pytest.mark.parametrize("model", [
    pytest.param(lambda: _tiny("glm4_moe", **TINY_ROUTED_MOE), id="glm4-moe"),
    pytest.param(lambda: _tiny("apertus"), id="apertus"),
])
def test_persistent_buffers_are_checkpoint_tensors_as_save_pretrained_writes_them(model, tmp_path):
    """GLM-4-MoE's router bias (`e_score_correction_bias`) and Apertus' xIELU constants are buffers that checkpoints
    hold and vLLM loads (regression: only parameters were sent, so a dummy-loaded engine kept dummy router biases and
    the layerwise reload left Apertus' constants uninitialized); non-persistent buffers (rotary tables) are not."""
    model = model()
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (not iterable)
    view = CheckpointView(model)
    assert {m.name: m.shape for m in view.metadata() if m.alias_of is None} == saved
    buffers = dict(model.named_buffers())
    persistent = [name for name in saved if name in buffers]
    assert persistent and not any("rotary" in name for name in saved)
    for name in persistent:
        assert view.tensor(name) is buffers[name]  # the live buffer: a change the trainer makes is what is sent
    # fp32 master weights stream in the wire dtype; a buffer, which mixed precision leaves alone, in its own
    masters = {m.name: m.dtype for m in CheckpointView(model.float(), wire_dtype=torch.bfloat16).metadata()}
    assert {masters[name] for name in persistent} == {"float32"}
    assert masters["model.layers.0.self_attn.q_proj.weight"] == "bfloat16"


def test_a_buffer_save_pretrained_leaves_out_is_not_described():
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4))
            self.register_buffer("table", torch.arange(4.0), persistent=False)
            self.register_buffer("ignored", torch.zeros(2))

    block = Block()
    block._keys_to_ignore_on_save = {"ignored"}
    assert [m.name for m in describe_weights(block)] == ["proj.weight", "proj.bias", "scale"]


def test_a_buffer_in_a_dtype_no_bucket_carries_is_refused_at_plan_time_by_name():
    """Buffers keep their own dtype, and int16 or uint32 have no place in a bucket (regression: the plan was made and
    the sync failed at packing, mid-stream)."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.register_buffer("counts", torch.zeros(4, dtype=torch.int16))
            self.register_buffer("ids", torch.zeros(2, dtype=torch.uint32))

    with pytest.raises(InvalidTensorError, match="cannot plan the transfer") as error:
        make_plan(describe_weights(Block()), RolloutModelInfo(None, False), SyncConfig(check_against_rollout=False))
    assert "counts: dtype int16 cannot travel in a refit bucket" in str(error.value)
    assert "ids: dtype uint32 cannot travel" in str(error.value)


def test_a_module_registered_under_two_paths_plans_its_second_path_as_an_alias():
    """Regression: parameters were listed under every path (remove_duplicate=False) but modules under their first
    only, so a module shared by two paths (Zamba2's shared transformer blocks) raised a raw KeyError."""
    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Module()
    model.first, model.second = torch.nn.Sequential(shared), torch.nn.Sequential(shared)
    metas = {m.name: m for m in describe_weights(model)}
    assert metas["second.0.weight"].alias_of == "first.0.weight" and metas["second.0.weight"].module_classes[0] == "Linear"
    plan = make_plan(list(metas.values()), RolloutModelInfo(None, False), SyncConfig(check_against_rollout=False))
    assert dict(plan.copies) == {"second.0.weight": "first.0.weight", "second.0.bias": "first.0.bias"}


def test_a_ranks_layout_reads_every_checkpoint_tensor_in_its_described_shape_scalar_buffers_too():
    """A trainer rank reads what it holds by rows (`DTensorLayout.rows`); Apertus' 0-d xIELU buffers are one row
    there (regression: they went out as shape (1,), and the replica refused the bucket)."""
    from refit.sharding.dtensor_layout import DTensorLayout

    layout = DTensorLayout(_tiny("apertus"))
    metas = [m for m in layout.metadata() if m.alias_of is None]
    assert any(m.shape == () for m in metas)
    for meta in metas:
        held = layout.held(meta.name)
        assert held == (0, meta.shape[0] if meta.shape else 1), meta.name  # one process holds all of it
        assert tuple(layout.rows(meta.name, *held).shape) == meta.shape, meta.name
