"""Which tensors a rollout engine expects quantized, read from its config.

This is the one place that decides it. The decision comes from the engine's
own `quantization_config` (compressed-tensors format, the block of an HF
`config.json`), never from refit-side guesses, so what the trainer sends is
exactly what vLLM's loaders expect: `targets` (class names such as `Linear`,
or module names, `re:` for regexes), `ignore` (same syntax), and the weight
arguments of each config group. A pattern means what it means to
compressed-tensors' `match_name` (tests/quantizer/test_scheme.py checks the
two agree): `re:` and a regex matched from the start of the name, otherwise
the exact name or one of the module's class names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from refit.errors import UnsupportedSchemeError

__all__ = ["Fp8BlockScheme"]

# The weight arguments FP8_BLOCK means; anything else in a config group is a
# scheme refit does not implement, and sending FP8_BLOCK to it would be wrong.
_FP8_BLOCK_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "block", "symmetric": True, "dynamic": False}


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp8BlockScheme:
    """The FP8_BLOCK layout of one rollout model.

    `targets` and `ignore` use compressed-tensors syntax and apply to module
    names in the trainer's (Hugging Face) naming, which is also the
    checkpoint's.
    """

    block: tuple[int, int] = (128, 128)
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ("lm_head",)

    def __post_init__(self) -> None:
        if len(self.block) != 2 or not all(isinstance(b, int) and b > 0 for b in self.block):
            raise UnsupportedSchemeError(f"block structure {self.block!r}: expected two positive ints, e.g. (128, 128)")
        for field in ("targets", "ignore"):
            for pattern in getattr(self, field):
                if not isinstance(pattern, str):
                    raise UnsupportedSchemeError(f"{field} entry {pattern!r}: expected a str (a name, a class name or 're:<regex>')")
                if pattern.startswith("re:"):
                    try:
                        re.compile(pattern.removeprefix("re:"))
                    except re.error as error:
                        raise UnsupportedSchemeError(f"{field} entry {pattern!r} is not a valid regex: {error}") from None

    @classmethod
    def from_quantization_config(cls, config: Mapping[str, Any]) -> Fp8BlockScheme:
        """Parse an HF `quantization_config` (compressed-tensors); refuse anything but FP8_BLOCK.

        All problems found are reported together.
        """
        problems: list[str] = []
        if config.get("quant_method") != "compressed-tensors":
            problems.append(f"quant_method={config.get('quant_method')!r}, expected 'compressed-tensors'")
        groups = config.get("config_groups") or {}
        if not groups:
            problems.append("config_groups is empty: nothing says which tensors are quantized")
        targets: list[str] = []
        blocks: set[tuple[int, int]] = set()
        for group_name, group in groups.items():
            weights = group.get("weights") or {}
            for key, expected in _FP8_BLOCK_WEIGHTS.items():
                if weights.get(key) != expected:
                    problems.append(f"config_groups.{group_name}.weights.{key}={weights.get(key)!r}, FP8_BLOCK needs {expected!r}")
            structure = weights.get("block_structure")
            block = _block_structure(structure)
            if block is None:
                problems.append(f"config_groups.{group_name}.weights.block_structure={structure!r}, expected [rows, cols]")
            else:
                blocks.add(block)
            targets.extend(group.get("targets") or [])
        if len(blocks) > 1:
            problems.append(f"config groups use different block structures {sorted(blocks)}; refit supports one")
        if problems:
            raise UnsupportedSchemeError("unsupported quantization_config:\n  " + "\n  ".join(problems))
        return cls(block=blocks.pop(), targets=tuple(targets), ignore=tuple(config.get("ignore") or ()))

    def quantizes(self, module_name: str, module_classes: Sequence[str]) -> bool:
        """Whether `module_name`'s `weight` is sent as FP8_BLOCK.

        `module_classes` are the class names of the module's MRO (the trainer
        reports them), matched as compressed-tensors matches classes.
        """
        # compressed-tensors' `match_name` is these few lines, and importing it (it imports transformers) cost
        # every driver's first plan ~3 s of CPU; the scheme test holds the two to the same answers.

        def matches(pattern: str) -> bool:
            if pattern.startswith("re:"):
                return re.match(pattern.removeprefix("re:"), module_name) is not None
            return pattern == module_name or pattern in module_classes

        return any(matches(t) for t in self.targets) and not any(matches(i) for i in self.ignore)


def _block_structure(structure: Any) -> tuple[int, int] | None:
    """`block_structure` as compressed-tensors' QuantizationArgs reads it (two ints, or the older "ROWSxCOLS"
    string), so refit accepts what vLLM loads; None for anything else."""
    if isinstance(structure, str):
        try:
            structure = [int(part) for part in structure.split("x")]
        except ValueError:
            return None
    if not (isinstance(structure, Sequence) and len(structure) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) for b in structure)):
        return None
    return structure[0], structure[1]
