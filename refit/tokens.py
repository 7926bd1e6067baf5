"""Token-id prompts, checked before they reach vLLM.

Rollouts exchange token ids with the trainer (no tokenizer). vLLM does not
range-check them: an id at or above the vocabulary size, or a negative one,
raises `IndexError` inside the forward pass and leaves the engine's
scheduler holding the request, so every later call blocks. Checking here,
once, for generation and calibration alike, keeps bad ids out.
"""

from __future__ import annotations

from typing import Any

from refit.errors import InvalidTensorError

__all__ = ["token_prompts"]


def token_prompts(prompts: Any, *, vocab_size: int | None = None, setting: str = "prompts") -> tuple[tuple[int, ...], ...]:
    """`prompts` as a tuple of non-empty tuples of ints in `[0, vocab_size)`; raise naming the first bad one."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
        raise InvalidTensorError(f"{setting}={prompts!r}: expected a list of token-id sequences")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
            raise InvalidTensorError(f"{setting}[{i}]={prompt!r}: expected a sequence of token ids, not text or a scalar")
        if len(prompt) == 0:
            raise InvalidTensorError(f"{setting}[{i}] is empty: every prompt needs at least one token id")
        ids = tuple(int(t) if _is_int(t) else t for t in prompt)
        bad = [t for t in ids if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            limit = f"[0, {vocab_size})" if vocab_size is not None else "non-negative ints"
            raise InvalidTensorError(f"{setting}[{i}] holds token ids {bad[:4]} outside {limit}")
        out.append(ids)
    return tuple(out)


def _is_int(value: Any) -> bool:
    # numpy and torch integer scalars count; bools and floats do not.
    return not isinstance(value, bool) and hasattr(value, "__index__")
