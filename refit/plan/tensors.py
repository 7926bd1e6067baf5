"""A trainer's tensors described without their data: what a weight source reports and a plan is made from."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from refit.errors import PlanMismatchError

__all__ = ["TensorMeta", "checked_metadata", "module_classes"]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """One trainer parameter as a weight source describes it (no data)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "bfloat16"
    module_classes: tuple[str, ...]  # class names of the owning module's MRO
    alias_of: str | None = None  # a tied parameter: same tensor as `alias_of`
    piece_of: str | None = None  # a piece of this (fused) in-memory parameter, e.g. one expert's gate_proj

    def renamed(self, rename: Callable[[str], str]) -> TensorMeta:
        """This tensor under `rename`d names, the ones it refers to included (its tied source, its fused parameter)."""
        return replace(self, name=rename(self.name), alias_of=self.alias_of and rename(self.alias_of),
                       piece_of=self.piece_of and rename(self.piece_of))


def module_classes(metas: Sequence[TensorMeta]) -> dict[str, tuple[str, ...]]:
    """Module name -> its class names, the map `Fp8BlockQuantizer` matches `Linear`-style targets with."""
    return {m.name.rpartition(".")[0]: m.module_classes for m in metas}


def checked_metadata(metas: Any, who: str = "the trainer", *, aliases: bool = True) -> list[TensorMeta]:
    """What a weight source reported (`weight_metadata()`), each entry a `TensorMeta` of a non-empty str name, a str
    dtype and a shape of non-negative ints (a list or `torch.Size` of them taken as the tuple it stands for), and each
    alias naming a tensor reported beside it (unless `aliases` is False: a rank of a sharded trainer may report only
    what it holds); every problem named at once, before a plan is made of them.

    Why: a weight source of the user's own makes its metadata by hand, and each of these otherwise failed far from
    its cause: a torch.dtype as `attribute name must be string`, an alias of a missing name as a bare `KeyError`, a
    list shape as a shape that differs from the rollout's equal tuple.
    """
    if isinstance(metas, (str, bytes)) or not hasattr(metas, "__iter__"):
        raise PlanMismatchError(f"{who}'s weight_metadata() returned {type(metas).__name__}, not a list of refit.TensorMeta")
    metas = list(metas)
    problems: list[str] = []
    out: list[TensorMeta] = []
    for i, meta in enumerate(metas):
        if not isinstance(meta, TensorMeta):
            problems.append(f"entry {i}: a {type(meta).__name__}, not a refit.TensorMeta (refit.describe_weights makes them)")
            continue
        if not isinstance(meta.name, str) or not meta.name:
            problems.append(f"entry {i}: name {meta.name!r}, expected a non-empty str")
            continue
        if not isinstance(meta.dtype, str):
            problems.append(f"{meta.name}: dtype {meta.dtype!r}, expected torch's name as a str (e.g. 'bfloat16')")
        shape = _shape(meta.shape)
        if shape is None:
            problems.append(f"{meta.name}: shape {meta.shape!r}, expected a tuple of non-negative ints")
        else:
            meta = replace(meta, shape=shape) if shape != meta.shape or type(meta.shape) is not tuple else meta
        out.append(meta)
    names = {meta.name for meta in out}
    problems += [f"{meta.name}: alias_of={meta.alias_of!r}, which the trainer does not report"
                 for meta in out if aliases and meta.alias_of is not None and meta.alias_of not in names]
    if problems:
        more = [f"... and {len(problems) - 20} more"] if len(problems) > 20 else []
        raise PlanMismatchError(f"{who}'s weight metadata cannot be planned:\n  " + "\n  ".join(problems[:20] + more))
    return out


def _shape(shape: Any) -> tuple[int, ...] | None:
    """`shape` as a tuple of non-negative ints, or None if it is not one."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        return None
    try:
        dims = tuple(operator.index(n) for n in shape if not isinstance(n, bool))
    except TypeError:
        return None
    return dims if len(dims) == len(shape) and all(n >= 0 for n in dims) else None
