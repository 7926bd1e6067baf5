"""Deterministic fixtures for refit's tests: a toy task and tiny models solving it.

Importing this package needs only torch (transformers is imported on use), so
it also works in the separate llmcompressor venv that quantizes the fixtures.
"""

from refit.testing.counting_task import (
    NEW_TOKENS,
    PROMPT_LEN,
    STEPS,
    VOCAB_SIZE,
    accuracy,
    expected_continuation,
    make_prompts,
    make_sequences,
)
from refit.testing.models import (
    FIXTURES_DIR,
    VARIANTS,
    greedy_continuations,
    model_dir,
    tiny_qwen3_config,
)

__all__ = [
    "FIXTURES_DIR",
    "NEW_TOKENS",
    "PROMPT_LEN",
    "STEPS",
    "VARIANTS",
    "VOCAB_SIZE",
    "accuracy",
    "expected_continuation",
    "greedy_continuations",
    "make_prompts",
    "make_sequences",
    "model_dir",
    "tiny_qwen3_config",
]
