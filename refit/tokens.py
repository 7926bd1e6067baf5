"""Token-id prompts, checked before they reach vLLM.

Rollouts exchange token ids with the trainer (no tokenizer). vLLM does not
range-check them: an id at or above the vocabulary size, or a negative one,
raises `IndexError` inside the forward pass and leaves the engine's
scheduler holding the request, so every later call blocks. Checking here,
once, for generation and calibration alike, keeps bad ids out.
"""

from __future__ import annotations

import operator
from typing import Any

from refit.errors import InvalidTensorError

__all__ = ["token_prompts"]


def token_prompts(prompts: Any, *, vocab_size: int | None = None, setting: str = "prompts",
                  max_model_len: int | None = None) -> tuple[tuple[int, ...], ...]:
    """`prompts` as a tuple of non-empty tuples of ints in `[0, vocab_size)`, each shorter than `max_model_len` (vLLM
    refuses a prompt that leaves no room for one generated token); raise naming the first bad one."""
    if not _is_sequence(prompts, "__iter__"):
        raise InvalidTensorError(f"{setting}={prompts!r}: expected a list of token-id sequences")
    out = []
    for i, prompt in enumerate(prompts):
        if not _is_sequence(prompt, "__len__"):
            raise InvalidTensorError(f"{setting}[{i}]={prompt!r}: expected a sequence of token ids, not text or a scalar")
        if len(prompt) == 0:
            raise InvalidTensorError(f"{setting}[{i}] is empty: every prompt needs at least one token id")
        ids = tuple(_as_int(t) for t in prompt)
        bad = [t for t in ids
               if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            limit = f"[0, {vocab_size})" if vocab_size is not None else "non-negative ints"
            raise InvalidTensorError(f"{setting}[{i}] holds token ids {bad[:4]} outside {limit}")
        if max_model_len is not None and len(ids) >= max_model_len:
            raise InvalidTensorError(f"{setting}[{i}] holds {len(ids)} token ids; the engine's max_model_len {max_model_len} "
                                     "takes prompts of fewer tokens (EngineConfig.max_model_len)")
        out.append(ids)
    return tuple(out)


def _is_sequence(value: Any, attribute: str) -> bool:
    # A 0-d tensor or array has __len__ and __iter__, but both raise TypeError.
    return not isinstance(value, (str, bytes)) and hasattr(value, attribute) and getattr(value, "ndim", 1) != 0


def _as_int(value: Any) -> Any:
    """`value` as an int where it is one (numpy and torch integer scalars too), else itself, to be reported.

    operator.index, not hasattr(__index__): every torch.Tensor has __index__, and int() of a float tensor truncates.
    A bool stays a bool (operator.index would make it 0 or 1): it is no token id.
    """
    if isinstance(value, bool):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value
