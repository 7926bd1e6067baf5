"""A trainer's tensors described without their data: what a weight source reports and a plan is made from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

__all__ = ["TensorMeta", "module_classes"]


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
