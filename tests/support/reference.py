"""Independent reference measurements on a transformers model.

`attention_amax` measures what refit's KV-scale recompute measures inside
vLLM, but through Hugging Face's own modules: q and k after their per-head
norm and RoPE, v after its projection. Written for Qwen3-style attention
(q_norm/k_norm), the fixtures' architecture.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["attention_amax"]


@torch.no_grad()
def attention_amax(model: torch.nn.Module, prompts: Sequence[Sequence[int]]) -> dict[str, float]:
    """`{"<layer>.<q|k|v>_scale": amax}` over every token of `prompts`."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    amax: dict[str, float] = {}

    def hook_for(layer: int):
        def measure(attention: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            heads = (*hidden.shape[:-1], -1, attention.head_dim)
            q = attention.q_norm(attention.q_proj(hidden).view(heads)).transpose(1, 2)
            k = attention.k_norm(attention.k_proj(hidden).view(heads)).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            for scale, tensor in (("q_scale", q), ("k_scale", k), ("v_scale", attention.v_proj(hidden))):
                key = f"{layer}.{scale}"
                amax[key] = max(amax.get(key, 0.0), float(tensor.abs().amax()))

        return measure

    handles = [
        layer.self_attn.register_forward_pre_hook(hook_for(i), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        model.eval()
        for prompt in prompts:
            model(input_ids=torch.tensor([list(prompt)]))
    finally:
        for handle in handles:
            handle.remove()
    return amax
