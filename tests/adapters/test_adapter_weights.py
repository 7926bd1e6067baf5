"""An adapter as a sync carries it: its plain form, its digest, and the checks against a base (pure logic)."""

from __future__ import annotations

import pytest
import torch

from refit.adapters import AdapterWeights, check_adapter, check_values, lora_module
from refit.errors import ConfigError, InvalidTensorError
from refit.plan.expected_weights import ExpectedWeight

BASE = (ExpectedWeight("model.layers.0.self_attn.q_proj.weight", (256, 128), True),
        ExpectedWeight("model.layers.0.mlp.down_proj.weight", (128, 512), True))
PREFIX = "base_model.model.model.layers.0."


def adapter(rank: int = 4, **tensors: torch.Tensor) -> AdapterWeights:
    gen = torch.Generator().manual_seed(rank)
    made = {
        PREFIX + "self_attn.q_proj.lora_A.weight": torch.randn(rank, 128, generator=gen),
        PREFIX + "self_attn.q_proj.lora_B.weight": torch.randn(256, rank, generator=gen),
        PREFIX + "mlp.down_proj.lora_A.weight": torch.randn(rank, 512, generator=gen),
        PREFIX + "mlp.down_proj.lora_B.weight": torch.randn(128, rank, generator=gen),
    }
    made.update({PREFIX + k.replace("__", "."): v for k, v in tensors.items()})
    return AdapterWeights("policy", {"r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "down_proj"]}, made)


def test_the_plain_form_round_trips_bit_for_bit_and_keeps_the_digest():
    original = adapter()
    back = AdapterWeights.from_plain(original.to_plain())
    assert back.name == "policy" and back.config == original.config
    assert all(torch.equal(back.tensors[n], t) for n, t in original.tensors.items())
    assert back.digest() == original.digest() == original.meta().digest
    assert original.meta(digest=False).digest is None  # a check of shapes alone does not hash the bytes
    assert original.meta().nbytes == sum(t.numel() * 4 for t in original.tensors.values())
    changed = adapter(**{"mlp__down_proj.lora_B.weight": torch.zeros(128, 4)})
    assert changed.digest() != original.digest()


def test_an_adapter_that_fits_the_base_passes():
    check_adapter(adapter().meta(), BASE, max_rank=8)
    check_adapter(adapter().meta(), None, max_rank=8)  # an unknown base: only the adapter's own consistency


@pytest.mark.parametrize("bad, error, match", [
    (lambda: adapter(rank=16).meta(), ConfigError, "rank 16 is above the engine's max_lora_rank 8"),
    (lambda: adapter(**{"mlp__down_proj.lora_A.weight": torch.zeros(4, 256)}).meta(), InvalidTensorError,
     r"mlp\.down_proj\.lora_A/B\.weight: lora_B @ lora_A is \[128, 256\], but the base weight"),
    (lambda: adapter(**{"mlp__up_proj.lora_A.weight": torch.zeros(4, 128)}).meta(), InvalidTensorError,
     "module 'model.layers.0.mlp.up_proj' has no lora_B tensor"),
    (lambda: adapter(**{"mlp__gate_proj.lora_A.weight": torch.zeros(4, 128),
                        "mlp__gate_proj.lora_B.weight": torch.zeros(512, 4)}).meta(), InvalidTensorError,
     "the rollout's model has no weight 'model.layers.0.mlp.gate_proj.weight'"),
    (lambda: adapter(**{"self_attn__q_proj.lora_B.weight": torch.zeros(256, 2)}).meta(), InvalidTensorError,
     "lora_A has rank 4, lora_B 2"),
    (lambda: adapter(**{"self_attn__q_proj.weight": torch.zeros(256, 128)}).meta(), InvalidTensorError,
     "is not a LoRA weight as PEFT names it"),
])
def test_a_bad_adapter_is_refused_naming_the_tensor_or_setting(bad, error, match):
    with pytest.raises(error, match=match):
        check_adapter(bad(), BASE, max_rank=8)


def test_a_bad_name_or_rank_setting_and_non_finite_values_are_refused():
    good = adapter()
    with pytest.raises(ConfigError, match="adapter name 'my adapter'"):
        check_adapter(AdapterWeights("my adapter", good.config, good.tensors).meta(), BASE, max_rank=8)
    with pytest.raises(ConfigError, match="config r=0"):
        check_adapter(AdapterWeights("policy", {**good.config, "r": 0}, good.tensors).meta(), BASE, max_rank=8)
    with pytest.raises(InvalidTensorError, match="must share one of"):
        AdapterWeights("policy", good.config, {**good.tensors, PREFIX + "x.lora_A.weight": torch.zeros(4, 2, dtype=torch.int8)}).meta()
    poisoned = adapter(**{"mlp__down_proj.lora_B.weight": torch.full((128, 4), float("nan"))})
    with pytest.raises(InvalidTensorError, match=r"'base_model\.model\.model\.layers\.0\.mlp\.down_proj\.lora_B\.weight' holds non-finite"):
        check_values(poisoned)
    with pytest.raises(InvalidTensorError, match="not an adapter's plain form"):
        AdapterWeights.from_plain({"name": "policy", "config": {}, "tensors": [["a", "int3", [1], b"x"]]})


@pytest.mark.parametrize("setting, match", [
    ({"lora_alpha": float("nan")}, r"config lora_alpha=nan, expected a finite number"),
    ({"lora_alpha": float("inf")}, r"config lora_alpha=inf, expected a finite number"),
    ({"lora_alpha": "16"}, r"config lora_alpha='16', expected a finite number"),
    ({"alpha_pattern": {"q_proj": float("nan")}}, r"config alpha_pattern\['q_proj'\]=nan, expected a finite number"),
], ids=["nan", "inf", "str", "nan-pattern"])
def test_a_scaling_that_is_no_finite_number_is_refused_before_anything_is_sent(setting, match):
    """vLLM scales every LoRA output by lora_alpha / r (PEFTHelper) and checks neither: a NaN alpha passed every check
    (the tensors were finite) and the replicas served NaN logits from the swap on."""
    good = adapter()
    with pytest.raises(ConfigError, match=match):
        check_adapter(AdapterWeights("policy", {**good.config, **setting}, good.tensors).meta(), BASE, max_rank=8)


def test_lora_module_names_the_module_and_the_half():
    assert lora_module(PREFIX + "self_attn.q_proj.lora_B.weight") == ("model.layers.0.self_attn.q_proj", "B")


def test_what_a_peft_state_dict_holds_beside_lora_weights_or_mixed_dtypes_are_refused_naming_the_tensor():
    """Found: modules_to_save, or LoRA on lm_head or the embedding, put a base-dtype tensor in peft's state dict; the
    source refused it with "must share one of [...], not ['bfloat16', 'float32']", naming neither tensor nor module."""
    good = adapter()
    lm_head = torch.zeros(8, 4, dtype=torch.bfloat16)
    saved = AdapterWeights("policy", good.config, {**good.tensors, "base_model.model.lm_head.weight": lm_head})
    with pytest.raises(InvalidTensorError, match=r"'base_model\.model\.lm_head\.weight' is not a LoRA weight"):
        saved.meta()
    half = adapter(**{"mlp__down_proj.lora_B.weight": torch.zeros(128, 4, dtype=torch.bfloat16)})
    with pytest.raises(InvalidTensorError, match=r"bfloat16: \['base_model\.model\.model\.layers\.0\.mlp\.down_proj\.lora_B\.weight'\]"):
        half.meta()
    with pytest.raises(InvalidTensorError, match="adapter 'policy' has no tensors"):
        AdapterWeights("policy", good.config, {}).meta()
