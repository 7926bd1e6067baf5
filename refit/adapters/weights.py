"""`AdapterWeights`: one LoRA adapter as a sync carries it, and the checks it must pass before any replica sees it.

Why a class of refit's own rather than peft's objects: a sync moves the
adapter between processes that must not import peft (the driver) or that
only have vLLM (the replica), and across vLLM's RPC, which takes plain data
only. So an adapter is its name, its PEFT config as the dict
`adapter_config.json` holds, and its tensors named as a PEFT checkpoint
names them (`base_model.model.<module>.lora_A.weight`), which is what vLLM's
own loader reads from a directory; `to_plain` / `from_plain` turn it into
bytes and back without pickle.

The checks run twice: on the driver, against the rollout's expected
weights, before anything is sent (a wrong rank, a module the base does not
have, a shape that does not fit its base weight), and on each replica
again before its engine sees a byte, with the values (finite). Each error
names the offending tensor or setting.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from refit.errors import ConfigError, InvalidTensorError
from refit.plan.expected_weights import ExpectedWeight

__all__ = ["AdapterMeta", "AdapterWeights", "check_adapter", "check_values", "lora_module"]

_LORA_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<half>[AB])\.weight$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def lora_module(tensor_name: str) -> tuple[str, str]:
    """(`model.layers.0.self_attn.q_proj`, "A") for PEFT's `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    match = _LORA_NAME.match(tensor_name)
    if match is None:
        raise InvalidTensorError(
            f"adapter tensor {tensor_name!r} is not a LoRA weight as PEFT names it "
            "('base_model.model.<module>.lora_A.weight' or '.lora_B.weight')"
        )
    return match["module"], match["half"]


@dataclass(frozen=True, slots=True)
class AdapterMeta:
    """What the driver checks and reports without the bytes: the adapter's name, config, and tensor shapes."""

    name: str
    config: Mapping[str, Any]  # PEFT's LoraConfig as adapter_config.json holds it (r, lora_alpha, target_modules, ...)
    shapes: Mapping[str, tuple[int, ...]]
    dtype: str
    digest: str | None  # SHA-256 of the tensors' names, shapes and bytes: every replica must hold these exact bytes
    # (None: not computed, for a check that needs only the shapes)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes.values()) * _DTYPES[self.dtype].itemsize


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """One LoRA adapter: its name, PEFT config and tensors (see the module docstring)."""

    name: str
    config: Mapping[str, Any]
    tensors: Mapping[str, torch.Tensor]

    def meta(self, *, digest: bool = True) -> AdapterMeta:
        """Its description without the bytes; `digest=False` leaves the digest out (a replica checks the shapes,
        and its workers hash what they install)."""
        if not self.tensors:
            raise InvalidTensorError(f"adapter {self.name!r} has no tensors")
        # Names first: what a peft state dict holds beside LoRA weights (a modules_to_save copy, the base of an
        # adapted embedding or lm_head) is in the base's dtype, and a dtype mismatch alone would not say why.
        for name in sorted(self.tensors):
            lora_module(name)
        by_dtype: dict[str, list[str]] = {}
        for name, tensor in sorted(self.tensors.items()):
            by_dtype.setdefault(str(tensor.dtype).removeprefix("torch."), []).append(name)
        if len(by_dtype) != 1 or not by_dtype.keys() <= set(_DTYPES):
            held = "; ".join(f"{dtype}: {names[:2]}" + (f" and {len(names) - 2} more" if len(names) > 2 else "")
                             for dtype, names in sorted(by_dtype.items(), key=lambda item: len(item[1])))
            raise InvalidTensorError(f"adapter {self.name!r}: its tensors must share one of {sorted(_DTYPES)}, not {held}")
        return AdapterMeta(self.name, dict(self.config), {n: tuple(t.shape) for n, t in self.tensors.items()},
                           next(iter(by_dtype)), self.digest() if digest else None)

    def digest(self) -> str:
        sha = hashlib.sha256()
        for name in sorted(self.tensors):
            tensor = self.tensors[name]
            sha.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
            sha.update(_tensor_bytes(tensor))
        return sha.hexdigest()

    def to_plain(self) -> dict[str, Any]:
        """Plain data for vLLM's RPC (msgpack): each tensor's bytes, dtype and shape."""
        return {
            "name": self.name, "config": dict(self.config),
            "tensors": [[name, str(t.dtype).removeprefix("torch."), list(t.shape), _tensor_bytes(t)]
                        for name, t in sorted(self.tensors.items())],
        }

    @classmethod
    def from_plain(cls, plain: Any) -> AdapterWeights:
        try:
            tensors = {}
            for name, dtype, shape, data in plain["tensors"]:
                flat = torch.frombuffer(bytearray(data), dtype=_DTYPES[dtype]) if data else torch.empty(0, dtype=_DTYPES[dtype])
                tensors[str(name)] = flat.reshape([int(n) for n in shape])
            return cls(str(plain["name"]), dict(plain["config"]), tensors)
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise InvalidTensorError(f"not an adapter's plain form ({type(error).__name__}: {error})") from None


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes, in row-major order (what `from_plain` reads back and the digest hashes)."""
    return tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


def check_adapter(meta: AdapterMeta, base_weights: tuple[ExpectedWeight, ...] | None, max_rank: int) -> None:
    """Refuse an adapter this base cannot serve, naming the offending tensor or setting; returns None if it fits.

    `base_weights`: the rollout's expected weights (None: unknown, only the
    adapter's own consistency is checked); `max_rank`: the engine's
    `max_lora_rank`.
    """
    if not isinstance(meta.name, str) or not _NAME.match(meta.name):
        raise ConfigError(f"adapter name {meta.name!r}: expected 1-64 letters, digits, '_', '.' or '-'")
    rank = meta.config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"adapter {meta.name!r}: config r={rank!r}, expected a positive int")
    # vLLM scales every LoRA output by alpha / r (its PEFTHelper) and checks neither: a NaN alpha served NaN logits.
    alphas = [("lora_alpha", meta.config.get("lora_alpha"))]
    pattern = meta.config.get("alpha_pattern") or {}
    alphas += [(f"alpha_pattern[{key!r}]", value) for key, value in (pattern.items() if isinstance(pattern, Mapping) else [])]
    for setting, alpha in alphas:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise ConfigError(f"adapter {meta.name!r}: config {setting}={alpha!r}, expected a finite number (its LoRA "
                              "scaling is alpha / r)")
    if not meta.shapes:
        raise InvalidTensorError(f"adapter {meta.name!r} has no tensors")
    halves: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in meta.shapes.items():
        module, half = lora_module(name)
        if len(shape) != 2:
            raise InvalidTensorError(f"adapter tensor {name!r} has shape {list(shape)}; a LoRA weight is 2-D")
        halves.setdefault(module, {})[half] = shape
    expected = None if base_weights is None else {w.name: w.shape for w in base_weights}
    for module, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise InvalidTensorError(f"adapter {meta.name!r}: module {module!r} has no {missing} tensor")
        (a_rank, a_in), (b_out, b_rank) = pair["A"], pair["B"]
        where = f"adapter tensors base_model.model.{module}.lora_A/B.weight"
        if a_rank != b_rank:
            raise InvalidTensorError(f"{where}: lora_A has rank {a_rank}, lora_B {b_rank}")
        if a_rank > max_rank:
            raise ConfigError(f"{where}: rank {a_rank} is above the engine's max_lora_rank {max_rank} (EngineConfig.lora_rank)")
        if not meta.config.get("rank_pattern") and a_rank != rank:
            raise InvalidTensorError(f"{where}: rank {a_rank}, but the adapter's config says r={rank}")
        if expected is None:
            continue
        base = expected.get(f"{module}.weight")
        if base is None:
            raise InvalidTensorError(f"{where}: the rollout's model has no weight {module + '.weight'!r} to adapt")
        if len(base) != 2 or (b_out, a_in) != tuple(base):
            raise InvalidTensorError(
                f"{where}: lora_B @ lora_A is {[b_out, a_in]}, but the base weight {module + '.weight'!r} is {list(base)}"
            )


def check_values(adapter: AdapterWeights) -> None:
    """The replica's own check of the bytes it received: every value finite."""
    for name, tensor in sorted(adapter.tensors.items()):
        if not torch.isfinite(tensor).all():
            raise InvalidTensorError(f"adapter tensor {name!r} holds non-finite values (NaN or inf)")
