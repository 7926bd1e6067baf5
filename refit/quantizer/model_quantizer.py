"""Quantize a stream of `(name, tensor)` pairs the way the rollout expects.

Trainers hand over weights in their own (Hugging Face) names. Each `X.weight`
whose module `X` the scheme targets becomes `X.weight` (FP8) plus
`X.weight_scale`; everything else (norms, embeddings, `lm_head`, biases,
ignored modules) passes through untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from refit.errors import InvalidTensorError, PlanMismatchError
from refit.quantizer.fp8_block import is_finite, loadable_form, non_finite
from refit.quantizer.scheme import Fp8BlockScheme

__all__ = ["Fp8BlockQuantizer"]


class Fp8BlockQuantizer:
    """Decides, per parameter name, quantize or pass through, then does it.

    `module_classes` maps each module name of the trainer's model to the class
    names of its MRO (e.g. `("Linear", "Module")`), because compressed-tensors
    targets such as `Linear` are class names, and a stream of tensors carries
    none.
    """

    def __init__(self, scheme: Fp8BlockScheme, module_classes: Mapping[str, Sequence[str]]) -> None:
        self.scheme = scheme
        self._module_classes = {name: tuple(classes) for name, classes in module_classes.items()}

    def is_quantized(self, name: str) -> bool:
        """Whether parameter `name` is sent as FP8_BLOCK (only `weight` params of targets are)."""
        module_name, _, param = name.rpartition(".")
        if param != "weight":
            return False
        if module_name not in self._module_classes:
            raise PlanMismatchError(
                f"{name}: module {module_name!r} is not in the trainer's module list, so refit cannot tell "
                "whether the rollout expects it quantized; report module classes for every parameter"
            )
        return self.scheme.quantizes(module_name, self._module_classes[module_name])

    def quantize(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The tensors that stand for `name` on the wire: one, or weight and weight_scale."""
        if not self.is_quantized(name):
            _check_finite(name, tensor)
            return [(name, tensor)]
        return loadable_form(name, tensor, self.scheme.block)

    def __call__(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            yield from self.quantize(name, tensor)


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    if not is_finite(tensor):
        bad = int(non_finite(tensor).sum())
        raise InvalidTensorError(f"{name}: {bad} of {tensor.numel()} values are NaN or Inf; refusing to send it")
