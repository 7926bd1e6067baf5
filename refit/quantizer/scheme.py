"""Which tensors a rollout engine expects quantized, read from its config.

This is the one place that decides it. The decision comes from the engine's
own `quantization_config` (compressed-tensors format, the block of an HF
`config.json`), never from refit-side guesses, so what the trainer sends is
exactly what vLLM's loaders expect: `targets` (class names such as `Linear`,
or module names, `re:` for regexes), `ignore` (same syntax), and the weight
arguments of each config group. Names are matched with compressed-tensors'
own `match_name`, so `re:` patterns mean what they mean to llmcompressor.
"""

from __future__ import annotations

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
            if not (isinstance(structure, Sequence) and len(structure) == 2):
                problems.append(f"config_groups.{group_name}.weights.block_structure={structure!r}, expected [rows, cols]")
            else:
                blocks.add((int(structure[0]), int(structure[1])))
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
        # Imported here, where a plan is made (the driver): compressed-tensors takes seconds to import, and a
        # trainer's first `describe_weights` or stream would pay them inside the sync's deadline.
        from compressed_tensors.utils.match import match_name

        def matches(pattern: str) -> bool:
            return match_name(module_name, pattern) or pattern in module_classes

        return any(matches(t) for t in self.targets) and not any(matches(i) for i in self.ignore)
