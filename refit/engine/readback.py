"""Reading an engine's FP8 weight scales back after a refit and comparing them with what the sync sent.

Why: integrity tags prove the bytes reached the replica as sent; this proves they are
what the engine holds once the reload is finalized. vLLM's loaders write
each checkpoint scale into a slice of a fused parameter (q, k, v into
`qkv_proj.weight_scale`; every expert's gate and up into
`w13_weight_scale`), so the expected value of a parameter is its pieces'
scales, concatenated by rows in the order the provenance tracker knows.

Only where the engine keeps scales in checkpoint layout can they be
compared: on the CPU (refit's reference kernels, vLLM's CPU kernels) and
with tensor parallelism 1. Where a parameter's shape differs (a kernel's own
layout, a tensor-parallel shard), it is skipped; the transit tags and the
logprob probe still cover it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from refit.provenance.tracker import ScaleProvenanceTracker

__all__ = ["scale_mismatches"]


def scale_mismatches(
    model: torch.nn.Module, tracker: ScaleProvenanceTracker, sent: Mapping[str, torch.Tensor]
) -> list[str]:
    """Every engine weight scale (as `module.scale`) whose value differs from the scales `sent` for it."""
    modules = dict(model.named_modules())
    wrong = []
    for scale in tracker.weight_scales():
        if not scale.checkpoint_names or not all(name in sent for name in scale.checkpoint_names):
            continue  # not streamed by this sync
        held = getattr(modules[scale.vllm_module], scale.scale).detach()
        if scale.index is not None:
            held = held[scale.index]
        expected = torch.cat([sent[name] for name in scale.checkpoint_names])
        if expected.shape != held.shape:
            continue
        if not torch.equal(expected.to(held.dtype), held):
            wrong.append(f"{scale.module}.{scale.scale}")
    return wrong
