"""`EngineFacts`: what a replica needs to know about its engine, read once from the engine's vLLM config.

A module of its own, below both ends of the worker RPC: the replica reads
them from an engine it holds (`EngineFacts.of(llm.vllm_config)`), and a
worker reads them for a replica that holds no engine (a `vllm serve` server,
`RefitWorkerExtension.refit_engine_facts`), which answers them as JSON-able
data (`to_plain` / `from_plain`): a server's HTTP carries no refit classes
and nothing pickled.

A replica that decodes speculatively has two models, and its facts describe
both (`RolloutModelInfo.draft`), each planned against its own expected
weights: a draft model (`method="draft_model"`) from its own checkpoint; MTP
layers (`method="mtp"`) from the target's checkpoint, where they are named
`model.mtp_layers.<i>.*` (refit/plan/mtp_layers.py): they are the drafter's
weights, not the target's (whose loader skips them), so they move from the
target's expected weights to the draft's. EAGLE-style heads are not drafts
refit knows how to name: their engines sync the target alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from refit.errors import EngineError
from refit.plan.expected_weights import ExpectedWeight
from refit.plan.transfer_plan import RolloutModelInfo

__all__ = ["EngineFacts", "draft_model_dir", "speculative_method"]


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the core needs to know about an engine, read once from its vLLM config (`EngineFacts.of`)."""

    model_info: RolloutModelInfo
    vocab_size: int
    workers: int  # vLLM workers, each a rank of a collective group
    fp8_kv_cache: bool
    initial_refusal: str | None  # why it must not serve before its first sync (a dummy load)
    device: str = "cpu"  # where its workers run ("cpu", "cuda", ...): `transport="auto"` asks
    max_model_len: int | None = None  # the longest sequence it takes: a prompt must be shorter (None: not known)

    @classmethod
    def of(cls, vllm_config: Any) -> EngineFacts:
        """From a running engine's `VllmConfig`, so an engine the user started is described as one refit started."""
        from vllm.config import set_current_vllm_config

        model_dir = vllm_config.model_config.model
        dummy = str(vllm_config.load_config.load_format) == "dummy"
        draft_dir = draft_model_dir(vllm_config)
        # A dummy-loaded engine's expected weights come from transformers' model of its config, built on the meta
        # device. vLLM's Transformers modeling backend (its engine for a family it has no class of its own for) puts
        # its compile decorator on transformers' classes in place, and a decorated class asks vLLM for the current
        # config when it is built: this engine's.
        with set_current_vllm_config(vllm_config):
            info = RolloutModelInfo.from_checkpoint(model_dir, from_files=not dummy,
                                                    mtp=speculative_method(vllm_config) == "mtp")
            if draft_dir is not None:
                info = info.with_draft(RolloutModelInfo.from_checkpoint(draft_dir, from_files=not dummy))
        info = replace(info, serves_lora=getattr(vllm_config, "lora_config", None) is not None)
        return cls(
            model_info=info,
            vocab_size=int(vllm_config.model_config.get_vocab_size()),
            workers=int(vllm_config.parallel_config.world_size),
            fp8_kv_cache=str(vllm_config.cache_config.cache_dtype).startswith("fp8"),
            initial_refusal=(
                "it started with load_format='dummy', so its weights and scales are placeholders; run a sync first"
                if dummy else None
            ),
            device=str(vllm_config.device_config.device_type),
            max_model_len=int(vllm_config.model_config.max_model_len),
        )

    def to_plain(self) -> dict[str, Any]:
        """JSON-able data: what a worker of a server answers (`refit_engine_facts`)."""
        return {
            "model_info": _info_to_plain(self.model_info),
            "vocab_size": self.vocab_size, "workers": self.workers, "fp8_kv_cache": self.fp8_kv_cache,
            "initial_refusal": self.initial_refusal, "device": self.device, "max_model_len": self.max_model_len,
        }

    @classmethod
    def from_plain(cls, plain: Any) -> EngineFacts:
        """The facts `to_plain` described; refuses data of any other shape (`EngineError`), naming what is wrong."""
        try:
            refusal = plain["initial_refusal"]
            return cls(
                model_info=_info_from_plain(plain["model_info"]),
                vocab_size=int(plain["vocab_size"]), workers=int(plain["workers"]),
                fp8_kv_cache=bool(plain["fp8_kv_cache"]), initial_refusal=None if refusal is None else str(refusal),
                device=str(plain["device"]),
                max_model_len=None if plain.get("max_model_len") is None else int(plain["max_model_len"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise EngineError(f"not an engine's facts ({type(error).__name__}: {error}); the sender is not refit's") from None


def speculative_method(vllm_config: Any) -> str | None:
    """vLLM's speculative method of the engine (`"draft_model"`, `"mtp"`, ...), None if it decodes without one."""
    spec = getattr(vllm_config, "speculative_config", None)
    return None if spec is None else getattr(spec, "method", None)


def draft_model_dir(vllm_config: Any) -> str | None:
    """The checkpoint of the engine's speculative draft model (`method="draft_model"`), if it has one.

    An MTP drafter (`method="mtp"`) has none of its own: its layers are in the target's checkpoint
    (`RolloutModelInfo.from_checkpoint(..., mtp=True)`).
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if speculative_method(vllm_config) != "draft_model" or spec.draft_model_config is None:
        return None
    return str(spec.draft_model_config.model)


def _info_to_plain(info: RolloutModelInfo) -> dict[str, Any]:
    return {
        "quantization_config": info.quantization_config,
        "tie_word_embeddings": info.tie_word_embeddings,
        "weights": None if info.weights is None else [[w.name, list(w.shape), w.fp8_block] for w in info.weights],
        "vocab_size": info.vocab_size,
        "draft": None if info.draft is None else _info_to_plain(info.draft),
        "mtp_prefixes": list(info.mtp_prefixes),
        "serves_lora": info.serves_lora,
    }


def _info_from_plain(info: Any) -> RolloutModelInfo:
    weights, quantization, draft = info["weights"], info["quantization_config"], info.get("draft")
    return RolloutModelInfo(
        None if quantization is None else dict(quantization),
        bool(info["tie_word_embeddings"]),
        None if weights is None else tuple(
            ExpectedWeight(str(name), tuple(int(n) for n in shape), bool(fp8)) for name, shape, fp8 in weights
        ),
        None if info["vocab_size"] is None else int(info["vocab_size"]),
        None if draft is None else _info_from_plain(draft),
        tuple(str(prefix) for prefix in info.get("mtp_prefixes", ())),
        serves_lora=info.get("serves_lora") is True,
    )
