"""refit: weight sync for RL on LLMs.

Streams a trainer's weights, FP8_BLOCK-quantized, into running vLLM engines
over Ray, records where every scale came from, and repairs placeholder
KV-cache scales after each refit.
"""

from refit.errors import (
    EngineError,
    InvalidTensorError,
    LifecycleError,
    PlanMismatchError,
    RefitError,
    UnsupportedSchemeError,
)

__all__ = [
    "EngineError",
    "InvalidTensorError",
    "LifecycleError",
    "PlanMismatchError",
    "RefitError",
    "UnsupportedSchemeError",
]
