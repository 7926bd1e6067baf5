"""A running vLLM engine that refit can update in place.

`RolloutEngine` owns one `vllm.LLM` started with refit's weight-transfer
backend and drives the update lifecycle through `collective_rpc`, which
reaches the model both in-process and in separate worker processes
(tensor parallel > 1): `begin_update` -> `load` per bucket ->
`finish_update` (reload finalized, then the post-refit KV-scale stage).
It holds no Ray state; `actors.RolloutActor` wraps it for Ray.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from refit.engine.transfer_engine import BACKEND
from refit.engine.worker_extension import WORKER_EXTENSION
from refit.errors import EngineError, LifecycleError
from refit.provenance import KvScalePolicy, ScaleRecord, ScaleSource, refuse_invalid_scales

__all__ = ["EngineConfig", "EngineDescription", "Generation", "RolloutEngine"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """How to start the vLLM engine; `extra` passes any other `vllm.LLM` keyword."""

    model: str
    load_format: str = "auto"
    kv_cache_dtype: str = "auto"
    dtype: str = "bfloat16"
    max_model_len: int = 256
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    seed: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def llm_kwargs(self) -> dict[str, Any]:
        reserved = {"weight_transfer_config", "worker_extension_cls", "skip_tokenizer_init"} & set(self.extra)
        if reserved:
            raise ValueError(f"EngineConfig.extra may not set {sorted(reserved)}: refit sets them")
        return {
            "model": self.model,
            "load_format": self.load_format,
            "kv_cache_dtype": self.kv_cache_dtype,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "tensor_parallel_size": self.tensor_parallel_size,
            "seed": self.seed,
            # Rollouts exchange token ids with the trainer; no tokenizer needed.
            "skip_tokenizer_init": True,
            "weight_transfer_config": {"backend": BACKEND},
            "worker_extension_cls": WORKER_EXTENSION,
            **self.extra,
        }


@dataclass(frozen=True, slots=True)
class EngineDescription:
    """What a sync plan needs to know about the rollout model."""

    quantization_config: dict[str, Any] | None
    tie_word_embeddings: bool


@dataclass(frozen=True, slots=True)
class Generation:
    """Greedy (or sampled) continuations with their log-probabilities."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]  # of each generated token
    prompt_logprobs: list[list[float | None]] | None


class RolloutEngine:
    def __init__(self, config: EngineConfig) -> None:
        # The engine core must live in this process: in a separate core
        # process, tensors decoded from an RPC cannot be pickled on to the
        # workers ("cannot pickle memoryview objects"). Workers may still be
        # separate processes (tensor parallel > 1).
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1":
            raise EngineError(
                "VLLM_ENABLE_V1_MULTIPROCESSING=1: refit needs vLLM's engine core in the rollout process; "
                "unset it or set it to 0 (tensor-parallel workers still run as separate processes)"
            )
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.config = config
        self.llm = LLM(**config.llm_kwargs())
        self._updating = False
        self._buckets_loaded = 0
        # Why this engine must not serve, if it must not: after an abandoned
        # update some layers hold new weights and some old, and after a refused
        # KV-scale stage the scales are invalid. Serving either as if whole is
        # the failure refit exists to prevent.
        self._unservable: str | None = None

    def describe(self) -> EngineDescription:
        hf_config = self.llm.llm_engine.model_config.hf_config
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        quant = getattr(hf_config, "quantization_config", None)
        return EngineDescription(
            quantization_config=dict(quant) if quant else None,
            tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
        )

    def begin_update(self) -> None:
        """Must be called before `load`; puts every layer in loadable form."""
        if self._updating:
            raise LifecycleError("begin_update: an update is already in progress")
        self.llm.collective_rpc("start_weight_update")
        self._updating = True
        self._buckets_loaded = 0

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        """Load one bucket of checkpoint-format tensors. Must follow `begin_update`."""
        if not self._updating:
            raise LifecycleError("load: call begin_update first")
        refuse_invalid_scales(tensors)  # before anything of this bucket is loaded
        self._buckets_loaded += 1  # counted first: a bucket that failed half-way is partly loaded
        self.llm.collective_rpc("update_weights", args=({"version": version, "tensors": list(tensors)},))

    def finish_update(
        self, kv_scales: KvScalePolicy, calibration_prompts: Sequence[Sequence[int]] = ()
    ) -> list[str]:
        """Finalize the reload, run the post-refit stage, drop stale prefix-cache entries.

        Returns the attention scales the stage wrote ("module.scale").
        """
        if not self._updating:
            raise LifecycleError("finish_update: call begin_update first")
        self.llm.collective_rpc("finish_weight_update")
        self._updating = False
        self._buckets_loaded = 0
        self._unservable = "the post-refit KV-scale stage did not complete"
        measured = None
        if kv_scales is KvScalePolicy.RECOMPUTE:
            if not calibration_prompts:
                raise ValueError("kv_scales='recompute' needs calibration_prompts")
            # The calibration pass itself runs through an FP8 KV cache, which
            # refuses dummy scales: make placeholders valid (1.0) first.
            self.llm.collective_rpc("refit_apply_kv_policy", args=(str(KvScalePolicy.AUTO), None))
            self.llm.collective_rpc("refit_start_amax")
            self._generate(calibration_prompts, max_tokens=1)
            # Tensor-parallel ranks see different heads: the amax is the max over ranks.
            measured = _max_over_ranks(self.llm.collective_rpc("refit_stop_amax"))
        written = self.llm.collective_rpc("refit_apply_kv_policy", args=(str(kv_scales), measured))[0]
        # Cached prefixes hold K/V computed by the old weights.
        self.llm.reset_prefix_cache()
        self._unservable = None
        return written

    def abandon_update(self) -> None:
        """Close a failed update.

        If no bucket was loaded, the old model is intact and keeps serving.
        Otherwise some layers hold new weights and some old: generation is
        refused until a later update completes.
        """
        if self._updating:
            self._updating = False
            if self._buckets_loaded:
                self._unservable = "the last update was abandoned half-way, so some layers hold old weights"
            self.llm.collective_rpc("refit_abandon_update")

    def served_version(self) -> int | None:
        return self.llm.collective_rpc("refit_served_version")[0]

    def scale_records(self) -> list[ScaleRecord]:
        rows = self.llm.collective_rpc("refit_scale_records")[0]
        return [ScaleRecord(**{**row, "source": ScaleSource(row["source"])}) for row in rows]

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 8, prompt_logprobs: bool = False,
        temperature: float = 0.0,
    ) -> Generation:
        if self._updating:
            raise LifecycleError("generate: an update is in progress; the model is half-loaded")
        if self._unservable:
            raise LifecycleError(f"generate: {self._unservable}; run a sync to completion before generating")
        return self._generate(prompts, max_tokens, prompt_logprobs, temperature)

    def _generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, prompt_logprobs: bool = False,
        temperature: float = 0.0,
    ) -> Generation:
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, logprobs=0,
            prompt_logprobs=0 if prompt_logprobs else None, detokenize=False,
        )
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        token_ids, logprobs, prompt_lps = [], [], []
        for out in outputs:
            completion = out.outputs[0]
            token_ids.append(list(completion.token_ids))
            logprobs.append([step[tok].logprob for step, tok in zip(completion.logprobs, completion.token_ids)])
            if prompt_logprobs:
                prompt_lps.append([
                    None if step is None else step[tok].logprob
                    for step, tok in zip(out.prompt_logprobs, out.prompt_token_ids)
                ])
        return Generation(token_ids, logprobs, prompt_lps if prompt_logprobs else None)


def _max_over_ranks(per_rank: list[list[tuple[str, str, float]]]) -> list[tuple[str, str, float]]:
    amax: dict[tuple[str, str], float] = {}
    for rows in per_rank:
        for module, scale, value in rows:
            amax[(module, scale)] = max(amax.get((module, scale), 0.0), value)
    return [(module, scale, value) for (module, scale), value in amax.items()]
