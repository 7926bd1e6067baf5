"""MTP layers: speculative layers a target's own checkpoint holds, and how each architecture names them there.

A replica started with vLLM's `method="mtp"` drafts with these layers, but
vLLM loads them into a drafter model of its own, not into the target (whose
loader skips them). So a sync must know which of the checkpoint's tensors
are the drafter's: it plans them as the draft's, against the drafter's
expected weights, and they travel as `draft.` + their checkpoint name
(docs/draft.md). A trainer names them as the checkpoint does.

Only architectures whose naming refit knows are synced; an MTP engine of
another one is refused where its facts are read (`mtp_prefixes`), rather
than served with layers no sync updates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from refit.errors import ConfigError

__all__ = ["mtp_layer_weights", "mtp_prefixes"]

_MIMO = "MiMoForCausalLM"
# A MiMo MTP layer beside its Qwen2 decoder block (whose weights it names as a decoder layer's): suffix -> shape,
# from the hidden size. input_proj is a plain linear in vLLM, never quantized.
_MIMO_OWN = {"token_layernorm.weight": lambda h: (h,), "hidden_layernorm.weight": lambda h: (h,),
             "final_layernorm.weight": lambda h: (h,), "input_proj.weight": lambda h: (h, 2 * h)}


def _architecture(config: Mapping[str, Any]) -> str | None:
    architectures = config.get("architectures") or [None]
    return architectures[0]


def mtp_prefixes(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Where a checkpoint with this `config.json` holds its MTP layers, one prefix per layer.

    Raises `ConfigError` naming the architecture when refit does not know it, or when the config names none.
    """
    architecture, layers = _architecture(config), int(config.get("num_nextn_predict_layers") or 0)
    if architecture != _MIMO:
        raise ConfigError(
            f"speculative method 'mtp' on a {architecture} checkpoint: refit does not know how it names its MTP layers "
            f"(it knows {_MIMO}'s), so a sync would leave the drafter stale; serve it without method='mtp'")
    if layers < 1:
        raise ConfigError(f"speculative method 'mtp': the {architecture} checkpoint's config has "
                          f"num_nextn_predict_layers={layers}, so it holds no MTP layer")
    return tuple(f"model.mtp_layers.{i}." for i in range(layers))


def mtp_layer_weights(config: Mapping[str, Any], decoder_layer: Mapping[str, tuple[tuple[int, ...], bool]],
                      ) -> list[tuple[str, tuple[int, ...], bool]]:
    """The MTP layers' (name, shape, FP8_BLOCK) for a checkpoint known from its config alone (a dummy load).

    `decoder_layer`: the target's first decoder layer's weights, by suffix, as (shape, FP8_BLOCK): a MiMo MTP
    layer's block is one. Empty for an architecture without MTP layers refit knows.
    """
    if _architecture(config) != _MIMO or not config.get("num_nextn_predict_layers"):
        return []
    hidden = int(config["hidden_size"])
    weights = []
    for prefix in mtp_prefixes(config):
        weights += [(prefix + suffix, shape, fp8) for suffix, (shape, fp8) in decoder_layer.items()]
        weights += [(prefix + suffix, shape(hidden), False) for suffix, shape in _MIMO_OWN.items()]
    return weights
