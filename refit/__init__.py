"""refit: weight sync for RL on LLMs.

Streams a trainer's weights, FP8_BLOCK-quantized, into running vLLM engines
over Ray, records where every scale came from, and repairs placeholder
KV-cache scales after each refit.

    report = refit.sync(trainer, rollouts)            # one-off
    syncer = refit.Syncer(trainer, rollouts, config)  # plans once, reuse per step

Public names load on first use, so `import refit` does not import vLLM until
something that needs it is touched (the quantizer alone needs only torch).
"""

from __future__ import annotations

import importlib
from typing import Any

from refit.errors import (
    EngineError,
    InvalidTensorError,
    LifecycleError,
    PlanMismatchError,
    RefitError,
    UnsupportedSchemeError,
)

_LAZY = {
    "sync": "refit.orchestration",
    "Syncer": "refit.orchestration",
    "SyncConfig": "refit.orchestration",
    "SyncReport": "refit.orchestration",
    "TensorMeta": "refit.orchestration",
    "TransferPlan": "refit.orchestration",
    "describe_weights": "refit.orchestration",
    "produce_buckets": "refit.orchestration",
    "WireBucket": "refit.transport.buckets",
    "EngineConfig": "refit.engine.rollout_engine",
    "KvScalePolicy": "refit.provenance",
    "ScaleSource": "refit.provenance",
    "ScaleRecord": "refit.provenance",
    "quantize_fp8_block": "refit.quantizer",
    "Fp8BlockQuantizer": "refit.quantizer",
    "Fp8BlockScheme": "refit.quantizer",
}

__all__ = [
    "EngineError",
    "InvalidTensorError",
    "LifecycleError",
    "PlanMismatchError",
    "RefitError",
    "UnsupportedSchemeError",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'refit' has no attribute {name!r}")
