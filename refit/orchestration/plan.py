"""The transfer plan: what is sent, in which form, in which bucket.

Made once per (trainer, rollout model) pair from metadata alone, then reused
by every sync: names, shapes, which tensors are FP8_BLOCK-quantized, the
tied-embedding alias, and the bucket layout. The producer checks each tensor
against it, so a trainer whose model changed shape is refused before any
byte is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import layerwise_groups

from refit.engine.rollout_engine import EngineDescription
from refit.errors import InvalidTensorError, PlanMismatchError
from refit.quantizer import Fp8BlockQuantizer, Fp8BlockScheme
from refit.quantizer.fp8_block import SUPPORTED_DTYPES

__all__ = ["PlannedTensor", "TensorMeta", "TransferPlan", "make_plan"]

_LM_HEAD = "lm_head.weight"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """One trainer parameter as a weight source describes it (no data)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "bfloat16"
    module_classes: tuple[str, ...]  # class names of the owning module's MRO
    alias_of: str | None = None  # a tied parameter: same tensor as `alias_of`


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    target: str  # the checkpoint name the rollout receives
    source: str  # the trainer parameter it is read from
    shape: tuple[int, ...]
    dtype: str
    block: tuple[int, int] | None  # FP8_BLOCK block structure if quantized

    @property
    def quantize(self) -> bool:
        return self.block is not None

    @property
    def source_bytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize

    @property
    def quantized_bytes(self) -> int:
        """FP8 codes plus block scales if quantized, else the tensor itself."""
        if self.block is None:
            return self.source_bytes
        (rows, cols), (bh, bw) = self.shape, self.block
        return math.prod(self.shape) + -(-rows // bh) * -(-cols // bw) * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class TransferPlan:
    buckets: tuple[tuple[PlannedTensor, ...], ...]
    quantize_on: str  # "trainer" or "rollout"

    @property
    def tensors(self) -> list[PlannedTensor]:
        return [t for bucket in self.buckets for t in bucket]

    @property
    def wire_bytes(self) -> int:
        """Bytes each replica fetches per sync."""
        return sum(_wire_bytes(t, self.quantize_on) for t in self.tensors)


def make_plan(
    sources: Sequence[TensorMeta], engine: EngineDescription, *, bucket_bytes: int, quantize_on: str
) -> TransferPlan:
    """Plan a transfer of `sources` into a rollout described by `engine`.

    Every problem found is reported at once, before anything runs.
    """
    if quantize_on not in ("trainer", "rollout"):
        raise ValueError(f"quantize_on={quantize_on!r}: expected 'trainer' or 'rollout'")
    by_name = {m.name: m for m in sources}
    targets = [(m.name, m.alias_of or m.name) for m in sources]
    if engine.tie_word_embeddings and _LM_HEAD not in by_name:
        targets.append((_LM_HEAD, _embedding_name(by_name)))

    classes = {m.name.rpartition(".")[0]: m.module_classes for m in sources}
    quantizer = None
    if engine.quantization_config is not None:
        scheme = Fp8BlockScheme.from_quantization_config(engine.quantization_config)
        quantizer = Fp8BlockQuantizer(scheme, classes)

    problems: list[str] = []
    planned: dict[str, PlannedTensor] = {}
    for target, source in targets:
        meta = by_name[source]
        # A tied alias carries exactly its source's values (the reload breaks
        # the tie, so both names must match), hence its source's form too.
        quantize = quantizer is not None and quantizer.is_quantized(source)
        if quantize and len(meta.shape) != 2:
            problems.append(f"{target}: the rollout expects it FP8_BLOCK-quantized, but its shape is {meta.shape}, not 2-D")
        if quantize and getattr(torch, meta.dtype, None) not in SUPPORTED_DTYPES:
            problems.append(f"{target}: dtype {meta.dtype} cannot be FP8_BLOCK-quantized")
        block = quantizer.scheme.block if quantize else None
        planned[target] = PlannedTensor(target, source, meta.shape, meta.dtype, block)
    if problems:
        raise InvalidTensorError("cannot plan the transfer:\n  " + "\n  ".join(problems))

    buckets = _pack(
        [planned[name] for group in layerwise_groups(list(planned)) for name in group], bucket_bytes, quantize_on
    )
    return TransferPlan(buckets, quantize_on)


def _embedding_name(by_name: dict[str, TensorMeta]) -> str:
    candidates = [n for n in by_name if n.endswith("embed_tokens.weight")]
    if len(candidates) != 1:
        raise PlanMismatchError(
            "the rollout model ties lm_head to the input embeddings, but the trainer reports no "
            f"{_LM_HEAD} and {len(candidates)} embedding candidates {candidates}; report {_LM_HEAD} "
            "as a TensorMeta with alias_of=<embedding name>"
        )
    return candidates[0]


def _wire_bytes(tensor: PlannedTensor, quantize_on: str) -> int:
    return tensor.quantized_bytes if quantize_on == "trainer" else tensor.source_bytes


def _pack(
    tensors: list[PlannedTensor], bucket_bytes: int, quantize_on: str
) -> tuple[tuple[PlannedTensor, ...], ...]:
    """Greedy, order-preserving: a tensor larger than a bucket travels alone."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be positive")
    buckets: list[list[PlannedTensor]] = []
    size = 0
    for t in tensors:
        nbytes = _wire_bytes(t, quantize_on)
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return tuple(tuple(b) for b in buckets)
