"""A rank's finite check names the tensor that holds the NaN, also inside a fused parameter (one process, a real
transformers MoE; the sharded refusal across ranks: tests/sync/test_sharded_trainer.py)."""

from __future__ import annotations

import pytest
import torch

from refit.errors import InvalidTensorError
from refit.plan import RolloutModelInfo, SyncConfig, make_plan
from refit.sharding.dtensor_layout import DTensorLayout
from tests.support.fakes import FP8_BLOCK


def test_a_nan_in_one_expert_of_a_fused_parameter_names_that_expert():
    """Found by review: the refusal named the first tensor cut from the parameter (expert 0)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2, head_dim=32)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    layout = DTensorLayout(model)
    plan = make_plan(layout.metadata(), RolloutModelInfo(FP8_BLOCK, False), SyncConfig())
    layout.check_finite(plan, 0)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[2, 5, 7] = float("nan")
    with pytest.raises(InvalidTensorError, match=r"model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight holds NaN or Inf on rank 0$"):
        layout.check_finite(plan, 0)
