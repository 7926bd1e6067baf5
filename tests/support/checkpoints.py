"""Write an FP8_BLOCK checkpoint of a bf16 checkpoint with refit's quantizer.

Used to start a fresh engine on exactly the weights a sync delivers, the
reference a synced engine must match. The quantizer is proven bit-identical
to llmcompressor (tests/quantizer/test_llmcompressor_fixture.py), so this is
the llmcompressor checkpoint of those weights, made without its venv.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file, save_file

from refit.quantizer import Fp8BlockQuantizer, Fp8BlockScheme

__all__ = ["TINY", "TINY_ROUTED_MOE", "write_fewer_layers", "write_fp8_block_checkpoint", "write_random", "write_random_bf16",
           "write_variant"]


def write_fp8_block_checkpoint(bf16_dir: str | Path, out_dir: str | Path, *, like: str | Path,
                               ignore: list[str] | None = None) -> Path:
    """Quantize `bf16_dir` into `out_dir` with the quantization_config of checkpoint `like` (its `ignore` list replaced
    by `ignore` if given: the modules left bf16, by name or `re:` pattern)."""
    from transformers import AutoModelForCausalLM

    from refit.plan import describe_weights, module_classes

    bf16_dir, out_dir = Path(bf16_dir), Path(out_dir)
    config = json.loads((bf16_dir / "config.json").read_text())
    config["quantization_config"] = json.loads((Path(like) / "config.json").read_text())["quantization_config"]
    if ignore is not None:
        config["quantization_config"]["ignore"] = ignore
    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    classes = module_classes(describe_weights(model))
    quantizer = Fp8BlockQuantizer(Fp8BlockScheme.from_quantization_config(config["quantization_config"]), classes)

    tensors = {}
    for path in sorted(bf16_dir.glob("*.safetensors")):
        tensors.update(quantizer(load_file(str(path)).items()))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json",):
        if (bf16_dir / extra).exists():
            shutil.copy(bf16_dir / extra, out_dir / extra)
    return out_dir


def write_fewer_layers(bf16_dir: str | Path, out_dir: str | Path, layers: int) -> Path:
    """A random model like `bf16_dir` but with only `layers` decoder layers (a trainer missing tensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(bf16_dir)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return Path(out_dir)


def write_variant(bf16_dir: str | Path, out_dir: str | Path, *, seed: int, **config: object) -> tuple[Path, Path]:
    """A random bf16 model like `bf16_dir` with `config`'s fields changed (layers, vocabulary, KV heads), and its
    FP8_BLOCK checkpoint (the fixture's scheme): `(bf16 dir, fp8 dir)` under `out_dir`."""
    from transformers import AutoConfig

    changed = AutoConfig.from_pretrained(bf16_dir)
    for field, value in config.items():
        setattr(changed, field, value)
    if getattr(changed, "layer_types", None):
        changed.layer_types = [changed.layer_types[0]] * changed.num_hidden_layers
    return write_random(changed, out_dir, seed=seed, like=Path(bf16_dir).parent / "fp8_block")


TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
"""The size of the tiny random models tests make of other families (with `AutoConfig.for_model`)."""

TINY_ROUTED_MOE = dict(head_dim=64, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                       first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1)
"""A tiny DeepSeek-V3-style MoE (GLM-4-MoE, dots1): a dense first layer, sigmoid routing with a router bias, a shared
expert."""


def write_random(config: object, out_dir: str | Path, *, seed: int, like: str | Path, ignore: list[str] | None = None,
                 edit: Callable[[object], None] | None = None) -> tuple[Path, Path]:
    """A random bf16 model of transformers `config` (changed by `edit` before it is saved) and its FP8_BLOCK checkpoint
    in the scheme of checkpoint `like` (`ignore`: as `write_fp8_block_checkpoint`'s): `(bf16 dir, fp8 dir)` under
    `out_dir`."""
    bf16 = write_random_bf16(config, out_dir, seed=seed, edit=edit)
    return bf16, write_fp8_block_checkpoint(bf16, Path(out_dir) / "fp8_block", like=like, ignore=ignore)


def write_random_bf16(config: object, out_dir: str | Path, *, seed: int,
                      edit: Callable[[object], None] | None = None) -> Path:
    """A random bf16 model of transformers `config` (changed by `edit` before it is saved), in `out_dir`/bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    bf16 = Path(out_dir) / "bf16"
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    if edit is not None:
        edit(model)
    model.save_pretrained(bf16)
    return bf16
