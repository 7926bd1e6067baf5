"""refit's layer order equals vLLM's `layerwise_groups`, flattened (refit keeps vLLM off the driver)."""

import random

import pytest

from refit.plan.transfer_plan import _layer_order

NAMES = [
    "model.embed_tokens.weight",
    *(f"model.layers.{i}.{p}" for i in range(12) for p in ("self_attn.q_proj.weight", "mlp.experts.3.down_proj.weight")),
    "model.norm.weight",
    "lm_head.weight",
    *(f"visual.blocks.{i}.attn.weight" for i in range(3)),
]


@pytest.mark.engine  # imports vLLM
@pytest.mark.parametrize("seed", range(5))
def test_same_order_as_vllm_layerwise_groups(seed):
    from vllm.distributed.weight_transfer.base import layerwise_groups

    names = list(NAMES)
    if seed:
        random.Random(seed).shuffle(names)
    assert _layer_order(names) == [n for group in layerwise_groups(names) for n in group]
