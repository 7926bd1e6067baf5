"""The logprob probe: a replica scores fixed prompts after a refit, and the trainer's own logprobs are the reference.

Integrity tags prove that the bytes arrived as sent; the probe checks what the
engine computes with them, which also covers what tags cannot see: a kernel
that reads the weights wrongly, KV-cache scales that do not fit the new
weights, a layer the reload left stale.

The prompts are token ids drawn from a fixed seed over the whole vocabulary
(no tokenizer, nothing task-specific), and the measure is |delta logprob| of
every prompt token after the first, mean and max, between the replica and
the trainer. How far a correct refit may differ depends on precision, so the
thresholds do too (`thresholds_for`). They were derived on this project's
fixtures (tiny Qwen3, Llama and Qwen3-MoE trained on a counting task, probed
with random token ids, where their logprobs are large and so are rounding
effects): the largest difference a correct sync showed, times about 3. A
sync that leaves one layer wrong differs by far more. Both are measured
again on every run by `tests/verification/test_verified_sync.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ProbeRequest", "ProbeResult", "ProbeThresholds", "compare", "probe_prompts", "prompt_logprobs", "thresholds_for"]

PROBE_SEED = 20_251_130
PROBE_PROMPTS = 4
PROBE_LENGTH = 24


@dataclass(frozen=True, slots=True)
class ProbeThresholds:
    """Largest mean and max |delta logprob| a correct refit shows at one precision."""

    mean: float
    max: float


# (FP8_BLOCK weights, FP8 KV cache) -> thresholds. Correct syncs of the fixtures differ by (mean / max
# |dlogprob|): bf16 0.016 / 0.073; FP8_BLOCK 0.076 / 0.29; FP8_BLOCK + FP8 KV cache: Qwen3 0.144 / 0.46,
# Llama 0.143 / 0.49, Qwen3-MoE 0.155 / 1.38. A sync that sends layer 1's MLP as layer 0's (FP8 + FP8 KV):
# 1.47 / 4.86. The thresholds are about 3x the worst correct sync (the max, one token's worst case, 2.5x).
_THRESHOLDS = {
    (False, False): ProbeThresholds(mean=0.05, max=0.25),
    (True, False): ProbeThresholds(mean=0.25, max=1.0),
    (False, True): ProbeThresholds(mean=0.45, max=3.5),
    (True, True): ProbeThresholds(mean=0.45, max=3.5),
}


def thresholds_for(fp8_weights: bool, fp8_kv_cache: bool) -> ProbeThresholds:
    return _THRESHOLDS[(fp8_weights, fp8_kv_cache)]


def probe_prompts(vocab_size: int, *, n: int = PROBE_PROMPTS, length: int = PROBE_LENGTH) -> list[list[int]]:
    """The fixed probe prompts for a vocabulary: the same on every replica, trainer and run."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab_size, (n, length), generator=generator).tolist()


@dataclass(frozen=True, slots=True)
class ProbeRequest:
    """What the driver hands each replica at finish: the prompts and the trainer's logprobs.

    Each replica picks the thresholds of its own precision (`thresholds_for`).
    """

    prompts: tuple[tuple[int, ...], ...]
    reference: tuple[tuple[float, ...], ...]  # per prompt, the logprob of each token after the first
    fail: bool  # breaching fails the sync (else it is flagged in the report)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    mean: float
    max: float
    thresholds: ProbeThresholds

    @property
    def passed(self) -> bool:
        return self.mean <= self.thresholds.mean and self.max <= self.thresholds.max

    def __str__(self) -> str:
        verdict = "passed" if self.passed else "BREACHED"
        return (f"probe {verdict}: mean |dlogprob| {self.mean:.4f} (<= {self.thresholds.mean}), "
                f"max {self.max:.4f} (<= {self.thresholds.max})")


def prompt_logprobs(model: torch.nn.Module, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
    """A Hugging Face causal LM's logprob of every prompt token after the first, as vLLM's `prompt_logprobs`.

    One prompt at a time (any lengths, no padding), softmax in float32.
    """
    model.eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            logits = model(input_ids=ids).logits.float().log_softmax(-1)[0]
            out.append(logits[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist())
    return out


def compare(got: Sequence[Sequence[float]], reference: Sequence[Sequence[float]], thresholds: ProbeThresholds) -> ProbeResult:
    """Mean and max |got - reference| over every scored token."""
    diffs = [abs(g - r) for row_g, row_r in zip(got, reference, strict=True) for g, r in zip(row_g, row_r, strict=True)]
    if not diffs or not all(math.isfinite(d) for d in diffs):
        return ProbeResult(math.inf, math.inf, thresholds)
    return ProbeResult(math.fsum(diffs) / len(diffs), max(diffs), thresholds)
