"""Streamed attention scales: what `refuse_invalid_scales` lets through to the engine (pure logic)."""

import pytest
import torch

from refit.errors import InvalidTensorError
from refit.provenance import refuse_invalid_scales

K_SCALE = "model.layers.0.self_attn.k_scale"


@pytest.mark.parametrize(("value", "shown"), [(0.0, "min 0"), (-0.5, "min -0.5"), (float("nan"), "min nan"), (float("inf"), "")])
def test_an_attention_scale_that_is_not_finite_and_positive_is_refused_by_name(value, shown):
    with pytest.raises(InvalidTensorError, match=rf"{K_SCALE}: streamed scale holds non-positive or non-finite values.*{shown}"):
        refuse_invalid_scales([("model.layers.0.mlp.down_proj.weight", torch.zeros(4, 4)), (K_SCALE, torch.tensor(value))])


def test_valid_attention_scales_and_tensors_that_are_not_attention_scales_pass():
    refuse_invalid_scales([(K_SCALE, torch.tensor(0.02, dtype=torch.bfloat16)),
                           ("model.layers.0.self_attn.v_scale", torch.tensor([0.5, 1.0])),
                           ("model.layers.0.mlp.down_proj.weight", torch.full((2, 2), -1.0))])
