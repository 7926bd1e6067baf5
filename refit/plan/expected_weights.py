"""What the rollout's model expects to receive: every weight's name, shape and form.

The plan is checked against this before any byte moves (`make_plan`), so a
trainer with a renamed, missing, extra or reshaped tensor, or one the
rollout expects in another form, is refused with every such tensor named,
and the replicas keep serving. Without it a partial update was found only
after loading, or not at all.

Two sources, in the rollout's checkpoint format (the names and forms its
checkpoint holds, which is what vLLM's loaders take):
- the checkpoint's safetensors headers, when the engine loaded from files
  (no tensor data is read), of the files its model.safetensors.index.json
  names where it has one, as vLLM loads;
- otherwise (a config-only directory, `load_format="dummy"`), the model
  built from its `config.json` on the meta device, with the FP8 forms the
  rollout's `quantization_config` gives, and the MTP layers the config
  names (refit/plan/mtp_layers.py), which transformers' model lacks.

Scales (`weight_scale`, attention KV scales) and zero points are not
listed: a quantized weight brings its own scale, and the post-refit stage
owns the attention scales.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from refit.errors import ConfigError
from refit.plan.checkpoint_format import describe_weights
from refit.plan.mtp_layers import mtp_layer_weights
from refit.plan.tensors import module_classes
from refit.quantizer import Fp8BlockQuantizer, Fp8BlockScheme

__all__ = ["ExpectedWeight", "expected_weights", "may_stream"]

# Attention KV-cache scales: the post-refit stage owns them, and a trainer
# that calibrates them itself may stream them too (they are then loaded).
_OPTIONAL = ("q_scale", "k_scale", "v_scale", "prob_scale")
# Tensors that come with another one (a quantized weight's scale) or are not loaded at all.
_NOT_STREAMED_ALONE = ("weight_scale", "weight_scale_inv", "input_scale", "k_zero_point", "v_zero_point", "q_zero_point",
                       *_OPTIONAL)


def may_stream(name: str) -> bool:
    """A name a trainer may send although the rollout does not require it (an attention KV scale)."""
    return name.rpartition(".")[2] in _OPTIONAL


@dataclass(frozen=True, slots=True)
class ExpectedWeight:
    name: str
    shape: tuple[int, ...]
    fp8_block: bool  # the rollout expects FP8 codes plus a block scale


def expected_weights(
    model_dir: str | Path, quantization_config: dict | None, *, from_files: bool
) -> tuple[ExpectedWeight, ...]:
    """The weights a rollout started from `model_dir` expects, sorted by name."""
    model_dir = Path(model_dir)
    files = _loaded_files(model_dir)
    weights = _from_headers(files) if from_files and files else _from_config(model_dir, quantization_config)
    return tuple(sorted(weights, key=lambda w: w.name))


def _loaded_files(model_dir: Path) -> list[Path]:
    """The safetensors files vLLM loads: where the checkpoint has an index, only those it names (vLLM's
    `filter_duplicate_safetensors_files`), since Mistral's repositories ship a consolidated.safetensors of other
    names beside the shards."""
    files = sorted(model_dir.glob("*.safetensors"))
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        return files
    try:
        indexed = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(f"{index}: not a safetensors index with a weight_map ({type(error).__name__}: {error})") from None
    # A shard the index names but the directory lacks would otherwise show as every one of its tensors "extra in the
    # trainer", blaming the wrong side; vLLM cannot load such a checkpoint either.
    if missing := sorted(str(name) for name in indexed - {path.name for path in files}):
        raise ConfigError(f"{index} names {len(missing)} shard(s) missing from {model_dir}: {', '.join(missing[:8])}")
    return [path for path in files if path.name in indexed]


def _streamed(name: str) -> bool:
    return name.rpartition(".")[2] not in _NOT_STREAMED_ALONE


def _from_headers(files: list[Path]) -> list[ExpectedWeight]:
    weights = []
    for path in files:
        try:
            for name, entry in _header(path).items():
                if name != "__metadata__" and _streamed(name):
                    weights.append(ExpectedWeight(name, tuple(entry["shape"]), entry["dtype"].startswith("F8")))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ConfigError(f"{path}: not a readable safetensors file ({type(error).__name__}: {error})") from None
    return weights


def _header(path: Path) -> dict:
    """A safetensors file's header (8-byte length, then JSON); no tensor data is read."""
    size = path.stat().st_size
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        # A corrupt or truncated length once asked Python for terabytes (MemoryError, OverflowError), naming no file.
        if size < 8 or length > size - 8:
            raise ValueError(f"its header claims {length} bytes, the file has {size}")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise TypeError(f"its header is a JSON {type(header).__name__}, not an object")
    return header


def _from_config(model_dir: Path, quantization_config: dict | None) -> list[ExpectedWeight]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the unquantized model's names and shapes; the forms come from the scheme
    with torch.device("meta"):  # names and shapes only
        model = AutoModelForCausalLM.from_config(config)
    metas = [m for m in describe_weights(model) if m.alias_of is None]  # a tied alias is not in a checkpoint
    quantizer = None
    if quantization_config:
        quantizer = Fp8BlockQuantizer(Fp8BlockScheme.from_quantization_config(quantization_config), module_classes(metas))
    weights = [ExpectedWeight(m.name, m.shape, quantizer is not None and quantizer.is_quantized(m.name)) for m in metas]
    # MTP layers: transformers' class of such a checkpoint has none (vLLM's drafter loads them), so they are
    # described from the config, their decoder block as the target's first decoder layer.
    first_layer = "model.layers.0."
    block = {w.name.removeprefix(first_layer): (w.shape, w.fp8_block) for w in weights if w.name.startswith(first_layer)}
    return weights + [ExpectedWeight(*w) for w in mtp_layer_weights(config.to_dict(), block)]
