"""A toy task on which wrong weights show up as wrong greedy tokens.

Every sequence is an arithmetic progression of token ids modulo the vocabulary,
``t_i = (start + i * step) % VOCAB_SIZE`` with ``step`` in ``STEPS``. The step is
not given: the model has to read it off the prompt through attention (compare
the last two tokens) and then apply a per-token "add step" lookup through its
MLPs and unembedding. Both need the weights to be right, so a refit that
corrupts, stales or mis-scales any tensor drops greedy accuracy visibly, while
a correct one keeps it near 100%. No tokenizer is involved: prompts and outputs
are plain token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

VOCAB_SIZE = 512
"""Token ids live in ``[0, VOCAB_SIZE)``; also the tiny models' vocabulary size."""

STEPS = (1, 2, 3)
"""Possible differences between consecutive tokens of one sequence."""

PROMPT_LEN = 8
"""Prompt length the fixtures are trained and checked for."""

NEW_TOKENS = 8
"""Number of generated tokens the fixtures are checked for."""


def make_sequences(n: int, length: int, seed: int) -> torch.Tensor:
    """Return ``n`` random progressions of ``length`` tokens, int64 ``[n, length]``.

    Start and step are drawn from a private generator seeded with ``seed``, so
    the same arguments always give the same tensor, whatever the global RNG.
    """
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB_SIZE, (n, 1), generator=gen)
    steps = torch.tensor(STEPS)
    step = steps[torch.randint(0, len(STEPS), (n, 1), generator=gen)]
    return (start + step * torch.arange(length)) % VOCAB_SIZE


def make_prompts(n: int, prompt_len: int, seed: int) -> list[list[int]]:
    """Return ``n`` prompts of ``prompt_len`` tokens as lists, the form vLLM takes.

    ``prompt_len`` must be at least 2: the step is only defined by two tokens.
    """
    if prompt_len < 2:
        raise ValueError(f"prompt_len must be >= 2 to define a step, got {prompt_len}")
    return make_sequences(n, prompt_len, seed).tolist()


def expected_continuation(prompt: Sequence[int], n_tokens: int) -> list[int]:
    """Return the ``n_tokens`` tokens that continue ``prompt``'s progression."""
    if len(prompt) < 2:
        raise ValueError(f"a prompt needs at least 2 tokens, got {len(prompt)}")
    step = (prompt[-1] - prompt[-2]) % VOCAB_SIZE
    return [(prompt[-1] + (i + 1) * step) % VOCAB_SIZE for i in range(n_tokens)]


def accuracy(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> float:
    """Fraction of prompts whose generated tokens all equal the expected continuation.

    ``outputs[i]`` holds only the generated tokens for ``prompts[i]``; its
    length sets how many tokens are checked. An empty output counts as wrong,
    so an engine that produced nothing cannot score.
    """
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts but {len(outputs)} outputs")
    if not prompts:
        raise ValueError("accuracy of zero prompts is undefined")
    correct = sum(
        len(out) > 0 and list(out) == expected_continuation(prompt, len(out))
        for prompt, out in zip(prompts, outputs)
    )
    return correct / len(prompts)
