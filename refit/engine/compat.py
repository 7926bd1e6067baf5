"""The vLLM version refit's engine integration was written against, checked in one place.

refit hooks into vLLM only through supported extension points (a general
plugin, a weight-transfer backend, a worker extension, the layerwise reload
API), but their signatures move between releases. Each hook checks what it
relies on and fails with this message, rather than with an attribute error
deep inside a worker, or a plugin load failure vLLM only logs.
"""

from __future__ import annotations

import vllm

from refit.errors import EngineError

__all__ = ["EXPECTED_VLLM_VERSION", "incompatible_vllm", "require_vllm_release"]

EXPECTED_VLLM_VERSION = "0.32.0"


def incompatible_vllm(component: str, problem: str) -> EngineError:
    return EngineError(
        f"refit's {component} was written for vLLM {EXPECTED_VLLM_VERSION}, but in the installed "
        f"vLLM {vllm.__version__} {problem}. Install vLLM {EXPECTED_VLLM_VERSION} "
        "(scripts/setup_env.sh main) or port refit/engine/ to this version."
    )


def require_vllm_release(component: str) -> None:
    """Refuse a vLLM whose major.minor differs from the one refit was written against."""
    if vllm.__version__.split(".")[:2] != EXPECTED_VLLM_VERSION.split(".")[:2]:
        raise incompatible_vllm(component, "the release differs")
