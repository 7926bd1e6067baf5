"""Every exception refit raises on bad input, in one place.

Each message names the offending tensor or setting, what was expected, and
what to do, so a failed refit can be fixed without reading refit's source.
All of them derive from `RefitError`, so callers can catch one type.
"""

from __future__ import annotations

__all__ = [
    "RefitError",
    "InvalidTensorError",
    "UnsupportedSchemeError",
    "PlanMismatchError",
    "LifecycleError",
    "EngineError",
]


class RefitError(Exception):
    """Base class of refit's errors."""


class InvalidTensorError(RefitError, ValueError):
    """A weight cannot be quantized or loaded as it is (NaN/Inf, dtype, rank)."""


class UnsupportedSchemeError(RefitError, ValueError):
    """A quantization config asks for something refit does not implement."""


class PlanMismatchError(RefitError, ValueError):
    """A weight source's tensors no longer match the plan made for them."""


class LifecycleError(RefitError, RuntimeError):
    """A lifecycle step was called out of order."""


class EngineError(RefitError, RuntimeError):
    """A rollout engine refused or failed an update."""
