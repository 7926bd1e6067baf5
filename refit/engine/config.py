"""`EngineConfig`: how a rollout's vLLM engine starts, validated on construction.

Importing this module does not import vLLM, so a driver or trainer can build
configs without it. The engine's memory is part of the config because vLLM's
own defaults assume one engine per device: on a GPU that is right, but on the
CPU backend vLLM reserves `gpu_memory_utilization` (0.92) of the *whole
machine's* memory for each engine, so a second engine, or a trainer beside
one, does not fit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from refit.engine.vllm_logs import quiet_benign_vllm_warnings
from refit.errors import ConfigError

__all__ = ["DEFAULT_CPU_KV_CACHE_BYTES", "EngineConfig", "REFERENCE_KERNEL_ENV", "TRANSFER_BACKEND", "WORKER_EXTENSION",
           "engine_kwargs", "reference_kernels_first"]

TRANSFER_BACKEND = "refit"
"""The name refit's weight-transfer backend is registered under in vLLM (refit/engine/transfer_backend.py)."""

WORKER_EXTENSION = "refit.engine.worker_rpc.RefitWorkerExtension"
"""Mixed into every vLLM worker; a dotted path so that naming it does not import vLLM."""

REFERENCE_KERNEL_ENV = "REFIT_CPU_REFERENCE_KERNEL"
"""Set to "1" in an engine's environment on the CPU: refit's reference FP8_BLOCK kernel first, vLLM's native CPU
kernels only after it, so every CPU computes the same numbers (refit/engine/cpu_kernel.py says why)."""


def reference_kernels_first() -> bool:
    """Whether this process's environment asks for refit's reference CPU kernels first (`REFERENCE_KERNEL_ENV`)."""
    return os.environ.get(REFERENCE_KERNEL_ENV) == "1"


DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
"""KV cache per engine on a CPU when `kv_cache_bytes` is None: 1 GiB holds ~30k tokens of a
small model, and lets a trainer and two rollouts share a 24 GiB machine."""

_SET_BY_REFIT = ("weight_transfer_config", "worker_extension_cls", "skip_tokenizer_init", "kv_cache_memory_bytes")


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    model: str
    """Local directory of the rollout's checkpoint (with `config.json`); only its config is read
    when `load_format="dummy"`."""

    load_format: Literal["auto", "dummy", "safetensors"] = "auto"
    """`"dummy"` starts on placeholder weights: the replica refuses to serve until its first sync."""

    kv_cache_dtype: str = "auto"
    """vLLM's KV-cache dtype, e.g. `"fp8_e4m3"`."""

    dtype: str = "bfloat16"
    max_model_len: int = 256
    enforce_eager: bool = True
    """Eager execution; `kv_scales="recompute"` needs it (its hooks see only an eager forward)."""

    tensor_parallel_size: int = 1
    seed: int = 0

    kv_cache_bytes: int | None = None
    """Memory for the KV cache. None: `DEFAULT_CPU_KV_CACHE_BYTES` on a CPU, and on a GPU vLLM's
    own sizing from `memory_fraction`."""

    memory_fraction: float | None = None
    """Fraction of the device's memory the engine may use (vLLM's `gpu_memory_utilization`).
    None: vLLM's default (0.92) on a GPU; unused on a CPU, where `kv_cache_bytes` sizes the cache."""

    draft_model: str | None = None
    """Local checkpoint of a speculative draft model (vLLM's `method="draft_model"`), loaded like `model`
    (`load_format` too); syncs update it with the target (`SyncConfig.draft`, docs/draft.md)."""

    speculative_method: Literal["draft_model", "mtp"] = "draft_model"
    """`"mtp"`: draft with the MTP layers of `model`'s own checkpoint (vLLM's `method="mtp"`; no `draft_model`),
    synced with the target like a draft model (docs/draft.md)."""

    num_speculative_tokens: int = 2
    """Tokens the draft proposes per step, when there is a draft (MTP layers: at most as many as the checkpoint has)."""

    lora_rank: int | None = None
    """Serve LoRA adapters of rank up to this, synced from memory by `Syncer.sync_adapter` (docs/lora.md);
    None: no LoRA (a LoRA trainer's full sync then sends its adapter merged into the base)."""

    extra: Mapping[str, Any] = field(default_factory=dict)
    """Any other `vllm.LLM` keyword."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not isinstance(self.model, (str, Path)) or not str(self.model):
            problems.append(f"model={self.model!r}: expected the path of a local checkpoint directory")
        if self.load_format not in ("auto", "dummy", "safetensors"):
            problems.append(f"load_format={self.load_format!r}: expected 'auto', 'dummy' or 'safetensors'")
        if self.draft_model is not None and (not isinstance(self.draft_model, (str, Path)) or not str(self.draft_model)):
            problems.append(f"draft_model={self.draft_model!r}: expected the path of a local checkpoint directory or None")
        if self.speculative_method not in ("draft_model", "mtp"):
            problems.append(f"speculative_method={self.speculative_method!r}: expected 'draft_model' or 'mtp'")
        elif self.speculative_method == "mtp" and self.draft_model is not None:
            problems.append(f"speculative_method='mtp' with draft_model={self.draft_model!r}: MTP layers come from "
                            "model's own checkpoint; set one or the other")
        if self.lora_rank is not None and (isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int)
                                           or self.lora_rank < 1):
            problems.append(f"lora_rank={self.lora_rank!r}: expected a positive int or None")
        for name in ("max_model_len", "tensor_parallel_size", "num_speculative_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r}: expected a positive int")
        if self.kv_cache_bytes is not None and (
            isinstance(self.kv_cache_bytes, bool) or not isinstance(self.kv_cache_bytes, int) or self.kv_cache_bytes < 1
        ):
            problems.append(f"kv_cache_bytes={self.kv_cache_bytes!r}: expected a positive int (bytes) or None")
        if self.memory_fraction is not None and not (
            isinstance(self.memory_fraction, (int, float)) and 0 < self.memory_fraction <= 1
        ):
            problems.append(f"memory_fraction={self.memory_fraction!r}: expected a number in (0, 1] or None")
        reserved = sorted(set(_SET_BY_REFIT + ("gpu_memory_utilization", "speculative_config") + tuple(lora_settings(1)))
                          & set(self.extra))
        if reserved:
            problems.append(
                f"extra sets {reserved}: refit sets these (use kv_cache_bytes / memory_fraction / draft_model / lora_rank)")
        if problems:
            raise ConfigError("invalid EngineConfig:\n  " + "\n  ".join(problems))

    def check_model_directory(self) -> None:
        """Refuse a model directory this machine lacks.

        Called where the engine starts, not where the config is made: on a
        cluster without shared storage the checkpoint exists only on the
        rollout nodes, not on the driver's.
        """
        for setting, value in (("model", self.model), ("draft_model", self.draft_model)):
            if value is None:
                continue
            model = Path(str(value))
            if not (model / "config.json").is_file():
                what = "does not exist" if not model.exists() else "has no config.json"
                raise ConfigError(
                    f"invalid EngineConfig: {setting}={str(value)!r} {what} on this node: "
                    "refit starts engines from a local checkpoint directory"
                )

    @property
    def initial_refusal(self) -> str | None:
        """Why a replica of this engine must not serve before its first sync, if it must not."""
        if self.load_format == "dummy":
            return "it started with load_format='dummy', so its weights and scales are placeholders; run a sync first"
        return None

    def kv_cache_bytes_on(self, on_gpu: bool) -> int | None:
        """The KV-cache size the engine is given on this kind of device (None: vLLM sizes it)."""
        if self.kv_cache_bytes is not None or on_gpu:
            return self.kv_cache_bytes
        return DEFAULT_CPU_KV_CACHE_BYTES

    def llm_kwargs(self, *, on_gpu: bool) -> dict[str, Any]:
        """Keywords for `vllm.LLM` (or `AsyncEngineArgs`): this config's, and `engine_kwargs`'.

        Also quiets, in this process, the vLLM warnings an engine refit configures logs on every healthy start
        and sync (refit/engine/vllm_logs.py names each), wherever the engine is started from.
        """
        quiet_benign_vllm_warnings()
        return {
            "model": str(self.model),
            "load_format": self.load_format,
            "kv_cache_dtype": self.kv_cache_dtype,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "tensor_parallel_size": self.tensor_parallel_size,
            "seed": self.seed,
            # Rollouts exchange token ids with the trainer; no tokenizer needed.
            "skip_tokenizer_init": True,
            **engine_kwargs(on_gpu=on_gpu, kv_cache_bytes=self.kv_cache_bytes, lora_rank=self.lora_rank),
            **({"gpu_memory_utilization": self.memory_fraction} if self.memory_fraction is not None else {}),
            **self._speculative(),
            **self.extra,
        }

    def _speculative(self) -> dict[str, Any]:
        """A draft model's or MTP layers' speculative config, with the engine's stats on (the draft's acceptance is
        read from them)."""
        if self.speculative_method == "mtp":
            spec = {"method": "mtp", "num_speculative_tokens": self.num_speculative_tokens}
        elif self.draft_model is not None:
            spec = {"method": "draft_model", "model": str(self.draft_model),
                    "num_speculative_tokens": self.num_speculative_tokens}
        else:
            return {}
        return {"speculative_config": spec, "disable_log_stats": False}


ADAPTER_SLOTS = 2
"""LoRA adapters an engine holds at once: the one it serves, and the one it retires or stages beside it."""


def lora_settings(max_rank: int | None) -> dict[str, Any]:
    """The engine arguments for LoRA adapters of rank up to `max_rank` (None: no LoRA)."""
    if max_rank is None:
        return {}
    return {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": ADAPTER_SLOTS, "max_cpu_loras": ADAPTER_SLOTS}


def engine_kwargs(*, on_gpu: bool | None = None, kv_cache_bytes: int | None = None,
                  lora_rank: int | None = None) -> dict[str, Any]:
    """The engine arguments refit needs, to merge into your own `vllm.LLM(...)` or `AsyncEngineArgs(...)`.

    Its worker extension (`worker_extension_cls`: the methods a sync calls
    in every worker) and its weight-transfer backend
    (`weight_transfer_config`), plus the memory default: on a CPU
    (`on_gpu=False`; None: no CUDA device here) a KV cache of
    `kv_cache_bytes` (default `DEFAULT_CPU_KV_CACHE_BYTES`), because vLLM's
    CPU backend otherwise reserves 92% of the whole machine per engine; on a
    GPU vLLM's own sizing unless `kv_cache_bytes` is given; with
    `lora_rank`, LoRA adapters up to that rank, with room for two at once
    (one served, one staged or retiring: `Syncer.sync_adapter` swaps them).
    Keys you set yourself after merging win, but refit needs the first two
    as given.
    """
    if on_gpu is None:
        import torch

        on_gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = {"worker_extension_cls": WORKER_EXTENSION, "weight_transfer_config": {"backend": TRANSFER_BACKEND}}
    if kv_cache_bytes is not None or not on_gpu:
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes if kv_cache_bytes is not None else DEFAULT_CPU_KV_CACHE_BYTES
    return kwargs | lora_settings(lora_rank)
