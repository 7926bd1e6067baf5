"""Merge mode (`MergedLora`) against peft's own `merge_and_unload`, bit for bit, on a real transformers model with
a real peft adapter; what it cannot merge is refused by name. The sync itself: tests/sync/test_lora_sync.py."""

from __future__ import annotations

import copy

import pytest
import torch

from refit.adapters.peft_source import MergedLora
from refit.errors import ConfigError
from refit.plan.checkpoint_format import CheckpointView

pytest.importorskip("peft")


def peft_model(**settings):
    """A tiny random Qwen2 (q/k/v biases) in bf16 under a peft LoRA adapter whose every trained tensor is nonzero."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "init_lora_weights": False}
    model = get_peft_model(Qwen2ForCausalLM(config).to(torch.bfloat16), LoraConfig(**lora | settings))
    with torch.no_grad():  # as after training: DoRA's magnitudes, a LoRA bias and a module trained whole all moved
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.mark.parametrize("settings", [
    {},
    {"use_dora": True},
    {"lora_bias": True, "target_modules": ["q_proj", "k_proj"]},
    {"modules_to_save": ["lm_head"]},
    {"target_modules": ["embed_tokens", "q_proj"]},
], ids=["lora", "dora", "lora-bias", "modules-to-save", "embedding"])
def test_every_tensor_is_what_merge_and_unload_holds_under_the_base_checkpoints_names(settings):
    """Found: DoRA's magnitudes, LoRA biases, an Embedding's LoRA and a module trained whole were sent unmerged (the
    last under peft's wrapper names), so a merge-mode rollout served the frozen base there."""
    model = peft_model(**settings)
    merged = MergedLora(model)
    expected = CheckpointView(copy.deepcopy(model).merge_and_unload())
    assert [m.name for m in merged.metadata()] == [m.name for m in expected.metadata()]
    differ = [m.name for m in expected.metadata() if not torch.equal(merged.tensor(m.name), expected.tensor(m.name))]
    assert not differ
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), peft_model(**settings).state_dict().values()))


def test_what_merge_mode_cannot_merge_is_refused_naming_the_module():
    with pytest.raises(ConfigError, match=r"model\.embed_tokens \(TrainableTokensWrapper\).*sync_adapter"):
        MergedLora(peft_model(trainable_token_indices=[1, 2]))


def test_a_module_another_adapter_trains_whole_is_sent_as_the_frozen_original_under_its_own_name():
    """Found by review: a modules_to_save wrapper without a copy for the active adapter had its module left out."""
    from peft import LoraConfig

    model = peft_model()
    model.add_adapter("other", LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    model.set_adapter("default")
    merged = MergedLora(model)
    expected = CheckpointView(copy.deepcopy(model).merge_and_unload())
    assert "lm_head.weight" in [m.name for m in merged.metadata()]
    assert [m.name for m in merged.metadata()] == [m.name for m in expected.metadata()]
    assert all(torch.equal(merged.tensor(m.name), expected.tensor(m.name)) for m in expected.metadata())


def test_what_the_model_holds_now_is_merged_after_its_base_is_replaced_or_another_adapter_made_active():
    """Found: the view read the base's tensor objects captured when it was made, so after `load_state_dict(...,
    assign=True)` merge mode sent the replaced base; and it kept merging the adapter active then."""
    from peft import LoraConfig

    model = peft_model()
    merged = MergedLora(model)
    replaced = {name: value + 1 for name, value in model.state_dict().items() if ".lora_" not in name}
    model.load_state_dict(replaced, strict=False, assign=True)
    expected = CheckpointView(copy.deepcopy(model).merge_and_unload())
    assert [m.name for m in expected.metadata() if not torch.equal(merged.tensor(m.name), expected.tensor(m.name))] == []

    model.add_adapter("other", LoraConfig(r=2, target_modules=["k_proj"], init_lora_weights=False))
    model.set_adapter("other")
    expected = CheckpointView(copy.deepcopy(model).merge_and_unload())
    assert [m.name for m in expected.metadata() if not torch.equal(merged.tensor(m.name), expected.tensor(m.name))] == []


def test_a_rollout_that_serves_lora_is_planned_the_base_unmerged_which_is_what_peft_unload_holds():
    """A LoRA rollout applies the adapter itself: the plan for it says so, through every form it travels in (to the
    trainer pickled, in the replica's facts as JSON), and `unmerged` is the base as the trainer holds it."""
    import dataclasses
    import json
    import pickle

    from refit.engine.facts import _info_from_plain, _info_to_plain
    from refit.orchestration.membership import check_same_model
    from refit.plan import RolloutModelInfo, SyncConfig, make_plan

    model = peft_model()
    merged = MergedLora(model)
    expected = CheckpointView(copy.deepcopy(model).unload())
    assert [m.name for m in expected.metadata() if not torch.equal(merged.unmerged(m.name), expected.tensor(m.name))] == []
    lora = dataclasses.replace(RolloutModelInfo(None, False), serves_lora=True)
    assert _info_from_plain(json.loads(json.dumps(_info_to_plain(lora)))) == lora
    plan = make_plan(merged.metadata(), lora, SyncConfig())
    assert pickle.loads(pickle.dumps(plan.for_sync(None))).lora_served
    assert not make_plan(merged.metadata(), RolloutModelInfo(None, False), SyncConfig()).lora_served
    with pytest.raises(ConfigError, match="LoRA on or off"):  # one plan cannot serve both kinds
        check_same_model([("replica 0", lora), ("replica 1", RolloutModelInfo(None, False))])


def test_the_metadata_describes_what_the_model_holds_now_as_its_tensors_do():
    """Found by review: `tensor` re-read a model changed since merge mode was made, `metadata` did not, so a new plan
    (what a refused sync says to make) described the old base again, and the same tensors were refused again."""
    model = peft_model()
    merged = MergedLora(model)
    merged.metadata()
    replaced = {name: value.float() for name, value in model.state_dict().items() if ".lora_" not in name}
    model.load_state_dict(replaced, strict=False, assign=True)
    described = {m.name: m.dtype for m in merged.metadata()}
    assert {name: str(merged.unmerged(name).dtype).removeprefix("torch.") for name in described} == described
    assert set(described.values()) == {"float32"}
